"""The MoE tail at TP1 on Hopper (the seeds' ``moe/tail.py``), a first, two-kernel
version: the rounding points of DESIGN §3.4 with plain FP32 FMA (no tensor cores yet).

``TailNorm`` (one CTA of 256 threads per token): thread t owns 16-byte packets t + 256·i
of the latent; partial = BF16(Σ_r row_r · w_r) as an FP32 FMA chain in rank order;
ss = Σ BF16(partial²) (thread partials, then the warps' butterfly, then the 8 warps in
order); inv = rsqrt(ss / L + eps); xn = BF16((partial · inv) · gamma) into a scratch row.

``UpProjection`` (H/32 CTAs of 8 warps, a warp per 4 output rows): each lane walks its
share of K in 16-byte packets, holds the packets of up to 8 tokens in registers and
streams the 4 weight rows past them; a butterfly sums the lanes; out = BF16(BF16(up) +
shared). Batches above 8 loop over groups of 8 tokens and read the weights again per
group. On the H200 (L2-cold) this takes 20 µs at B ≤ 2 (the compiled composite takes
24 µs), 31–43 µs at B = 4–8, and about 80–300 µs above that. That is still 4× faster
than the reference on CUDA at B ≥ 16 (364–404 µs), but short of the targets. The
tensor-core, cluster and TMA-prefetch version is still to come.
PDL: the up projection waits for the norm only after its launch; both release late.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from .. import backend
from ..ops import tail as tail_op
from .common import (
    THREADS, Release, compiled, fake, fake_stream, launch, load_words, pack_bf16, store_words, unpack_bf16,
)
from .route import hopper

WARPS = THREADS // 32
ROWS_PER_WARP = 4
ROWS_PER_CTA = WARPS * ROWS_PER_WARP
TOKENS_PER_GROUP = 8
TOP_K = tail_op.TOP_K


class TailNorm(Release):
    def __init__(self, latent: int):
        super().__init__(early=False)
        self.latent, self.packets = latent, latent // 8
        self.rounds = (self.packets + THREADS - 1) // THREADS

    @cute.jit
    def __call__(self, expanded: cute.Tensor, weights: cute.Tensor, gamma: cute.Tensor, xn: cute.Tensor,
                 eps: Float32, stream):
        launch(self.kernel(expanded, weights, gamma, xn, eps), [xn.shape[0]], stream)

    @cute.kernel
    def kernel(self, expanded: cute.Tensor, weights: cute.Tensor, gamma: cute.Tensor, xn: cute.Tensor, eps: Float32):
        tid, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        sums = SmemAllocator().allocate_tensor(Float32, cute.make_layout(WARPS), 16)
        cute.arch.griddepcontrol_wait()
        partial = cute.make_rmem_tensor((self.rounds, 8), Float32)
        squares = Float32(0.0)
        for p in cutlass.range_constexpr(self.rounds):
            packet = tid + THREADS * p
            for i in cutlass.range_constexpr(8):
                partial[p, i] = Float32(0.0)
            if packet < self.packets:
                for r in cutlass.range_constexpr(TOP_K):  # the FMA chain, rank order
                    weight = Float32(weights[token, r])
                    row = expanded.iterator + token * expanded.stride[0] + r * expanded.stride[1]
                    values = unpack_words(load_words(row + packet * 8))
                    for i in cutlass.range_constexpr(8):
                        partial[p, i] = partial[p, i] + values[i] * weight
                for i in cutlass.range_constexpr(8):
                    partial[p, i] = Float32(BFloat16(partial[p, i]))
                    squares += Float32(BFloat16(partial[p, i] * partial[p, i]))
        for shift in cutlass.range_constexpr(5):
            squares += cute.arch.shuffle_sync_bfly(squares, offset=1 << shift)
        if lane == 0:
            sums[warp] = squares
        cute.arch.sync_threads()
        total = sums[0]
        for w in cutlass.range_constexpr(1, WARPS):
            total += sums[w]
        inv = cute.math.rsqrt(total / Float32(self.latent) + eps)
        for p in cutlass.range_constexpr(self.rounds):
            packet = tid + THREADS * p
            if packet < self.packets:
                scale = unpack_words(load_words(gamma.iterator + packet * 8))
                normed = [(partial[p, i] * inv) * scale[i] for i in range(8)]
                words = [pack_bf16(normed[i], normed[i + 1]) for i in range(0, 8, 2)]
                store_words(xn.iterator + token * xn.stride[0] + packet * 8, words)
        self.release_late()


class UpProjection(Release):
    def __init__(self, latent: int, hidden: int, batch: int):
        super().__init__(early=False)
        self.latent, self.hidden, self.batch = latent, hidden, batch
        self.steps = latent // 8 // 32  # packets per lane

    @cute.jit
    def __call__(self, xn: cute.Tensor, w_up: cute.Tensor, shared: cute.Tensor, out: cute.Tensor, stream):
        launch(self.kernel(xn, w_up, shared, out), [self.hidden // ROWS_PER_CTA], stream)

    @cute.kernel
    def kernel(self, xn: cute.Tensor, w_up: cute.Tensor, shared: cute.Tensor, out: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        first_row = cta * ROWS_PER_CTA + warp * ROWS_PER_WARP
        cute.arch.griddepcontrol_wait()
        full = self.batch // TOKENS_PER_GROUP
        for group in cutlass.range(full, unroll=1):
            self.group(xn, w_up, shared, out, group * TOKENS_PER_GROUP, TOKENS_PER_GROUP, first_row, lane)
        if cutlass.const_expr(self.batch % TOKENS_PER_GROUP):
            self.group(xn, w_up, shared, out, full * TOKENS_PER_GROUP, self.batch % TOKENS_PER_GROUP, first_row, lane)
        self.release_late()


    @cute.jit
    def group(self, xn, w_up, shared, out, first, tokens: cutlass.Constexpr[int], first_row, lane):
        """Tokens [first, first + tokens) against this warp's ROWS_PER_WARP rows."""
        acc = cute.make_rmem_tensor((ROWS_PER_WARP, tokens), Float32)
        for n in cutlass.range_constexpr(ROWS_PER_WARP):
            for t in cutlass.range_constexpr(tokens):
                acc[n, t] = Float32(0.0)
        for step in cutlass.range(self.steps, unroll=4):
            k = (lane + 32 * step) * 8
            x = [unpack_words(load_words(xn.iterator + (first + t) * xn.stride[0] + k)) for t in range(tokens)]
            for n in cutlass.range_constexpr(ROWS_PER_WARP):
                w = unpack_words(load_words(w_up.iterator + (first_row + n) * w_up.stride[0] + k))
                for t in cutlass.range_constexpr(tokens):
                    for i in cutlass.range_constexpr(8):
                        acc[n, t] = acc[n, t] + w[i] * x[t][i]
        for n in cutlass.range_constexpr(ROWS_PER_WARP):
            for t in cutlass.range_constexpr(tokens):
                for shift in cutlass.range_constexpr(5):
                    acc[n, t] = acc[n, t] + cute.arch.shuffle_sync_bfly(acc[n, t], offset=1 << shift)
                if lane == (n * tokens + t) % 32:  # spread the stores over the lanes
                    row = first_row + n
                    up = Float32(BFloat16(acc[n, t]))
                    out[first + t, row] = BFloat16(up + Float32(shared[first + t, row]))


