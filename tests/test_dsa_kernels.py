"""The CuTe DSA indexer kernels (kernels/dsa.py): every variant the decoder runs compiles for
sm_90a without a GPU (no spills, no ptxas performance note); the plan, the by-token K-part
exchange and the epilogue's quantization rule are checked on the CPU (the rule against the
reference bit for bit, NaN / Inf included); the adapters route checks, unsupported shapes
and prepare. On a Hopper GPU both ops match the reference backend on fresh random inputs at
batches 1..64 with the outputs poisoned first: FP8 codes ≥ 99.9 % equal (NaN codes equal
up to their sign), scales exact and head weights within one BF16 ulp, cache rows outside
``slots`` untouched, slot −1 skipped, out-of-range slots dropped under capture."""

import warnings

import pytest
import torch

pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from kimi_ops import backend  # noqa: E402
from kimi_ops.config import INDEX_DIM, INDEX_HEADS  # noqa: E402
from kimi_ops.checks import KimiArgumentError  # noqa: E402
from kimi_ops.kernels.dsa import host as dsa  # noqa: E402
from kimi_ops.kernels.dsa import plan as dsa_plan  # noqa: E402
from kimi_ops.kernels.gemm import plan as gemm_plans  # noqa: E402
from kimi_ops.kernels.launch import SMEM_BYTES  # noqa: E402
from kimi_ops.kernels.ring import CHUNK, swizzled  # noqa: E402
from kimi_ops.numerics import quantize_e4m3  # noqa: E402
from kimi_ops.testing import composite  # noqa: E402
from benchmarks import bench_dsa as bench  # noqa: E402  (its inputs and eps)
from kimi_ops.ops import dsa as dsa_op  # noqa: E402

from conftest import KERNEL_BATCHES, bf16_ulps, deliver_staged, on_hopper, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("dirty_shared_memory")  # kernels must not read stale shared memory

kimi = torch.ops.kimi
K = 1536

# The decoder's front runs raw rows (q_norm_w given) at every bucket; normalized rows at the
# smallest and largest bucket (the op's other mode: CI time).
FRONT_VARIANTS = [(tokens, True) for tokens in gemm_plans.TOKEN_TILES] + [(8, False), (64, False)]


@pytest.mark.parametrize("tokens, norm", FRONT_VARIANTS)
def test_front_compiles(tokens, norm, clean_ptxas):
    assert dsa.compile_index_front.build(K, tokens, norm) is not None
    clean_ptxas()


@pytest.mark.parametrize("tokens", gemm_plans.TOKEN_TILES)
def test_front_with_keys_compiles(tokens, clean_ptxas):
    """The decoder's front (raw rows) with the key insert's CTAs, at every bucket."""
    assert dsa.compile_index_front.build(K, tokens, True, True) is not None
    clean_ptxas()


def test_key_insert_compiles(clean_ptxas):
    assert dsa.compile_key_insert.build() is not None
    clean_ptxas()


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", gemm_plans.TOKEN_TILES)
def test_plan_puts_a_head_in_a_cta_and_the_grid_in_one_wave(tokens, norm):
    plan = dsa_plan.index_plan(K, tokens, norm)
    assert (plan.tiles, plan.split) == (2, 3) and plan.rows == INDEX_DIM and plan.blocks == INDEX_HEADS
    assert plan.ctas == 96 <= dsa_plan.resident(plan.split) and plan.split * plan.chunks * CHUNK == K
    assert plan.by_token and plan.per_owner % 2 == 0 and plan.per_owner * plan.split >= tokens
    assert plan.stride % 4 == 2 and plan.depth == plan.chunks  # pairs in distinct banks; the K slice in the ring
    assert 2 * plan.receive_bytes <= plan.ring_bytes and plan.ring_bytes + 2048 + plan.reserve <= SMEM_BYTES
    assert plan.chunks % plan.sets == 0 and (1 + plan.sets) * plan.tiles * tokens // 2 <= gemm_plans.ACCUMULATOR_REGISTERS


