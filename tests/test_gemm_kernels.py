"""The CuTe decode-GEMM engine (kernels/gemm/): every variant the decoder runs at TP 1 / 2
/ 8 compiles for sm_90a without a GPU, with no spills and no ptxas performance note; its
plans cover every row once in one wave; on a Hopper GPU ``kimi::oproj``, ``kimi::moe_front``,
``kimi::gate_up_situ`` and the publishing ops match the reference backend (outputs
poisoned first, fresh inputs), bit for bit across runs, and the boxes hold the functional
op's rows."""

import warnings

import pytest
import torch

pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from kimi_ops import KimiConfig  # noqa: E402
from kimi_ops.checks import KimiArgumentError  # noqa: E402
from kimi_ops.kernels.gemm import engine  # noqa: E402
from kimi_ops.kernels.gemm import host as gemm  # noqa: E402
from kimi_ops.kernels.gemm import plan as gemm_plans  # noqa: E402
from kimi_ops.kernels.gemm.shared import CALL_STRIDE  # noqa: E402
from kimi_ops.kernels.dsa import plan as dsa_plans  # noqa: E402
from kimi_ops.kernels.ring import CHUNK  # noqa: E402
from kimi_ops.kernels.launch import SMEM_BYTES  # noqa: E402
from kimi_ops.mailbox import SENTINEL, canonical  # noqa: E402
from kimi_ops.numerics import rms_norm  # noqa: E402
from kimi_ops.ops import oproj as oproj_ops  # noqa: E402
from benchmarks import bench_projection as bench  # noqa: E402  (the variants it times compile)

from conftest import KERNEL_BATCHES, armed_box, assert_bf16_close, deliver_staged, on_hopper, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("dirty_shared_memory")  # kernels must not read stale shared memory

kimi = torch.ops.kimi
TPS = (1, 2, 8)


variants = bench.variants


