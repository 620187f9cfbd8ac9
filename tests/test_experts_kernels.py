"""The routed experts' CuTe kernels (kernels/experts/: the pair grid and by-expert forms, and
the streamed form, whose rows are checked at their terms' scale): their variants compile for sm_90a
without a GPU, with no spills and no ptxas performance note; on a Hopper GPU
``kimi::routed_experts`` equals the reference backend on the same device (outputs
poisoned first, fresh inputs) at every batch up to CAP, at TP1 and at a TP8 rank, with
repeated experts across tokens (past one wave a cluster serves TOKENS of an expert's tokens), repeated ids in a token, ids
outside [0, E), −0 and NaN latent rows, extreme finite weights and latent values; it replays
from a CUDA graph."""

import os

import pytest
import torch

pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from kimi_ops import backend  # noqa: E402
from kimi_ops.mailbox import EXPERTS_READY, KimiMailboxError, raise_if_error  # noqa: E402
from kimi_ops.kernels.experts import host as experts  # noqa: E402
from kimi_ops.kernels.experts import kernels as experts_kernels  # noqa: E402
from kimi_ops.kernels.experts import plan as experts_plan  # noqa: E402
from kimi_ops.kernels.launch import multiprocessors  # noqa: E402

from conftest import KERNEL_BATCHES, assert_bf16_close, on_hopper, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("dirty_shared_memory")  # kernels must not read stale shared memory

kimi = torch.ops.kimi
K3, TINY = (3584, 16, 896), (128, 16, 64)  # (L, I, E): kimi_k3's stand-in, KimiConfig.tiny's L and E
TP8_RANK = (512, 16, 112)  # bench_layer --tp8-rank's: a CTA the expert, 8 chunk groups (4 with no down chunk)


@pytest.mark.parametrize("latent, intermediate, cluster, per_sm", [
    (3584, 16, None, 1), (3584, 8, None, 1), (128, 16, None, 1), (256, 16, None, 1), (320, 16, None, 1),
    (64, 8, None, 1),
    (3584, 16, 1, 1), (3584, 16, 2, 1), (3584, 16, 7, 1), (3584, 16, 8, 1),  # a ring shorter than the stream; two
    # groups of 224 threads; full warps; 8 groups
    (512, 16, 1, 2),  # two CTAs an SM past one wave (call_plan): 4 groups
])
@pytest.mark.parametrize("tokens", [1, experts_plan.TOKENS])
def test_routed_experts_compiles(latent, intermediate, cluster, per_sm, tokens, clean_ptxas):
    """T = 1 (a CTA a pair in one wave: no count of the tokens before) and TOKENS."""
    assert experts.compile_routed_experts.build(latent, intermediate, cluster, per_sm, tokens, False,
                                                False) is not None
    clean_ptxas()


@pytest.mark.parametrize("latent, intermediate", [(512, 16), (128, 16), (64, 8), (320, 16), (1280, 16)])
@pytest.mark.parametrize("counted", [False, True])
def test_routed_experts_by_expert_compiles(latent, intermediate, counted, clean_ptxas):
    """The grid by expert (call_plan's past one wave where a CTA holds a whole expert; 1280:
    at one CTA an SM, 512 threads)."""
    per_sm = experts_plan.per_sm_for(latent, intermediate, experts_plan.MMA_TOKENS)
    assert experts_plan.whole_slice(latent, intermediate, per_sm)
    assert experts.compile_routed_experts.build(latent, intermediate, 1, per_sm, experts_plan.MMA_TOKENS, True,
                                                counted) is not None
    clean_ptxas()


@pytest.mark.parametrize("latent, cluster, per_sm, tokens", [
    (3584, None, 1, 1), (512, None, 1, 1), (512, 1, experts_plan.PAST_WAVE_PER_SM, experts_plan.TOKENS),
    (3584, 1, experts_plan.PAST_WAVE_PER_SM, 1),  # one token a CTA, two an SM (call_plan's B = 9-16 at TP1)
])
def test_routed_experts_counted_compiles(latent, cluster, per_sm, tokens, clean_ptxas):
    """The wait for the route poll's ready count instead of the PDL wait: in clusters, a CTA
    the pair, and past one wave."""
    assert experts.compile_routed_experts.build(latent, 16, cluster, per_sm, tokens, False, True) is not None
    clean_ptxas()


