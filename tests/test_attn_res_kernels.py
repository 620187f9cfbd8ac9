"""The CuTe AttnRes kernels (kernels/attn_res/): their variants compile for sm_90a without
a GPU, with no spills and no ptxas performance note; the work split and stash buckets hold
on the CPU; on a Hopper GPU ``kimi::attn_res`` and the fused ``kimi::attn_res_take`` match
the reference backend on the same device (outputs poisoned first, fresh inputs) at every
batch up to CAP, N in (0, 1, 3) and TP in (1, 2, 8), −0 and NaN rows included; the fused
op re-arms what it took, leaves the rest, times out into the error word, and both replay
from a CUDA graph."""

import pytest
import torch

pytest.importorskip("cutlass", reason="CuTe DSL (nvidia-cutlass-dsl) is not installed")

from kimi_ops.kernels.attn_res import host as attn_res  # noqa: E402
from kimi_ops.kernels.attn_res import kernels as attn_res_kernels  # noqa: E402
from kimi_ops.kernels.attn_res import plan as attn_res_plan  # noqa: E402
from kimi_ops.kernels import launch  # noqa: E402
from kimi_ops.mailbox import SENTINEL, TAKE_POLL, KimiMailboxError, canonical, raise_if_error  # noqa: E402

from conftest import KERNEL_BATCHES, armed_box, assert_bf16_close, on_hopper, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("dirty_shared_memory")  # kernels must not read stale shared memory

kimi = torch.ops.kimi
HIDDEN, TINY = 7168, 256  # kimi_k3's H; KimiConfig.tiny's
CAPACITY = 64


@pytest.mark.parametrize("hidden, tp, rows", [
    (HIDDEN, 1, 0), (HIDDEN, 8, 0), (HIDDEN, 1, 4), (HIDDEN, 2, 4), (HIDDEN, 8, 32), (HIDDEN, 16, 64),
    (TINY, 1, 0), (TINY, 2, 3),
])
def test_attn_res_compiles(hidden, tp, rows, clean_ptxas):
    assert attn_res.compile_attn_res.build(hidden, tp, attn_res_plan.cluster_for(hidden), rows) is not None
    clean_ptxas()


@pytest.mark.parametrize("hidden, tp, rows", [(HIDDEN, 1, 0), (HIDDEN, 8, 4), (TINY, 2, 3)])
def test_attn_res_take_compiles(hidden, tp, rows, clean_ptxas):
    assert attn_res.compile_attn_res.build(hidden, tp, attn_res_plan.cluster_for(hidden), rows, True) is not None
    clean_ptxas()


def test_the_take_compiles_with_marks(monkeypatch, clean_ptxas):
    """KIMI_OPS_MARKS (kernels.values.Marks): the take's marks compiled in (the build is not
    cached: the setting is read at import, and the cache's key holds it)."""
    monkeypatch.setattr(attn_res_kernels, "MARKS", True)
    assert attn_res.compile_attn_res.build(HIDDEN, 8, attn_res_plan.cluster_for(HIDDEN), 4, True) is not None
    clean_ptxas()


def test_marks_need_their_words_after_the_error_word(monkeypatch):
    """KIMI_OPS_MARKS: a take whose error word has no marks' words behind it is refused
    before any launch (its records would land past the word)."""
    monkeypatch.setattr(launch, "MARKS", True)
    box, partial = torch.zeros(1, 1, 4, TINY, dtype=torch.bfloat16), torch.zeros(1, TINY, dtype=torch.bfloat16)
    weights = [torch.ones(TINY, dtype=torch.bfloat16)] * 3
    with pytest.raises(ValueError, match="error must be the first of .* int32 words"):
        attn_res.AttnResTakeKernel().take(box, 0, 1, torch.zeros(1, dtype=torch.int32),
                                          torch.zeros(0, 1, TINY, dtype=torch.bfloat16), partial, *weights, 1e-6)


