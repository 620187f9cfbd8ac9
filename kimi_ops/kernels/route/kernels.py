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
BF16 out; 16-byte packets, 256 of them of one token per CTA.

PDL: the bias (a weight) is loaded before ``griddepcontrol.wait``; the dependents are
released at entry (kernels/launch.py says why), route poll's once its packets are re-armed.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32, Uint64
from cutlass.memory import SmemAllocator

from ...config import TOP_K
from ...mailbox import ROUTE_POLL
from ..launch import THREADS, launch
from ..mailbox import count_arrival, poll, rearm, release_consumed
from ..packets import butterfly_sum, ordered, sigmoid, situ_value, unpack_words
from ..ptx import bits_float, load_words, pack_values, store_words

LEAN_ABOVE = 8  # batches above this route with the lean ranking


class Route:
    """``lean`` (B > 8): candidates rank with 8 threads each (4 past 32 candidates), so
    few registers stay live; else one thread per candidate. Either falls back to one
    thread per candidate, looping over all of them, past 64 candidates (ties).
    ``polled``: thread t owns experts 4t..4t+3, one 16-byte packet of FP32 logit words."""

    def __init__(self, experts: int, renorm: bool, lean: bool, polled: bool = False):
        self.experts, self.renorm, self.lean, self.polled = experts, renorm, lean, polled
        self.slots = 4 if polled else (experts + THREADS - 1) // THREADS  # experts per thread

    def expert(self, tid, i):
        return tid * 4 + i if self.polled else tid + THREADS * i

    @cute.jit
    def __call__(self, logits: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, scale: Float32, stream):
        launch(self.kernel(logits, bias, ids, weights, scale), [logits.shape[0]], stream)

    @cute.kernel
    def kernel(self, logits: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, scale: Float32):
        tid, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()  # at entry (launch.py: PDL)
        offsets = self.load_bias(bias, tid)
        cute.arch.griddepcontrol_wait()
        raw = cute.make_rmem_tensor(self.slots, Float32)
        for i in cutlass.range_constexpr(self.slots):
            raw[i] = Float32(0.0)
            if self.expert(tid, i) < self.experts:
                raw[i] = logits[token, self.expert(tid, i)]
        self.route(raw, offsets, ids, weights, scale, token, tid)

    @cute.jit
    def load_bias(self, bias: cute.Tensor, tid):
        """This thread's experts' bias (a weight: callers load it before the PDL wait)."""
        offsets = cute.make_rmem_tensor(self.slots, Float32)
        for i in cutlass.range_constexpr(self.slots):
            offsets[i] = Float32(0.0)
            if self.expert(tid, i) < self.experts:
                offsets[i] = bias[self.expert(tid, i)]
        return offsets

    @cute.jit
    def route(self, raw, offsets, ids: cute.Tensor, weights: cute.Tensor, scale: Float32, token, tid):
        """Top-16 of this thread's raw logits (all 256 threads), published by warp 0."""
        warp, lane = tid // 32, tid % 32
        smem = SmemAllocator()
        maxima = smem.allocate_tensor(Uint64, cute.make_layout((8, 32), stride=(32, 1)), 16)
        dense = smem.allocate_tensor(Uint64, cute.make_layout(self.slots * THREADS), 16)
        scores = smem.allocate_tensor(Float32, cute.make_layout(self.slots * THREADS), 16)
        chosen = smem.allocate_tensor(Int32, cute.make_layout(TOP_K), 16)
        picked = smem.allocate_tensor(Float32, cute.make_layout(TOP_K), 16)
        found = smem.allocate_tensor(Int32, cute.make_layout(1), 16)
        cutoff = smem.allocate_tensor(Uint64, cute.make_layout(1), 16)

        keys = cute.make_rmem_tensor(self.slots, Uint64)
        top = Uint64(0)
        for i in cutlass.range_constexpr(self.slots):
            expert = self.expert(tid, i)
            keys[i] = Uint64(0)
            if expert < self.experts:
                score = sigmoid(raw[i])
                scores[expert] = score
                keys[i] = (Uint64(ordered(score + offsets[i])) << Uint64(32)) | Uint64(~Uint32(expert))
            top = larger(top, keys[i])
        maxima[warp, lane] = top
        if tid == 0:
            found[0] = Int32(0)
            cutoff[0] = Uint64(0)  # never a stale threshold: at worst every key is a candidate
        cute.arch.sync_threads()

        if warp == 0:  # the cutoff: the 16th largest lane-group maximum
            group = maxima[0, lane]
            for w in cutlass.range_constexpr(1, 8):
                group = larger(group, maxima[w, lane])
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
        for i in cutlass.range_constexpr(self.slots):  # candidates append at a shared count
            if keys[i] >= threshold:
                dense[cute.arch.atomic_add(found.iterator, Int32(1))] = keys[i]
        cute.arch.sync_threads()

        count = found[0]
        if cutlass.const_expr(self.lean):
            if count <= 32:
                self.rank_shared(dense, scores, chosen, picked, count, tid, 8)
            elif count <= 64:
                self.rank_shared(dense, scores, chosen, picked, count, tid, 4)
            else:
                self.rank_each(dense, scores, chosen, picked, count, tid)
        else:
            self.rank_each(dense, scores, chosen, picked, count, tid)
        cute.arch.sync_threads()
        self.publish(chosen, picked, ids, weights, scale, token, tid)

    @cute.jit
    def rank_each(self, dense, scores, chosen, picked, count, tid):
        """One thread per candidate counts the candidates above it."""
        for index in cutlass.range(tid, count, THREADS, unroll=1):
            mine = dense[index]
            rank = Int32(0)
            for j in cutlass.range(count, unroll=8):
                rank += Int32(dense[j] > mine)
            self.place(dense[index], rank, scores, chosen, picked)

    @cute.jit
    def rank_shared(self, dense, scores, chosen, picked, count, tid, share: cutlass.Constexpr[int]):
        """``share`` threads per candidate (count ≤ 256 / share) each count a share of the
        candidates above it; a butterfly adds the shares."""
        part, index = tid % share, tid // share
        mine = Uint64(0)
        if index < count:
            mine = dense[index]
        rank = Int32(0)
        for k in cutlass.range_constexpr(THREADS // share // share):
            j = part + share * k
            if j < count:
                rank += Int32(dense[j] > mine)
        rank = butterfly_sum(rank, share)
        if (part == 0) & (index < count):
            self.place(mine, rank, scores, chosen, picked)

    @cute.jit
    def place(self, key, rank, scores, chosen, picked):
        if rank < TOP_K:
            expert = Int32(~Uint32(key & Uint64(0xFFFFFFFF)))
            chosen[rank] = expert
            picked[rank] = scores[expert]

    @cute.jit
    def publish(self, chosen, picked, ids: cute.Tensor, weights: cute.Tensor, scale: Float32, token, tid):
        """Warp 0: lane r publishes rank r; every lane sums the scores in the same order."""
        lane = tid % 32
        if tid < 32:
            value = Float32(0.0)
            if lane < TOP_K:
                ids[token, lane] = chosen[lane]
                value = picked[lane]
            total = butterfly_sum(value, TOP_K)
            if lane < TOP_K:
                value = value * scale
                if cutlass.const_expr(self.renorm):
                    value = value / (total + Float32(1e-20))
                weights[token, lane] = BFloat16(value)


class RoutePoll(Route):
    """``kimi::moe_route_poll``: CTAs [0, B) route from the logit words of the front row,
    CTAs [B, 2B) copy its latent; both poll their 16-byte packets (Lamport, bounded),
    re-arm them, release the dependents (mailbox.release_consumed) and wait for the
    previous grid only before writing outputs. ``counted``: no wait (a caller keeps alive
    every buffer that grid reads: ours may be allocated where a freed one was), and each
    CTA counts its outputs into ``ready`` once stored (mailbox.count_arrival) for routed
    experts that wait for the count, not for our end."""

    def __init__(self, experts: int, latent: int, renorm: bool, lean: bool, counted: bool = False):
        super().__init__(experts, renorm, lean, polled=True)
        self.latent, self.counted = latent, counted
        self.packets = latent // 8  # 16-byte packets of the latent

    @cute.jit
    def __call__(self, rows: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
                 latent: cute.Tensor, error: cute.Tensor, ready: cute.Tensor, scale: Float32, first_row: Int32,
                 stream):
        launch(self.kernel(rows, bias, ids, weights, latent, error, ready, scale, first_row), [2 * ids.shape[0]],
               stream)

    @cute.kernel
    def kernel(self, rows: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
               latent: cute.Tensor, error: cute.Tensor, ready: cute.Tensor, scale: Float32, first_row: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        batch = ids.shape[0]
        token = cta % batch
        row = rows.iterator + (first_row + token) * rows.stride[0]
        if cta < batch:
            offsets = self.load_bias(bias, tid)
            raw = cute.make_rmem_tensor(4, Float32)
            for i in cutlass.range_constexpr(4):
                raw[i] = Float32(0.0)
            if tid * 4 < self.experts:
                packet = row + self.latent + tid * 8
                words = poll(packet, error, ROUTE_POLL)
                rearm(packet)
                for i in cutlass.range_constexpr(4):
                    raw[i] = bits_float(words[i])
            release_consumed()
            if cutlass.const_expr(not self.counted):
                cute.arch.griddepcontrol_wait()
            self.route(raw, offsets, ids, weights, scale, token, tid)
        else:
            rounds = (self.packets + THREADS - 1) // THREADS
            taken = cute.make_rmem_tensor((rounds, 4), Uint32)
            for p in cutlass.range_constexpr(rounds):
                packet_index = tid + THREADS * p
                if packet_index < self.packets:
                    packet = row + packet_index * 8
                    words = poll(packet, error, ROUTE_POLL)
                    rearm(packet)
                    for i in cutlass.range_constexpr(4):
                        taken[p, i] = words[i]
            release_consumed()
            if cutlass.const_expr(not self.counted):
                cute.arch.griddepcontrol_wait()
            for p in cutlass.range_constexpr(rounds):
                packet_index = tid + THREADS * p
                if packet_index < self.packets:
                    store_words(latent.iterator + token * latent.stride[0] + packet_index * 8,
                                [taken[p, i] for i in range(4)])
        if cutlass.const_expr(self.counted):
            count_arrival(ready)


class Situ:
    """Grid (B, chunks): each thread reads one 16-byte packet of gate and one of up
    (4 FP32 or 8 BF16 columns), so a CTA covers 256 packets of one token and a small batch
    still spreads over many SMs. The BF16 outputs leave as one 8- or 16-byte store."""

    def __init__(self, width: int, source):
        self.width, self.source = width, source
        self.columns = 128 // source.width  # per thread: one 16-byte packet
        self.chunks = (width + self.columns * THREADS - 1) // (self.columns * THREADS)

    @cute.jit
    def __call__(self, gate_up: cute.Tensor, out: cute.Tensor, beta: Float32, linear_beta: Float32, stream):
        launch(self.kernel(gate_up, out, beta, linear_beta), [gate_up.shape[0], self.chunks], stream)

    @cute.kernel
    def kernel(self, gate_up: cute.Tensor, out: cute.Tensor, beta: Float32, linear_beta: Float32):
        tid, _, _ = cute.arch.thread_idx()
        token, chunk, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()  # at entry (launch.py: PDL)
        first = (chunk * THREADS + tid) * self.columns
        cute.arch.griddepcontrol_wait()
        if first < self.width:
            row = gate_up.iterator + token * gate_up.stride[0] + first
            gate, up = self.unpack(load_words(row)), self.unpack(load_words(row + self.width))
            values = [situ_value(g, u, beta, linear_beta) for g, u in zip(gate, up)]
            words = pack_values(values)
            store_words(out.iterator + token * out.stride[0] + first, words)

    @cute.jit
    def unpack(self, words):
        """A packet's columns as FP32, each first rounded to BF16 (as RouteSitu loads them)."""
        if cutlass.const_expr(self.source is Float32):
            return [Float32(BFloat16(bits_float(word))) for word in words]
        return unpack_words(words)


@cute.jit
def larger(a: Uint64, b: Uint64) -> Uint64:
    """The larger rank word, compared unsigned (``cutlass.max`` of a Uint64 and a
    constant emits a signed max, which ranks every positive score below 0)."""
    result = a
    if b > a:
        result = b
    return result