def test_partition_rejects_what_the_kernel_cannot_take():
    assert dsa_plan.index_partition(96, 8, True) is None and dsa_plan.index_partition(1000, 8, False) is None
    assert dsa_plan.index_partition(256, 64, True) == (2, 1)  # 4 chunks: split 3 does not divide them, 2 costs more
    assert "at most 64 tokens" in dsa.unsupported_front(K, 65, True)
    assert "K % 64" in dsa.unsupported_front(96, 4, True)
    assert dsa.unsupported_front(K, 1, True) is None and dsa.unsupported_front(K, 64, False) is None


@pytest.mark.parametrize("tokens", gemm_plans.TOKEN_TILES)
def test_by_token_exchange_sums_every_part_once_in_order(tokens):
    """CPU model of the K-part exchange in by_token mode: every CTA's m64nT accumulators
    (DecodeGemm.consume's layout) go by token pair into their owner's block (DecodeGemm.stage:
    ours into our receive buffer, the others' into the staging), each staged block whole into
    its owner's receive buffer at our part (DecodeGemm.send: the owners of tokens only,
    GemmPlan.receivers), without overlap; each owner's channel reads (IndexFront.finish)
    find Σ of the parts, each part once."""
    plan = dsa_plan.index_plan(K, tokens, True)
    gen = torch.Generator().manual_seed(tokens)
    sums = torch.randn(plan.split, plan.rows, tokens, generator=gen, dtype=torch.float64)  # [part][row][token]
    received = [dict() for _ in range(plan.split)]
    block = plan.block_bytes // 4
    n = tokens // 2
    for part in range(plan.split):
        staging = {}
        for tid in range(128):
            warp, g, t = tid // 32, tid % 32 // 4, tid % 4
            for tile in range(plan.tiles):
                for h in range(2):
                    row = tile * 64 + 16 * warp + 8 * h + g
                    for j in range(tokens // 8):
                        assert tile * n + 4 * j + 2 * h + 1 < plan.tiles * n
                        token = 8 * j + 2 * t
                        owner, index = plan.owner(token)
                        assert plan.owner(token + 1) == (owner, index + 1)  # one 8-byte store a pair
                        word = plan.receive_word(owner, row, index)
                        assert word % 2 == 0 and owner * block <= word < (owner + 1) * block - 1
                        target = received[part] if owner == part else staging
                        for e in range(2):
                            assert word + e not in target
                            target[word + e] = float(sums[part, row, token + e])
        assert all(word < plan.receivers * block for word in staging)  # nothing staged for the others
        deliver_staged(staging, received, part, block, plan.receivers)
    assert plan.receivers == (2 if tokens == 8 else plan.split)  # 8 tokens: 4 an owner, the third owns none
    seen = set()
    for owner in range(plan.split):
        for index in range(plan.per_owner):
            token = owner * plan.per_owner + index
            if token >= tokens:
                continue
            seen.add(token)
            for row in range(plan.rows):
                total = sum(received[owner][plan.receive_word(p, row, index)] for p in range(plan.split))
                assert total == pytest.approx(float(sums[:, row, token].sum()))
    assert seen == set(range(tokens))


@pytest.mark.parametrize("tokens", gemm_plans.TOKEN_TILES)
def test_raw_rows_cover_every_packet_once_and_send_every_sum_once(tokens):
    """CPU model of DecodeGemm.produce_normalized's items: producer p holds token
    p // 8 + 16·j, piece p % 8 of every chunk; the (token, piece) packets of a slot are each
    written once, the 8 lanes of a token (one butterfly) are one warp's consecutive lanes,
    and one lane per token sends its Σ x²: the factored barrier's split · T · 8 bytes."""
    plan = dsa_plan.index_plan(K, tokens, True)
    written, senders = {}, {}
    for producer in range(gemm_plans.PRODUCERS):
        piece = producer % (CHUNK // 8)
        for j in range(plan.x_items):
            token = producer // (CHUNK // 8) + gemm_plans.PRODUCERS // (CHUNK // 8) * j
            if token >= tokens:
                continue
            word = swizzled(0, token, piece) * 4
            assert word not in written and word + 4 <= plan.x_slot // 4
            written[word] = (token, piece)
            assert producer // 32 == (producer - piece) // 32 == (producer - piece + 7) // 32  # one warp's lanes
            if piece == 0:
                assert token not in senders
                senders[token] = producer
    assert len(written) == tokens * CHUNK // 8 and sorted(senders) == list(range(tokens))
    assert plan.split * len(senders) * 8 == plan.split * plan.tokens * 8


def test_key_insert_takes_aligned_rows_only():
    k_in = torch.zeros(3 * 128 + 1, dtype=torch.bfloat16)[1:].view(3, 128)  # 2 bytes off
    norm = torch.ones(128, dtype=torch.bfloat16)
    reason = dsa.KeyInsertKernel().unsupported(k_in, norm, norm, 1e-6, torch.zeros(4, 132, dtype=torch.uint8),
                                               torch.zeros(3, dtype=torch.int64))
    assert "align" in reason


def kernel_rule(values: torch.Tensor):
    """The epilogue's quantization as the kernel computes it (module doc), in torch FP32:
    NaN-propagating amax clamped at 1e-10, IEEE amax / 448, pow2_ceil on the bits,
    x · rcp(scale), saturation to ±448, e4m3 (RNE)."""
    amax = values.abs().amax(-1, keepdim=True)
    amax = torch.where(torch.isnan(amax), amax, amax.clamp_min(1e-10))
    scale = composite.pow2_ceil(amax / 448.0)
    scaled = values * torch.reciprocal(scale)
    codes = torch.where(torch.isnan(scaled), scaled, scaled.clamp(-448.0, 448.0)).to(torch.float8_e4m3fn)
    return codes, scale


def same_codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes equal, NaN codes (0x7F / 0xFF) equal whatever their sign: a NaN's sign
    bit comes from the libraries' NaN payloads (the GPU writes 0x7F)."""
    a, b = a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()
    return (a == b) | (((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F))


def test_kernel_rule_is_the_reference_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    values = (torch.randn(64, 32, 128, generator=gen) * torch.exp2(torch.randint(-30, 30, (64, 32, 1), generator=gen)))
    values = values.bfloat16().float()
    values[0, 0] = float("nan")
    values[0, 1, 7] = float("inf")
    values[0, 2, 3] = -float("inf")
    values[0, 3] = 0.0
    values[0, 4, :5] = float("nan")
    values[1, 0] = 448.0 * 2.0**-20  # amax / 448 exactly a power of two
    codes, scale = kernel_rule(values)
    want, want_scale = quantize_e4m3(values)
    assert same_codes(codes, want).all()
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))


def test_adapters_use_the_ops_checks_and_are_registered(monkeypatch):
    from kimi_ops import kernels

    monkeypatch.setattr(backend, "KERNELS", {})
    assert kernels.register()
    assert dsa.IndexFrontKernel.check is dsa_op.check_dsa_index_front
    assert dsa.KeyInsertKernel.check is dsa_op.check_dsa_index_key_insert
    assert isinstance(backend.KERNELS["dsa_index_front"], dsa.IndexFrontKernel)
    assert isinstance(backend.KERNELS["dsa_index_key_insert"], dsa.KeyInsertKernel)
    assert dsa.IndexFrontKeysKernel.check is dsa_op.check_dsa_index_front_keys
    assert isinstance(backend.KERNELS["dsa_index_front_keys"], dsa.IndexFrontKeysKernel)


def test_prepare_compiles_every_bucket_of_both_modes(monkeypatch):
    compiled = []
    monkeypatch.setattr(dsa, "compile_index_front", lambda *key: compiled.append(key))
    monkeypatch.setattr(dsa, "compile_key_insert", lambda: compiled.append("key"))
    dsa.IndexFrontKernel().prepare(K, range(8, 72, 8))
    dsa.IndexFrontKernel().prepare(K, [1, 64], modes=(True,))
    dsa.IndexFrontKernel().prepare(96, [8])  # not the kernel's: nothing to compile
    dsa.KeyInsertKernel().prepare()
    dsa.IndexFrontKeysKernel().prepare(K, [1, 64], modes=(True,))
    assert compiled == [(K, t, True, False) for t in gemm_plans.TOKEN_TILES] + [
        (K, t, False, False) for t in gemm_plans.TOKEN_TILES] + [(K, 8, True, False), (K, 64, True, False), "key",
                                                                  (K, 8, True, True), (K, 64, True, True)]


@pytest.mark.parametrize("normalized", [True, False])
def test_bench_composites_are_the_reference(normalized):
    """bench_dsa's composites (FP32 torch ops) compute the op: codes, scales and caches of
    the reference on the CPU (its float64 sums aside: ≥ 99.9 % of codes)."""
    rows, head_in, q_norm_w, k_in, norm_w, norm_b = bench.inputs(4, device="cpu")
    wq_b = (torch.randn(4096, K, generator=torch.Generator().manual_seed(1)) * K**-0.5).bfloat16()
    gamma = None if normalized else q_norm_w
    q, head_w = composite.front_composite(rows, wq_b, head_in, gamma, bench.EPS)
    want_q, want_w = kimi.dsa_index_front(rows, wq_b, head_in, gamma, bench.EPS)
    assert float(same_codes(q, want_q).double().mean()) >= 0.999
    assert float(bf16_ulps(head_w, want_w).max()) <= 1
    cache, want_cache = torch.zeros(8, 132, dtype=torch.uint8), torch.zeros(8, 132, dtype=torch.uint8)
    slots = torch.tensor([5, 0, 7, 2])
    composite.key_composite(k_in, norm_w, norm_b, bench.EPS, cache, slots)
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, bench.EPS, want_cache, slots)
    assert float(same_codes(cache[:, :128], want_cache[:, :128]).double().mean()) >= 0.99
    assert float((cache[:, 128:] == want_cache[:, 128:]).double().mean()) >= 0.9