def test_one_token_per_cluster_each_cta_a_slice_of_whole_packets():
    """H = 7168: 8 CTAs of 112 packets (128 threads); tiny H: one CTA; every packet of H
    once, no CTA past CTA_PACKETS where a cluster size allows it."""
    assert attn_res_plan.cluster_for(HIDDEN) == 8 and attn_res_plan.cluster_for(TINY) == 1
    for hidden in (64, TINY, 512, 1024, 2048, 4096, HIDDEN, 8192, 1032):
        cluster = attn_res_plan.cluster_for(hidden)
        kernel = attn_res_kernels.AttnRes(hidden, 1, cluster, 0)
        assert cluster in attn_res_plan.CLUSTERS and kernel.packets * cluster * 8 == hidden
        assert kernel.threads * kernel.rounds >= kernel.packets > kernel.threads * (kernel.rounds - 1)
        assert kernel.threads % 32 == 0 and kernel.threads <= attn_res_plan.MAX_THREADS
    assert attn_res_kernels.AttnRes(HIDDEN, 1, 8, 0).threads == 128


def test_large_batches_take_one_cta_a_token(clean_ptxas):
    """Above ONE_CTA_ABOVE tokens a CTA takes a token's whole H while its stash fits
    ONE_CTA_STASH (bench_attn_res); deeper stashes keep the cluster."""
    assert [attn_res_plan.cluster_for(HIDDEN, b, 4) for b in (1, 8, 16, 17, 64)] == [8, 8, 8, 1, 1]
    assert attn_res_plan.cluster_for(HIDDEN, 64, 6) == 8
    for polled in (False, True):
        assert attn_res.compile_attn_res.build(HIDDEN, 1, 1, 4, polled) is not None
    clean_ptxas()


def test_every_exchange_round_has_slots_of_its_own():
    kernel = attn_res_kernels.AttnRes(HIDDEN, 8, 8, 6)
    slots = ([kernel.block_ss + n for n in range(6)] + [kernel.block_dot + n for n in range(6)]
             + [kernel.partial_ss, kernel.partial_dot, kernel.h_ss])
    assert sorted(slots) == list(range(kernel.slots))
    # each round its own mbarrier (st.async counted on it), whatever the stash: at rows = 0
    # the blocks' slots are empty, the rounds are not
    assert (attn_res_kernels.BLOCK_SS, attn_res_kernels.BLOCK_DOT, attn_res_kernels.PARTIAL_SS,
            attn_res_kernels.PARTIAL_DOT, attn_res_kernels.H_SS) == tuple(range(attn_res_kernels.EXCHANGES))
    empty = attn_res_kernels.AttnRes(HIDDEN, 8, 8, 0)
    assert (empty.partial_ss, empty.partial_dot, empty.h_ss, empty.slots) == (0, 1, 2, 3)
    assert empty.smem_bytes() >= 8 * attn_res_kernels.EXCHANGES + 16


def test_stash_buckets_take_every_block_count_up_to_64():
    assert attn_res_plan.stash_rows(0) == 0 and attn_res_plan.stash_rows(5) == 6 and attn_res_plan.stash_rows(64) == 64
    assert attn_res_plan.stash_rows(65) is None
    for count in range(1, 65):
        rows = attn_res_plan.stash_rows(count)
        assert count <= rows < 1.5 * count + 1
        assert attn_res.unsupported_shape(HIDDEN, 8, count) is None  # fits a CTA's shared memory
    assert "blocks" in attn_res.unsupported_shape(HIDDEN, 1, 65)
    assert "16-byte" in attn_res.unsupported_shape(100, 1, 0)
    assert "sources" in attn_res.unsupported_shape(HIDDEN, 17, 0)