@cute.jit
def unpack_words(words):
    """A 16-byte packet's eight BF16 values as FP32."""
    return [value for word in words for value in unpack_bf16(word)]


@compiled
def compile_norm(latent: int):
    batch = cute.sym_int()
    return cute.compile(
        TailNorm(latent), fake(BFloat16, (batch, TOP_K, latent)), fake(BFloat16, (batch, TOP_K), align=2),
        fake(BFloat16, (latent,)), fake(BFloat16, (batch, latent)), Float32(1e-6), fake_stream(),
        options="--enable-tvm-ffi",
    )


@compiled
def compile_up(latent: int, hidden: int, batch: int):
    return cute.compile(
        UpProjection(latent, hidden, batch), fake(BFloat16, (batch, latent)), fake(BFloat16, (hidden, latent)),
        fake(BFloat16, (batch, hidden), align=2), fake(BFloat16, (batch, hidden), align=2), fake_stream(),
        options="--enable-tvm-ffi",
    )


class TailKernel:
    """``kimi::moe_tail`` on CUDA (TP1)."""

    def prepare(self, latent: int, hidden: int, batches) -> None:
        compile_norm(latent)
        for batch in batches:
            compile_up(latent, hidden, batch)

    def unsupported(self, expanded, weights, shared, gamma, w_up, eps):
        latent, hidden = expanded.shape[2], w_up.shape[0]
        if latent % 256 or hidden % ROWS_PER_CTA:
            return f"the tail kernel needs L % 256 == 0 and H % {ROWS_PER_CTA} == 0 (L={latent}, H={hidden})"
        return hopper(expanded)

    def __call__(self, expanded, weights, shared, gamma, w_up, eps):
        batch, hidden = tail_op.check_moe_tail(expanded, weights, shared, gamma, w_up, eps)
        latent = expanded.shape[2]
        out = shared.new_empty((batch, hidden))
        if batch:
            xn = expanded.new_empty((batch, latent))
            compile_norm(latent)(expanded, weights, gamma, xn, eps)
            compile_up(latent, hidden, batch)(xn, w_up, shared, out)
        return out


def register() -> None:
    backend.KERNELS["moe_tail"] = TailKernel()
