"""The mailbox ops, the config and the decoder reject what they cannot serve (issue 20):
each case raises a KimiArgumentError naming the argument, in the op's own name, with
nothing written; where a case is legal it computes the reference's result."""

import math

import pytest
import torch

from kimi_ops import KimiArgumentError, KimiConfig, KimiDecoder
from samples import sample_args

kimi = torch.ops.kimi


def tensors_of(args):
    """Every tensor argument, list members included (not the meta ones: no data)."""
    flat = [m for a in args for m in (a if isinstance(a, list) else [a])]
    return [t for t in flat if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def bits(t):
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def odd_width(box):
    return torch.randn(*box.shape[:-1], box.shape[-1] - 1).bfloat16()


def unpacked_width(box):  # even (viewable as words) but not whole 16-byte packets
    return torch.randn(*box.shape[:-1], box.shape[-1] + 2).bfloat16()


def odd_offset(box):
    shifted = torch.empty(box.numel() + 1, dtype=box.dtype)[1:].view(box.shape)
    return shifted.copy_(box)


def put(args, index, value):
    return args[:index] + (value,) + args[index + 1 :]


def put_member(args, index, member, value):
    boxes = list(args[index])
    boxes[member] = value
    return put(args, index, boxes)


def meta(t):
    return t.to("meta")


# (op, change of the sample arguments, words the message must hold)
CASES = [
    # 1. a meta tensor among real ones (the fake would run: nothing written or flagged)
    ("moe_tail_poll", lambda a: put(a, 2, meta(a[2])), ["'gamma'", "on cpu"]),
    ("moe_tail_poll", lambda a: put(a, 3, meta(a[3])), ["'w_up'", "on cpu"]),
    ("moe_tail_poll", lambda a: put(a, 6, meta(a[6])), ["'error'", "on cpu"]),
    ("moe_tail_poll", lambda a: put(a, 1, meta(a[1])), ["'rs_box'", "on cpu"]),
    ("moe_tail_poll", lambda a: put_member(a, 5, 1, meta(a[5][1])), ["'out_boxes[1]'", "on cpu"]),
    ("oproj_publish", lambda a: put_member(a, 2, 1, meta(a[2][1])), ["'boxes[1]'", "on cpu", "meta"]),
    ("oproj_publish", lambda a: put(a, 0, meta(a[0])), ["'x'"]),
    ("moe_front_publish", lambda a: put_member(a, 3, 0, meta(a[3][0])), ["'boxes[0]'", "meta"]),
    ("moe_front_publish", lambda a: put(a, 1, meta(a[1])), ["'w'", "meta"]),
    ("moe_tail_push", lambda a: put_member(a, 1, 1, meta(a[1][1])), ["'rs_boxes[1]'", "meta"]),
    ("moe_tail_push", lambda a: put(a, 0, meta(a[0])), ["meta"]),
    ("oproj_push", lambda a: put_member(a, 2, 1, meta(a[2][1])), ["'rs_boxes[1]'", "meta"]),
    ("oproj_push", lambda a: put(a, 1, meta(a[1])), ["'w'"]),
    ("moe_tail_publish", lambda a: put_member(a, 2, 0, meta(a[2][0])), ["'latent_boxes[0]'", "meta"]),
    ("moe_tail_publish", lambda a: put(a, 1, meta(a[1])), ["'weights'", "meta"]),
    ("mailbox_take", lambda a: put(a, 3, meta(a[3])), ["'error'", "meta"]),
    ("moe_route_poll", lambda a: put(a, 1, meta(a[1])), ["'bias'", "meta"]),
    # 2. box geometry: whole 16-byte packets, 16-byte aligned
    ("mailbox_arm", lambda a: put(a, 0, odd_width(a[0])), ["'box'", "multiple of 8"]),
    ("mailbox_rearm", lambda a: put(a, 0, unpacked_width(a[0])), ["'box'", "multiple of 8"]),
    ("mailbox_take", lambda a: put(a, 0, odd_width(a[0])), ["'box'", "multiple of 8"]),
    ("mailbox_take", lambda a: put(a, 0, odd_offset(a[0])), ["'box'", "16-byte aligned"]),
    ("moe_route_poll", lambda a: put(a, 0, odd_offset(a[0])), ["'box'", "16-byte aligned"]),
    ("moe_tail_poll", lambda a: put(a, 0, odd_offset(a[0])), ["'latent_box'", "16-byte aligned"]),
    ("moe_tail_push", lambda a: put_member(a, 1, 1, odd_offset(a[1][1])), ["'rs_boxes[1]'", "16-byte aligned"]),
    ("oproj_push", lambda a: put_member(a, 2, 0, odd_offset(a[2][0])), ["'rs_boxes[0]'", "16-byte aligned"]),
    ("oproj_publish", lambda a: put_member(a, 2, 0, odd_offset(a[2][0])), ["'boxes[0]'", "16-byte aligned"]),
    ("moe_front_publish", lambda a: (a[0], a[1][:-4].contiguous(), a[2], [torch.randn(3, 1, 8, 104).bfloat16()] * 2,
                                     a[4], a[5]), ["'w'", "multiple of 8 latent rows"]),
    ("mailbox_arm", lambda a: put(a, 0, torch.randn(0, 2, 8, 16).bfloat16()), ["'box'", "at least one parity"]),
    # 3. moe_tail_poll's boxes against each other; lists with a box twice
    ("moe_tail_poll", lambda a: put(a, 1, a[1][:2].contiguous()), ["'rs_box'", "[3, 2, 8]"]),
    ("moe_tail_poll", lambda a: put(a, 1, a[1][:, :1].contiguous()), ["'rs_box'", "[3, 2, 8]"]),
    ("moe_tail_poll", lambda a: put(put(put(a, 0, a[0][:, :, :4].contiguous()), 1, a[1][:, :, :4].contiguous()), 11, 2),
     ["'rearm_batch'", "[1, 4]"]),
    ("moe_tail_poll", lambda a: put(a, 1, a[0]), ["'rs_box'"]),
    ("moe_tail_poll", lambda a: put_member(a, 5, 1, a[5][0]), ["'out_boxes[1]'", "own", "out_boxes[0]"]),
    ("moe_tail_poll", lambda a: put_member(a, 5, 0, torch.randn(1, 1, 16, 64).bfloat16()[:, :, ::2]),
     ["'out_boxes[0]'", "contiguous"]),
    ("moe_tail_poll", lambda a: put(put(a, 5, a[5][:1]), 10, 0), ["'out_boxes'", "one box per rank"]),
    ("oproj_publish", lambda a: put_member(a, 2, 1, a[2][0]), ["'boxes[1]'", "own"]),
    ("moe_front_publish", lambda a: put_member(a, 3, 1, a[3][0]), ["'boxes[1]'", "own"]),
    ("moe_tail_push", lambda a: put_member(a, 1, 1, a[1][0]), ["'rs_boxes[1]'", "own"]),
    ("oproj_push", lambda a: put_member(a, 2, 1, a[2][0]), ["'rs_boxes[1]'", "own"]),
    ("oproj_push", lambda a: put(a, 1, a[1][:48]), ["'rs_boxes'", "N/TP = 48/2"]),
    ("oproj_push", lambda a: put(a, 3, 3), ["'parity'"]),
    # the fused shared expert: its workspace, counter and down checked like the two ops' arguments
    ("shared_expert_push", lambda a: put(a, 5, a[5][:2]), ["'act'", "at least x.shape[0] = 3 rows"]),
    ("shared_expert_push", lambda a: put(a, 5, torch.randn(8, 24).bfloat16()), ["'act'", "[*, 16]"]),
    ("shared_expert_push", lambda a: put(a, 5, meta(a[5])), ["'act'", "meta"]),
    ("shared_expert_push", lambda a: put(a, 5, a[0].view(-1)[:128].view(8, 16)), ["'x'", "a buffer of its own"]),
    ("shared_expert_push", lambda a: put(a, 6, torch.zeros(1, dtype=torch.int32)), ["'ticket'", "torch.int64"]),
    ("shared_expert_push", lambda a: put(a, 2, torch.randn(64, 24).bfloat16()), ["'w_down'", "[*, 16]"]),
    ("shared_expert_push", lambda a: put(a, 2, torch.randn(48, 16).bfloat16()), ["'rs_boxes'", "N/TP = 48/2"]),
    ("shared_expert_push", lambda a: put(a, 1, torch.randn(24, 64).bfloat16()), ["'w_gate_up'", "multiple of 16"]),
    ("shared_expert_push", lambda a: put(a, 8, 3), ["'parity'"]),
    ("shared_expert_push", lambda a: put(a, 10, torch.zeros(2, dtype=torch.int32)), ["'error'"]),
    # the front inside it: each op's checks in the fused op's name, its two box lists apart
    ("moe_front_shared_push", lambda a: put(a, 1, a[1][:-4].contiguous()), ["'w_front'", "multiple of 8 latent rows"]),
    ("moe_front_shared_push", lambda a: put_member(a, 3, 1, a[3][0]), ["'front_boxes[1]'", "own"]),
    ("moe_front_shared_push", lambda a: put(a, 3, [torch.randn(3, 1, 8, 104).bfloat16() for _ in range(2)]),
     ["'front_boxes'", "L + 2E = 112"]),
    ("moe_front_shared_push", lambda a: put(a, 4, torch.randn(32, 64).bfloat16()), ["'w_gate_up'", "[*, 128]"]),
    ("moe_front_shared_push", lambda a: put(a, 8, a[8][:2]), ["'act'", "at least x.shape[0] = 3 rows"]),
    ("moe_front_shared_push", lambda a: put(a, 8, a[3][0].view(-1)[:128].view(8, 16)), ["'act'", "the same memory"]),
    ("moe_front_shared_push", lambda a: put(a, 9, torch.zeros(1, dtype=torch.int32)), ["'ticket'", "torch.int64"]),
    ("moe_front_shared_push", lambda a: put(a, 11, 3), ["'parity'"]),
    ("moe_front_shared_push", lambda a: put(a, 12, 2), ["'rank'"]),
    ("moe_front_shared_push", lambda a: put(a, 13, torch.zeros(2, dtype=torch.int32)), ["'error'"]),
    # attn_res_take_into's buffer: rows enough for the batch, H wide, BF16, its own memory
    ("attn_res_take_into", lambda a: put(a, 10, a[10][:2]), ["'h_normed'", "at least batch = 3 rows"]),
    ("attn_res_take_into", lambda a: put(a, 10, torch.randn(8, 48).bfloat16()), ["'h_normed'", "[*, 64]"]),
    ("attn_res_take_into", lambda a: put(a, 10, a[10].float()), ["'h_normed'", "torch.bfloat16"]),
    ("attn_res_take_into", lambda a: put(a, 10, torch.randn(16, 64).bfloat16()[::2]), ["'h_normed'", "contiguous"]),
    ("attn_res_take_into", lambda a: put(a, 10, meta(a[10])), ["'h_normed'", "meta"]),
    ("attn_res_take_into", lambda a: put(a, 10, a[5]), ["'partial'", "a buffer of its own"]),
    ("attn_res_take_into", lambda a: put(a, 10, a[0][0, 0]), ["'h_normed'", "own"]),
    ("moe_tail_publish", lambda a: put_member(a, 2, 1, a[2][0]), ["'latent_boxes[1]'", "own"]),
    ("mailbox_take", lambda a: put(a, 3, a[0].view(-1)[:2].view(torch.int32)), ["'error'", "own"]),
    # 4. the two-shot boxes: moe_latent_reduce's against each other, the publish's widths, serve refusing them
    ("moe_latent_reduce", lambda a: put(a, 1, a[1][:1]), ["'gathered_boxes'", "one box per source", "TP = 2"]),
    ("moe_latent_reduce", lambda a: put(a, 1, [torch.randn(3, 1, 8, 40).bfloat16() for _ in range(2)]),
     ["'gathered_boxes'", "L = TP · recv_box width = 48"]),
    ("moe_latent_reduce", lambda a: put(a, 4, 0), ["'rearm_parity'", "not the published parity 0"]),
    ("moe_latent_reduce", lambda a: put(a, 7, 9), ["'batch (over the mailbox capacity?)'"]),
    ("moe_latent_reduce", lambda a: put_member(a, 1, 1, a[1][0]), ["'gathered_boxes[1]'", "own"]),
    ("moe_latent_reduce", lambda a: put(a, 6, 2), ["'rank'", "[0, 1]"]),
    ("moe_latent_reduce", lambda a: put(a, 5, 9), ["'rearm_batch'", "[1, 8]"]),
    ("moe_latent_reduce", lambda a: put(a, 2, a[2].float()), ["'error'", "int32"]),
    ("moe_latent_reduce", lambda a: put(a, 0, a[1][1].view(3, 2, 8, 24)), ["'gathered_boxes[1]'", "own"]),
    ("moe_tail_publish", lambda a: put(a, 2, [torch.randn(3, 2, 8, 16).bfloat16() for _ in range(2)]),
     ["'latent_boxes'", "L/TP = 24", "two-shot"]),
    ("moe_tail_serve", lambda a: put(a, 2, [torch.randn(3, 2, 8, 24).bfloat16() for _ in range(2)]),
     ["'latent_boxes'", "two-shot receive boxes go to moe_tail_publish"]),
    ("moe_tail_poll", lambda a: put(put(put(a, 0, torch.randn(3, 1, 8, 48).bfloat16()), 5, a[5][:1]), 10, 0),
     ["'out_boxes'", "one box per rank (TP = 2)"]),
    # 5. moe_route_poll's experts in its own name, checked before the error word is set
    *[("moe_route_poll", lambda a, e=e: put(a, 1, torch.randn(e)), ["kimi::moe_route_poll", "'bias.shape[0] (experts)'"])
      for e in (8, 15, 1025)],
    ("moe_route_poll", lambda a: put(put(a, 0, torch.randn(3, 1, 8, 112).bfloat16()), 1, torch.randn(31)),
     ["'box'", "E = 31", "multiple of 8"]),
    # 6. the route poll's ready counter (int64 [2]) and the routed experts' wait for it, with its error word
    ("moe_route_poll", lambda a: put(a, 7, torch.zeros(2, dtype=torch.int32)), ["'ready'", "torch.int64"]),
    ("moe_route_poll", lambda a: put(a, 7, torch.zeros(3, dtype=torch.int64)), ["'ready'", "[2]"]),
    ("moe_route_poll", lambda a: put(a, 7, meta(a[7])), ["'ready'", "meta"]),
    ("routed_experts_counted", lambda a: put(a, 6, a[6].int()), ["'ready'", "torch.int64"]),
    ("routed_experts_counted", lambda a: put(a, 6, a[6][:1]), ["'ready'", "[2]"]),
    ("routed_experts_counted", lambda a: put(a, 7, a[7].long()), ["'error'", "torch.int32"]),
    ("routed_experts_counted", lambda a: put(a, 6, meta(a[6])), ["'ready'", "meta"]),
    ("routed_experts_counted", lambda a: put(a, 7, a[6][:1].view(torch.int32)[:1]), ["'error'", "the same memory"]),
    ("routed_experts_counted", lambda a: put(a, 5, 3), ["kimi::routed_experts_counted", "'tp'"]),
    # 7. eps finite and > 0
    *[(name, lambda a, i=i, eps=eps: put(a, i, eps), ["'eps'", "finite and > 0"])
      for name, i in (("moe_tail", 5), ("attn_res", 6), ("dsa_index_front", 4), ("dsa_index_key_insert", 3),
                      ("moe_tail_poll", 4))
      for eps in (-1.0, 0.0, math.nan, math.inf)],
]


@pytest.mark.parametrize("name, change, words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rejected_with_nothing_written(name, change, words):
    args = change(sample_args(name, 3, torch.Generator().manual_seed(11)))
    before = [t.clone() for t in tensors_of(args)]
    with pytest.raises(KimiArgumentError) as error:
        getattr(kimi, name)(*args)
    message = str(error.value)
    assert message.startswith(f"kimi::{name}: argument '"), message
    for word in words:
        assert word in message, message
    for old, new in zip(before, tensors_of(args)):
        assert torch.equal(bits(old), bits(new)), f"{name} wrote before raising"


def test_key_insert_into_an_empty_cache_with_every_slot_skipped():
    args = sample_args("dsa_index_key_insert", 3, torch.Generator().manual_seed(2))
    cache = torch.empty(0, 132, dtype=torch.uint8)
    kimi.dsa_index_key_insert(*args[:4], cache, torch.full((3,), -1))
    with pytest.raises(KimiArgumentError, match=r"'slots' must be in \[-1, 0\)"):
        kimi.dsa_index_key_insert(*args[:4], cache, torch.tensor([-1, 0, -1]))


CONFIG_CASES = [
    (dict(eps=-1.0), "eps"), (dict(eps=math.nan), "eps"), (dict(latent=127), "latent"), (dict(hidden=100), "hidden"),
    (dict(experts=8), "experts"), (dict(experts=2048), "experts"), (dict(experts=66), "experts"),
    (dict(top_k=8), "top_k"), (dict(attn_res_block=0), "attn_res_block"), (dict(attn_res_block=-1), "attn_res_block"),
    (dict(capacity=-1), "capacity"), (dict(capacity=0), "capacity"), (dict(shared_intermediate=0), "shared_intermediate"),
    (dict(hidden=256.0), "hidden"), (dict(index_slots=-1), "index_slots"), (dict(renorm=1), "renorm"),
    (dict(routed_scale=math.inf), "routed_scale"),
]


@pytest.mark.parametrize("fields, name", CONFIG_CASES, ids=[str(c[0]) for c in CONFIG_CASES])
def test_config_validates_at_construction(fields, name):
    with pytest.raises(KimiArgumentError, match=f"^KimiConfig: {name} must be"):
        KimiConfig.tiny(**fields)


DECODER_CASES = [
    (dict(num_layers=0), "num_layers"), (dict(num_layers=-3), "num_layers"), (dict(num_layers=2.0), "num_layers"),
    (dict(tp=2.0), "tp"), (dict(tp="2"), "tp"), (dict(tp=None), "tp"), (dict(tp=True), "tp"), (dict(tp=0), "tp"),
    (dict(tp=32), "config.latent"), (dict(tp=3), "config.hidden"),
    *([(dict(device="cuda"), "device")] if not torch.cuda.is_available() else []),
]


@pytest.mark.parametrize("arguments, name", DECODER_CASES, ids=[str(c[0]) for c in DECODER_CASES])
def test_decoder_validates_its_arguments(arguments, name):
    with pytest.raises(KimiArgumentError, match=f"^KimiDecoder: {name} must be"):
        KimiDecoder(KimiConfig.tiny(), **{"num_layers": 2, **arguments})


def test_forward_names_hidden_and_slots():
    decoder = KimiDecoder(KimiConfig.tiny(capacity=8, index_slots=4), 2, tp=2)
    good = torch.randn(3, 256).bfloat16()
    for hidden in (torch.randn(256).bfloat16(), torch.randn(3, 255).bfloat16(), good.float(), good.to("meta"),
                   torch.randn(9, 256).bfloat16(), torch.randn(0, 256).bfloat16()):
        with pytest.raises(KimiArgumentError, match="^KimiDecoder.forward: hidden must be"):
            decoder(hidden)
    for slots in (torch.arange(3).int(), torch.arange(4), torch.arange(3).to("meta")):
        with pytest.raises(KimiArgumentError, match="^KimiDecoder.forward: slots must be"):
            decoder(good, slots)
    with pytest.raises(KimiArgumentError, match="slots must be given when B > config.index_slots = 4"):
        decoder(torch.randn(5, 256).bfloat16())
    assert decoder(good).shape == (3, 256)