def test_prepare_compiles_each_bucket_once(monkeypatch):
    compiled = []
    monkeypatch.setattr(attn_res, "compile_attn_res", lambda *key: compiled.append(key))
    attn_res.AttnResKernel().prepare(HIDDEN, (8, 1), range(0, 6))
    assert compiled == [(HIDDEN, tp, 8, rows, False) for tp in (8, 1) for rows in (0, 1, 2, 3, 4, 6)]
    compiled.clear()
    attn_res.AttnResTakeKernel().prepare(HIDDEN, (2,), [0, 3, 30])
    assert compiled == [(HIDDEN, 2, 8, rows, True) for rows in (0, 3, 32)]
    compiled.clear()
    attn_res.AttnResTakeKernel().prepare(HIDDEN, (1,), [1], batches=(8, 64))
    assert compiled == [(HIDDEN, 1, 8, 1, True), (HIDDEN, 1, 1, 1, True)]


def kernel_model(blocks, partial, sublayer, query, key_w, out_w, eps, cluster):
    """The kernel's arithmetic on the CPU, step by step and in its orders (a thread's
    packet of 8, the lanes' butterfly, the warps, the cluster's CTAs), with torch's rsqrt
    and exp in place of the GPU's instructions. For H whose CTAs' packets are whole warps."""
    hidden = partial.shape[1]
    shape = attn_res_kernels.AttnRes(hidden, 1, cluster, 0)
    assert shape.packets == shape.threads

    def over_h(terms):  # float64 [..., H] -> Σ in the kernel's order, rounded to FP32
        lanes = terms.reshape(*terms.shape[:-1], cluster, shape.warps, 32, 8).sum(-1)
        while lanes.shape[-1] > 1:  # the butterfly: lane l adds lane l ^ 1, then l ^ 2, ...
            lanes = lanes[..., 0::2] + lanes[..., 1::2]
        return lanes[..., 0].sum(-1).sum(-1).float()

    def inverse_rms(values):  # FP32 of BF16 values
        return torch.rsqrt(over_h(values.double() ** 2) / hidden + eps)

    acc = partial.float()
    for source in sublayer:  # rank order
        acc = acc + source.float()
    new_partial = acc.bfloat16()
    values = torch.cat([blocks, new_partial[None]]).float()
    keys = ((values * inverse_rms(values).unsqueeze(-1)) * key_w.float()).bfloat16().float()
    logits = over_h(keys.double() * query.double())  # [N + 1, B]
    e = torch.exp(logits - logits.max(0).values)
    alpha = e / e.sum(0)
    h = (alpha.unsqueeze(-1) * values).double().sum(0).float().bfloat16()  # FP32 products, FP64 sum
    h_normed = ((h.float() * inverse_rms(h.float()).unsqueeze(-1)) * out_w.float()).bfloat16()
    return new_partial, h, h_normed


@pytest.mark.parametrize("count, tp", [(0, 1), (3, 2), (5, 8)])
def test_kernel_arithmetic_reproduces_the_reference_rounding_points(count, tp):
    """On the CPU, the kernel's orders of FP64 sums of FP32-exact terms give the
    reference's bits: new_partial and h_normed exactly, h exactly (its α from the same
    exp and division as torch's softmax here: on the GPU they may flip an α's last bit)."""
    for hidden, batch in ((TINY, 4), (1024, 3)):
        args = args_of(batch, count, tp, seed=count + tp, hidden=hidden, device="cpu")
        want = reference(kimi.attn_res, *args, 1e-6)
        got = kernel_model(*args, 1e-6, attn_res_plan.cluster_for(hidden))
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.int16), w.view(torch.int16))


