"""The DSA indexer front on Hopper (the seeds' ``dsa/front_mma.py`` IndexFrontMma, re-derived
for wgmma): ``kimi::dsa_index_front`` as one variant of the decode-GEMM engine
(:mod:`kimi_ops.kernels.gemm`) with a quantizing epilogue, ``kimi::dsa_index_key_insert``
as a launch of its own, and ``kimi::dsa_index_front_keys``: the front with the key insert's
CTAs after its grid (one launch, as the seeds' front; they land on the SMs the front's 96
leave free and run beside it).

Front: q_c [B, K] × wq_b [4096, K]ᵀ (K = 1536) on the engine's main loop. A CTA owns one
indexer head (its 128 wq_b rows: two 64-row tiles, one TMA box) over 1/split of K; the
split CTAs of a head form a cluster (:func:`index_partition`: split 3 for K = 1536, 96
CTAs, eight 8 KB chunks each, the whole slice in the ring at once). Everything up to the
K parts' exchange is the engine's: the weights by TMA (L2 evict-first, the first
PACE_BYTES before the PDL wait), x by the producer warpgroup, per-chunk wgmma sums added in
chunk order. The K parts meet by token (GemmPlan ``by_token``): CTA q of the cluster takes
tokens [q·P, (q+1)·P) of every row of the head and adds the parts 0, 1, … in order (the
same bits every run), so a head's 128 channels are in one CTA and its amax needs no
second exchange.

Raw-row mode (``q_norm_w`` given): the producers normalize x on its way into shared memory
(``DecodeGemm.produce_normalized``): Σ x² per token over the CTA's K slice in FP64 (exact),
the parts' sums to every CTA of the cluster over DSMEM (st.async), rr = rsqrt.approx(ss/K
+ eps) (torch.rsqrt's instruction on CUDA), xn = BF16((x · rr) · gamma): QueryNorm's
rounding points (:func:`kimi_ops.numerics.rms_norm`).

Epilogue (:meth:`IndexFront.finish`, thread = channel): proj = BF16(Σ parts); per (token,
head) amax = max(1e-10, max |proj|) (NaN-propagating, as torch.amax), scale = the
smallest power of two ≥ amax / 448 (IEEE division, then the exponent bits: exact),
q = e4m3(proj · 1/scale) (rcp of a power of two is exact, and of ±0 / ∞ gives what torch's
division gives; satfinite = the reference's clamp to ±448), head_w = BF16((head_in · scale)
· 4096^-0.5) (two exact products: the last is 2^-6).

Key insert (:class:`KeyInsert`): a warp per token (4 values a lane), 8 tokens a CTA:
LayerNorm with FP64 sums (exact, any order: the reference's FP32 mean and variance),
BF16(((x − mean) · rstd) · w + b) by mul.rn / add.rn (never contracted into an FMA), the
same FP8 rule, then the 132-byte row (codes, FP32 scale) at ``cache[slot]``; slot −1 and
slots outside the cache write nothing (the op's host check raises on them first; under
capture the kernel drops them, as the reference does).

MX key scales (the seeds' ``mx``, UE8M0 bytes): the public cache row carries a 4-byte FP32
scale; a UE8M0 byte is that scale's exponent field (power-of-two scales: exact), so an MX
variant is a layout change of the cache (129 or 132 + per-block bytes), not of the maths —
see benchmarks/NOTES.md.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int64, Uint8, Uint32
from cutlass.memory import SmemAllocator

from ...config import INDEX_DIM
from ...numerics import E4M3_MAX
from ..gemm.engine import DecodeGemm
from ..gemm.plan import CONSUMER_WARPS, GemmPlan
from ..launch import launch
from ..packets import butterfly_sum, clamp, unpack_words
from ..ptx import (
    abs_f32,
    add_rn,
    bits_float,
    divide,
    e4m3_pair,
    float_bits,
    load_pair,
    load_shared_floats,
    max_nan,
    mul_rn,
    reciprocal,
    rsqrt_like_torch,
    store_word,
    warp_max_bits,
)
from .plan import FOLD, KEY_WARPS


@cute.jit
def pow2_ceil(x: Float32) -> Float32:
    """kimi_ops.numerics.pow2_ceil on the bits: x itself when its mantissa is zero, else the
    next exponent (NaN: 0x80000000, as the reference's bit arithmetic gives)."""
    bits = float_bits(x)
    result = bits
    if (bits & Uint32(0x007FFFFF)) != Uint32(0):
        result = (bits & Uint32(0x7F800000)) + Uint32(0x00800000)
    return bits_float(result)


@cute.jit
def warp_max(value: Float32) -> Float32:
    """max_nan over the warp, in every lane, of values ≥ +0 or NaN (magnitudes): their bits
    order as unsigned integers, and every NaN's above +∞ (the NaN's payload is not kept:
    fp8_scale gives every NaN the same scale)."""
    return bits_float(warp_max_bits(float_bits(value)))


@cute.jit
def fp8_scale(amax: Float32) -> Float32:
    """The power-of-two scale of an amax already clamped to ≥ 1e-10 (NaN stays NaN)."""
    return pow2_ceil(divide(amax, Float32(E4M3_MAX)))


@cute.jit
def float64_sum(values):
    """Σ in FP64 of FP32 values: exact for a lane's four keys (BF16) or their FP32 squares."""
    total = Float64(0.0)
    for v in values:
        total += Float64(v)
    return total


class IndexFront(DecodeGemm):
    """``kimi::dsa_index_front`` at one (K, T, mode): the engine's main loop and K-part
    exchange (by token), the quantizing epilogue of the module doc; ``norm``: raw rows;
    ``keys``: the key insert's CTAs after the front's (``kimi::dsa_index_front_keys``;
    whole clusters of them, KEY_WARPS tokens each; else its arguments are placeholders)."""

    def __init__(self, plan: GemmPlan, norm: bool, keys: bool = False):
        super().__init__(plan, None)
        self.norm, self.keys = norm, keys

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, q: cute.Tensor, head_w: cute.Tensor,
                 head_in: cute.Tensor, k_in: cute.Tensor, k_norm_w: cute.Tensor, k_norm_b: cute.Tensor,
                 cache: cute.Tensor, slots: cute.Tensor, eps: Float32, stream):
        w_copy, w_boxes = self.weight_copy(w)
        x_copy, x_boxes = self.x_copy(x)
        extra = 0
        if cutlass.const_expr(self.keys):
            split = self.plan.split
            extra = (k_in.shape[0] + KEY_WARPS * split - 1) // (KEY_WARPS * split) * split
        self.launch(self.kernel(w_copy, w_boxes, x_copy, x_boxes, x, gamma, q, head_w, head_in, k_in, k_norm_w,
                                k_norm_b, cache, slots, eps), stream, extra)

    @cute.kernel
    def kernel(self, w_copy: cute.CopyAtom, w_boxes: cute.Tensor, x_copy: cute.CopyAtom, x_boxes: cute.Tensor,
               x: cute.Tensor, gamma: cute.Tensor, q: cute.Tensor, head_w: cute.Tensor, head_in: cute.Tensor,
               k_in: cute.Tensor, k_norm_w: cute.Tensor, k_norm_b: cute.Tensor, cache: cute.Tensor,
               slots: cute.Tensor, eps: Float32):
        cta, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.keys):
            if cta >= self.plan.ctas:
                tid, _, _ = cute.arch.thread_idx()
                cute.arch.griddepcontrol_launch_dependents()
                insert_keys(k_in, k_norm_w, k_norm_b, cache, slots, eps, cta - self.plan.ctas, tid)
        if cta < self.plan.ctas:
            self.body(w_copy, w_boxes, (x_copy, x_boxes), x, (q, head_w, head_in), (gamma, eps) if self.norm else None)

    def prefetched(self, outs, block, part):
        return outs  # no mailbox: nothing to load before the epilogue

    @cute.jit
    def finish(self, receive, batch, block, part, tid, q, head_w, head_in):
        """Thread ``tid`` = channel of head ``block`` for our tokens [part·P, (part+1)·P):
        BF16 of the parts' sum in part order, the head amax over the four warps, then thread
        i the scale of our token i (and its folded head weight), then every thread its
        channel's e4m3 codes.

        Every load comes before the stores, and no phase branches per token: a global load
        after a store through another pointer waits for it (no restrict), and a branch per
        token keeps ptxas from overlapping the tokens' latency chains — per token in turn
        (head_in's load behind q's store, the scale's division) this epilogue cost ~0.5 µs
        a token, 22 tokens a CTA at 64 (benchmarks/NOTES.md)."""
        plan = self.plan
        warp, lane = tid // 32, tid % 32
        per_owner = plan.per_owner
        first = part * per_owner
        shared = SmemAllocator().allocate_tensor(Float32, cute.make_layout((CONSUMER_WARPS + 1) * per_owner), 16)
        inverses = per_owner * CONSUMER_WARPS  # after amax [warp][token]: 1/scale [token]
        head = Float32(head_in[clamp(first + tid, batch - 1), block])  # thread i: our token i's (i < P)
        pairs = [[load_shared_floats(receive.iterator + plan.receive_word(p, tid, index)) for p in range(plan.split)]
                 for index in range(0, per_owner, 2)]  # tokens index, index + 1 (per_owner is even)
        values = []
        for index in cutlass.range_constexpr(per_owner):
            total = pairs[index // 2][0][index % 2]
            for p in cutlass.range_constexpr(1, plan.split):
                total = total + pairs[index // 2][p][index % 2]
            values.append(Float32(BFloat16(total)))  # the projection's output
        tops = [warp_max(abs_f32(value)) for value in values]
        if lane == 0:
            for index in cutlass.range_constexpr(per_owner):
                shared[warp * per_owner + index] = tops[index]
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * CONSUMER_WARPS)
        if tid < per_owner:
            top = Float32(1e-10)
            for w in cutlass.range_constexpr(CONSUMER_WARPS):
                top = max_nan(top, shared[w * per_owner + tid])
            scale = fp8_scale(top)
            shared[inverses + tid] = reciprocal(scale)
            if first + tid < batch:
                head_w[first + tid, block] = BFloat16((head * scale) * Float32(FOLD))
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * CONSUMER_WARPS)
        codes = [e4m3_pair(Float32(0.0), values[index] * shared[inverses + index]) for index in range(per_owner)]
        for index in cutlass.range_constexpr(per_owner):
            if first + index < batch:
                q[first + index, block * INDEX_DIM + tid] = Uint8(codes[index] & Uint32(0xFF))