# GPU: against the reference backend on the same device.


def poisoned_pool(*shapes):
    """NaN blocks of the outputs' sizes, freed: the caching allocator hands them to the op."""
    pool = [torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda") for shape in shapes]
    del pool


def front_inputs(batch, seed, normalized):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(batch, K, generator=gen)
    if normalized:  # q_c as QueryNorm leaves it: unit RMS
        rows = rows / rows.square().mean(-1, keepdim=True).sqrt()
    rows = (rows * (1 if normalized else 3.0)).bfloat16().cuda()
    wq_b = (torch.randn(4096, K, generator=gen) * K**-0.5).bfloat16().cuda()
    head_in = torch.randn(batch, 32, generator=gen).bfloat16().cuda()
    q_norm_w = None if normalized else (1 + 0.1 * torch.randn(K, generator=gen)).bfloat16().cuda()
    return rows, wq_b, head_in, q_norm_w


def assert_front_matches(got, want, min_equal=0.999):
    """Codes ≥ ``min_equal`` equal (the rest BF16 rounding ties of the projection); head
    weights within one BF16 ulp, and bit-equal wherever the head's codes are: the fold
    (head_in · scale · 2^-6) is exact, so a scale off by a power of two would be 2^n off."""
    q, head_w = got
    want_q, want_w = want
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape and head_w.shape == want_w.shape
    equal = same_codes(q, want_q)
    assert float(equal.double().mean()) >= min_equal, f"{float(equal.double().mean()):.5%} of codes equal"
    ulps = bf16_ulps(head_w.cpu(), want_w.cpu())
    assert float(ulps.max()) <= 1
    heads_equal = equal.all(-1)
    assert (ulps[heads_equal] == 0).all()


@on_hopper
@pytest.mark.parametrize("normalized", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_front_kernel(batch, normalized):
    rows, wq_b, head_in, q_norm_w = front_inputs(batch, seed=batch + 100 * normalized, normalized=normalized)
    poisoned_pool((batch, 32, 64), (batch, 32))
    got = kimi.dsa_index_front(rows, wq_b, head_in, q_norm_w, 1e-6)
    assert_front_matches(got, reference(kimi.dsa_index_front, rows, wq_b, head_in, q_norm_w, 1e-6))
    again = kimi.dsa_index_front(rows, wq_b, head_in, q_norm_w, 1e-6)
    assert torch.equal(got[0].view(torch.uint8), again[0].view(torch.uint8)) and torch.equal(got[1], again[1])


@on_hopper
@pytest.mark.parametrize("normalized", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("batch", [3, 64])
def test_front_nan_and_inf_rows_give_the_reference_bytes(batch, normalized):
    rows, wq_b, head_in, q_norm_w = front_inputs(batch, seed=7, normalized=normalized)
    rows[0, 11] = float("nan")
    rows[1, 5] = float("inf")
    rows[2, 100] = -float("inf")
    head_in[2, 3] = 0.0
    got = kimi.dsa_index_front(rows, wq_b, head_in, q_norm_w, 1e-6)
    want = reference(kimi.dsa_index_front, rows, wq_b, head_in, q_norm_w, 1e-6)
    assert same_codes(got[0][:3], want[0][:3]).all()
    assert torch.equal(got[1][:3].isnan(), want[1][:3].isnan())
    finite = ~want[1][:3].isnan()
    assert torch.equal(got[1][:3][finite], want[1][:3][finite])
    if batch > 3:
        assert_front_matches((got[0][3:], got[1][3:]), (want[0][3:], want[1][3:]))


def key_inputs(batch, slots_count, seed):
    gen = torch.Generator().manual_seed(seed)
    k_in = (torch.randn(batch, 128, generator=gen) * 2 + 0.5).bfloat16().cuda()
    norm_w = (1 + 0.1 * torch.randn(128, generator=gen)).bfloat16().cuda()
    norm_b = (0.1 * torch.randn(128, generator=gen)).bfloat16().cuda()
    cache = torch.randint(0, 256, (slots_count, 132), generator=gen, dtype=torch.uint8).cuda()  # poisoned rows
    slots = torch.randperm(slots_count, generator=gen)[:batch]
    slots[::3] = -1  # padding tokens
    return k_in, norm_w, norm_b, cache, slots.cuda()


def assert_caches_match(got, want, before, slots):
    """The written rows: codes equal (NaN codes up to sign), scale bytes equal; every other
    row as it was before the call."""
    written = torch.zeros(got.shape[0], dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    got, want, before = got.cpu(), want.cpu(), before.cpu()
    assert torch.equal(got[~written], before[~written])
    assert same_codes(got[written, :128], want[written, :128]).all()
    assert torch.equal(got[written, 128:], want[written, 128:])


@on_hopper
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_key_insert_kernel(batch):
    k_in, norm_w, norm_b, cache, slots = key_inputs(batch, 3 * batch + 5, seed=batch)
    k_in[0, 3] = float("nan")
    if batch > 1:
        k_in[1, 9] = float("inf")
    before, want = cache.clone(), cache.clone()
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-6, cache, slots)
    reference(kimi.dsa_index_key_insert, k_in, norm_w, norm_b, 1e-6, want, slots)
    assert_caches_match(cache, want, before, slots)


@on_hopper
def test_key_insert_host_check_raises_and_capture_drops_out_of_range_slots():
    k_in, norm_w, norm_b, cache, slots = key_inputs(8, 40, seed=3)
    before = cache.clone()
    with pytest.raises(KimiArgumentError, match="slots"):
        kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-6, cache, torch.tensor([0, 99, -1, 1, 2, 3, 4, 5]).cuda())
    assert torch.equal(cache, before)
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-6, cache, slots)  # loaded outside the capture
    cache.copy_(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-6, cache, slots)
    bad = slots.clone()
    bad[1], bad[4] = 40, 1 << 40  # past the cache: dropped, as the reference drops them
    slots.copy_(bad)
    cache.copy_(before)
    graph.replay()
    want = before.clone()
    skipped = torch.where((bad >= 40), torch.full_like(bad, -1), bad)
    reference(kimi.dsa_index_key_insert, k_in, norm_w, norm_b, 1e-6, want, skipped)
    assert_caches_match(cache, want, before, skipped)


def separate_ops(rows, wq_b, head_in, q_norm_w, k_in, norm_w, norm_b, eps, cache, slots):
    """What kimi::dsa_index_front_keys computes, as the two ops' launches."""
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, eps, cache, slots)
    return kimi.dsa_index_front(rows, wq_b, head_in, q_norm_w, eps)


