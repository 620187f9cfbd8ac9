"""Each functional op against the independent float64 oracle, on fresh random inputs."""

import pytest
import torch

import oracle
from kimi_ops import KimiArgumentError, backend
from kimi_ops.numerics import ordered_key
from kimi_ops.ops import oproj as oproj_ops
from kimi_ops.config import INDEX_DIM, INDEX_HEADS
from conftest import BATCHES, DEVICES, HOPPER, assert_bf16_close, assert_tail_close, randn

kimi = torch.ops.kimi


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("experts", [64, 896, 1024])
def test_moe_route(gen, device, batch, experts):
    logits = randn(gen, batch, experts, device=device, scale=3.0)
    bias = randn(gen, experts, device=device, scale=0.1)
    for renorm in (True, False):
        ids, weights = kimi.moe_route(logits, bias, 2.827, renorm)
        want_ids, want_weights = oracle.route(logits.cpu(), bias.cpu(), 2.827, renorm)
        assert torch.equal(ids.cpu(), want_ids)
        assert_bf16_close(weights, want_weights, max_ulps=1)


def test_ordered_key():
    """The seeds' ordered key: monotone over the numbers, −0 just below +0, NaN lowest."""
    values = torch.tensor([float("-inf"), -2.5, -1e-38, -0.0, 0.0, 1e-45, 3.0, float("inf")])
    keys = ordered_key(values)
    assert keys.tolist() == sorted(keys.tolist()) and len(set(keys.tolist())) == len(values)
    assert ordered_key(torch.tensor([float("nan")])).item() == 0 < keys.min().item()