class KeyInsert:
    """``kimi::dsa_index_key_insert``: a warp per token, KEY_WARPS tokens a CTA (module doc)."""

    @cute.jit
    def __call__(self, k_in: cute.Tensor, norm_w: cute.Tensor, norm_b: cute.Tensor, cache: cute.Tensor,
                 slots: cute.Tensor, eps: Float32, stream):
        launch(self.kernel(k_in, norm_w, norm_b, cache, slots, eps), [(k_in.shape[0] + KEY_WARPS - 1) // KEY_WARPS],
               stream)

    @cute.kernel
    def kernel(self, k_in: cute.Tensor, norm_w: cute.Tensor, norm_b: cute.Tensor, cache: cute.Tensor,
               slots: cute.Tensor, eps: Float32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()  # a tiny grid: dependents may start at once
        insert_keys(k_in, norm_w, norm_b, cache, slots, eps, cta, tid)


@cute.jit
def insert_keys(k_in, norm_w, norm_b, cache, slots, eps, block, tid):
    """Key-insert CTA ``block``: warp w the token block·KEY_WARPS + w, the norm's weights
    loaded before the PDL wait (they do not depend on the previous kernel)."""
    warp, lane = tid // 32, tid % 32
    weights = unpack_words(load_pair(norm_w.iterator + 4 * lane))
    biases = unpack_words(load_pair(norm_b.iterator + 4 * lane))
    cute.arch.griddepcontrol_wait()
    token = block * KEY_WARPS + warp
    if token < k_in.shape[0]:
        slot = Int64(slots[token])
        if (slot >= Int64(0)) & (slot < Int64(cache.shape[0])):
            insert_key(k_in, token, slot, cache, weights, biases, eps, lane)


@cute.jit
def insert_key(k_in, token, slot, cache, weights, biases, eps, lane):
    """One token's key (a lane's 4 values): LayerNorm, BF16, FP8 codes and scale into its row."""
    x = unpack_words(load_pair(k_in.iterator + Int64(token) * k_in.stride[0] + 4 * lane))
    total = float64_sum(x)
    mean = divide(Float32(butterfly_sum(total, 32)), Float32(INDEX_DIM))
    centered = [v - mean for v in x]
    squares = float64_sum([mul_rn(c, c) for c in centered])
    rstd = rsqrt_like_torch(add_rn(divide(Float32(butterfly_sum(squares, 32)), Float32(INDEX_DIM)), eps))
    keys = [Float32(BFloat16(add_rn(mul_rn(mul_rn(centered[i], rstd), weights[i]), biases[i]))) for i in range(4)]
    top = abs_f32(keys[0])
    for i in cutlass.range_constexpr(1, 4):
        top = max_nan(top, abs_f32(keys[i]))
    scale = fp8_scale(max_nan(Float32(1e-10), warp_max(top)))
    inverse = reciprocal(scale)
    low, high = e4m3_pair(keys[1] * inverse, keys[0] * inverse), e4m3_pair(keys[3] * inverse, keys[2] * inverse)
    row = cache.iterator + slot * (INDEX_DIM + 4)
    store_word(row + 4 * lane, low | (high << Uint32(16)))
    if lane == 0:
        store_word(row + INDEX_DIM, float_bits(scale))