def test_cluster_size(monkeypatch):
    """kimi_k3 (L = 3584: 344 KB an expert) in clusters of 4 while 16·B·C CTAs fit the SMs
    (16·B/TP the pairs a rank expects to serve), a TP8 rank's (512: 48 KB) one CTA; the
    fewest CTAs whose slice is at most SLICE_BYTES, whole chunks always."""
    monkeypatch.setattr(experts_plan, "multiprocessors", lambda device: 132)
    if "KIMI_OPS_STREAM_FROM" not in os.environ:
        assert experts_plan.STREAM_FROM == 32  # the default: the streamed form from 32 tokens on
    monkeypatch.setattr(experts_plan, "STREAM_FROM", 0)  # the pair grid's bands alone first
    assert [experts_plan.cluster_for(3584, 16, batch, 0) for batch in (1, 2, 3, 8)] == [4, 4, 1, 1]
    assert [experts_plan.cluster_for(3584, 16, batch, 0, 8) for batch in (1, 16, 17, 64)] == [4, 4, 1, 1]
    assert [experts_plan.cluster_for(512, 16, batch, 0) for batch in (1, 8)] == [1, 1]
    # dependents released at entry while the pairs served are one wave
    assert [experts_plan.call_plan(3584, 16, b, 0).wave for b in (1, 2, 8, 9)] == [True, True, True, False]
    assert [experts_plan.call_plan(512, 16, b, 0, 8).wave for b in (64, 66, 67)] == [True, True, False]
    # in one wave a CTA an SM serving one token; while the pairs fit two an SM, two serving
    # one token each; past that two an SM serving up to TOKENS (kimi_k3's FP64 latent slices
    # at T = 4 take one an SM), or by expert where a CTA holds a whole one (L = 512): the
    # rank's E/TP experts at MAX_SPREAD CTAs each where 2·132 CTAs hold them, else fewer,
    # in passes of MMA_TOKENS
    one, shared = (1, 1, True, 0, False), (experts_plan.PAST_WAVE_PER_SM, 1, False, 0, False)
    past = (1, experts_plan.TOKENS, False, 0, False)
    plans = [experts_plan.call_plan(3584, 16, b, 0, 1, 896) for b in (1, 2, 3, 8, 9, 16, 17, 64)]
    assert [p.cluster for p in plans] == [4, 4, 1, 1, 1, 1, 1, 1]
    assert [p[1:] for p in plans] == [one, one, one, one, shared, shared, past, past]
    assert experts_plan.call_plan(3584, 16, 200, 0, 8, 896)[1:] == past  # 344 KB experts: never by expert
    by_expert = [(experts_plan.PAST_WAVE_PER_SM, experts_plan.MMA_TOKENS, True, spread, False) for spread in (2, 1)]
    assert [experts_plan.call_plan(512, 16, b, 0, 8, 896)[1:] for b in (66, 67, 132, 133)] == [
        one, shared, shared, by_expert[0]]  # 112 experts a rank
    assert experts_plan.call_plan(512, 16, 133, 0, 1, 200)[1:] == by_expert[1]  # 2 · 200 > 2 · 132
    two_an_sm = (experts_plan.PAST_WAVE_PER_SM, experts_plan.TOKENS, False, 0, False)
    assert experts_plan.call_plan(512, 16, 133, 0, 1, 300)[1:] == two_an_sm  # past 2 · 132: pairs
    # STREAM_FROM (KIMI_OPS_STREAM_FROM) set: the streamed form from that batch where it takes
    # the call (I = 16, whole chunks, E/TP within its lists), else the bands above
    monkeypatch.setattr(experts_plan, "STREAM_FROM", 16)
    assert experts_plan.call_plan(3584, 16, 15, 0, 1, 896)[1:] == shared
    assert [experts_plan.call_plan(3584, 16, b, 0, 1, 896) for b in (16, 64)] == [experts_plan.STREAMED] * 2
    assert experts_plan.call_plan(512, 16, 133, 0, 8, 896) == experts_plan.STREAMED
    assert experts_plan.call_plan(3584, 8, 64, 0, 1, 896)[1:] == past
    assert experts_plan.call_plan(3584, 16, 64, 0, 1, 2048)[1:] == past
    assert experts_plan.call_plan(448, 16, 133, 0, 1, 200)[1:] == by_expert[1]


def compile_arguments(key, counted):
    """A variant key's compile arguments past (L, I): the streamed form's, or the pair grid's."""
    return (counted,) if key[4] else (*key[:4], counted)