@on_hopper
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_front_with_keys_kernel(batch):
    """One launch: the reference's codes, scales and cache rows (the front's and the key
    insert's tolerances), and the same bits as the two ops' kernels."""
    rows, wq_b, head_in, q_norm_w = front_inputs(batch, seed=batch + 300, normalized=False)
    k_in, norm_w, norm_b, cache, slots = key_inputs(batch, 2 * batch + 7, seed=batch + 300)
    before, want, separate = cache.clone(), cache.clone(), cache.clone()
    poisoned_pool((batch, 32, 64), (batch, 32))
    args = (rows, wq_b, head_in, q_norm_w, k_in, norm_w, norm_b, 1e-6)
    got = kimi.dsa_index_front_keys(*args, cache, slots)
    expected = reference(kimi.dsa_index_front_keys, *args, want, slots)
    assert_front_matches(got, expected)
    assert_caches_match(cache, want, before, slots)
    q, head_w = separate_ops(*args, separate, slots)
    assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[1], head_w)
    assert torch.equal(cache, separate)


@on_hopper
def test_front_with_keys_rejects_bad_slots_before_any_write():
    rows, wq_b, head_in, q_norm_w = front_inputs(8, seed=5, normalized=False)
    k_in, norm_w, norm_b, cache, slots = key_inputs(8, 40, seed=5)
    before = cache.clone()
    for bad in ([0, 99, -1, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 6]):
        with pytest.raises(KimiArgumentError, match="dsa_index_front_keys: argument 'slots'"):
            kimi.dsa_index_front_keys(rows, wq_b, head_in, q_norm_w, k_in, norm_w, norm_b, 1e-6, cache,
                                      torch.tensor(bad).cuda())
        assert torch.equal(cache, before)