def test_moe_route_ties_and_nan():
    """Equal keys rank the lower expert first; NaN ranks below every number."""
    experts = 64
    logits = torch.full((4, experts), -30.0)
    bias = torch.zeros(experts)
    logits[0, 10:40] = 1.0  # 30 tied keys: experts 10..25 win, in id order
    logits[1, :] = float("nan")
    logits[1, 50:55] = 2.0  # five numbers beat 59 NaNs; then NaNs by lower id
    logits[2, :] = float("-inf")  # sigmoid = 0: the keys are the bias
    bias[7] = 1e-30  # the only positive key
    logits[3, 5] = float("nan")
    ids, weights = kimi.moe_route(logits, bias, 1.0, False)
    assert ids[0].tolist() == list(range(10, 26))
    assert ids[1].tolist() == [50, 51, 52, 53, 54] + list(range(11))
    assert ids[2].tolist()[0] == 7 and ids[2].tolist()[1:] == [e for e in range(16) if e != 7]
    assert 5 not in ids[3].tolist()
    want_ids, want_weights = oracle.route(logits, bias, 1.0, False)
    assert torch.equal(ids, want_ids)
    assert_bf16_close(weights, want_weights, max_ulps=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ(gen, device, batch, dtype):
    gate_up = randn(gen, batch, 2 * 384, dtype=dtype, device=device, scale=2.0)
    for beta, linear_beta in ((1.0, 0.0), (1.702, 1.0)):
        got = kimi.situ(gate_up, beta, linear_beta)
        assert_bf16_close(got, oracle.situ(gate_up.cpu(), beta, linear_beta))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rank, tp", [(0, 1), (3, 4)])
def test_routed_experts(gen, device, batch, rank, tp):
    """Every rank's rows of its experts, the others zero; ids outside [0, E) give zero rows."""
    experts, width, intermediate = 64, 256, 16
    latent = randn(gen, batch, width, dtype=torch.bfloat16, device=device)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:16] for _ in range(batch)]).to(torch.int32)
    ids[0, :2] = torch.tensor([-1, experts], dtype=torch.int32)
    gate_up = randn(gen, experts, 2 * intermediate, width, dtype=torch.bfloat16, device=device, scale=width**-0.5)
    down = randn(gen, experts, width, intermediate, dtype=torch.bfloat16, device=device, scale=intermediate**-0.5)
    got = kimi.routed_experts(latent, ids.to(device), gate_up, down, rank, tp)
    want, magnitude = oracle.routed_experts(latent.cpu(), ids, gate_up.cpu(), down.cpu(), rank, tp)
    # An act flipped by the CPU's and CUDA's sigmoid moves a row by an ulp of its terms
    assert_bf16_close(got, want, max_ulps=1, max_flipped=0.02, magnitude=magnitude)
    served = (ids >= 0) & (ids < experts) & (ids // (experts // tp) == rank)
    assert not got.cpu()[~served].any() and got.cpu()[served].abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_routed_experts_of_no_tokens(device):
    """B = 0: empty rows [0, 16, L], the fake's shape (opcheck holds them to each other)."""
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(0, 64, generator=gen).bfloat16().to(device)
    args = (latent, torch.zeros(0, 16, dtype=torch.int32, device=device),
            torch.randn(32, 16, 64, generator=gen).bfloat16().to(device),
            torch.randn(32, 64, 8, generator=gen).bfloat16().to(device), 0, 1)
    assert kimi.routed_experts(*args).shape == (0, 16, 64)
    torch.library.opcheck(kimi.routed_experts.default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
def test_moe_front(gen, device, batch):
    x = randn(gen, batch, 1024, dtype=torch.bfloat16, device=device)
    w = randn(gen, 96 + 256, 1024, dtype=torch.bfloat16, device=device, scale=0.03)
    logits, latent = kimi.moe_front(x, w, 96)
    assert logits.dtype == torch.float32 and latent.dtype == torch.bfloat16
    full = oracle.linear(x.cpu(), w.cpu())
    torch.testing.assert_close(logits.cpu().double(), full[:, :96], rtol=1e-6, atol=1e-6)
    assert_bf16_close(latent, full[:, 96:].to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
def test_oproj(gen, device, batch):
    x = randn(gen, batch, 1536, dtype=torch.bfloat16, device=device)
    w = randn(gen, 512, 1536, dtype=torch.bfloat16, device=device, scale=0.03)
    assert_bf16_close(kimi.oproj(x, w), oracle.linear(x.cpu(), w.cpu()).to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
def test_normed_oproj_is_oproj_of_the_normalized_rows(gen, device, batch):
    """kimi::normed_oproj(x, w, g) = kimi::oproj(rms_norm(x; g), w) bit for bit (on CUDA: the
    plans are partition's alike, so the sums' order is the same), and the float64 oracle's
    rms then linear within the rounding of both (the embedding's h_normed as AttnRes leaves
    it, then layer 0's stacked GEMM)."""
    x = randn(gen, batch, 1536, dtype=torch.bfloat16, device=device, scale=4.0)
    w = randn(gen, 512, 1536, dtype=torch.bfloat16, device=device, scale=0.03)
    g = (1 + randn(gen, 1536, device=device, scale=0.1)).bfloat16()
    got = kimi.normed_oproj(x, w, g, 1e-6)
    h_normed = kimi.attn_res(x.new_empty(0, batch, 1536), torch.zeros_like(x), x[None], g, g, g, 1e-6)[2]
    assert torch.equal(got, kimi.oproj(h_normed, w))
    xn = oracle.rms(x.cpu(), g.cpu(), 1e-6)  # an xn one ulp off flips a term: ulps at the terms' size
    assert_bf16_close(got, oracle.linear(xn, w.cpu()).to(torch.bfloat16), max_ulps=2,
                      magnitude=oracle.linear(xn.abs(), w.cpu().abs()))
    with pytest.raises(KimiArgumentError, match="'norm_w' must be"):
        kimi.normed_oproj(x, w, g[:64], 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
def test_gate_up_situ_is_situ_of_the_gate_up_rows(gen, device, batch):
    """The interleaved rows (interleave_gate_up) give kimi::situ(kimi::oproj(x, [gate; up]))
    bit for bit (on CUDA too: at this shape the situ plan splits K as oproj's at every
    bucket, so the sums' order is the same; at 2 × 256 rows and 64 tokens it does not), both
    betas."""
    x = randn(gen, batch, 1536, dtype=torch.bfloat16, device=device)
    w = randn(gen, 2 * 512, 1536, dtype=torch.bfloat16, device=device, scale=0.03)
    paired = oproj_ops.interleave_gate_up(w)
    assert torch.equal(paired[8:16], w[512:520]) and torch.equal(paired[16:24], w[8:16])
    for beta, linear_beta in ((1.0, 0.0), (1.702, 1.0)):
        got = kimi.gate_up_situ(x, paired, beta, linear_beta)
        assert torch.equal(got, kimi.situ(kimi.oproj(x, w), beta, linear_beta))
    assert_bf16_close(kimi.gate_up_situ(x, paired, 1.0, 0.0),  # the GEMM's rounding, then situ's: 2 ulps
                      oracle.situ(oracle.linear(x.cpu(), w.cpu()).to(torch.bfloat16), 1.0, 0.0), max_ulps=2)
    with pytest.raises(KimiArgumentError, match="'w' must be .* a multiple of 16"):
        kimi.gate_up_situ(x, paired[:40], 1.0, 0.0)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_oproj_push_is_oproj_then_the_push(gen, tp, batch):
    """Each rank's shard of BF16(x @ w.T) at source ``rank`` of its box: the boxes the
    functional oproj and moe_tail_push leave (poisoned rows elsewhere untouched)."""
    x = randn(gen, batch, 256, dtype=torch.bfloat16)
    w = randn(gen, 128, 256, dtype=torch.bfloat16, scale=0.05)
    got = [torch.full((3, tp, 16, 128 // tp), 7.0, dtype=torch.bfloat16) for _ in range(tp)]
    want = [box.clone() for box in got]
    kimi.oproj_push(x, w, got, 1, tp - 1)
    kimi.moe_tail_push(kimi.oproj(x, w), want, 1, tp - 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0][1, tp - 1, :batch], want[0][0, 0, :batch])  # rows were written


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("batch", [1, 5])
def test_shared_expert_push_is_gate_up_situ_then_the_push(gen, tp, batch):
    """The fused shared expert's activations in act[:B] (the rows past B untouched) and the
    boxes oproj_push leaves from them."""
    x = randn(gen, batch, 256, dtype=torch.bfloat16)
    w_gate_up = oproj_ops.interleave_gate_up(randn(gen, 2 * 64, 256, dtype=torch.bfloat16, scale=0.05))
    w_down = randn(gen, 128, 64, dtype=torch.bfloat16, scale=0.1)
    act = torch.full((16, 64), 7.0, dtype=torch.bfloat16)
    ticket, error = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    got = [torch.full((3, tp, 16, 128 // tp), 7.0, dtype=torch.bfloat16) for _ in range(tp)]
    want = [box.clone() for box in got]
    kimi.shared_expert_push(x, w_gate_up, w_down, 1.0, 0.0, act, ticket, got, 2, tp - 1, error)
    activations = kimi.gate_up_situ(x, w_gate_up, 1.0, 0.0)
    kimi.oproj_push(activations, w_down, want, 2, tp - 1)
    assert torch.equal(act[:batch], activations) and bool((act[batch:] == 7.0).all())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0][2, tp - 1, :batch], torch.full_like(got[0][2, tp - 1, :batch], 7.0))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("batch", [1, 5])
def test_moe_front_shared_push_is_the_front_publish_and_the_shared_expert(gen, tp, batch):
    """The fused op leaves the front boxes, act and the reduce-scatter boxes as
    moe_front_publish then shared_expert_push leave them, on poisoned boxes."""
    x = randn(gen, batch, 256, dtype=torch.bfloat16)
    n_logits, latent_shard = 32 // tp, 48 // tp
    w_front = randn(gen, n_logits + latent_shard, 256, dtype=torch.bfloat16, scale=0.05)
    w_gate_up = oproj_ops.interleave_gate_up(randn(gen, 2 * 64, 256, dtype=torch.bfloat16, scale=0.05))
    w_down = randn(gen, 128, 64, dtype=torch.bfloat16, scale=0.1)
    poisoned = lambda *shape: torch.full(shape, 7.0, dtype=torch.bfloat16)  # noqa: E731
    got = ([poisoned(3, 1, 16, 48 + 64) for _ in range(tp)], poisoned(16, 64),
           [poisoned(3, tp, 16, 128 // tp) for _ in range(tp)])
    want = tuple([b.clone() for b in part] if isinstance(part, list) else part.clone() for part in got)
    ticket, error = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    rank = tp - 1
    kimi.moe_front_shared_push(x, w_front, n_logits, got[0], w_gate_up, w_down, 1.0, 0.0, got[1], ticket, got[2], 2,
                               rank, error)
    kimi.moe_front_publish(x, w_front, n_logits, want[0], 2, rank)
    kimi.shared_expert_push(x, w_gate_up, w_down, 1.0, 0.0, want[1], ticket, want[2], 2, rank, error)
    for a, b in zip(got[0] + [got[1]] + got[2], want[0] + [want[1]] + want[2]):
        assert torch.equal(a, b)
    assert not torch.equal(got[0][0][2, 0, :batch], poisoned(batch, 48 + 64))
    assert not torch.equal(got[2][0][2, rank, :batch], poisoned(batch, 128 // tp))


def tail_inputs(gen, batch, hidden, latent, device):
    return (
        randn(gen, batch, 16, latent, dtype=torch.bfloat16, device=device),
        randn(gen, batch, 16, dtype=torch.bfloat16, device=device, scale=0.2),
        randn(gen, batch, hidden, dtype=torch.bfloat16, device=device),
        randn(gen, latent, dtype=torch.bfloat16, device=device, scale=0.1) + 1,
        randn(gen, hidden, latent, dtype=torch.bfloat16, device=device, scale=0.05),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
def test_moe_tail(gen, device, batch):
    args = tail_inputs(gen, batch, 1024, 512, device)
    got = kimi.moe_tail(*args, 1e-6)
    assert_tail_close(got, oracle.tail(*(a.cpu() for a in args), 1e-6), args[2])


def test_moe_tail_kimi_shapes(gen):
    args = tail_inputs(gen, 2, 7168, 3584, "cpu")
    assert_bf16_close(kimi.moe_tail(*args, 1e-6), oracle.tail(*args, 1e-6), magnitude=args[2])


def test_moe_tail_negative_zero_rows(gen):
    """A token whose expert rows are all −0.0 yields the shared row (finite, no NaN)."""
    expanded, weights, shared, gamma, w_up = tail_inputs(gen, 3, 256, 128, "cpu")
    expanded[1] = -0.0
    got = kimi.moe_tail(expanded, weights, shared, gamma, w_up, 1e-6)
    assert torch.equal(got[1], shared[1])
    want = oracle.tail(expanded, weights, shared, gamma, w_up, 1e-6)
    assert_bf16_close(got, want, magnitude=shared)


def index_front_inputs(gen, batch, device):
    return (
        randn(gen, batch, 1536, dtype=torch.bfloat16, device=device),
        randn(gen, 4096, 1536, dtype=torch.bfloat16, device=device, scale=0.03),
        randn(gen, batch, 32, dtype=torch.bfloat16, device=device),
        randn(gen, 1536, dtype=torch.bfloat16, device=device, scale=0.1) + 1,
    )


def assert_e4m3_close(got, got_scale, want, want_scale, max_flipped=0.01):
    """Dequantized FP8 values (q · scale) within one e4m3 step plus 2^-9 of the row's range
    (448 · scale: what BF16 flips of the inputs move a small, cancelled value by), and at
    most ``max_flipped`` of them not equal. Scales may differ: a flipped input can move
    the amax across a power of two."""
    got = got.cpu().float() * got_scale.cpu().float()
    want = want.float() * want_scale.float()
    step = torch.maximum(got.abs(), want.abs()) / 8 + 448 * want_scale.float() * 2**-9
    assert bool(((got - want).abs() <= step).all())
    assert float((got != want).float().mean()) <= max_flipped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("normalized", [True, False])
def test_dsa_index_front(gen, device, batch, normalized):
    rows, wq_b, head_in, q_norm_w = index_front_inputs(gen, batch, device)
    q_norm_w = None if normalized else q_norm_w
    q, head_w = kimi.dsa_index_front(rows, wq_b, head_in, q_norm_w, 1e-6)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    want_q, want_w = oracle.index_front(rows.cpu(), wq_b.cpu(), head_in.cpu(), cpu(q_norm_w), 1e-6)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (batch, 32, 128)
    # head_w / head_in recovers each head's scale (a power of two times 1/64).
    scale = lambda w: (w.cpu().float() / head_in.cpu().float() * 64)[..., None]  # noqa: E731
    assert_e4m3_close(q, scale(head_w), want_q, scale(want_w))
    assert_bf16_close(head_w, want_w, max_ulps=0, max_flipped=0.02)


def test_dsa_index_front_zero_rows():
    """All-zero rows quantize with the floor amax 1e-10 (no division by zero, no NaN)."""
    rows, wq_b, head_in = torch.zeros(2, 1536, dtype=torch.bfloat16), torch.ones(4096, 1536, dtype=torch.bfloat16), torch.ones(2, 32, dtype=torch.bfloat16)
    q, head_w = kimi.dsa_index_front(rows, wq_b, head_in, None, 1e-6)
    assert q.float().abs().sum() == 0 and torch.isfinite(head_w.float()).all()
    assert_bf16_close(head_w, oracle.index_front(rows, wq_b, head_in, None, 1e-6)[1], max_ulps=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_dsa_helpers_take_column_views_of_one_gemm(gen, device, batch):
    """The decoder's wq_a, w_head and wk as one GEMM (PreparedIndexFront): q_c, head_in and
    k_in are column views of its rows; the consumers (the stand-in core's GEMM, the index
    front, the key insert) give on them exactly what they give on contiguous copies."""
    x = randn(gen, batch, 7168, dtype=torch.bfloat16, device=device)
    w_in = randn(gen, 1536 + INDEX_HEADS + INDEX_DIM, 7168, dtype=torch.bfloat16, device=device, scale=7168**-0.5)
    q_c, head_in, k_in = kimi.oproj(x, w_in).split([1536, INDEX_HEADS, INDEX_DIM], dim=1)
    assert q_c.stride() == (1536 + INDEX_HEADS + INDEX_DIM, 1) and (batch == 1 or not q_c.is_contiguous())
    _, wq_b, _, q_norm_w = index_front_inputs(gen, batch, device)
    w_core = randn(gen, 256, 1536, dtype=torch.bfloat16, device=device, scale=1536**-0.5)
    assert torch.equal(kimi.oproj(q_c, w_core), kimi.oproj(q_c.contiguous(), w_core))
    for norm in (q_norm_w, None):
        got = kimi.dsa_index_front(q_c, wq_b, head_in, norm, 1e-6)
        want = kimi.dsa_index_front(q_c.contiguous(), wq_b, head_in.contiguous(), norm, 1e-6)
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    norm_w, norm_b = torch.ones(128, dtype=torch.bfloat16, device=device), torch.zeros(128, dtype=torch.bfloat16, device=device)
    caches = [torch.zeros(batch, 132, dtype=torch.uint8, device=device) for _ in range(2)]
    slots = torch.arange(batch, device=device)
    if device == "cuda" and HOPPER:  # the kernels take the views (no silent fallback to the reference)
        for op, args in (("oproj", (q_c, w_core)), ("dsa_index_front", (q_c, wq_b, head_in, q_norm_w, 1e-6)),
                         ("dsa_index_front", (q_c, wq_b, head_in, None, 1e-6)),
                         ("dsa_index_key_insert", (k_in, norm_w, norm_b, 1e-5, caches[0], slots))):
            kernel = backend.KERNELS.get(op)  # None: CuTe DSL not installed
            assert kernel is None or kernel.unsupported(*args) is None, op
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-5, caches[0], slots)
    kimi.dsa_index_key_insert(k_in.contiguous(), norm_w, norm_b, 1e-5, caches[1], slots)
    assert torch.equal(caches[0], caches[1])
    if batch > 1:  # columns of unit stride are no rows
        with pytest.raises(KimiArgumentError, match="'k_in' must be rows with unit column stride"):
            kimi.dsa_index_key_insert(k_in.t().contiguous().t(), norm_w, norm_b, 1e-5, caches[0], slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_dsa_index_front_keys_is_the_two_ops(gen, device, batch):
    """The decoder's call on column views of one GEMM: the front's outputs and the cache of
    kimi::dsa_index_front and kimi::dsa_index_key_insert, bit for bit (on Hopper: the fused
    kernel against the two kernels)."""
    x = randn(gen, batch, 7168, dtype=torch.bfloat16, device=device)
    w_in = randn(gen, 1536 + INDEX_HEADS + INDEX_DIM, 7168, dtype=torch.bfloat16, device=device, scale=7168**-0.5)
    q_c, head_in, k_in = kimi.oproj(x, w_in).split([1536, INDEX_HEADS, INDEX_DIM], dim=1)
    _, wq_b, _, q_norm_w = index_front_inputs(gen, batch, device)
    norm_w = randn(gen, 128, dtype=torch.bfloat16, device=device, scale=0.1) + 1
    norm_b = randn(gen, 128, dtype=torch.bfloat16, device=device, scale=0.1)
    caches = [torch.randint(0, 256, (2 * batch + 3, 132), dtype=torch.uint8, generator=gen).to(device)
              for _ in range(2)]
    caches[1].copy_(caches[0])
    slots = torch.randperm(2 * batch + 3, generator=gen)[:batch].to(device)
    slots[::4] = -1
    args = (q_c, wq_b, head_in, q_norm_w)
    if device == "cuda" and HOPPER:
        kernel = backend.KERNELS.get("dsa_index_front_keys")
        assert kernel is None or kernel.unsupported(*args, k_in, norm_w, norm_b, 1e-6, caches[0], slots) is None
    got = kimi.dsa_index_front_keys(*args, k_in, norm_w, norm_b, 1e-6, caches[0], slots)
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-6, caches[1], slots)
    want = kimi.dsa_index_front(*args, 1e-6)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
def test_dsa_index_key_insert(gen, device, batch):
    k_in = randn(gen, batch, 128, dtype=torch.bfloat16, device=device, scale=3.0)
    norm_w = randn(gen, 128, dtype=torch.bfloat16, device=device, scale=0.1) + 1
    norm_b = randn(gen, 128, dtype=torch.bfloat16, device=device, scale=0.1)
    num_slots = 2 * batch + 4
    cache = torch.randint(0, 256, (num_slots, 132), dtype=torch.uint8, generator=gen).to(device)
    slots = torch.randperm(num_slots, generator=gen)[:batch]
    if batch > 1:
        slots[batch // 2] = -1  # a padding token: skipped
    slots = slots.to(device)
    before = cache.clone()
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-5, cache, slots)
    want_rows = oracle.index_key(k_in.cpu(), norm_w.cpu(), norm_b.cpu(), 1e-5)
    written = slots.cpu() >= 0
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots.cpu()[written]] = False
    assert torch.equal(cache.cpu()[untouched], before.cpu()[untouched])
    got = cache.cpu()[slots.cpu()[written]]
    want = want_rows[written]
    assert torch.equal(got[:, 128:], want[:, 128:])  # FP32 scales exact
    fp8, scale = lambda rows: rows[:, :128].view(torch.float8_e4m3fn), lambda rows: rows[:, 128:].view(torch.float32)  # noqa: E731
    assert_e4m3_close(fp8(got), scale(got), fp8(want), scale(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("completed", [0, 3])
def test_attn_res(gen, device, batch, completed):
    hidden, tp = 512, 2
    args = (
        randn(gen, completed, batch, hidden, dtype=torch.bfloat16, device=device),
        randn(gen, batch, hidden, dtype=torch.bfloat16, device=device),
        randn(gen, tp, batch, hidden, dtype=torch.bfloat16, device=device),
        randn(gen, hidden, dtype=torch.bfloat16, device=device, scale=0.05),
        randn(gen, hidden, dtype=torch.bfloat16, device=device, scale=0.1) + 1,
        randn(gen, hidden, dtype=torch.bfloat16, device=device, scale=0.1) + 1,
    )
    got = kimi.attn_res(*args, 1e-6)
    want = oracle.attn_res(*(a.cpu() for a in args), 1e-6)
    for g, w in zip(got, want):
        assert_bf16_close(g, w, max_ulps=2, max_flipped=0.02)