def test_prepare_compiles_every_key_a_call_takes(monkeypatch):
    """Without a device (a cache warmed on a CPU): the three keys, and every call's key among
    them at any batch, TP and SM count (an H20's 78 SMs: a TP ≥ 2 call in clusters)."""
    from kimi_ops.kernels import compile as kernel_compile

    for latent in (512, 2240, 3584):
        with kernel_compile.collecting() as needed:
            experts.RoutedExpertsKernel().prepare(latent, 16)
        keys = experts.prepared_variants(latent, 16)
        assert sorted(key[1][2:] for key in needed) == sorted(compile_arguments(key, False) for key in keys)
        with kernel_compile.collecting() as needed:  # kimi::routed_experts_counted's
            experts.RoutedExpertsKernel(counted=True).prepare(latent, 16)
        assert sorted(key[1][2:] for key in needed) == sorted(compile_arguments(key, True) for key in keys)
        assert experts_plan.per_sm_for(latent, 16, 1) == experts_plan.PAST_WAVE_PER_SM  # the shared band's
        # L = 512: C = 1 in one wave too; by expert where a CTA holds a whole expert
        assert len(keys) == 3 + (experts_plan.cluster_size(latent, 16) > 1) + (latent == 512) + experts_plan.streams(latent, 16)
        for sms in (78, 132):
            monkeypatch.setattr(experts_plan, "multiprocessors", lambda device, sms=sms: sms)
            for tp in (1, 2, 8):
                for count in (64, 112, 896):
                    for batch in range(1, experts_plan.MAX_BATCH + 1):
                        assert experts_plan.call_plan(latent, 16, batch, 0, tp, count).variant in keys
    assert experts_plan.cluster_size(3584, 16) == 4 and experts_plan.cluster_size(3584, 8) == 2
    assert experts_plan.cluster_size(512, 16) == 1 and experts_plan.cluster_size(4096, 16) == 4
    for latent in range(64, 4097, 64):
        for intermediate in (8, 16):
            cluster = experts_plan.cluster_size(latent, intermediate)
            sizes = [c for c in range(1, 9) if (latent // 8) % (experts_plan.GATE_ROWS * c) == 0]
            fits = 6 * intermediate * latent // cluster <= experts_plan.SLICE_BYTES
            assert cluster in sizes and (fits or cluster == max(sizes))  # the most where none fits


@pytest.mark.parametrize("batch, tp, rank, spread", [(64, 1, 0, 2), (33, 8, 5, 2), (256, 3, 2, 1), (5, 1, 0, 2)])
def test_by_expert_writes_every_row_once(batch, tp, rank, spread):
    """CPU model of the grid by expert (RoutedExperts.serve_expert, zero_rows_of_others): CTA
    c serves share c % spread of expert rank·E/TP + c // spread's tokens, in passes of T,
    each token's rows at its mask's slots; the zero rows of pairs c, c + grid, … whose id
    is another rank's or outside [0, E): every row of [B·16] written once."""
    count, threads, packets, tokens = 112, 256, 64, experts_plan.MMA_TOKENS
    per_rank = count // tp
    gen = torch.Generator().manual_seed(batch)
    ids = torch.stack([torch.randperm(count // 4, generator=gen)[:16] for _ in range(batch)])  # shared experts
    ids[0, 3], ids[1, 0], ids[1, 1] = ids[0, 2], -1, count  # a repeated id, ids outside [0, E)
    grid = per_rank * spread
    written = torch.zeros(batch * 16, dtype=torch.int64)
    for cta in range(grid):
        expert = rank * per_rank + cta // spread
        masks = [sum(1 << k for k in range(16) if ids[b, k] == expert) for b in range(batch)]
        matched = [b for b in range(batch) if masks[b]]
        each = -(-len(matched) // spread)
        first = cta % spread * each
        last = min(len(matched), first + each)
        for start in range(first, last, tokens):
            for n in range(min(last - start, tokens)):
                b = matched[start + n]
                for k in range(16):
                    if masks[b] >> k & 1:
                        written[b * 16 + k] += 1
        rows = threads // packets
        for tid in range(rows * packets):
            for pair in range(cta + grid * (tid // packets), batch * 16, grid * rows):
                expert_id = int(ids.view(-1)[pair])
                if tid % packets == 0 and not (0 <= expert_id < count and expert_id // per_rank == rank):
                    written[pair] += 1
    assert written.tolist() == [1] * (batch * 16)


@pytest.mark.parametrize("latent, intermediate", [(512, 16), (640, 8), (320, 16), (64, 8)])
def test_gate_mma_sums_every_product_once(latent, intermediate):
    """CPU model of RoutedExperts.gate_mma's fragments (mma m8n8k4: lane l holds A[l // 4,
    l % 4], B[l % 4, l // 4], D[l // 4, 2·(l % 4) + i]): the warps' tasks over a by-expert
    variant's rows (A's rows permuted) and K blocks, the weights' row in the ring, the
    stash's [T, 4, P, 2] layout (tokens token_doubles apart); summed over the group warps
    (activate's order) the parts are W·Xᵀ for every token slot, an uneven split of the
    blocks included (640: 20 blocks over 3 warps). Each quarter warp's 16-byte loads of A
    and of B fall in 32 distinct banks."""
    per_sm = experts_plan.per_sm_for(latent, intermediate, experts_plan.MMA_TOKENS)
    kernel = experts_kernels.RoutedExperts(latent, intermediate, 1, per_sm, experts_plan.MMA_TOKENS, by_expert=True)
    packets, splits, tokens = kernel.packets, kernel.group_warps, kernel.tokens
    gen = torch.Generator().manual_seed(latent)
    weights = torch.randn(2 * intermediate, latent, generator=gen, dtype=torch.float64)
    latents = torch.randn(tokens, latent, generator=gen, dtype=torch.float64)
    ring = torch.zeros(kernel.depth * kernel.slot_words * 2)  # BF16 values: a word holds two
    for row in range(2 * intermediate):
        start = (row // experts_plan.GATE_ROWS * kernel.slot_words + row % experts_plan.GATE_ROWS * kernel.row_words) * 2
        ring[start:start + latent] = weights[row].float()
    ring = ring.double()
    xs = torch.zeros(tokens * kernel.token_doubles, dtype=torch.float64)
    for n in range(tokens):
        for column in range(latent):
            c, r = divmod(column, 8)
            xs[n * kernel.token_doubles + (r // 2 * packets + c) * 2 + r % 2] = latents[n, column]
    parts = torch.zeros(tokens, 2 * intermediate, splits, dtype=torch.float64)
    blocks = packets // 4
    for warp in range(kernel.warps):
        for task in range(warp, 2 * intermediate // 8 * splits, kernel.warps):
            g = [lane // 4 for lane in range(32)]
            split, rows = task % splits, [task // splits * 8 + (a & 4) + (a & 1) * 2 + (a & 2) // 2 for a in g]
            d = torch.zeros(8, 8, dtype=torch.float64)
            for block in range(split * blocks // splits, (split + 1) * blocks // splits):
                for s in range(8):  # k-step s: value s of lane % 4's packet
                    a, b = torch.zeros(8, 4, dtype=torch.float64), torch.zeros(4, 8, dtype=torch.float64)
                    a_words, b_words = [], []  # each lane's 16-byte load's first 32-bit word
                    for lane in range(32):
                        packet, row = block * 4 + lane % 4, rows[lane]
                        start = row // experts_plan.GATE_ROWS * kernel.slot_words + row % experts_plan.GATE_ROWS * kernel.row_words
                        a[lane // 4, lane % 4] = ring[(start + packet * 4) * 2 + s]
                        xs_at = lane // 4 * kernel.token_doubles + (s // 2 * packets + packet) * 2
                        b[lane % 4, lane // 4] = xs[xs_at + s % 2]
                        a_words.append(start + packet * 4)
                        b_words.append(xs_at * 2)
                    for words in (a_words, b_words):
                        for phase in range(4):
                            banks = {(w + i) % 32 for w in words[8 * phase:8 * phase + 8] for i in range(4)}
                            assert len(banks) == 32
                    d += a @ b
            for lane in range(32):
                for i in range(2):
                    parts[2 * (lane % 4) + i, rows[lane], split] = d[lane // 4, 2 * (lane % 4) + i]
    want = latents @ weights.float().double().T
    torch.testing.assert_close(parts.sum(-1), want, rtol=1e-12, atol=1e-12)


def test_a_cta_takes_every_packet_and_row_once_and_fits_shared_memory():
    for latent in range(64, 4097, 64):
        for intermediate in (8, 16):
            # every variant a call takes, and T = TOKENS a CTA an SM
            pair_forms = {key[:4] for key in experts.prepared_variants(latent, intermediate) if not key[4]}
            for cluster, per_sm, tokens, by_expert in sorted(pair_forms | {(1, 1, experts_plan.TOKENS, False)}):
                kernel = experts_kernels.RoutedExperts(latent, intermediate, cluster, per_sm, tokens,
                                                       by_expert=by_expert)
                group = kernel.group_threads
                assert group % 32 == 0 and kernel.packets <= group < kernel.packets + 32
                # groups take whole gate chunks at once only with the whole slice in flight
                assert kernel.gate_chunks % kernel.groups == 0 and kernel.threads == kernel.groups * group
                assert kernel.groups == 1 or kernel.depth == kernel.chunks
                assert kernel.threads <= max(experts_plan.MAX_THREADS // per_sm, group)
                assert kernel.slice * kernel.cluster == latent and kernel.packets * 8 == kernel.slice
                assert kernel.row_threads * experts_plan.GATE_ROWS == kernel.packets
                assert kernel.gate_chunks * experts_plan.GATE_ROWS == 2 * intermediate  # every gate/up row once
                down_chunks = kernel.chunks - kernel.gate_chunks  # of 4 slice values: the slice's I down values
                assert down_chunks * 4 * kernel.slice == kernel.slice * intermediate
                assert kernel.down_rows * intermediate == 32  # a thread's 4 packets: whole down rows
                assert kernel.packets * kernel.down_rows * down_chunks == kernel.slice  # every output row once
                # per_sm of them in an SM's 228 KB, 1 KB each kept for the system
                assert 1 <= kernel.depth <= kernel.chunks and kernel.smem_bytes() <= experts_plan.smem_share(per_sm)
                assert per_sm * (kernel.smem_bytes() + 1024) <= 228 * 1024
                assert (tokens == 1 and per_sm == 1) or kernel.depth >= experts_plan.MIN_RING  # past one wave
            # the whole slice in flight in one wave
            assert experts_kernels.RoutedExperts(latent, intermediate, None, 1, 1).depth == kernel.chunks
    with pytest.raises(ValueError, match="does not fit 1/2 of an SM"):  # kimi_k3's FP64 stash at T = 4
        experts_kernels.RoutedExperts(3584, 16, 1, 2, experts_plan.TOKENS)
    assert "multiple of 8" in experts.unsupported_shape(3584, 12, 1)
    assert "[8, 16]" in experts.unsupported_shape(3584, 32, 1)  # KimiConfig.tiny's I: the reference
    assert "multiple of 64" in experts.unsupported_shape(100, 16, 1)
    assert "up to 4096" in experts.unsupported_shape(7168, 16, 1)  # 896 threads a CTA
    assert "tokens" in experts.unsupported_shape(3584, 16, experts_plan.MAX_BATCH + 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in tensors: on a CPU-only machine")
def test_launcher_takes_the_adapters_arguments():
    """The compiled launcher's argument checks pass on the shapes RoutedExpertsKernel
    builds (the call then fails only for want of a driver)."""
    from standins import cuda_standin as cuda

    (latent, intermediate, count), batch = K3, 4
    launch = experts.compile_routed_experts.build(latent, intermediate, 1,
                                                  experts_plan.per_sm_for(latent, intermediate, experts_plan.TOKENS),
                                                  experts_plan.TOKENS, False, True)
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        launch(cuda((batch, latent)), cuda((batch * 16,), "i32"), cuda((count * 2 * intermediate, latent)),
               cuda((count * latent, intermediate)), cuda((batch * 16, latent)), cuda((2,), "i64"), cuda((1,), "i32"),
               batch, 0, count, count, 0, 0)
    streamed = experts.compile_streamed_experts.build(latent, intermediate, True)  # its grid last: a CTA an SM
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        streamed(cuda((batch, latent)), cuda((batch * 16,), "i32"), cuda((count * 2 * intermediate, latent)),
                 cuda((count * latent, intermediate)), cuda((batch * 16, latent)), cuda((2,), "i64"),
                 cuda((1,), "i32"), batch, 0, count, count, 132)


def args_of(batch, shape, seed, device="cuda"):
    """Latent rows ~ N(0, 1), weights scaled like trained ones, ids as routing gives them
    (16 distinct experts a token), drawn from a third of E so that tokens share experts."""
    latent, intermediate, count = shape
    assert count >= 48, "16 distinct ids from a third of E"
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(count // 3, generator=gen)[:16] * 3 for _ in range(batch)]).to(torch.int32)

    def rand(*size, scale):
        return (torch.randn(*size, generator=gen) * scale).bfloat16().to(device)

    return (rand(batch, latent, scale=1.0), ids.to(device), rand(count, 2 * intermediate, latent, scale=latent**-0.5),
            rand(count, latent, intermediate, scale=intermediate**-0.5))


def poison(batch, latent):
    """Freed NaN blocks of the output's size: the caching allocator hands one to the op."""
    blocks = [torch.full((batch, 16, latent), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    del blocks


def served_by_the_kernel(*args):
    """The call's arguments are the kernel's (under the auto backend an unsupported call
    would compare the reference with itself)."""
    assert backend.KERNELS["routed_experts"].unsupported(*args) is None


def assert_matches(got, want):
    """The rows within an ulp, ≤ 1 % not bit-equal (situ's sigmoid and the FP64 sums'
    rounding at a tie); the zero rows exactly."""
    assert_bf16_close(got, want, max_ulps=1, max_flipped=0.01)
    assert torch.equal(got == 0, want == 0)


@on_hopper
@pytest.mark.parametrize("rank, tp", [(0, 1), (5, 8)])
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
@pytest.mark.parametrize("shape", [K3, TP8_RANK], ids=["k3", "tp8_rank"])
def test_routed_experts_kernel(batch, rank, tp, shape):
    args = args_of(batch, shape, seed=100 * tp + batch)
    served_by_the_kernel(*args, rank, tp)
    poison(batch, shape[0])
    got = kimi.routed_experts(*args, rank, tp)
    assert_matches_at_scale(got, args, rank, tp)  # the streamed form's sums are FP32 (from STREAM_FROM tokens on)


@on_hopper
def test_routed_experts_kernel_tiny_and_odd_ids():
    """KimiConfig.tiny's L and E (a CTA the expert, 16 threads with packets a group); a token with a
    repeated id (both rows written), ids −1 and
    E (zero rows), −0 and NaN latent rows (NaN rows only where the NaN token's experts are)."""
    latent, ids, gate_up, down = args_of(6, TINY, seed=7)
    ids[0, 3] = ids[0, 4]
    ids[1, 0], ids[1, 1] = -1, TINY[2]
    latent[2] = -0.0
    latent[3, 5] = float("nan")
    for rank, tp in ((0, 1), (1, 2)):
        served_by_the_kernel(latent, ids, gate_up, down, rank, tp)
        poison(6, TINY[0])
        got = kimi.routed_experts(latent, ids, gate_up, down, rank, tp)
        want = reference(kimi.routed_experts, latent, ids, gate_up, down, rank, tp)
        assert_matches(got, want)
        assert torch.equal(torch.isnan(got), torch.isnan(want))


@on_hopper
@pytest.mark.parametrize("batch", [6, 16, 40])
def test_routed_experts_kernel_with_extreme_finite_values(batch):
    """The FP64 operands (weights widened from their bits, the latent and acts times 2^896)
    keep every finite product exact: ±0, BF16 denormals, the smallest normal and large
    weights among the trained-like ones, and the largest BF16 latent values, met by the
    smallest denormal weight (a product of ~0.03); in one wave (B = 6), one token a CTA at
    two an SM (16), and by expert (40: passes of MMA_TOKENS, step 1 by FP64 mma)."""
    latent, ids, gate_up, down = args_of(batch, TINY, seed=11 + batch)
    gen = torch.Generator().manual_seed(batch)
    specials = torch.tensor([0.0, -0.0, 2.0**-133, -(2.0**-130), 2.0**-126, 2.0**20]).bfloat16()
    for weights in (gate_up, down):
        picks = torch.randint(0, len(specials), weights[..., 1::7].shape, generator=gen)
        weights[..., 1::7] = specials[picks].cuda()
    gate_up[..., 0] = 2.0**-133
    signs = torch.where(torch.rand(batch, generator=gen) < 0.5, -1.0, 1.0)
    latent[:, 0] = (torch.finfo(torch.bfloat16).max * signs).bfloat16().cuda()
    served_by_the_kernel(latent, ids, gate_up, down, 0, 1)
    poison(batch, TINY[0])
    got = kimi.routed_experts(latent, ids, gate_up, down, 0, 1)
    want = reference(kimi.routed_experts, latent, ids, gate_up, down, 0, 1)
    assert torch.isfinite(want).all()
    assert_matches(got, want)


@on_hopper
@pytest.mark.parametrize("batch", [33, experts_plan.MAX_BATCH])
def test_routed_experts_kernel_shared_experts_and_wide_batches(batch):
    """L = 64, I = 8 (a CTA the expert, 8 threads with packets a group) at batches past the mask loop's
    stride and at the kernel's largest: every token on the same 16 experts (by expert: each
    expert's B tokens shared by its CTAs, in passes of MMA_TOKENS), and a repeated id in
    two tokens (5, 8): both its rows written, the later tokens' places one fewer."""
    args = args_of(batch, (64, 8, 48), seed=batch)
    args[1][5, 7], args[1][8, 9] = args[1][5, 2], args[1][8, 1]
    served_by_the_kernel(*args, 2, 3)
    poison(batch, 64)
    assert_matches(kimi.routed_experts(*args, 2, 3), reference(kimi.routed_experts, *args, 2, 3))


@on_hopper
@pytest.mark.parametrize("batch", [3, 40])
def test_routed_experts_kernel_with_a_partial_warp(batch):
    """L = 320: 40 packets in 64 threads (a warp and a part of one whose lanes hold none)."""
    args = args_of(batch, (320, 16, 48), seed=300 + batch)
    served_by_the_kernel(*args, 0, 1)
    poison(batch, 320)
    assert_matches(kimi.routed_experts(*args, 0, 1), reference(kimi.routed_experts, *args, 0, 1))


@on_hopper
@pytest.mark.parametrize("cluster", [1, 2, 7, 8])
def test_routed_experts_kernel_at_other_cluster_sizes(cluster):
    """The sweeps' variants (compile_routed_experts' ``cluster``, one wave's T = 1): a CTA the whole expert
    (a ring shorter than the stream, one group), clusters of 2 (two groups of 224 threads),
    7 (full warps at L = 3584) and 8."""
    batch, (width, intermediate, count) = 8, K3
    latent, ids, gate_up, down = args_of(batch, K3, seed=cluster)
    out = torch.full((batch, 16, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    unused = torch.zeros(2, dtype=torch.int64, device="cuda")  # the uncounted variant's ready and error
    experts.compile_routed_experts(width, intermediate, cluster, 1, 1, False, False)(
        latent, ids.view(-1), gate_up.view(-1, width), down.view(-1, intermediate), out.view(-1, width), unused,
        unused[:1].view(torch.int32)[:1], batch, 0, count, count, 0, 0)
    assert_matches(out, reference(kimi.routed_experts, latent, ids, gate_up, down, 0, 1))


@on_hopper
@pytest.mark.parametrize("batch", [1, 8, 67])
@pytest.mark.parametrize("shape", [K3, TP8_RANK], ids=["k3", "tp8_rank"])
def test_routed_experts_kernel_waits_for_the_ready_count(batch, shape):
    """With the route poll's ready counter (its 2B CTAs counted in): the rows of the
    uncounted call, no error, the counter zeroed for the next step, in one wave (in
    clusters at kimi_k3's L) and past it."""
    args = args_of(batch, shape, seed=300 + batch)
    ready = torch.tensor([2 * batch, 0], device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert backend.KERNELS["routed_experts_counted"].unsupported(*args, 0, 1, ready, error) is None
    poison(batch, shape[0])
    got = kimi.routed_experts_counted(*args, 0, 1, ready, error)
    assert torch.equal(got, kimi.routed_experts(*args, 0, 1))
    assert ready.tolist() == [0, 0] and int(error) == 0


@on_hopper
def test_routed_experts_kernel_reports_a_count_that_never_comes():
    """A route poll that counted too few CTAs: the wait is bounded, the error word names
    it, the counter is zeroed."""
    args = args_of(4, TP8_RANK, seed=7)
    ready = torch.tensor([7, 0], device="cuda")  # 2B = 8
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    kimi.routed_experts_counted(*args, 0, 1, ready, error)
    torch.cuda.synchronize()  # returns: the wait is bounded
    assert int(error) == EXPERTS_READY and ready.tolist() == [0, 0]
    with pytest.raises(KimiMailboxError, match="ready count"):
        raise_if_error(error)


@on_hopper
def test_routed_experts_kernel_replays_from_a_graph():
    args = args_of(8, K3, seed=11)
    first = kimi.routed_experts(*args, 0, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = kimi.routed_experts(*args, 0, 1)
    for seed in range(12, 17):
        fresh = args_of(8, K3, seed=seed)
        for buffer, value in zip(args, fresh):
            buffer.copy_(value)
        graph.replay()
        assert torch.equal(static, kimi.routed_experts(*args, 0, 1))
    assert not torch.equal(static, first)


# The streamed form (kernels/experts/stream.py): FP32 sums on tensor cores, so within an ulp
# at the rows' terms' scale rather than of the FP64 forms' rounding.

@pytest.mark.parametrize("latent", [3584, 512])
@pytest.mark.parametrize("counted", [False, True])
def test_streamed_experts_compiles(latent, counted, clean_ptxas):
    assert experts.compile_streamed_experts.build(latent, 16, counted) is not None
    clean_ptxas()


def load_matrices_model(slot, addresses):
    """ldmatrix.x4 on a slot of values (word w: values 2w, 2w + 1): lane l gives the row
    ``addresses[l]`` of matrix l // 8; register q of lane (g, t) is word t of matrix q's row g.
    Also each matrix's bank groups: 8 rows of 4 words in 32 distinct banks, or fewer."""
    registers = [[slot[2 * (addresses[8 * q + lane // 4] + lane % 4):][:2] for q in range(4)] for lane in range(32)]
    banks = [len({(addresses[8 * q + r] + i) % 32 for r in range(8) for i in range(4)}) for q in range(4)]
    return registers, min(banks)


def mma_model(a, b):
    """mma m16n8k16 on the lanes' registers (a: 4 pairs, b: 2 pairs): D = A·B [16, 8]."""
    A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for k in range(4):
            A[g + 8 * (k % 2), 2 * t + 8 * (k // 2):][:2] = a[lane][k]
        for k in range(2):
            B[2 * t + 8 * k:][:2, g] = b[lane][k]
    return A @ B


def test_streamed_fragments_take_every_product_once():
    """CPU model of StreamedExperts' fragments (plan.latent_piece, gate_piece, down_piece,
    sum_place, act_word) over slots laid out as its producer fills them: the warps' sums of a
    pass are latent · gate_upᵀ over every column once, the down's D is acts · downᵀ over every
    row once, the pass's pairs past the count (stale slot rows, NaN here) reach no counted
    row; the gate/up and latent loads are conflict-free, the down's at most 2-way."""
    latent, double, count = 512, 2 * experts_plan.STREAM_INTERMEDIATE, 11
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(double, latent, generator=gen, dtype=torch.float64)
    rows = torch.randn(count, latent, generator=gen, dtype=torch.float64)
    down = torch.randn(latent, double // 2, generator=gen, dtype=torch.float64)
    acts = torch.randn(experts_plan.PASS_PAIRS, double // 2, generator=gen, dtype=torch.float64)
    columns = experts_plan.GATE_COLUMNS
    warp_columns = columns // experts_plan.STREAM_WARPS

    def fill(slot, first, row, values):  # a row's 16-byte pieces where the producer's copies put them
        for piece in range(columns // 8):
            slot[2 * experts_plan.slot_row_piece(first, row, piece):][:8] = values[8 * piece:][:8]

    parts = torch.zeros(experts_plan.STREAM_WARPS, experts_plan.PASS_PAIRS, double, dtype=torch.float64)
    for chunk in range(latent // columns):
        slot = torch.full((2 * experts_plan.SLOT_WORDS,), float("nan"), dtype=torch.float64)
        for r in range(double):
            fill(slot, 0, r, weights[r, chunk * columns:][:columns])
        for n in range(count):
            fill(slot, double, n, rows[n, chunk * columns:][:columns])
        for warp in range(experts_plan.STREAM_WARPS):
            for step in range(warp_columns // 16):
                column = warp * warp_columns + 16 * step
                a, banks = load_matrices_model(slot, [experts_plan.latent_piece(lane, column) for lane in range(32)])
                assert banks == 32
                for group in range(2):
                    m, banks = load_matrices_model(
                        slot, [experts_plan.gate_piece(lane, group, column) for lane in range(32)])
                    assert banks == 32
                    for half in range(2):
                        d = mma_model(a, [m[lane][2 * half:2 * half + 2] for lane in range(32)])
                        for lane in range(32):
                            for k in range(4):
                                row, at = experts_plan.sum_place(lane, 2 * group + half, k)
                                parts[warp, row, at] += d[8 * (k // 2) + lane // 4, 2 * (lane % 4) + k % 2]
    assert torch.allclose(parts.sum(0)[:count], rows @ weights.T)
    a = [[acts[row, 2 * word:2 * word + 2] for row, word in (experts_plan.act_word(lane, k) for k in range(4))]
         for lane in range(32)]
    out = torch.full((experts_plan.PASS_PAIRS, latent), float("nan"), dtype=torch.float64)
    for chunk in range(latent // experts_plan.DOWN_ROWS):
        slot = torch.full((2 * experts_plan.SLOT_WORDS,), float("nan"), dtype=torch.float64)
        slot[:experts_plan.DOWN_ROWS * double // 2] = down[chunk * experts_plan.DOWN_ROWS:][
            :experts_plan.DOWN_ROWS].flatten()
        for warp in range(experts_plan.STREAM_WARPS):
            for group in range(experts_plan.DOWN_ROWS // experts_plan.STREAM_WARPS // 16):
                first = warp * experts_plan.DOWN_ROWS // experts_plan.STREAM_WARPS + 16 * group
                m, banks = load_matrices_model(slot, [experts_plan.down_piece(lane, first) for lane in range(32)])
                assert banks >= 16
                for n in range(2):
                    d = mma_model(a, [m[lane][2 * n:2 * n + 2] for lane in range(32)])
                    for lane in range(32):
                        for k in range(4):
                            row, at = experts_plan.sum_place(lane, n, k)
                            out[row, chunk * experts_plan.DOWN_ROWS + first + at] = d[8 * (k // 2) + lane // 4,
                                                                                      2 * (lane % 4) + k % 2]
    assert torch.allclose(out, acts @ down.T)


def test_streamed_zeroing_rounds_check_every_pair_once():
    """StreamedExperts.zero_rows_of_others: CTA c's rounds (plan.zeroing_pair) check each of
    its pairs c + grid·j once, and the grid's CTAs every pair once."""
    warps = experts_plan.STREAM_WARPS
    for grid, pairs in ((132, 16), (132, 1024), (132, 4096), (7, 1000)):
        checked = [experts_plan.zeroing_pair(cta, first, grid, warp, lane)
                   for cta in range(grid) for first in range(0, pairs, grid * experts_plan.ZEROING_ROUND)
                   for warp in range(warps) for lane in range(32)]
        checked = [pair for pair in checked if pair < pairs]
        assert sorted(checked) == list(range(pairs))
        assert all(pair % grid == cta for cta in range(grid)
                   for pair in (experts_plan.zeroing_pair(cta, 0, grid, w, lane) for w in range(warps) for lane in range(32)))


def row_terms(latent, ids, gate_up, down, rank, tp):
    """[B, 16, L]: Σ_j |act_j · down[e, l, j]| of each pair's row (the reference's acts), the
    scale at which a row's ulps are counted."""
    from kimi_ops.ops.experts import mine
    from kimi_ops.ops.route import situ

    batch, intermediate = latent.shape[0], down.shape[2]
    index = torch.where(mine(ids, gate_up.shape[0], rank, tp), ids, 0).long()
    hidden = torch.einsum("bl,bril->bri", latent.double(), gate_up[index].double()).float()
    act = situ(hidden.reshape(batch * 16, 2 * intermediate), 1.0, 0.0).view(batch, 16, intermediate)
    return torch.einsum("bri,brli->brl", act.double().abs(), down[index].double().abs()) * (1 + 2**-7)


def run_streamed(latent, ids, gate_up, down, rank, tp, ready=None, error=None):
    """The streamed form's kernel on a poisoned output, a CTA an SM."""
    batch, width = latent.shape
    count, intermediate = gate_up.shape[0], down.shape[2]
    out = torch.full((batch, 16, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    counted = ready is not None
    if not counted:
        ready = torch.zeros(2, dtype=torch.int64, device="cuda")
        error = torch.zeros(1, dtype=torch.int32, device="cuda")
    experts.compile_streamed_experts(width, intermediate, counted)(
        latent, ids.view(-1), gate_up.view(-1, width), down.view(-1, intermediate), out.view(-1, width), ready, error,
        batch, rank, count // tp, count, multiprocessors(0))
    return out


def assert_matches_at_scale(got, args, rank, tp):
    """As assert_matches, the ulps counted at the rows' terms' scale (row_terms)."""
    want = reference(kimi.routed_experts, *args, rank, tp)
    assert_bf16_close(got, want, max_ulps=1, max_flipped=0.01, magnitude=row_terms(*args, rank, tp))
    assert torch.equal(got == 0, want == 0)
    assert torch.equal(torch.isnan(got), torch.isnan(want))


def test_ulps_at_scale_where_the_scale_is_nan():
    """A NaN token's rows served by another rank are equal zeros with a NaN scale (row_terms):
    they pass; a NaN on one side, or a plain 2-ulp miss under a NaN scale, still fails."""
    zeros, scale = torch.zeros(4, dtype=torch.bfloat16), torch.full((4,), float("nan"))
    assert_bf16_close(zeros, zeros.clone(), magnitude=scale)
    one_nan = zeros.clone()
    one_nan[1] = float("nan")
    with pytest.raises(AssertionError):
        assert_bf16_close(one_nan, zeros, magnitude=torch.ones(4))
    ones = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_bf16_close(ones + 2 * 2**-7, ones, magnitude=scale)


@on_hopper
@pytest.mark.parametrize("rank, tp", [(0, 1), (5, 8)])
@pytest.mark.parametrize("batch", [1, 5, 8, 33, 64])
@pytest.mark.parametrize("shape", [K3, TP8_RANK], ids=["k3", "tp8_rank"])
def test_streamed_experts_kernel(batch, rank, tp, shape):
    args = args_of(batch, shape, seed=700 + 100 * tp + batch)
    assert_matches_at_scale(run_streamed(*args, rank, tp), args, rank, tp)


@on_hopper
@pytest.mark.parametrize("batch", [16, 64])
def test_routed_experts_op_takes_the_streamed_form(batch, monkeypatch):
    """With STREAM_FROM at 16, ``kimi::routed_experts`` and its counted form run the streamed
    kernel (the adapter's grid of a CTA an SM)."""
    monkeypatch.setattr(experts_plan, "STREAM_FROM", 16)
    args = args_of(batch, K3, seed=900 + batch)
    assert experts_plan.call_plan(K3[0], 16, batch, 0, 1, K3[2]).stream
    poison(batch, K3[0])
    got = kimi.routed_experts(*args, 0, 1)
    assert_matches_at_scale(got, args, 0, 1)
    assert torch.equal(got, run_streamed(*args, 0, 1))
    ready = torch.tensor([2 * batch, 0], device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert torch.equal(got, kimi.routed_experts_counted(*args, 0, 1, ready, error))
    assert ready.tolist() == [0, 0] and int(error) == 0


@on_hopper
@pytest.mark.parametrize("batch", [40, experts_plan.MAX_BATCH])
def test_streamed_experts_kernel_passes_and_odd_ids(batch):
    """Every token on the same 16 experts (B pairs an expert: passes of PASS_PAIRS over its
    weights), a repeated id in a token (both rows), ids −1 and E (zero rows), −0 and NaN
    latent rows (NaN only in the NaN token's rows)."""
    latent, ids, gate_up, down = args_of(batch, TP8_RANK, seed=batch)
    ids[:] = ids[0]
    ids[5, 7] = ids[5, 2]
    ids[1, 0], ids[1, 1] = -1, TP8_RANK[2]
    latent[2] = -0.0
    latent[3, 5] = float("nan")
    args = (latent, ids, gate_up, down)
    for rank, tp in ((0, 1), (1, 2)):
        assert_matches_at_scale(run_streamed(*args, rank, tp), args, rank, tp)


@on_hopper
def test_streamed_experts_kernel_is_bit_identical_run_to_run_and_counted():
    """The atomics' order of a list does not reach a row; the counted wait gives the same rows
    and zeroes the counter."""
    args = args_of(64, K3, seed=3)
    first = run_streamed(*args, 0, 1)
    assert all(torch.equal(first, run_streamed(*args, 0, 1)) for _ in range(3))
    ready = torch.tensor([2 * 64, 0], device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert torch.equal(first, run_streamed(*args, 0, 1, ready, error))
    assert ready.tolist() == [0, 0] and int(error) == 0
