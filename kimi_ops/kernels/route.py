"""Routing and the shared expert's activation on Hopper (the seeds' ``RouteSitu`` route
and situ roles). Route: one CTA of 256 threads per token.

Route (exact top-16 of E ≤ 1024): thread t owns experts t + 256·i. Each expert's rank key
is the 64-bit word ordered(sigmoid(logit) + bias) << 32 | ~expert, so larger words rank
first and equal keys go to the lower expert. The 32 lane-group maxima (lane l's best over
the 8 warps) give a cutoff — their 16th largest — at or below the 16th largest key; the
keys at or above it are compacted to shared memory and each ranks itself by counting the
larger ones (many candidates, e.g. all keys tied, only loop longer). Warp 0 publishes the
16 ids by rank and the weights: score · scale, with renorm divided (IEEE) by the
butterfly sum of the 16 scores + 1e-20, one BF16 rounding.

Situ: gate and up each rounded to BF16, g · sigmoid(beta · g) · (u + linear_beta) in FP32,
BF16 out; 1024 columns of one token per CTA.

PDL: the bias (a weight) is loaded before ``griddepcontrol.wait``; dependents are
released at the end, so they cannot take SMs from a tail still routing.
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Uint32, Uint64
from cutlass.memory import SmemAllocator

from .. import backend
from ..ops import route as route_op
from .common import compiled, fake, fake_stream, ordered, sigmoid

THREADS = 256
TOP_K = route_op.TOP_K


class Route:
    def __init__(self, experts: int, renorm: bool):
        self.experts, self.renorm = experts, renorm
        self.slots = (experts + THREADS - 1) // THREADS  # experts per thread

    @cute.jit
    def __call__(self, logits: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, scale: Float32, stream):
        self.kernel(logits, bias, ids, weights, scale).launch(
            grid=[logits.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, logits: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, scale: Float32):
        tid, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        smem = SmemAllocator()
        maxima = smem.allocate_tensor(Uint64, cute.make_layout((8, 32), stride=(32, 1)), 16)
        dense = smem.allocate_tensor(Uint64, cute.make_layout(self.slots * THREADS), 16)
        scores = smem.allocate_tensor(Float32, cute.make_layout(self.slots * THREADS), 16)
        chosen = smem.allocate_tensor(Int32, cute.make_layout(TOP_K), 16)
        picked = smem.allocate_tensor(Float32, cute.make_layout(TOP_K), 16)
        found = smem.allocate_tensor(Int32, cute.make_layout(1), 16)
        cutoff = smem.allocate_tensor(Uint64, cute.make_layout(1), 16)

        offsets = cute.make_rmem_tensor(self.slots, Float32)
        for i in cutlass.range_constexpr(self.slots):  # the bias is a weight: before the wait
            offsets[i] = Float32(0.0)
            if tid + THREADS * i < self.experts:
                offsets[i] = bias[tid + THREADS * i]
        cute.arch.griddepcontrol_wait()

        keys = cute.make_rmem_tensor(self.slots, Uint64)
        top = Uint64(0)
        for i in cutlass.range_constexpr(self.slots):
            expert = tid + THREADS * i
            keys[i] = Uint64(0)
            if expert < self.experts:
                score = sigmoid(logits[token, expert])
                scores[expert] = score
                keys[i] = (Uint64(ordered(score + offsets[i])) << Uint64(32)) | Uint64(~Uint32(expert))
            top = cutlass.max(top, keys[i])
        maxima[warp, lane] = top
        if tid == 0:
            found[0] = Int32(0)
        cute.arch.sync_threads()

        if warp == 0:  # the cutoff: the 16th largest lane-group maximum
            group = maxima[0, lane]
            for w in cutlass.range_constexpr(1, 8):
                group = cutlass.max(group, maxima[w, lane])
            cute.arch.sync_warp()
            maxima[0, lane] = group
            cute.arch.sync_warp()
            above = Int32(0)
            for j in cutlass.range_constexpr(32):
                above += Int32(maxima[0, j] > group)
            if above == TOP_K - 1:
                cutoff[0] = group
        cute.arch.sync_threads()

        threshold = cutoff[0]
        for i in cutlass.range_constexpr(self.slots):
            if keys[i] >= threshold:
                dense[cute.arch.atomic_add(found.iterator, Int32(1))] = keys[i]
        cute.arch.sync_threads()

        count = found[0]
        for index in cutlass.range(tid, count, THREADS, unroll=1):
            mine = dense[index]
            rank = Int32(0)
            for j in cutlass.range(count, unroll=4):
                rank += Int32(dense[j] > mine)
            if rank < TOP_K:
                expert = Int32(~Uint32(mine & Uint64(0xFFFFFFFF)))
                chosen[rank] = expert
                picked[rank] = scores[expert]
        cute.arch.sync_threads()

        if warp == 0:  # lane r publishes rank r; every lane sums in the same order
            value = Float32(0.0)
            if lane < TOP_K:
                ids[token, lane] = chosen[lane]
                value = picked[lane]
            total = value
            for shift in cutlass.range_constexpr(4):
                total += cute.arch.shuffle_sync_bfly(total, offset=1 << shift)
            if lane < TOP_K:
                value = value * scale
                if cutlass.const_expr(self.renorm):
                    value = value / (total + Float32(1e-20))
                weights[token, lane] = BFloat16(value)
        cute.arch.griddepcontrol_launch_dependents()


class Situ:
    """Grid (B, chunks): a CTA covers COLUMNS_PER_CTA columns of one token, so a small
    batch still spreads over many SMs; each thread issues all its loads first."""

    COLUMNS_PER_CTA = 4 * THREADS

    def __init__(self, width: int):
        self.width = width
        self.chunks = (width + self.COLUMNS_PER_CTA - 1) // self.COLUMNS_PER_CTA

    @cute.jit
    def __call__(self, gate_up: cute.Tensor, out: cute.Tensor, beta: Float32, linear_beta: Float32, stream):
        self.kernel(gate_up, out, beta, linear_beta).launch(
            grid=[gate_up.shape[0], self.chunks, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, gate_up: cute.Tensor, out: cute.Tensor, beta: Float32, linear_beta: Float32):
        tid, _, _ = cute.arch.thread_idx()
        token, chunk, _ = cute.arch.block_idx()
        first = chunk * self.COLUMNS_PER_CTA + tid
        rounds = self.COLUMNS_PER_CTA // THREADS
        cute.arch.griddepcontrol_wait()
        pair = cute.make_rmem_tensor((rounds, 2), Float32)
        for i in cutlass.range_constexpr(rounds):  # issue every load first
            if first + THREADS * i < self.width:
                pair[i, 0] = Float32(gate_up[token, first + THREADS * i])
                pair[i, 1] = Float32(gate_up[token, self.width + first + THREADS * i])
        for i in cutlass.range_constexpr(rounds):
            if first + THREADS * i < self.width:
                gate = Float32(BFloat16(pair[i, 0]))
                up = Float32(BFloat16(pair[i, 1]))
                out[token, first + THREADS * i] = BFloat16(gate * sigmoid(gate * beta) * (up + linear_beta))
        cute.arch.griddepcontrol_launch_dependents()


@compiled
def compile_route(experts: int, renorm: bool):
    batch = cute.sym_int()
    return cute.compile(
        Route(experts, renorm),
        fake(Float32, (batch, experts), align=4), fake(Float32, (experts,), align=4),
        fake(Int32, (batch, TOP_K)), fake(BFloat16, (batch, TOP_K)), Float32(1.0), fake_stream(),
        options="--enable-tvm-ffi",
    )


@compiled
def compile_situ(width: int, dtype: str):
    batch = cute.sym_int()
    source = Float32 if dtype == "float32" else BFloat16
    return cute.compile(
        Situ(width), fake(source, (batch, 2 * width), align=4), fake(BFloat16, (batch, width), align=4),
        Float32(1.0), Float32(0.0), fake_stream(), options="--enable-tvm-ffi",
    )


def hopper(tensor: torch.Tensor) -> str | None:
    if torch.cuda.get_device_capability(tensor.device)[0] != 9:
        return f"the CuTe kernels target sm_90, not {torch.cuda.get_device_name(tensor.device)}"
    return None


class RouteKernel:
    """``kimi::moe_route`` on CUDA."""

    def unsupported(self, logits, bias, scale, renorm):
        return hopper(logits)

    def __call__(self, logits, bias, scale, renorm):
        batch = route_op.check_moe_route(logits, bias, scale, renorm)
        ids = logits.new_empty((batch, TOP_K), dtype=torch.int32)
        weights = logits.new_empty((batch, TOP_K), dtype=torch.bfloat16)
        if batch:
            compile_route(logits.shape[1], bool(renorm))(logits, bias, ids, weights, scale)
        return ids, weights


class SituKernel:
    """``kimi::situ`` on CUDA."""

    def unsupported(self, gate_up, beta, linear_beta):
        return hopper(gate_up)

    def __call__(self, gate_up, beta, linear_beta):
        batch, width = route_op.check_situ(gate_up, beta, linear_beta)
        out = gate_up.new_empty((batch, width), dtype=torch.bfloat16)
        if batch:
            dtype = str(gate_up.dtype).removeprefix("torch.")
            compile_situ(width, dtype)(gate_up, out, beta, linear_beta)
        return out


def register() -> None:
    backend.KERNELS["moe_route"] = RouteKernel()
    backend.KERNELS["situ"] = SituKernel()
