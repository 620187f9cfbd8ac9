"""The tail's fronts (the seeds' front half) and the shared expert's push. Each front
releases its dependent at entry, so the tail's weight loads start at once; NormFront and
TailFront then wait for their predecessor, PollNormFront and LatentReduce never do (their
inputs come by bounded polls).

``NormFront`` (functional, TP1; one CTA per token, a thread per 16-byte packet): latent =
BF16(Σ_r row_r · w_r) as an FP32 FMA chain in rank order, ss = Σ BF16(latent²) in FP64 —
exact for these BF16 squares, so every order gives the reference's float64 sum — over
the CTA, inv = rsqrt.approx(ss / L + eps) (the instruction torch.rsqrt runs on CUDA) and
xn = BF16((latent · inv) · gamma), bit-equal to the reference on the same device, into
a [B, L] tensor. The tail's clusters then only copy their K slice: redoing the front,
the sum and the normalization in every cluster (28 at TP1) cost 2.3 µs per call at
B = 8 (benchmarks/NOTES.md). A thread's 16 row loads are all in flight (one HBM round
trip; ptxas kept two at a time until the launch let it take the registers). Where all
its CTAs fit two per SM on the SMs the tail leaves free (B ≤ 40 on 132 SMs) it launches
for two per SM (72 registers, about half the loads in flight), so that the next call's
tail CTAs never wait for a front CTA's SM.

``PollNormFront`` (publish mode, before the wave): NormFront's rows from the polled latent
boxes, with the re-arm of the previous MoE layer's boxes over a grid of at least one CTA
a token (:meth:`PollNormFront.ctas`).

``TailFront`` (publish mode; grid B × L/2048 CTAs of 256 threads): the partial latent
BF16(Σ_r row_r · w_r) of one packet per thread, stored (−0 → +0, NaN canonical) as
source ``rank`` of every rank's latent box, one relaxed system-scope store per peer; or,
two-shot, of its column owner's receive box only (one store a packet).

``LatentReduce`` (two-shot's second half; grid B × ⌈L/TP/2048⌉): a thread per packet of
our latent chunk sums its TP polled sources in rank order (as the tails do) and stores
the BF16 sum into every rank's gathered box, which the tail then polls as one source.

``ShardPush``: the shared expert's rows into the reduce-scatter boxes (it waits for its
predecessor, then releases: the tail's re-arms of the previous layer's rows rely on that,
and released at entry its waiting CTAs held SMs the next tail's clusters needed, 2-5 µs
slower a call at B = 4-16 on the H200: benchmarks/NOTES.md).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64
from cutlass.memory import SmemAllocator

from ...config import TOP_K
from ..launch import PDL, THREADS, launch
from ..mailbox import box_row, peer_bases, poll_all, store_to_owner, store_to_peers
from ..packets import butterfly_sum, clamp, inverse_rms, normalized, unpack_words
from ..ptx import load_words, pack_values, store_words
from .common import (
    LATENT_POLL,
    TWO_SHOT_POLL,
    rank_sums,
    rearm_previous,
    sum_of_squares,
)

FRONT_PACKETS = THREADS  # packets (8 columns) per TailFront CTA


class TailFront:
    """The publish half: partial = BF16(Σ_r row_r · w_r) per (token, packet), stored as
    source ``rank`` of every rank's latent box (the tail sums the sources, then normalizes);
    ``chunk`` (two-shot: L/TP), of its column owner's receive box instead."""

    def __init__(self, latent: int, tp: int, chunk: int = 0):
        self.latent, self.tp, self.chunk = latent, tp, chunk
        self.packets = latent // 8

    @cute.jit
    def __call__(self, expanded: cute.Tensor, weights: cute.Tensor, peers: cute.Tensor, row0: Int32, stream):
        grid = [expanded.shape[0], -(-self.packets // FRONT_PACKETS)]
        launch(self.kernel(expanded, weights, peers, row0), grid, stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, expanded: cute.Tensor, weights: cute.Tensor, peers: cute.Tensor, row0: Int32):
        """``peers``: the latent boxes' base addresses, written at row ``row0 + token`` of
        rows of L (two-shot: of rows of the chunk)."""
        tid, _, _ = cute.arch.thread_idx()
        token, part, _ = cute.arch.block_idx()
        packet = part * FRONT_PACKETS + tid
        # Trigger the dependents at once: our dependent (MoeTail) only prefetches weights before it waits
        # for us, and we wait for our predecessor before anything else.
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        if packet < self.packets:
            publish_partial(expanded, weights, peers, self.tp, self.latent, row0, token, packet, self.chunk)


REARM_STORES = 16  # the most re-arm stores a PollNormFront thread makes (PollNormFront.ctas)


class NormFront:
    """The functional front, normalized: xn = BF16((latent · inv) · gamma) of one token per
    CTA, latent = BF16(Σ_r row_r · w_r) (the FP32 FMA chain in rank order) and inv from
    the row's Σ BF16(latent²) (FP64, exact), which stays in the CTA: MoeTail then only
    copies its K slice instead of every cluster redoing the front, the sum and the
    normalization for all B tokens (28 times over at TP1). ``per_sm``: the CTAs an SM fits,
    ptxas's register target (``front_per_sm`` picks it per batch)."""

    def __init__(self, latent: int, per_sm: int):
        self.latent, self.packets, self.per_sm = latent, latent // 8, per_sm
        self.threads = min(1024, -(-self.packets // 32) * 32)
        self.rounds = -(-self.packets // self.threads)  # packets per thread

    @cute.jit
    def __call__(self, expanded: cute.Tensor, weights: cute.Tensor, gamma: cute.Tensor, rows: cute.Tensor,
                 eps: Float32, stream):
        self.launch_ctas(self.kernel(expanded, weights, gamma, rows, eps), rows.shape[0], stream)

    def launch_ctas(self, kernel, ctas, stream):
        """Over ``ctas`` CTAs: a token each (PollNormFront: more where its re-arm asks)."""
        # min_blocks_per_mp sets ptxas's register target: 1 keeps a thread's 16 row loads in
        # flight (107 registers; unset, 40 kept ~2), 2 about 9 (72). The carveout attribute
        # lets a multi-CTA target compile without a device.
        kernel.launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=PDL,
            min_blocks_per_mp=self.per_sm, preferred_smem_carveout=-1,
        )

    @cute.kernel
    def kernel(self, expanded: cute.Tensor, weights: cute.Tensor, gamma: cute.Tensor, rows: cute.Tensor,
               eps: Float32):
        token, _, _ = cute.arch.block_idx()
        columns, scale = self.gamma_packets(gamma)
        # Trigger the dependents at once: our dependent (MoeTail) only prefetches weights before it waits.
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        latents = [[Float32(BFloat16(a)) for a in weighted_rows(expanded, weights, token, columns[q])]
                   for q in range(self.rounds)]
        self.store_normed(latents, scale, rows, token, eps)

    def packets_of(self, tid):
        return [tid + q * self.threads for q in range(self.rounds)]

    @cute.jit
    def gamma_packets(self, gamma):
        """(each round's first column, clamped; its gamma packet): a weight, loaded before
        the wait."""
        tid, _, _ = cute.arch.thread_idx()
        columns = [clamp(packet, self.packets - 1) * 8 for packet in self.packets_of(tid)]
        return columns, [unpack_words(load_words(gamma.iterator + column)) for column in columns]

    @cute.jit
    def store_normed(self, latents, scale, rows, token, eps):
        """``token``'s row of xn from its rounded latent packets (one list of 8 per round):
        Σ BF16(latent²) over the CTA in FP64, inv, then the normalized packets."""
        tid, _, _ = cute.arch.thread_idx()
        warp, lane = tid // 32, tid % 32
        sums = SmemAllocator().allocate_tensor(Float64, cute.make_layout(32), 16)
        packets = self.packets_of(tid)
        squares = Float64(0.0)
        for q in cutlass.range_constexpr(self.rounds):
            if packets[q] < self.packets:
                squares += sum_of_squares(latents[q])
        squares = butterfly_sum(squares, 32)
        if lane == 0:
            sums[warp] = squares
        cute.arch.sync_threads()
        total = Float64(0.0)  # the warps' sums, one per lane; any order is exact
        if lane < self.threads // 32:
            total = sums[lane]
        inv = inverse_rms(butterfly_sum(total, 32), self.latent, eps)
        for q in cutlass.range_constexpr(self.rounds):
            if packets[q] < self.packets:
                store_words(rows.iterator + token * rows.stride[0] + packets[q] * 8,
                            normalized(latents[q], inv, scale[q]))


class PollNormFront(NormFront):
    """Publish mode's front for WaveMoeTail: NormFront's xn rows from the latent boxes,
    latent = BF16(Σ of the TP sources in rank order) polled per packet (bounded, into the
    error word), and the previous MoE layer's parity re-armed over the grid: a CTA per
    token, and more where the re-arm asks (:meth:`ctas`; those only re-arm). Its loads
    are TP packets per thread, in flight at any register target: two CTAs per SM."""

    def __init__(self, latent: int, tp: int):
        super().__init__(latent, per_sm=2)
        self.tp = tp

    def ctas(self, batch: int, rearm_batch: int, shard: int) -> int:
        """The grid: the batch's CTAs, or enough that no thread re-arms more than
        REARM_STORES packets. A CTA a token alone left a TP8 rank's first layer (L = 512:
        64 threads a CTA) re-arming the whole capacity, 61,440 packets, in one CTA at B = 1:
        the wave's layer took 106 µs against MoeTail's 67 (benchmarks/NOTES.md)."""
        packets = self.tp * rearm_batch * (self.latent + shard) // 8
        return max(batch, -(-packets // (self.threads * REARM_STORES)))

    @cute.jit
    def __call__(self, latent_box: cute.Tensor, shared_box: cute.Tensor, gamma: cute.Tensor, rows: cute.Tensor,
                 error: cute.Tensor, eps: Float32, parity: Int32, rearm_parity: Int32, rearm_batch: Int32,
                 ctas: Int32, stream):
        self.launch_ctas(self.kernel(latent_box, shared_box, gamma, rows, error, eps, parity, rearm_parity,
                                     rearm_batch), ctas, stream)

    @cute.kernel
    def kernel(self, latent_box: cute.Tensor, shared_box: cute.Tensor, gamma: cute.Tensor, rows: cute.Tensor,
               error: cute.Tensor, eps: Float32, parity: Int32, rearm_parity: Int32, rearm_batch: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        columns, scale = self.gamma_packets(gamma)
        # Trigger the dependents at once: the wave only streams weights before it waits for us.
        cute.arch.griddepcontrol_launch_dependents()
        for box in (latent_box, shared_box):
            rearm_previous(box, self.tp, rearm_parity, rearm_batch, cta * self.threads + tid, grid * self.threads)
        if cta < rows.shape[0]:  # a token's CTA (the rest only re-arm)
            capacity = latent_box.shape[2]
            polled = poll_all([latent_box.iterator + box_row(parity, source, cta, self.tp, capacity) * self.latent
                               + column for column in columns for source in range(self.tp)], error, LATENT_POLL)
            self.store_normed(rank_sums(polled, self.tp), scale, rows, cta, eps)


class LatentReduce:
    """The two-shot latent all-reduce's second half on the owner of latent columns
    [rank·chunk, …): per (token, packet) of the chunk, BF16(Σ of the TP sources polled from
    the receive box [3, TP, CAP, chunk], rank order), into those columns of every rank's
    gathered box [3, 1, CAP, L]; the previous MoE layer's parity of the receive box
    re-armed over the grid. Like PollNormFront it releases at entry and never waits: its
    inputs come by polls. Its re-arm is ordered before the next publish into that parity
    (two MoE layers on) by what lies between: the tail's polls of the gathered rows, the
    waiting kernels of a layer, and in multi-process groups the group barriers."""

    def __init__(self, chunk: int, tp: int):
        self.chunk, self.tp, self.packets = chunk, tp, chunk // 8
        self.parts = -(-self.packets // THREADS)

    @cute.jit
    def __call__(self, recv_box: cute.Tensor, peers: cute.Tensor, error: cute.Tensor, parity: Int32,
                 rearm_parity: Int32, rearm_batch: Int32, rank: Int32, batch: Int32, stream):
        launch(self.kernel(recv_box, peers, error, parity, rearm_parity, rearm_batch, rank, batch),
               [batch, self.parts], stream, min_blocks_per_mp=1)  # the TP sources' polls in flight: ptxas's register target

    @cute.kernel
    def kernel(self, recv_box: cute.Tensor, peers: cute.Tensor, error: cute.Tensor, parity: Int32,
               rearm_parity: Int32, rearm_batch: Int32, rank: Int32, batch: Int32):
        tid, _, _ = cute.arch.thread_idx()
        token, part, _ = cute.arch.block_idx()
        packet = part * THREADS + tid
        cute.arch.griddepcontrol_launch_dependents()  # the tail only streams weights before it polls our rows
        rearm_previous(recv_box, self.tp, rearm_parity, rearm_batch, (token * self.parts + part) * THREADS + tid,
                       batch * self.parts * THREADS)
        if packet < self.packets:
            capacity = recv_box.shape[2]
            bases = peer_bases(peers, self.tp)  # in flight with the polls
            polled = poll_all([recv_box.iterator + box_row(parity, source, token, self.tp, capacity) * self.chunk
                               + packet * 8 for source in range(self.tp)], error, TWO_SHOT_POLL)
            total = rank_sums(polled, self.tp)[0]
            words = pack_values(total)
            column = rank * self.chunk + packet * 8
            store_to_peers(bases, (Int64(box_row(parity, 0, token, 1, capacity)) * self.chunk * self.tp + column) * 2, words)


class ShardPush:
    """The shared expert's reduce-scatter stores (the seeds' ``WaveMoeTail.push``): packet
    p of token b goes to rank p·8 // N's box, row ``row0 + b`` of rows of N."""

    def __init__(self, hidden: int, tp: int):
        self.hidden, self.tp, self.shard = hidden, tp, hidden // tp

    @cute.jit
    def __call__(self, shared: cute.Tensor, peers: cute.Tensor, row0: Int32, stream):
        launch(self.kernel(shared, peers, row0), [shared.shape[0], -(-self.hidden // 8 // THREADS)], stream)

    @cute.kernel
    def kernel(self, shared: cute.Tensor, peers: cute.Tensor, row0: Int32):
        tid, _, _ = cute.arch.thread_idx()
        token, part, _ = cute.arch.block_idx()
        column = (part * THREADS + tid) * 8
        cute.arch.griddepcontrol_launch_dependents()  # at entry (launch.py: PDL)
        cute.arch.griddepcontrol_wait()
        if column < self.hidden:
            store_to_owner(peers, self.shard, row0 + token, column,
                           load_words(shared.iterator + token * shared.stride[0] + column))


@cute.jit
def publish_partial(expanded, weights, peers, tp: cutlass.Constexpr[int], latent: cutlass.Constexpr[int], row0,
                    token, packet, chunk: cutlass.Constexpr[int] = 0):
    """The partial latent BF16(Σ_r row_r · w_r) of ``token``'s ``packet`` as source ``rank``
    (row ``row0 + token`` of rows of L) of every rank's latent box (``peers``: their bases);
    ``chunk`` (two-shot), of its column owner's receive box (rows of ``chunk``)."""
    acc = weighted_rows(expanded, weights, token, packet * 8)
    words = pack_values(acc)
    if cutlass.const_expr(chunk):
        store_to_owner(peers, chunk, row0 + token, packet * 8, words)
    else:
        store_to_peers(peer_bases(peers, tp), (Int64(row0 + token) * latent + packet * 8) * 2, words)


@cute.jit
def weighted_rows(expanded, weights, token, column):
    """Σ_r row_r · w_r over the 8 columns from ``column`` of ``token``'s TOP_K expert rows
    (``expanded`` [B, TOP_K, L], ``weights`` [B, TOP_K]): the front's FP32 FMA chain in
    rank order, unrounded (the caller rounds once to BF16)."""
    # Every row's load first, all TOP_K in flight at once where the registers allow
    # (NormFront: 8 round trips became one, 107 registers).
    rows = [load_words(expanded.iterator + token * expanded.stride[0] + r * expanded.stride[1] + column)
            for r in range(TOP_K)]
    scales = [Float32(weights[token, r]) for r in range(TOP_K)]
    acc = [Float32(0.0)] * 8
    for r in cutlass.range_constexpr(TOP_K):
        values = unpack_words(rows[r])
        acc = [acc[i] + values[i] * scales[r] for i in range(8)]
    return acc
