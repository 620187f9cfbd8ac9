"""Mailboxes, parities, TP groups and the decoder on the reference backend (CPU)."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from kimi_ops import backend
from kimi_ops.config import KimiConfig
from kimi_ops.debug import KimiOpMode
from kimi_ops.kernels.launch import MARK_WORDS
from kimi_ops.mailbox import SENTINEL, KimiMailboxError, canonical, parities, raise_if_error
from kimi_ops.runtime import boxes as boxes_module
from kimi_ops.moe import MoeWeights
from kimi_ops.runtime.decoder import AttentionWeights, KimiDecoder, RankLayer

kimi = torch.ops.kimi
CONFIG = KimiConfig.tiny()


def hidden_states(batch, seed=0):
    return torch.randn(batch, CONFIG.hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()


def concentrate(decoder: KimiDecoder, tp: int) -> KimiDecoder:
    """Zero every contribution of ranks ≠ 0 (of a TP ``tp`` split) to the reductions: the
    o-proj and shared-down shards of ranks ≠ 0 and the experts they own. The reductions
    then add exact zeros, so a TP-N decoder must equal TP1 bit for bit while every box,
    shard offset and parity is still exercised (front rows, logits, output columns and
    the attention shards of every rank stay non-zero)."""
    c = decoder.config
    for layer in decoder.layers:
        for part in layer:
            if decoder.group.tp == 1:
                part.oproj.w_o[:, c.attn_out // tp :] = 0
                part.front.shared_down[:, c.shared_intermediate // tp :] = 0
            elif part.rank != 0:
                part.oproj.w_o.zero_()
                part.front.shared_down.zero_()
            part.front.expert_gate_up[c.experts // tp :] = 0
            part.front.expert_down[c.experts // tp :] = 0
    return decoder


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_simulated_tp_equals_tp1(tp):
    """Six layers (every parity, the wrap), three steps of changing batch: TP-N == TP1
    (TP4 and TP8 at B = 64: the two-shot latent all-reduce)."""
    reference = concentrate(KimiDecoder(CONFIG, 6, tp=1, seed=3), tp)
    sharded = concentrate(KimiDecoder(CONFIG, 6, tp=tp, seed=3), tp)
    for step, batch in enumerate((64, 1, 5)):
        x = hidden_states(batch, seed=step)
        want = reference(x)
        assert torch.equal(sharded(x), want)
        assert want.float().abs().sum() > 0


def test_simulated_tp_close_to_tp1_dense():
    """Dense weights: TP partial sums round per rank (DESIGN §3), so TP-N differs from TP1
    at the rounding level (about 1% per token after two layers). Tiny's 64 experts sit
    closely enough that such a perturbation swaps the 16th expert of about one token in
    four (one of 16 rows: tens of percent for that token); the exact equality of
    ``test_simulated_tp_equals_tp1`` is the semantic check."""
    x = hidden_states(16)
    want = KimiDecoder(CONFIG, 2, tp=1, seed=4)(x).double()
    for tp in (2, 8):
        got = KimiDecoder(CONFIG, 2, tp=tp, seed=4)(x).double()
        error = (got - want).norm(dim=1) / want.norm(dim=1)
        assert float(error.median()) < 0.02 and float(error.max()) < 0.4, error


@pytest.mark.parametrize("tp", [4, 8])
def test_two_shot_equals_one_shot(tp, monkeypatch):
    """Dense weights, six layers, steps switching between the two all-reduces (B = 9 and
    64 two-shot, 5 one-shot: a box's parities are re-armed by its next use, so a stale row
    would be read as data): bit-equal to a decoder whose all-reduces are all one-shot."""
    two_shot = KimiDecoder(CONFIG, 6, tp=tp, seed=21)
    batches = (64, 5, 9, 5, 64)
    assert [two_shot.boxes.two_shot(b) for b in batches] == [True, False, True, False, True]
    got = []
    for s, b in enumerate(batches):
        got.append(two_shot(hidden_states(b, seed=s)))
        assert armed_but_the_last_layers_parity(two_shot)
    monkeypatch.setattr(boxes_module, "TWO_SHOT_BATCH", CONFIG.capacity + 1)
    one_shot = KimiDecoder(CONFIG, 6, tp=tp, seed=21)
    assert "recv" not in one_shot.boxes.kinds
    for s, (b, row) in enumerate(zip(batches, got)):
        assert torch.equal(one_shot(hidden_states(b, seed=s)), row)


def armed_but_the_last_layers_parity(decoder: KimiDecoder) -> bool:
    """After a step every parity of the latent, shared and two-shot boxes is armed but the
    last MoE layer's (the next step's first layer re-arms it)."""
    boxes, count = decoder.boxes, len(decoder.layers)
    others = [p for p in range(3) if p != parities(count - 1, count)[0]]
    return all(bool((boxes.own(kind, r)[others].view(torch.int32) == SENTINEL).all())
               for kind in ("latent", "rs", "recv", "gathered") for r in decoder.group.ranks)


def test_parities_rotate_and_collisions_rejected():
    assert [parities(i, 6) for i in range(6)] == [(0, 2), (1, 0), (2, 1), (0, 2), (1, 0), (2, 1)]
    assert parities(0, 5) == (0, 1)
    for count in (1, 4, 7):
        with pytest.raises(ValueError, match=f"parities collide for {count} MoE layers"):
            KimiDecoder(CONFIG, count)


def test_writers_never_write_the_sentinel():
    words = torch.tensor([-0.0, 0.0, float("nan"), -float("nan"), 1.5], dtype=torch.bfloat16)
    pairs = canonical(words.repeat_interleave(2)).view(torch.int32)
    assert not bool((pairs == SENTINEL).any())
    logits = torch.tensor([-0.0, float("nan")], dtype=torch.float32)
    assert not bool((canonical(logits).view(torch.int32) == SENTINEL).any())


def test_negative_zero_and_nan_inputs_neither_hang_nor_corrupt():
    decoder = KimiDecoder(CONFIG, 6, tp=2, seed=5)
    fresh = KimiDecoder(CONFIG, 6, tp=2, seed=5)
    poison = hidden_states(8, seed=1)
    poison[0] = -0.0
    poison[3] = float("nan")
    out = decoder(poison)  # raises KimiMailboxError if a poll saw a sentinel
    assert not torch.isnan(out[0]).any() and torch.isnan(out[3]).all()
    assert torch.equal(out[[1, 2, 4]], fresh(poison[[1, 2, 4]]))
    x = hidden_states(8, seed=2)
    assert torch.equal(decoder(x), fresh(x))  # the boxes came back armed and clean


def test_rows_do_not_depend_on_other_tokens():
    decoder = KimiDecoder(CONFIG, 3, tp=2, seed=6)
    x = hidden_states(6)
    assert torch.equal(decoder(x)[2:4], decoder(x[2:4].contiguous()))


def test_unpublished_mailbox_raises_instead_of_hanging():
    decoder = KimiDecoder(CONFIG, 3, tp=2, seed=7)
    decoder.layers[1][1].front_publish = lambda x, boxes: None  # rank 1 never publishes
    with pytest.raises(KimiMailboxError, match="front row"):
        decoder(hidden_states(4))


def test_take_of_an_armed_box_sets_the_error_word():
    box = torch.empty(1, 2, 8, 16, dtype=torch.bfloat16)
    kimi.mailbox_arm(box)
    error = torch.zeros(1, dtype=torch.int32)
    kimi.mailbox_take(box, 0, 3, error)
    with pytest.raises(KimiMailboxError, match="never arrived"):
        raise_if_error(error)


def test_batch_over_capacity_is_rejected():
    decoder = KimiDecoder(KimiConfig.tiny(capacity=8), 2)
    with pytest.raises(ValueError, match=r"hidden must be a batch in \[1, 8\] \(the mailbox capacity\), got 9"):
        decoder(hidden_states(9))


@pytest.mark.parametrize("tp, batch", [(2, 5), (4, 16)])  # TP4 at 16 tokens: the two-shot all-reduce
def test_compiled_decoder_equals_eager_and_reinplaces_boxes(tp, batch):
    """fullgraph, bit-equal to eager over steps, and every mailbox op gets the box buffers
    themselves (graph inputs), never a clone."""
    torch._dynamo.reset()
    eager = KimiDecoder(CONFIG, 3, tp=tp, seed=8)
    compiled_module = KimiDecoder(CONFIG, 3, tp=tp, seed=8)
    compiled = torch.compile(compiled_module, fullgraph=True)
    out, (code, *_) = run_and_get_code(compiled, hidden_states(batch))
    assert torch.equal(out, eager(hidden_states(batch)))
    for seed in (1, 2):
        assert torch.equal(compiled(hidden_states(batch, seed)), eager(hidden_states(batch, seed)))
    compiled_module.check()
    calls = re.findall(r"torch\.ops\.kimi\.(\w+)\.default\((.*)\)", code)
    mutating = {"attn_res_take", "attn_res_take_into", "moe_route_poll", "moe_tail_poll", "oproj_publish",
                "moe_front_publish", "oproj_push", "moe_tail_publish", "dsa_index_front_keys"}
    if compiled_module.boxes.two_shot(batch):
        mutating.add("moe_latent_reduce")
    seen = {name for name, _ in calls} & mutating
    assert seen == mutating
    for name, args in calls:
        for box_list in re.findall(r"\[([^\]]*)\]", args):
            assert all(re.fullmatch(r"arg\d+_1", a.strip()) for a in box_list.split(",")), (name, args)
        if name in ("attn_res_take", "attn_res_take_into", "moe_route_poll", "moe_tail_poll", "moe_latent_reduce"):
            assert re.match(r"arg\d+_1,", args), (name, args)
    assert ".copy_(" not in code and "clone" not in code


def kimi_calls(decoder, hidden) -> list[tuple[str, list]]:
    """(op name, arguments) of every kimi op call of one step, in launch order."""
    calls = []

    class Calls(KimiOpMode):
        def kimi_op(self, func, args, kwargs):
            calls.append((func._schema.name.split("::")[1], args))
            return func(*args, **kwargs)

    with torch.no_grad(), Calls():
        decoder(hidden)
    return calls


def test_the_fused_forms_are_chosen_for_the_device_the_decoder_runs_on(monkeypatch):
    """In a process with CUDA the CuTe kernels are registered and prefer the fused shared
    expert at these shapes. A decoder on the CPU runs the references alone, so it keeps the
    two-op shared expert and the chain they need (its op calls are the reference backend's).
    A CUDA decoder's layers take the fused forms, though their weights are built on the CPU
    before the decoder moves them (a layer built here for a CUDA decoder: no GPU needed)."""

    class Eager:
        prefers = serves = staticmethod(lambda *key: True)
        prepare = staticmethod(lambda *key: None)

    monkeypatch.delenv("KIMI_OPS_BACKEND", raising=False)
    for name in ("shared_expert_push", "moe_front_shared_push", "moe_tail_poll"):
        monkeypatch.setitem(backend.KERNELS, name, Eager())
    decoder = KimiDecoder(CONFIG, 2, tp=1, seed=4)
    front = decoder.layers[0][0].front
    assert not (front.fused_shared or front.shared_first or front.front_inside)
    names = {name for name, _ in kimi_calls(decoder, hidden_states(1, seed=5))}
    assert {"gate_up_situ", "oproj_push"} <= names and "shared_expert_push" not in names
    gen = torch.Generator().manual_seed(0)
    weights = AttentionWeights.random(CONFIG, gen), MoeWeights.random(CONFIG, gen)
    front = RankLayer(CONFIG, *weights, 1, 0, 0, 2, torch.device("cuda", 0)).front
    assert front.fused_shared and front.shared_first and front.front_inside


@pytest.mark.parametrize("tp", [1, 2])
def test_the_embedding_folds_into_layer_0s_stacked_gemm(tp):
    """Up to ``embedding_folds_to`` (where kimi::normed_oproj's kernel serves the batch: the
    CPU's references never, so forced here) the step launches no AttnRes for the embedding
    and layer 0's stacked GEMM takes the raw hidden with the embedding's out_norm_w: the
    same step (blocks empty and a zero partial give h = hidden; each rank alike), eager and
    compiled (fullgraph). Past it the embedding's AttnRes runs as before."""
    torch._dynamo.reset()
    plain, folded = (KimiDecoder(CONFIG, 2, tp=tp, seed=6) for _ in range(2))
    assert plain.embedding_folds_to == 0
    folded.embedding_folds_to = 4
    compiled = torch.compile(folded, fullgraph=True, dynamic=False)
    for batch in (1, 4, 5):
        hidden = hidden_states(batch, seed=batch)
        names = [name for name, _ in kimi_calls(folded, hidden)]
        assert names.count("normed_oproj") == (tp if batch <= 4 else 0)
        assert names.count("attn_res") == (0 if batch <= 4 else tp)
        want = plain(hidden)
        assert torch.equal(folded(hidden), want) and torch.equal(compiled(hidden), want)


@pytest.mark.parametrize("chain", ["shared first", "front inside", "shared last"])
def test_the_fused_shared_expert_leads_routing_which_then_does_not_wait(chain):
    """The fused shared expert launches before routing, whose poll then does not wait for its
    end (PreparedFront.run) and counts its outputs into the model's ready counter, for
    which the experts wait; its input is the model's MoE input buffer, where the attention
    residual's take wrote it. "front inside": the front's publish in the same launch
    (kimi::moe_front_shared_push, PreparedFront.publish). "shared last": the chain before
    (bench_layer --shared-last). Either way the step equals the two-op decoder's, and the
    counter is left zeroed."""
    shared_first, inside = chain != "shared last", chain == "front inside"
    fused, two = (KimiDecoder(CONFIG, 2, tp=1, seed=4) for _ in range(2))
    for layer in fused.layers:  # the CPU's reference backend prefers no fused op: forced
        front = layer[0].front
        front.fused_shared, front.shared_first, front.front_inside = True, shared_first, inside
    hidden = hidden_states(3, seed=5)
    calls = kimi_calls(fused, hidden)
    names = [name for name, _ in calls]
    first = "moe_front_shared_push" if inside else "moe_front_publish"
    start = names.index(first)
    order = ["moe_route_poll", "routed_experts_counted"] if inside else \
        ["shared_expert_push", "moe_route_poll", "routed_experts_counted"] if shared_first else \
        ["moe_route_poll", "routed_experts", "shared_expert_push"]
    assert names[start:start + 1 + len(order)] == [first, *order]
    assert ("shared_expert_push" in names, "moe_front_publish" in names) == (not inside, not inside)
    (_, route), (_, experts), (_, shared), (_, take) = (
        next(c for c in calls if c[0] == name)
        for name in ("moe_route_poll", "routed_experts" if not shared_first else "routed_experts_counted",
                     first if inside else "shared_expert_push", "attn_res_take_into"))
    ready = fused.boxes.routed_ready(0)
    if shared_first:
        assert route[7] is ready and experts[6] is ready and experts[7] is fused.boxes.error(0)
    else:
        assert len(route) == 7  # the default dropped: uncounted
    assert ready.tolist() == [0, 0]
    moe_input = fused.boxes.moe_input(0)
    assert take[-1] is moe_input and shared[0].data_ptr() == moe_input.data_ptr()
    assert torch.equal(fused(hidden_states(3, seed=6)), two(hidden_states(3, seed=6)))
    if shared_first:  # Inductor keeps the launch order (the two ops share no written tensor)
        torch._dynamo.reset()
        _, (code, *_) = run_and_get_code(torch.compile(fused, fullgraph=True), hidden_states(3, seed=7))
        launched = re.findall(r"torch\.ops\.kimi\.(\w+)\.default\(", code)
        assert [name for name in launched if name in order + [first]] == [first, *order] * len(fused.layers)


def test_recompiles_are_bounded_by_batch_buckets():
    """One graph per decode batch bucket; repeated buckets reuse theirs."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(KimiDecoder(CONFIG, 2, seed=9), fullgraph=True, dynamic=False)
    for batch in (1, 8, 1, 8, 8):
        compiled(hidden_states(batch))
    assert counters["stats"]["unique_graphs"] == 2


def boxes_armed(decoder: KimiDecoder) -> bool:
    boxes = decoder.boxes
    return all(
        bool((boxes.own(kind, r).view(torch.int32) == SENTINEL).all()) and int(boxes.error(r)) == 0
        for kind in boxes.kinds for r in decoder.group.ranks
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_reset_recovers_after_a_fault(compiled):
    """A rank that skips its front publish for a step faults every later step (the error
    word is sticky) until reset(); after it the next step equals a fresh decoder's, eager
    and compiled (the compiled module shares the faulted one's boxes)."""
    torch._dynamo.reset()
    decoder = KimiDecoder(CONFIG, 3, tp=2, seed=13)
    step = torch.compile(decoder, fullgraph=True) if compiled else decoder
    x, y = hidden_states(4, seed=1), hidden_states(4, seed=2)
    step(x)
    decoder.check()
    part = decoder.layers[1][1]
    part.front_publish = lambda x, boxes: None  # rank 1 is dead for one step
    with pytest.raises(KimiMailboxError, match=r"KimiDecoder\.reset\(\)"):
        decoder(x)
    del part.front_publish  # back (the class's method)
    with pytest.raises(KimiMailboxError):
        decoder(x)  # still faulted: the word stays set
    assert not boxes_armed(decoder)
    decoder.reset()
    assert boxes_armed(decoder)
    got = step(y)
    decoder.check()
    assert torch.equal(got, KimiDecoder(CONFIG, 3, tp=2, seed=13)(y))


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_compiled_decoder_bit_equal_to_eager_at_every_tp(tp):
    """The stand-in experts sum in float64 (kimi::routed_experts), so Inductor's reduction
    order cannot change a bit: ten random inputs, bit-equal at every TP."""
    torch._dynamo.reset()
    eager = KimiDecoder(CONFIG, 2, tp=tp, seed=14)
    compiled = torch.compile(KimiDecoder(CONFIG, 2, tp=tp, seed=14), fullgraph=True, dynamic=False)
    for seed in range(10):
        x = hidden_states(5, seed=100 + seed)
        assert torch.equal(compiled(x), eager(x)), seed


def test_marks_follow_each_ranks_error_word(monkeypatch):
    """KIMI_OPS_MARKS: each rank's error word is the first of its marks' words (a view: the
    ops still take a one-word error), and a step and reset() leave the words after it alone."""
    monkeypatch.setattr(boxes_module, "MARKS", True)
    decoder = KimiDecoder(CONFIG, 2, tp=2, seed=3)
    for rank in decoder.group.ranks:
        error, marks = decoder.boxes.error(rank), decoder.boxes.marks(rank)
        assert error.shape == (1,) and error.data_ptr() == marks.data_ptr() and marks.numel() == MARK_WORDS
        marks[1:].fill_(7)
    decoder(hidden_states(3))
    decoder.boxes.reset()
    assert all(bool((decoder.boxes.marks(r)[1:] == 7).all()) and int(decoder.boxes.error(r)) == 0
               for r in decoder.group.ranks)