def args_of(batch, count, tp, seed, hidden=HIDDEN, device="cuda"):
    """AttnRes inputs of the decoder's scale: rows ~ N(0, 1), a small query, norm weights
    near 1."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=gen) * scale + offset).bfloat16().to(device)

    return (rand(count, batch, hidden), rand(batch, hidden), rand(tp, batch, hidden), rand(hidden, scale=0.05),
            rand(hidden, scale=0.1, offset=1.0), rand(hidden, scale=0.1, offset=1.0))


def poison(batch, hidden):
    """Freed NaN blocks of the outputs' size: the caching allocator hands them to the op."""
    blocks = [torch.full((batch, hidden), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    del blocks


def assert_matches(got, want, blocks, out_norm_w, eps=1e-6):
    """new_partial bit for bit (the same FP32 chain in rank order); h and h_normed within
    2 ulps counted at the terms' magnitude, ≤ 25 % not bit-equal. The kernel's rsqrt.approx,
    torch's on CUDA and torch's on the CPU each differ from the others by an ulp at times
    (seen on the H200); an ulp of a key's rr can flip a BF16 key, which moves a logit by
    ~2⁻⁸ |K q| and α by as much relatively: where α·V terms cancel, h moves by many of its
    own ulps but under one of the terms', and at B = 1 a token's α shift moves all of h
    (13 % of elements flipped, seen at N = 3, TP = 8)."""
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    terms = torch.cat([blocks, want[0][None]]).float().abs().amax(0)  # max_n |V_n|
    h = want[1].float()
    rr = torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    for g, w, magnitude in zip(got[1:], want[1:], (terms, terms * rr * out_norm_w.float().abs())):
        assert_bf16_close(g, w, max_ulps=2, max_flipped=0.25, magnitude=magnitude)


@on_hopper
@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("count", [0, 1, 3])
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_attn_res_kernel(batch, count, tp):
    args = args_of(batch, count, tp, seed=1000 * tp + 10 * count + batch)
    poison(batch, HIDDEN)
    got = kimi.attn_res(*args, 1e-6)
    assert_matches(got, reference(kimi.attn_res, *args, 1e-6), args[0], args[5])


@on_hopper
@pytest.mark.parametrize("count", [0, 5, 30])  # 5, 30: buckets 6 and 32 (rows past N left alone)
def test_attn_res_kernel_tiny_and_deep(count):
    for hidden, batch in ((TINY, 4), (HIDDEN, 2)):
        args = args_of(batch, count, 2, seed=count + hidden, hidden=hidden)
        poison(batch, hidden)
        assert_matches(kimi.attn_res(*args, 1e-6), reference(kimi.attn_res, *args, 1e-6), args[0], args[5])


@on_hopper
def test_attn_res_kernel_negative_zero_and_nan_rows():
    """Token 1 all −0 (new_partial keeps −0: the FP32 chain starts from partial), token 2
    one NaN in a source (its every h NaN: the softmax sum is), the others untouched."""
    blocks, partial, sublayer, query, key_w, out_w = args_of(4, 3, 2, seed=9)
    partial[1], sublayer[:, 1], blocks[:, 1] = -0.0, -0.0, -0.0
    sublayer[1, 2, 77] = float("nan")
    got = kimi.attn_res(blocks, partial, sublayer, query, key_w, out_w, 1e-6)
    want = reference(kimi.attn_res, blocks, partial, sublayer, query, key_w, out_w, 1e-6)
    assert_matches(got, want, blocks, out_w)
    assert bool((got[0][1].view(torch.int16) == torch.tensor(-0x8000, dtype=torch.int16)).all())
    assert torch.isnan(got[1][2]).all() and torch.isnan(got[2][2]).all()
    assert not torch.isnan(got[1][[0, 1, 3]]).any() and int(torch.isnan(got[0][2]).sum()) == 1
    again = args_of(4, 3, 2, seed=10)  # later calls unaffected
    assert_matches(kimi.attn_res(*again, 1e-6), reference(kimi.attn_res, *again, 1e-6), again[0], again[5])


@on_hopper
def test_attn_res_kernel_is_deterministic_and_replays_from_a_graph():
    args = args_of(8, 3, 8, seed=11)
    first = kimi.attn_res(*args, 1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = kimi.attn_res(*args, 1e-6)
    fresh = torch.Generator().manual_seed(12)
    for replay in range(100):
        if replay:
            for tensor in args[:3]:
                tensor.copy_(torch.randn(tensor.shape, generator=fresh).bfloat16())
        graph.replay()
        eager = kimi.attn_res(*args, 1e-6)
        for s, e in zip(static, eager):
            assert torch.equal(s.view(torch.int16), e.view(torch.int16)), replay
        if replay == 0:
            for s, f in zip(static, first):
                assert torch.equal(s.view(torch.int16), f.view(torch.int16))


def published(box, parity, rows):
    """``rows`` [TP, B, H] as the producers leave them in ``box`` (−0 → +0, NaN canonical)."""
    box[parity, :, :rows.shape[1]] = canonical(rows)


def armed(rows):
    return bool((rows.contiguous().view(torch.int32) == torch.tensor(SENTINEL, dtype=torch.int32)).all())


def take(box, parity, error, blocks, partial, weights, into=None):
    """attn_res_take, or attn_res_take_into ``into`` (then its rows [:B] stand for h_normed)."""
    batch = partial.shape[0]
    if into is None:
        return kimi.attn_res_take(box, parity, batch, error, blocks, partial, *weights, 1e-6)
    return (*kimi.attn_res_take_into(box, parity, batch, error, blocks, partial, *weights, 1e-6, into), into[:batch])


@on_hopper
@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("count", [0, 1, 3])
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
@pytest.mark.parametrize("into", [False, True])
def test_attn_res_take_kernel(batch, count, tp, into):
    """Parity 1 of a 3-parity box: rows [:B] published; ours against the reference on a
    copy of the box: the outputs, the taken rows re-armed, every other row as it was
    (``into``: h_normed into a poisoned buffer's rows [:B], the rows past them kept)."""
    blocks, partial, rows, *weights = args_of(batch, count, tp, seed=2000 * tp + 10 * count + batch)
    ours = armed_box(3, tp, CAPACITY, HIDDEN)
    ours[0].normal_()  # another parity's rows: never touched
    published(ours, 1, rows)
    theirs = ours.clone()
    errors = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2)]
    buffers = [torch.full((CAPACITY, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda") if into else None
               for _ in range(2)]
    poison(batch, HIDDEN)
    got = take(ours, 1, errors[0], blocks, partial, weights, buffers[0])
    want = reference(take, theirs, 1, errors[1], blocks, partial, weights, buffers[1])
    assert_matches(got, want, blocks, weights[2])
    assert armed(ours[1]) and torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    assert int(errors[0]) == 0
    if into:
        assert buffers[0][batch:].isnan().all()
    # the functional op on the same rows agrees bit for bit
    functional = kimi.attn_res(blocks, partial, canonical(rows), *weights, 1e-6)
    for g, f in zip(got, functional):
        assert torch.equal(g.view(torch.int16), f.view(torch.int16))


@on_hopper
def test_attn_res_take_times_out_into_the_error_word():
    blocks, partial, _, *weights = args_of(4, 1, 2, seed=5)
    box = armed_box(1, 2, CAPACITY, HIDDEN)  # nothing published
    box[0, 1, :4] = 1.0  # one source only
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    take(box, 0, error, blocks, partial, weights)
    torch.cuda.synchronize()  # returns: the polls are bounded
    assert int(error) == TAKE_POLL
    with pytest.raises(KimiMailboxError, match="consumer"):
        raise_if_error(error)


@on_hopper
def test_attn_res_take_replays_from_a_graph():
    """Captured once; before each replay the producers' rows land in the box anew."""
    blocks, partial, rows, *weights = args_of(8, 3, 8, seed=13)
    box = armed_box(1, 8, CAPACITY, HIDDEN)
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    published(box, 0, rows)
    take(box, 0, error, blocks, partial, weights)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = take(box, 0, error, blocks, partial, weights)
    fresh = torch.Generator().manual_seed(14)
    for replay in range(100):
        rows = torch.randn(rows.shape, generator=fresh).bfloat16().cuda()
        published(box, 0, rows)
        graph.replay()
        want = kimi.attn_res(blocks, partial, canonical(rows), *weights, 1e-6)
        for s, w in zip(static, want):
            assert torch.equal(s.view(torch.int16), w.view(torch.int16)), replay
        assert armed(box[0, :, :8])
    assert int(error) == 0