@pytest.mark.parametrize("variant", variants(), ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("tokens", [8, 64])
def test_gemm_compiles(variant, tokens, clean_ptxas):
    assert gemm.compile_gemm.build(*bench.compile_key(*variant, tokens)) is not None
    clean_ptxas()


@pytest.mark.parametrize("n, k", [(7168, 12288), (12288, 7168), (4480, 7168), (1536, 7168)])
@pytest.mark.parametrize("tokens", [16, 32])
def test_gemm_middle_buckets_compile(n, k, tokens, clean_ptxas):
    assert gemm.compile_gemm.build(n, k, tokens) is not None
    clean_ptxas()


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("tokens", [8, 64])
def test_oproj_push_compiles(tp, tokens, clean_ptxas):
    """The shared expert's down projection with the reduce-scatter stores in its epilogue."""
    assert gemm.compile_gemm.build(7168, 6144 // tp, tokens, False, 0, tp, True) is not None
    clean_ptxas()


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("tokens", [8, 64])
def test_gate_up_situ_compiles(tp, tokens, clean_ptxas):
    """The shared expert's gate/up projection with situ in its epilogue."""
    assert gemm.compile_gemm.build(12288 // tp, 7168, tokens, False, 0, 0, False, (1.0, 0.0)) is not None
    clean_ptxas()


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("tokens", [8, 64])
def test_shared_expert_compiles(tp, tokens, clean_ptxas):
    """The fused shared expert (gate/up, situ, the grid barrier, the down and its push)."""
    assert gemm.compile_shared.build(12288 // tp, 7168, 7168, tokens, tp, (1.0, 0.0)) is not None
    clean_ptxas()


@pytest.mark.parametrize("tokens", [8, 64])
def test_front_shared_expert_compiles(tokens, clean_ptxas):
    """The TP8 rank's front publish beside the fused shared expert's gate/up, in one grid."""
    assert gemm.compile_shared.build(1536, 7168, 7168, tokens, 1, (1.0, 0.0), 624, 112) is not None
    clean_ptxas()


def test_shared_expert_compiles_with_stamps(monkeypatch, clean_ptxas):
    """KIMI_OPS_MARKS (kernels.values.Stamps): every CTA's phases compiled in, a 16-byte store
    each (the build is not cached: the setting is read at import, and the cache's key holds it)."""
    from kimi_ops.kernels.gemm import shared

    monkeypatch.setattr(shared, "MARKS", True)
    assert gemm.compile_shared.build(1536, 7168, 7168, 8, 1, (1.0, 0.0)) is not None
    clean_ptxas()


def test_the_shared_expert_needs_the_marks_words_with_marks(monkeypatch):
    """KIMI_OPS_MARKS: a shared expert whose error word has no marks' words behind it is
    refused before any launch (its stamps would land past the word)."""
    from kimi_ops.kernels import launch

    monkeypatch.setattr(launch, "MARKS", True)
    with pytest.raises(ValueError, match="shared_expert_push: .* error must be the first of .* int32 words"):
        gemm.SharedExpertKernel()(*[None] * 10, torch.zeros(1, dtype=torch.int32))


def test_shared_expert_grid_is_one_size_and_resident():
    """The fused grid: every bucket's, whole clusters, resident at once, room for both plans."""
    for tp in (2, 8):
        plans = [gemm.shared_plan(12288 // tp, 7168, 7168, tokens, 0) for tokens in gemm_plans.TOKEN_TILES]
        for plan in plans:
            assert plan.grid == plans[0].grid and plan.grid % plan.gate_up.split == 0
            assert plan.grid <= gemm_plans.RESIDENT[plan.gate_up.split]
            assert plan.grid >= max(plan.gate_up.ctas, plan.down.ctas) and plan.down.split == plan.down.tiles == 1
            # the barriers, the ring, target and each plan's received barrier
            assert 8 * (2 * plan.depth + 1) <= 1024 and 1024 + plan.ring_bytes + 8 + 8 * 3 <= SMEM_BYTES


def test_front_and_gate_up_share_one_resident_grid():
    """The TP8 rank's front [624, 7168] beside the gate/up [1536, 7168]: alone they take 80 +
    96 CTAs, more than one wave; together joint_partition gives the gate/up three tiles a CTA
    (owners of 32 rows, the last two of a cluster none) and the front two, in clusters of 8,
    the down's 112 tiles the grid, at every bucket."""
    assert (gemm_plans.partition(624, 7168, 8), gemm_plans.partition(1536, 7168, 8, 16)) == ((1, 8), (2, 8))
    for tokens in gemm_plans.TOKEN_TILES:
        plan = gemm.shared_plan(1536, 7168, 7168, tokens, 624)
        assert (plan.front.tiles, plan.front.split, plan.front.ctas) == (2, 8, 40)
        assert (plan.gate_up.tiles, plan.gate_up.split, plan.gate_up.ctas, plan.gate_up.owned) == (3, 8, 64, 32)
        assert plan.grid == 112 and plan.cluster == 8 and plan.grid <= gemm_plans.RESIDENT[8]
        assert plan.gate_up.owned * (plan.gate_up.split - 2) == plan.gate_up.rows
        assert plan.gate_up.receivers == 6 and plan.front.receivers == 8  # no block goes to an owner of nothing
        assert 8 * (2 * plan.depth + 1) <= 1024 and 1024 + plan.ring_bytes + 8 + 8 * 3 <= SMEM_BYTES
    assert gemm.SharedExpertKernel().prefers(1536, 7168, 7168, 624)
    assert not gemm.SharedExpertKernel().prefers(12288, 7168, 7168, 896 + 3584)  # kimi_k3 TP1: no fused shared expert


def test_joint_partition_balances_the_slowest_cta():
    """The slowest CTA's cost first, then the first weight's; None past one wave."""
    parts = gemm_plans.joint_partition([(624, 8), (1536, 16)], 7168, 8)
    costs = [gemm_plans.cta_cost(112, tiles, split, 8) for tiles, split in parts]
    assert parts == [(2, 8), (3, 8)] and costs[0] < costs[1]
    assert gemm_plans.joint_partition([(16384, 8), (16384, 8)], 7168, 8) is None  # 86 blocks each


@pytest.fixture
def gemm_room(monkeypatch, tmp_path):
    """``gemm_room(kb)``: launch.GEMM_ROOM (KIMI_OPS_GEMM_ROOM) for the rest of the test, the
    plans' caches cleared around it (and the kernel cache a directory of its own)."""
    cached = (gemm_plans.gemm_plan, gemm.gemm_variant, gemm.shared_plan, gemm.shared_variant, dsa_plans.index_plan)
    monkeypatch.setenv("KIMI_OPS_CACHE_DIR", str(tmp_path))

    def set_room(kb: int) -> None:
        monkeypatch.setattr(gemm_plans, "GEMM_ROOM", kb * 1024)  # the DSA front's plan reads it there too
        for function in cached:
            function.cache_clear()

    yield set_room
    for function in cached:
        function.cache_clear()


TP8_RANK_SHAPES = [(7168, 1536, None), (1696, 7168, None), (1536, 1536, None), (624, 7168, None), (7168, 768, None),
                   (1536, 7168, (1.0, 0.0))]  # o-proj, the DSA helpers, the core, the front, the push, gate/up


def test_rings_leave_the_room_asked(gemm_room):
    """KIMI_OPS_GEMM_ROOM: each decode GEMM of the TP8 rank's layer leaves the room beside its
    ring (a successor's CTA of up to that much fits on its SM), its partition and grid as
    without it; the DSA front, whose raw rows need its whole K slice in the ring, leaves
    what that slice leaves, at most the room; a plan whose K parts' exchange (receive buffer
    and staging) needs more than the ring's slots says what it leaves (``room``)."""
    room = 112 * 1024

    def plans():
        return {(n, k, t): gemm.plan_of(n, k, t, situ) for n, k, situ in TP8_RANK_SHAPES for t in gemm_plans.TOKEN_TILES}

    full, shared_full = plans(), [gemm.shared_plan(1536, 7168, 7168, t, 0) for t in gemm_plans.TOKEN_TILES]
    gemm_room(room // 1024)
    for key, roomy in plans().items():
        assert (roomy.tiles, roomy.split, roomy.ctas) == (full[key].tiles, full[key].split, full[key].ctas), key
        assert roomy.room == room and roomy.ring_bytes + 2048 + room <= SMEM_BYTES, key
        assert 1 <= roomy.sets <= roomy.depth <= full[key].depth and roomy.chunks % roomy.sets == 0, key
    for tokens, before in zip(gemm_plans.TOKEN_TILES, shared_full):
        roomy = gemm.shared_plan(1536, 7168, 7168, tokens, 0)
        assert (roomy.grid, roomy.gate_up.ctas, roomy.down.ctas) == (before.grid, before.gate_up.ctas, before.down.ctas)
        assert 1024 + roomy.ring_bytes + 8 + room <= SMEM_BYTES < 1024 + before.ring_bytes + 8 + room
        assert gemm.shared_variant(1536, 7168, 7168, tokens, 1, (1.0, 0.0)).plan is roomy  # the compile's plan
    for tokens in gemm_plans.TOKEN_TILES:
        front = dsa_plans.index_plan(1536, tokens, True)
        whole = front.chunks * (front.w_slot + front.x_slot)
        assert front.depth == front.chunks and front.room == min(room, SMEM_BYTES - 2048 - front.reserve - whole)
        assert front.room > 0 and front.ring_bytes + 2048 + front.reserve + front.room <= SMEM_BYTES
    wide = gemm_plans.GemmPlan(1536, 7168, 64, (3, 8), unit=16)  # the fused front's gate/up: 8 blocks of 32 rows
    assert 2 * wide.receive_bytes > wide.depth * (wide.w_slot + wide.x_slot)
    assert wide.room == SMEM_BYTES - 2048 - wide.ring_bytes < room


def test_a_ring_keeps_a_slot_and_no_more_chunks_in_flight_than_slots(gemm_room):
    """A room past what leaves one slot leaves what the ring and the K parts' exchange leave
    (no plan fails for it), and the chunks in flight (each in a slot until its sum is in)
    never exceed the slots: at 180 KB the stacked DSA GEMM at 64 tokens in two tiles, split 8
    (its plan at 32 tokens), keeps one slot, one chunk in flight (two without the cap: the
    consumer would wait for a slot it holds)."""
    gemm_room(180)
    plan = gemm_plans.GemmPlan(1696, 7168, 64, (2, 8))
    assert (plan.depth, plan.sets) == (1, 1) and plan.ring_bytes == 2 * plan.receive_bytes  # the exchange's
    assert plan.room == SMEM_BYTES - 2048 - plan.ring_bytes < 180 * 1024  # what the exchange leaves
    gemm_room(226)
    plan = gemm_plans.GemmPlan(1696, 7168, 64, (2, 8))
    assert plan.depth == 1 and plan.room == SMEM_BYTES - 2048 - plan.ring_bytes


@pytest.mark.parametrize("room", [112, 140])
@pytest.mark.parametrize("tokens", [8, 64])
def test_shared_expert_with_room_compiles(gemm_room, room, tokens, clean_ptxas):
    gemm_room(room)
    assert gemm.compile_shared.build(1536, 7168, 7168, tokens, 1, (1.0, 0.0)) is not None
    clean_ptxas()


def test_fused_shared_expert_preferred_where_the_push_takes_the_whole_k():
    """The decoder's choice (backend.prefers): the TP8 rank's down (K = 768) and tiny's,
    whose push runs one CTA over the whole K as the fused down does, not kimi_k3 TP1's
    (K = 6144: the push splits K)."""
    kernel = gemm.SharedExpertKernel()
    assert kernel.prefers(2 * 768, 7168, 7168) and kernel.prefers(2 * 192, 256, 256)
    assert not kernel.prefers(12288, 7168, 7168)
    assert not kernel.prefers(2 * 768, 7168, 7164)  # no plan of the push (N % 8): no fused op either


def test_situ_epilogue_plans_own_whole_gate_up_pairs():
    """Every TP's shared gate/up shape at every bucket: a CTA owns whole 16-row pairs (TP16's
    default plan owns 8 rows a CTA: the situ plan splits otherwise)."""
    for tp in (1, 2, 4, 8, 16):
        for tokens in gemm_plans.TOKEN_TILES:
            plan = gemm.gemm_variant(12288 // tp, 7168, tokens, (False, 0, 0, False, (1.0, 0.0))).plan
            assert plan.owned % 16 == 0 and plan.blocks * plan.rows >= 12288 // tp
    assert gemm_plans.gemm_plan(768, 7168, 8).owned == 8 and gemm_plans.gemm_plan(768, 7168, 8, 16).owned == 16


def test_push_epilogue_takes_a_ctas_rows_into_one_owner():
    for tp in (1, 2, 8, 16):  # the decoder's shared down shapes, every bucket
        for tokens in gemm_plans.TOKEN_TILES:
            assert gemm.gemm_variant(7168, 6144 // tp, tokens, (False, 0, tp, True)).plan.owned > 0
    with pytest.raises(gemm.Unsupported, match="N/TP must be a multiple"):  # 48 rows a CTA, 2240 an owner
        gemm.gemm_variant(4480, 7168, 8, (False, 0, 2, True))


@pytest.mark.parametrize("variant", variants(), ids=lambda v: "-".join(map(str, v)))
def test_plan_covers_every_row_once_in_one_wave_and_fits(variant):
    _, n, k, n_logits, _ = variant
    assert gemm.unsupported_shape(n, k, 64, n_logits) is None
    for tokens in gemm_plans.TOKEN_TILES:
        plan = gemm_plans.gemm_plan(n, k, tokens)
        assert plan.blocks * plan.rows >= n > (plan.blocks - 1) * plan.rows
        assert plan.ctas <= gemm_plans.RESIDENT[plan.split] and plan.split in gemm_plans.SPLITS
        assert plan.split * plan.chunks * CHUNK == k and plan.rows <= 256
        assert plan.owned % 8 == 0 and plan.owned * plan.split == plan.rows and plan.receivers == plan.split
        assert plan.receive_bytes * (1 + (plan.split > 1)) <= plan.ring_bytes  # and the staging
        assert plan.ring_bytes + 2048 <= SMEM_BYTES and plan.block_bytes % 16 == 0  # a bulk copy's size
        assert plan.depth >= min(plan.chunks, 4) and plan.chunks % plan.sets == 0
        assert (1 + plan.sets) * plan.tiles * tokens // 2 <= gemm_plans.ACCUMULATOR_REGISTERS


@pytest.mark.parametrize("tiles, split, tokens", [(1, 1, 8), (3, 2, 64), (4, 4, 32), (1, 8, 16), (3, 8, 64)])
def test_stage_send_and_finish_sum_every_part_once_in_order(tiles, split, tokens):
    """CPU model of the K-part exchange through GemmPlan.receive_word: every CTA's m64nT
    accumulators (DecodeGemm.consume's layout) go into their rows' owners' blocks
    (DecodeGemm.stage: ours into our receive buffer, the others' into the staging), each
    staged block whole into its owner's receive buffer at our part (DecodeGemm.send),
    without overlap; each owner's packets (finish) read back Σ of the parts, each once."""
    plan = gemm_plans.GemmPlan.__new__(gemm_plans.GemmPlan)
    plan.tiles, plan.split, plan.tokens = tiles, split, tokens
    plan.rows, plan.stride = 64 * tiles, tokens + gemm_plans.RECEIVE_PAD
    plan.owned = plan.rows // split
    block = plan.owned * plan.stride
    gen = torch.Generator().manual_seed(tiles * 100 + split)
    sums = torch.randn(split, plan.rows, tokens, generator=gen, dtype=torch.float64)  # [part][row][token]
    received = [dict() for _ in range(split)]
    n = tokens // 2
    for part in range(split):
        staging = {}
        for tid in range(128):
            warp, g, t = tid // 32, tid % 32 // 4, tid % 4
            for tile in range(tiles):
                for h in range(2):
                    row = tile * 64 + 16 * warp + 8 * h + g
                    owner, index = row // plan.owned, row % plan.owned
                    for j in range(tokens // 8):
                        k = tile * n + 4 * j + 2 * h  # acc[k], acc[k + 1]: tokens 8j + 2t, + 1
                        word = plan.receive_word(owner, index, 8 * j + 2 * t)
                        assert word % 2 == 0 and owner * block <= word < (owner + 1) * block - 1
                        target = received[part] if owner == part else staging
                        for e in range(2):
                            assert word + e not in target
                            target[word + e] = float(sums[part, row, 8 * j + 2 * t + e])
                        assert k + 1 < tiles * n
        deliver_staged(staging, received, part, block, split)
    for owner in range(split):
        for index in range(plan.owned):
            for token in range(tokens):
                total = sum(received[owner][plan.receive_word(p, index, token)] for p in range(split))
                assert total == pytest.approx(float(sums[:, owner * plan.owned + index, token].sum()))


def test_partition_trades_weight_bytes_per_cta_for_splits():
    """One wave of whole-K CTAs where it covers the SMs (o-proj at TP8, the shared down);
    K splits where it would leave most idle (the front, the DSA helpers) or where fewer x
    reads pay (TP1's o-proj at 64 tokens); at 64 tokens a short K's two tiles go to one tile
    at half the split (the stacked DSA GEMM, the TP8 rank's o-proj), TP1's o-proj stays."""
    assert gemm_plans.partition(7168, 1536, 8) == (1, 1) and gemm_plans.partition(7168, 768, 64) == (1, 1)
    assert gemm_plans.partition(4480, 7168, 8) == (3, 4) and gemm_plans.partition(32, 7168, 8) == (1, 8)
    assert gemm_plans.partition(7168, 12288, 64) == (2, 2) and gemm_plans.partition(4480, 7168, 64) == (3, 4)
    assert gemm_plans.partition(1696, 7168, 32) == (2, 8) and gemm_plans.partition(1696, 7168, 64) == (1, 4)
    assert gemm_plans.partition(7168, 1536, 32) == (2, 2) and gemm_plans.partition(7168, 1536, 64) == (1, 1)
    assert gemm_plans.partition(7168, 100, 8) is None and gemm_plans.partition(100, 7168, 8) is None


def test_unsupported_shapes_say_why():
    assert "at most 64 tokens" in gemm.unsupported_shape(7168, 1536, 65)
    assert "n_logits % 8" in gemm.unsupported_shape(4480, 7168, 8, 4)
    assert "K % 64" in gemm.unsupported_shape(7168, 1000, 8)
    assert gemm.unsupported_shape(256, 256, 1) is None  # KimiConfig.tiny's shapes run on the kernel


def test_prepare_compiles_every_bucket_of_the_batches(monkeypatch):
    compiled = []
    monkeypatch.setattr(gemm, "compile_gemm", lambda *key: compiled.append(key))
    gemm.OprojKernel().prepare(7168, 1536, range(8, 136, 8))  # a capacity past 64: those run the reference
    gemm.FrontKernel().prepare(4480, 7168, 896, [1, 64])
    gemm.OprojPublishKernel().prepare(7168, 1536, 8, [3])
    gemm.FrontPublishKernel().prepare(560, 7168, 112, 8)
    gemm.OprojKernel().prepare(7168, 1000)  # not the engine's: nothing to compile
    gemm.GateUpSituKernel().prepare(1536, 7168, 1, 0, [8])
    assert compiled == [(7168, 1536, t) for t in (8, 16, 32, 64)] + [
        (4480, 7168, 8, True, 896), (4480, 7168, 64, True, 896), (7168, 1536, 8, False, 0, 8)
    ] + [(560, 7168, t, True, 112, 8) for t in (8, 16, 32, 64)] + [(1536, 7168, 8, False, 0, 0, False, (1.0, 0.0))]


# GPU: against the reference backend on the same device.


def poisoned_pool(*shapes, dtype=torch.bfloat16):
    """NaN blocks of the outputs' sizes, freed: the caching allocator hands them to the op."""
    pool = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape in shapes]
    del pool


def inputs(batch, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, k, generator=gen).bfloat16().cuda()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16().cuda()
    return x, w


def assert_gemm_close(got, want, x, w):
    """Within one BF16 ulp counted at the sum's scale sqrt(Σ_k (x_k·w_nk)²) (an FP32
    accumulation in any order is off by a fraction of it, which is many ulps of an output
    that cancels to near zero), at most 1 % of the elements not bit-equal."""
    scale = (x.double().square() @ w.double().square().T).sqrt()
    assert_bf16_close(got, want, magnitude=torch.maximum(scale, want.double().abs()))


def gpu_shapes():
    return sorted({(n, k) for op, n, k, _, _ in variants() if op == "oproj"})


@on_hopper
@pytest.mark.parametrize("n, k", gpu_shapes())
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_oproj_kernel(n, k, batch):
    x, w = inputs(batch, n, k, seed=n + k + batch)
    poisoned_pool((batch, n))
    got = kimi.oproj(x, w)
    assert_gemm_close(got, reference(kimi.oproj, x, w), x, w)
    assert torch.equal(got, kimi.oproj(x, w))  # bit-identical across runs


# kimi::normed_oproj: the stacked DSA GEMM over the raw embedding (the decoder's layer 0): at 8
# and 16 tokens one and two chunks past the ring, held in registers; at 32 and 64 three and 15,
# loaded again
NORMED = (1696, 7168)


@pytest.mark.parametrize("tokens", gemm_plans.TOKEN_TILES)
def test_normed_oproj_compiles(tokens, clean_ptxas):
    assert gemm.compile_normed.build(*NORMED, tokens) is not None
    clean_ptxas()


def test_normed_oproj_compiles_with_a_ring_shorter_than_its_reloads(monkeypatch, clean_ptxas):
    """KIMI_OPS_GEMM_ROOM's A/B setting can leave a ring of 3 slots at 64 tokens, fewer than
    RELOADS_AHEAD: every chunk past it is still loaded again once, before its slot."""
    monkeypatch.setattr(gemm_plans, "GEMM_ROOM", 170 * 1024)
    plan = gemm_plans.GemmPlan(*NORMED, 64, gemm_plans.partition(*NORMED, 64), reserve=8 * 4 * 64 + 64)
    assert not plan.holds_raw and plan.depth < engine.RELOADS_AHEAD
    monkeypatch.setattr(gemm, "raw_rows_plan", lambda *key: plan)
    assert gemm.compile_normed.build(*NORMED, 64) is not None
    clean_ptxas()


def test_normed_oproj_plans_are_partitions_past_the_ring():
    """The raw-row plan is partition's (so kimi::oproj over rms_norm rows sums in the same
    order), its ring shorter than the CTA's chunks (the chunks past it wait for their
    slots); a producer holds the packets of them all up to 16 tokens (raw_rows_fit), past
    that it loads x again for those past the ring."""
    kernel = gemm.NormedOprojKernel()
    for tokens in gemm_plans.TOKEN_TILES:
        plan = gemm_plans.raw_rows_plan(*NORMED, tokens)
        assert (plan.tiles, plan.split) == gemm_plans.partition(*NORMED, tokens)
        assert plan.depth < plan.chunks and plan.holds_raw == (tokens <= 16) and kernel.prefers(*NORMED, tokens)
    assert kernel.prefers(*NORMED, 64) and not kernel.prefers(1696, 7000, 8)  # K % 64


@on_hopper
@pytest.mark.parametrize("batch", sorted({*KERNEL_BATCHES, 13, 33, 40}))  # and tokens past the batch in a bucket
def test_normed_oproj_kernel(batch):
    """Raw rows of any scale: the rows the reference's rms_norm leaves, then kimi::oproj's
    kernel (the same plan, so the same bits), and within the GEMM's bound of the reference."""
    x, w = inputs(batch, *NORMED, seed=batch + 7)
    x = x * 5.0
    gen = torch.Generator().manual_seed(batch)
    gamma = (1 + 0.1 * torch.randn(NORMED[1], generator=gen)).bfloat16().cuda()
    assert gemm.NormedOprojKernel().unsupported(x, w, gamma, 1e-6) is None  # the kernel, not the reference
    poisoned_pool((batch, NORMED[0]))
    got = kimi.normed_oproj(x, w, gamma, 1e-6)
    rows = reference(kimi.normed_oproj, x, w, gamma, 1e-6)
    xn = rms_norm(x, gamma, 1e-6)
    assert_gemm_close(got, rows, xn, w)
    assert torch.equal(got, kimi.oproj(xn, w))
    assert torch.equal(got, kimi.normed_oproj(x, w, gamma, 1e-6))  # bit-identical across runs


def test_forced_partitions_are_the_plans_choices_and_compile(clean_ptxas):
    """bench_projection --partitions: the plan's partition is among the resident ones it
    times; a forced one (the stacked GEMM at 64 tokens in two tiles and clusters of 8, not
    the plan's) compiles clean, as its own cache key."""
    for n, k in ((1696, 7168), (7168, 1536), (560, 7168)):
        for batch in (32, 64):
            assert gemm_plans.partition(n, k, gemm_plans.token_tile(batch)) in bench.resident_partitions(n, k, batch)
    assert (2, 8) != gemm_plans.partition(1696, 7168, 64)
    assert gemm.compile_gemm.build(1696, 7168, 64, False, 0, 0, False, None, (2, 8)) is not None
    clean_ptxas()
    assert gemm.plan_of(1696, 7168, 64, None, (2, 8)).split == 8


@on_hopper
@pytest.mark.parametrize("batch", [17, 64])
def test_forced_partitions_give_the_oproj(batch):
    """Every resident partition of the stacked GEMM's weight gives kimi::oproj's rows."""
    n, k = 1696, 7168
    x, w = inputs(batch, n, k, seed=batch)
    want = reference(kimi.oproj, x, w)
    for parts in bench.resident_partitions(n, k, batch):
        poisoned_pool((batch, n))
        assert_gemm_close(gemm.OprojKernel.rows(gemm.forced_variant(n, k, batch, parts), x, w), want, x, w)


def test_a_single_row_gets_a_stride_tma_takes():
    """x goes to the engine by TMA: a [1, K] row with torch's arbitrary stride (a transposed
    column: (1, 1)) gets the compact one, the same data; other rows stay as they are."""
    from kimi_ops.kernels.arguments import tma_rows

    column = torch.randn(256, 1).bfloat16()
    row = tma_rows(column.T)
    assert row.stride() == (256, 1) and row.data_ptr() == column.data_ptr() and torch.equal(row, column.T)
    view = torch.randn(4, 320)[:, :256]
    assert tma_rows(view) is view


@on_hopper
def test_oproj_kernel_takes_a_single_row_of_any_stride():
    x, w = inputs(1, 512, 1536, seed=3)
    column = x.as_strided(x.shape, (1, 1))  # the same row, as torch may stride it
    assert torch.equal(kimi.oproj(column, w), kimi.oproj(x, w))


def front_variants():
    return [(n, k, n_logits) for op, n, k, n_logits, _ in variants() if op == "moe_front"]


def assert_front_close(got, want, x, w, n_logits):
    """Logits within 1e-5 of the reference relative to Σ |x_k · w_k| (FP32 accumulation in
    another order); the latent as assert_gemm_close."""
    scale = (x.double().abs() @ w[:n_logits].double().abs().T).float()
    assert (got[0] - want[0]).abs().le(1e-5 * scale + 1e-30).all()
    assert_gemm_close(got[1], want[1], x, w[n_logits:])


@on_hopper
@pytest.mark.parametrize("n, k, n_logits", front_variants())
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_front_kernel(n, k, n_logits, batch):
    x, w = inputs(batch, n, k, seed=n + batch)
    poisoned_pool((batch, n_logits), (batch, n - n_logits))
    got = kimi.moe_front(x, w, n_logits)
    assert_front_close(got, reference(kimi.moe_front, x, w, n_logits), x, w, n_logits)
    again = kimi.moe_front(x, w, n_logits)
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])


def armed(rows):
    return bool((rows.contiguous().view(torch.int32) == SENTINEL).all())


def box_cases(test):
    """A box-storing test at every TP and at B = 1, 8, 64, on Hopper."""
    return on_hopper(pytest.mark.parametrize("tp", TPS)(pytest.mark.parametrize("batch", [1, 8, 64])(test)))


def published_inputs(batch, n, k, seed):
    """x with a zero row (its rows' words +0, never the sentinel) and w."""
    x, w = inputs(batch, n, k, seed=seed)
    x[0] = 0.0
    return x, w


@box_cases
def test_oproj_publish_stores_the_functional_rows_in_every_box(tp, batch):
    n, k = 7168, 12288 // tp
    x, w = published_inputs(batch, n, k, seed=tp * 100 + batch)
    rank, capacity = tp - 1, 64
    boxes = [armed_box(1, tp, capacity, n) for _ in range(tp)]
    kimi.oproj_publish(x, w, boxes, rank)
    rows = canonical(kimi.oproj(x, w))
    for box in boxes:
        assert torch.equal(box[0, rank, :batch], rows)
        assert armed(box[0, rank, batch:]) and armed(box[0, :rank]) and armed(box[0, rank + 1 :])
        assert not (box[0, rank, :batch].view(torch.int32) == SENTINEL).any()


@box_cases
def test_oproj_push_stores_each_shard_in_its_owners_box(tp, batch):
    n, k = 7168, 6144 // tp
    x, w = published_inputs(batch, n, k, seed=tp * 1000 + batch)
    rank, parity, capacity, shard = tp - 1, 2, 64, n // tp
    boxes = [armed_box(3, tp, capacity, shard) for _ in range(tp)]
    kimi.oproj_push(x, w, boxes, parity, rank)
    rows = canonical(kimi.oproj(x, w))
    for owner, box in enumerate(boxes):
        assert torch.equal(box[parity, rank, :batch], rows[:, owner * shard : (owner + 1) * shard])
        assert armed(box[parity, rank, batch:]) and armed(box[parity, :rank]) and armed(box[:parity])
    want = [armed_box(3, tp, capacity, shard) for _ in range(tp)]
    reference(kimi.oproj_push, x, w, want, parity, rank)
    for got, ref in zip(boxes, want):  # the reference op stores in the same places (its GEMM rounds apart)
        assert torch.equal(got.view(torch.int32) == SENTINEL, ref.view(torch.int32) == SENTINEL)


@on_hopper
@pytest.mark.parametrize("tp", [1, 8])
def test_shared_expert_push_equals_gate_up_situ_then_oproj_push(tp):
    """One launch, the two ops' bits: act[:B] the gate/up kernel's activations (rows past B
    untouched), the boxes the push kernel's where its plan also takes the whole K in one CTA
    (else within 1 ulp at the sum's scale, as every GEMM), at every bucket; the counter
    advances by CALL_STRIDE a call and no error is set."""
    inner, n, rank, parity = 6144 // tp, 7168, tp - 1, 2
    ticket = torch.zeros(1, dtype=torch.int64, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    for batch in (1, 5, 8, 13, 64):
        gen = torch.Generator().manual_seed(tp * 100 + batch)
        x = torch.randn(batch, 7168, generator=gen).bfloat16().cuda()
        w_gate_up = (torch.randn(2 * inner, 7168, generator=gen) * 7168**-0.5).bfloat16().cuda()
        w_down = (torch.randn(n, inner, generator=gen) * inner**-0.5).bfloat16().cuda()
        act = torch.full((64, inner), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
        boxes = [armed_box(3, tp, 64, n // tp) for _ in range(tp)]
        call = (x, w_gate_up, w_down, 1.0, 0.0, act, ticket, boxes, parity, rank, error)
        if why := gemm.SharedExpertKernel().unsupported(*call):
            pytest.skip(f"the fused shared expert does not take TP{tp}'s shapes: {why}")
        before = int(ticket[0])
        kimi.shared_expert_push(*call)
        activations = kimi.gate_up_situ(x, w_gate_up, 1.0, 0.0)
        want = [armed_box(3, tp, 64, n // tp) for _ in range(tp)]
        kimi.oproj_push(activations, w_down, want, parity, rank)
        assert torch.equal(act[:batch], activations) and bool(torch.isnan(act[batch:]).all()), batch
        push = gemm.gemm_variant(n, inner, batch, (False, 0, tp, True)).plan
        owned = n // tp
        for owner, (got, ref) in enumerate(zip(boxes, want)):
            if push.split == 1:  # each row's chunk sums in chunk order by one CTA, as the fused down's
                assert torch.equal(got, ref), batch
            else:  # K split apart: another FP32 order, within an ulp at the sum's scale; the rest of the box alike
                rows = w_down[owner * owned : (owner + 1) * owned]
                assert_gemm_close(got[parity, rank, :batch], ref[parity, rank, :batch], activations, rows)
                rest_got, rest_ref = got.view(torch.int16).clone(), ref.view(torch.int16).clone()
                rest_got[parity, rank, :batch] = rest_ref[parity, rank, :batch] = 0
                assert torch.equal(rest_got, rest_ref), batch
        assert int(error[0]) == 0 and int(ticket[0]) - before == CALL_STRIDE, batch


@on_hopper
def test_front_shared_push_equals_the_front_publish_and_the_shared_expert():
    """The TP8 rank's front beside the fused shared expert, one launch: the front boxes, act
    and the reduce-scatter boxes hold the front publish kernel's and the fused shared
    expert's bits where the gate/up's K split is the same (the same chunk sums in the same
    order; at 64 tokens the gate/up alone splits K in 4, beside the front in 8: act within
    two ulps), at every bucket, on poisoned act and armed boxes; the counter advances by
    CALL_STRIDE, no error."""
    n_logits, n_front, inner, n, parity = 112, 624, 768, 7168, 1
    ticket = torch.zeros(1, dtype=torch.int64, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    for batch in (1, 5, 8, 13, 64):
        gen = torch.Generator().manual_seed(900 + batch)
        x = torch.randn(batch, 7168, generator=gen).bfloat16().cuda()
        w_front = (torch.randn(n_front, 7168, generator=gen) * 7168**-0.5).bfloat16().cuda()
        w_gate_up = (torch.randn(2 * inner, 7168, generator=gen) * 7168**-0.5).bfloat16().cuda()
        w_down = (torch.randn(n, inner, generator=gen) * inner**-0.5).bfloat16().cuda()
        outputs = lambda: ([armed_box(3, 1, 64, n_front + n_logits)],  # noqa: E731
                           torch.full((64, inner), float("nan"), dtype=torch.bfloat16, device="cuda"),
                           [armed_box(3, 1, 64, n)])
        (front_boxes, act, boxes), (want_front, want_act, want) = outputs(), outputs()
        call = (x, w_front, n_logits, front_boxes, w_gate_up, w_down, 1.0, 0.0, act, ticket, boxes, parity, 0, error)
        assert gemm.FrontSharedKernel().unsupported(*call) is None
        before = int(ticket[0])
        kimi.moe_front_shared_push(*call)
        assert int(error[0]) == 0 and int(ticket[0]) - before == CALL_STRIDE, batch
        kimi.moe_front_publish(x, w_front, n_logits, want_front, parity, 0)
        kimi.shared_expert_push(x, w_gate_up, w_down, 1.0, 0.0, want_act, ticket, want, parity, 0, error)
        assert not armed(front_boxes[0][parity, 0, :batch]) and armed(front_boxes[0][parity, 0, batch:]), batch
        assert torch.equal(front_boxes[0].view(torch.int16), want_front[0].view(torch.int16)), batch  # logit words
        assert bool(torch.isnan(act[batch:]).all()), batch
        tokens = gemm_plans.token_tile(batch)
        beside, alone = (gemm.shared_plan(2 * inner, 7168, n, tokens, n_front).gate_up,
                         gemm.shared_plan(2 * inner, 7168, n, tokens, 0).gate_up)
        if beside.split == alone.split:
            assert torch.equal(act[:batch], want_act[:batch]) and torch.equal(boxes[0], want[0]), batch
        else:  # the down's sums at the scale of its terms: an act ulp moves them by far less than theirs
            assert batch == 64 and armed(boxes[0][parity ^ 1]) and armed(boxes[0][parity, 0, batch:]), batch
            assert_bf16_close(act[:batch], want_act[:batch], max_ulps=2)  # situ of a gate and an up an ulp apart each
            terms = act[:batch].float().abs() @ w_down.float().abs().T
            assert_bf16_close(boxes[0][parity, 0, :batch], want[0][parity, 0, :batch], max_flipped=0.1,
                              magnitude=terms)


@on_hopper
def test_one_ticket_serves_the_fused_shared_expert_with_and_without_the_front():
    """At KimiConfig.tiny()'s shapes the fused shared expert's grid is 16 CTAs with the front
    and 8 without; bench_layer's breakdown calls both on the model's one ticket, back to
    back. Five such calls (each form twice in a row, then the other), their outputs
    allocated first so that nothing runs between them (the next call's CTAs fit beside the
    last's): each advances the counter by CALL_STRIDE, none sets an error (a counter left at
    a multiple of the narrower grid, or a CTA's arrival before its PDL wait counted toward
    the previous call, left CTAs waiting until the poll bound), and each leaves act and the
    boxes as the same call on a ticket of its own."""
    c = KimiConfig.tiny()
    inner, n, k, parity = c.shared_intermediate, c.hidden, c.hidden, 1
    n_logits, n_front = c.experts, c.experts + c.latent
    assert [gemm.shared_plan(2 * inner, k, n, 8, front).grid for front in (n_front, 0)] == [16, 8]  # this test's case
    shared = torch.zeros(1, dtype=torch.int64, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(41)
    w_front = (torch.randn(n_front, k, generator=gen) * k**-0.5).bfloat16().cuda()
    w_gate_up = (torch.randn(2 * inner, k, generator=gen) * k**-0.5).bfloat16().cuda()
    w_down = (torch.randn(n, inner, generator=gen) * inner**-0.5).bfloat16().cuda()

    def outputs():  # act (poisoned), the reduce-scatter box, the front box
        return (torch.full((64, inner), float("nan"), dtype=torch.bfloat16, device="cuda"),
                armed_box(3, 1, 64, n), armed_box(3, 1, 64, n_front + n_logits))

    def call(x, ticket, fronted, act, box, front_box):
        if fronted:
            kimi.moe_front_shared_push(x, w_front, n_logits, [front_box], w_gate_up, w_down, 1.0, 0.0, act, ticket,
                                       [box], parity, 0, error)
        else:
            kimi.shared_expert_push(x, w_gate_up, w_down, 1.0, 0.0, act, ticket, [box], parity, 0, error)

    order = (True, True, False, False, True)
    for batch in (1, 5, 13, 64):
        x = torch.randn(batch, k, generator=gen).bfloat16().cuda()
        got = [outputs() for _ in order]
        before = int(shared[0])
        for fronted, out in zip(order, got):
            call(x, shared, fronted, *out)
        assert int(error[0]) == 0 and int(shared[0]) - before == len(order) * CALL_STRIDE, batch
        for fronted, (act, box, front_box) in zip(order, got):
            want = outputs()
            call(x, torch.zeros_like(shared), fronted, *want)
            assert int(error[0]) == 0 and torch.equal(act[:batch], want[0][:batch]), (batch, fronted)
            assert torch.equal(box, want[1]) and torch.equal(front_box.view(torch.int16), want[2].view(torch.int16))


@box_cases
def test_front_publish_stores_logit_words_and_latent_in_every_box(tp, batch):
    experts, latent_width = 896 // tp, 3584 // tp
    n, k = experts + latent_width, 7168
    x, w = inputs(batch, n, k, seed=tp * 10 + batch)
    x[0] = 0.0
    x[-1, 5] = float("nan")  # NaN rows: canonical NaN words
    rank, parity, capacity = tp // 2, 1, 64
    width = tp * (latent_width + 2 * experts)
    boxes = [armed_box(3, 1, capacity, width) for _ in range(tp)]
    kimi.moe_front_publish(x, w, experts, boxes, parity, rank)
    logits, latent = kimi.moe_front(x, w, experts)
    logit_at = tp * latent_width + 2 * rank * experts
    for box in boxes:
        row = box[parity, 0, :batch]
        latent_words = row[:, rank * latent_width : (rank + 1) * latent_width].contiguous().view(torch.int16)
        assert torch.equal(latent_words, canonical(latent).view(torch.int16))  # bits: NaN rows too
        words = row[:, logit_at : logit_at + 2 * experts].contiguous().view(torch.float32)
        assert torch.equal(words.view(torch.int32), canonical(logits).view(torch.int32))
        assert armed(box[parity, 0, batch:]) and armed(box[(parity + 1) % 3])
        others = torch.ones(width, dtype=torch.bool)
        others[rank * latent_width : (rank + 1) * latent_width] = False
        others[logit_at : logit_at + 2 * experts] = False
        if others.any():  # TP1: the rank's latent and logits fill the row
            assert armed(row[:, others])


def situ_scale(x, w):
    """situ(g, u)'s error scale when g and u are sums off by their own scale (assert_gemm_close):
    |∂situ/∂g| · scale_g + |∂situ/∂u| · scale_u, at the exact g and u."""
    half = w.shape[0] // 2
    h = x.double() @ w.double().T
    scale = (x.double().square() @ w.double().square().T).sqrt()
    g, u, sig = h[:, :half], h[:, half:], torch.sigmoid(h[:, :half])
    return (sig * (1 + g * (1 - sig)) * u).abs() * scale[:, :half] + (g * sig).abs() * scale[:, half:]


@on_hopper
@pytest.mark.parametrize("tp", (1, 8, 16))
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_gate_up_situ_kernel(tp, batch):
    """The reference's activations within situ's tolerance (assert_bf16_close), and where the
    plan is oproj's (TP1, TP8) the bits of kimi::situ(kimi::oproj(x, [gate; up])): a row's
    sum does not depend on the CTA that owns it."""
    n = 12288 // tp
    x, w = inputs(batch, n, 7168, seed=n + batch)
    paired = oproj_ops.interleave_gate_up(w)
    poisoned_pool((batch, n // 2))
    got = kimi.gate_up_situ(x, paired, 1.0, 0.0)
    assert_bf16_close(got, reference(kimi.gate_up_situ, x, paired, 1.0, 0.0), magnitude=situ_scale(x, w))
    assert torch.equal(got, kimi.gate_up_situ(x, paired, 1.0, 0.0))
    if tp != 16:
        assert torch.equal(got, kimi.situ(kimi.oproj(x, w), 1.0, 0.0))


@on_hopper
def test_shared_expert_chain_replays_from_a_graph():
    """gate/up with situ → down at TP8 (PDL-chained kernels), captured once: replays over
    fresh inputs equal eager calls bit for bit."""
    x, gate_up = inputs(8, 1536, 7168, seed=1)
    gate_up = oproj_ops.interleave_gate_up(gate_up)
    _, down = inputs(8, 7168, 768, seed=2)

    def shared():
        return kimi.oproj(kimi.gate_up_situ(x, gate_up, 1.0, 0.0), down)

    hidden = kimi.gate_up_situ(x, gate_up, 1.0, 0.0)
    assert_gemm_close(shared(), reference(kimi.oproj, hidden, down), hidden, down)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = shared()
    for seed in range(3, 8):
        x.copy_(inputs(8, 1536, 7168, seed=seed)[0])
        graph.replay()
        assert torch.equal(out, shared())


@on_hopper
def test_bad_inputs_get_the_op_error_and_unsupported_shapes_the_reference():
    x, w = inputs(4, 256, 7168, seed=3)
    with pytest.raises(KimiArgumentError):
        kimi.oproj(x.float(), w)
    x, w = inputs(4, 64, 96, seed=4)  # K % 64: the reference, with a warning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(kimi.oproj(x, w), reference(kimi.oproj, x, w))