@on_hopper
def test_front_with_keys_replays_from_a_graph():
    """The decoder's call (raw rows), captured once: replays over fresh inputs equal the
    two ops' eager calls bit for bit."""
    rows, wq_b, head_in, q_norm_w = front_inputs(16, seed=9, normalized=False)
    k_in, norm_w, norm_b, cache, slots = key_inputs(16, 64, seed=9)
    args = lambda: (rows, wq_b, head_in, q_norm_w, k_in, norm_w, norm_b, 1e-6)  # noqa: E731

    kimi.dsa_index_front_keys(*args(), cache, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, head_w = kimi.dsa_index_front_keys(*args(), cache, slots)
    poison = cache.clone()
    for seed in range(10, 14):
        rows.copy_(front_inputs(16, seed, normalized=False)[0])
        k_in.copy_(key_inputs(16, 64, seed)[0])
        cache.copy_(poison)
        graph.replay()
        eager_cache = poison.clone()
        eager_q, eager_w = separate_ops(*args(), eager_cache, slots)
        assert torch.equal(q.view(torch.uint8), eager_q.view(torch.uint8)) and torch.equal(head_w, eager_w)
        assert torch.equal(cache, eager_cache) and not torch.equal(cache, poison)


@on_hopper
def test_bad_inputs_get_the_op_error_and_unsupported_shapes_the_reference():
    rows, wq_b, head_in, q_norm_w = front_inputs(4, seed=3, normalized=False)
    with pytest.raises(KimiArgumentError):
        kimi.dsa_index_front(rows.float(), wq_b, head_in, q_norm_w, 1e-6)
    rows, wq_b, q_norm_w = rows[:, :96].contiguous(), wq_b[:, :96].contiguous(), q_norm_w[:96].contiguous()
    with warnings.catch_warnings():  # K % 64: the reference, with the backend's warning
        warnings.simplefilter("ignore")
        got = kimi.dsa_index_front(rows, wq_b, head_in, q_norm_w, 1e-6)
    want = reference(kimi.dsa_index_front, rows, wq_b, head_in, q_norm_w, 1e-6)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
