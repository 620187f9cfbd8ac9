"""The MoE tail on Hopper (the seeds' ``moe/tail.py`` and ``moe/tail_runtime.py``), TP-general.

Two PDL-chained kernels, the seeds' front and tail halves. Each front releases its
dependent at entry and then waits for its own predecessor, so the tail's weight loads
start at once.

``NormFront`` (functional, TP1; one CTA per token, a thread per 16-byte packet): latent =
BF16(Σ_r row_r · w_r) as an FP32 FMA chain in rank order, ss = Σ BF16(latent²) in FP64 —
exact for these BF16 squares, so every order gives the reference's float64 sum — over
the CTA, inv = rsqrt.approx(ss / L + eps) (the instruction torch.rsqrt runs on CUDA) and
xn = BF16((latent · inv) · gamma), bit-equal to the reference on the same device, into
a [B, L] tensor. The tail's clusters then only copy their K slice: redoing the front,
the sum and the normalization in every cluster (28 at TP1) cost 2.3 µs per call at
B = 8 and 8 µs at B = 64 (measured, 18.8 → 16.5 and 33.0 → 25.1 µs). A thread's 16 row
loads are all in flight (one HBM round trip; ptxas kept two at a time until the launch
let it take the registers): B = 16 / 32 / 64 −0.7 / −1.0 / −0.3 µs per call. Where all
its CTAs fit two per SM on the SMs the tail leaves free (B ≤ 40 on 132 SMs) it launches
for two per SM (72 registers, about half the loads in flight), so that the next call's
tail CTAs never wait for a front CTA's SM: B = 16 / 32 −0.35 / −1.3 µs.

``TailFront`` (publish mode; grid B × L/2048 CTAs of 256 threads): the partial latent
BF16(Σ_r row_r · w_r) of one packet per thread, stored (−0 → +0, NaN canonical) as
source ``rank`` of every rank's latent box, one relaxed system-scope store per peer.

``MoeTail`` (clusters of CLUSTER = 4 CTAs, one CTA per SM, every cluster co-resident;
CTA c of a cluster owns K columns [c·L/4, (c+1)·L/4)):

1. Weights first: a producer warp streams w_up through a ring of ``depth`` slots with TMA
   (per slot and K part one box of the cluster's rows × CHUNK columns, 128-byte swizzle,
   L2 evict-first), from launch on, never waiting for the predecessor (functional) or the
   mailboxes (publish mode). Full and empty mbarriers per slot. Functional mode: the MMA
   warps take the first ``stash`` chunks into registers as they land and hand their
   slots back, a deeper ring while the front runs. The stream is paced (``pace``): a
   whole ring queued at once holds every other load 2-5 µs behind it (measured), and
   the front's and step 2's loads are the critical path. Evict-first: 51 MB pass through
   a 50 MB L2 per call and would evict the expert rows, xn and the shared rows.
2. xn: functional mode copies the CTA's K slice of NormFront's rows (cp.async). Publish
   mode polls the latent boxes (Lamport polls of every TP source bounded by the global
   timer), a warp per token, sums the sources in rank order in FP32, rounds to BF16,
   sums the slice's squares in FP64 (as NormFront) and the slices' sums meet in every
   CTA through DSMEM; then it normalizes in place.
3. Up projection on the tensor cores: mma.sync m16n8k16 BF16 → FP32, weights as A (16
   rows), xn as B (8 tokens), fragments by ldmatrix.x4 from 128-byte rows in the 128-byte
   swizzle (xn stored the same way), conflict-free; the order of the FP32 accumulation is
   the MMA's, which DESIGN §3.4 leaves free. Each MMA warp arrives on a slot's empty
   barrier once it holds its fragments.
4. The CTA releases its dependents once its xn is in (its first MMA warp's loads back; a
   CTA's release is its first thread's), so that the next call's two launches are done
   before our last CTA is (every dependent waits before reading what follows). Measured
   on the H200 after other graphs (a serving process's state; bench_tail's), µs per
   call at B = 1 / 4 / 8: 13.04 / 13.42 / 13.70 here, 13.25 / 13.62 / 13.95 at entry,
   14.22 / 14.33 / 14.43 after the producer's last chunk (which a process's first graph
   had measured best).
5. K-split reduction: each warp stores its FP32 partial sums into the owning CTA's shared
   memory (DSMEM: beside the ring where it fits, else over xn and the ring once the
   cluster has passed a barrier); the owner of rows [c·R/4, (c+1)·R/4) adds the parts in
   K order: up = BF16(Σ), out = BF16(up + BF16(Σ shared sources)), shared from a tensor
   (loaded after the wait, off the epilogue's path) or polled from the reduce-scatter
   box; written to ``out`` or, publish mode, to columns [rank·N, …) of every rank's
   output box.
6. Publish mode also re-arms the previous MoE layer's parity (rows [0, rearm_batch) of
   the latent and reduce-scatter boxes) while the weights stream.

Batches compile per 8-token group count (the MMA's N); the batch is a runtime argument.
From MIN_WAVE_GROUPS groups on, the tail is ``WaveMoeTail`` instead: no K split, wgmma,
xn multicast across the cluster (see its docstring). Publish mode takes it up to
MAX_WAVE_TP, after ``PollNormFront``: NormFront's rows from the polled latent boxes,
with the re-arm of step 6.
"""

import copy
import functools
import math
import operator

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from .. import backend
from ..ops import mailbox_ops
from ..ops import tail as tail_op
from .common import (
    CHUNK, SMEM_BYTES, THREADS, addresses, aligned, bits_float, butterfly_sum, clamp, compile_options, compiled,
    copy_async, descriptor, expect, fake, fake_stream, hopper, inverse_rms, l2_evict_first, landed, launch,
    load_shared, load_words, no_neg_zero, normalized, pack_bf16, paced, pinned, placeholder, poll_all, rearm,
    register_addresses, release, released, store_cluster, store_shared, store_to_peers, store_words,
    swizzled, swizzled_stages, unpack_words, wgmma_bf16,
)

TOP_K = tail_op.TOP_K
CLUSTER = 4  # CTAs per cluster, each owning 1/CLUSTER of K
# Co-resident clusters of 4 on an H200 at one CTA per SM (cuOccupancyMaxActiveClusters:
# clusters stay within a GPC, so 30, not 33; of 2: 66, of 8: 15).
ONE_WAVE_CLUSTERS = 30
MIN_DEPTH = 3  # ring slots in flight per warp
TILE_ROWS = 16  # MMA rows per tile
MAX_DEPTH = 16  # ring slots (shared memory keeps room for the mbarriers of as many)
PACE = 2  # ring slots in flight per CTA before step 2's loads are back (measured: 2, 3, 4 alike)
TILES_PER_WARP = 2
STASH_REGISTERS = 144  # per MMA lane for stashed A fragments, accumulators, B fragments (ptxas: no spills)
MAX_WARPS = 8
FRONT_PACKETS = THREADS  # packets (8 columns) per TailFront CTA
LATENT_LOADS = 32  # latent packets a lane polls at once (MoeTail.load_latent)
LATENT_POLL, SHARED_POLL = 2, 4  # kimi_ops.mailbox TAIL_LATENT_POLL, TAIL_SHARED_POLL
WAVE_ROWS = 64  # rows per WaveMoeTail CTA: wgmma's M
# WaveMoeTail CTAs sharing each xn chunk by multicast. Pairs: clusters of 2 fit 66 at a
# time, of 4 only 30 (the wave needs 28), so NormFront's CTAs block fewer of its
# placements (measured, B = 32 / 64: 16.2 / 17.9 µs, with 4: 18.0 / 18.3).
WAVE_CLUSTER = 2
MAX_WAVE_TP = 2  # publish mode's wave (poll_wave_plan)
WAVE_WARPS = 4  # per WaveMoeTail consumer warpgroup (two, taking alternate chunks)
WAVE_THREADS = 3 * 32 * WAVE_WARPS  # the consumers, then the producers' warpgroup
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232  # setmaxnreg: 128 · 40 + 256 · 232 <= 64 K
XN_BYTES = 96 * 1024  # the xn ring (L2 hits: slots in flight cover the cluster's round trip)
WGMMA_PENDING = 1  # chunks whose wgmmas stay in flight while the next chunk issues (measured: 1-3 alike)
# Accumulator sets per consumer warpgroup from SETS_TOKENS tokens on, taken by its chunks
# in turn and summed in set order at the end (one set below). Measured op-only, H200, µs,
# two rounds: B = 41 / 48 / 64 17.04-17.03 / 17.23-17.32 / 17.55-17.49 against one set's
# 17.19-17.38 / 17.63-17.77 / 17.85-17.96; at 32 tokens two sets lost 0.28 (stash 10 → 9).
ACCUMULATOR_SETS, SETS_TOKENS = 2, 64
# 8 KB slots in flight before xn is in (MoeTail's PACE bytes). Op-only at B = 64, H200, µs,
# each run beside 8 (17.6-17.8): 2 / 4 / 6 → 20.9 / 18.4 / 17.8, 10 / 12 → 18.0 / 18.2
# (at B = 41 / 48, 10 gained 0.05-0.2: not worth B = 64's loss).
WAVE_PACE = 8
MAX_WAVE_DEPTH = 32
MIN_WAVE_GROUPS, MAX_WAVE_GROUPS = 3, 8  # WaveMoeTail's batches (MoeTail is faster up to 16 tokens)
WAVE_REGISTERS = 184  # of CONSUMER_REGISTERS for the stash, accumulators and shared packets (ptxas: no spills)


class Plan:
    """Static partition of one rank's up projection [N, L] over clusters, CTAs and warps:
    one CTA per SM, all clusters co-resident, the rest of shared memory for the weight
    ring (measured: a deep ring beats two CTAs per SM with half the ring each)."""

    def __init__(self, tp: int, shard: int, latent: int, groups: int):
        self.tp, self.shard, self.latent, self.groups = tp, shard, latent, groups
        self.total_tiles = shard // TILE_ROWS
        tokens = 8 * groups
        self.cluster, self.cols = CLUSTER, latent // CLUSTER  # CTAs per cluster, K columns per CTA
        self.xn_words = -(-tokens * self.cols // 512) * 256  # whole KB: the ring after it stays 1024-byte aligned
        self.ss_words = 2 * CLUSTER * tokens  # FP64 sums [k slice][token] (publish mode)
        if self.cols % CHUNK == 0:
            self.partition()
        if self.cols % CHUNK == 0 and self.split:
            slot_words = self.warps * TILES_PER_WARP * TILE_ROWS * CHUNK // 2
            recv_words = CLUSTER * self.split * tokens * self.owned
            barrier_words = 2 * (2 * MAX_DEPTH + 1)  # full and empty per slot, xn in
            room = SMEM_BYTES // 4 - self.xn_words - self.ss_words - barrier_words - 256 - 64  # 1024-byte alignment
            self.depth = min(self.warp_chunks, MAX_DEPTH, room // slot_words)
            # chunks the MMA warps hold in registers (32 per lane each) beside the accumulators
            # and B fragments (12 per token group)
            self.stash = min(self.depth, max(0, (STASH_REGISTERS - 12 * groups) // 32))
            self.slot_bytes = 4 * slot_words
            # The partial sums land beside the ring where they fit (B <= 8 at TP1): no wait for
            # the cluster's rings to drain. Else over xn and the ring, once every CTA is done.
            self.receive_words = recv_words if recv_words <= room - self.depth * slot_words else 0
            self.ring_words = self.depth * slot_words
            if not self.receive_words:
                self.ring_words = max(self.ring_words, recv_words - self.xn_words)
            if self.depth >= min(MIN_DEPTH, self.warp_chunks) and self.ring_words <= room:
                return
        raise ValueError(f"the tail does not fit shared memory at TP{tp}, {tokens} tokens")

    def partition(self) -> None:
        self.chunks = self.cols // CHUNK
        multiple = max(TILES_PER_WARP, CLUSTER // 2)  # whole warps, 8-row owner packets
        per_cluster = -(-self.total_tiles // ONE_WAVE_CLUSTERS)
        self.tiles = -(-per_cluster // multiple) * multiple
        self.clusters = -(-self.total_tiles // self.tiles)
        self.rows = TILE_ROWS * self.tiles  # of a cluster: every CTA's TMA box is rows × CHUNK
        row_groups = self.tiles // TILES_PER_WARP
        self.split = max(
            (s for s in range(1, self.chunks + 1) if self.chunks % s == 0 and row_groups * s <= MAX_WARPS), default=0
        )
        self.warps = row_groups * self.split
        self.threads = 32 * self.warps
        self.warp_chunks = self.chunks // self.split
        self.owned = TILE_ROWS * self.tiles // CLUSTER  # output rows per CTA
        # owner packets per thread: 8 · groups tokens of owned / 8 packets each
        self.finish_rounds = -(-self.groups * self.owned // self.threads)
        self.tokens_per_pass = max(1, 4 // self.tp)  # latent loads in flight per lane: 16 × this
        self.packets = self.cols // 8  # 8-column packets of the CTA's K slice
        self.rounds = -(-self.packets // 32)  # of them per lane
        # a pass's rounds: at most LATENT_LOADS packets in flight per lane (TP16 polled all 64
        # at once: ptxas fell back to 32 registers and 7 KB of spills)
        self.rounds_per_pass = max(1, min(self.rounds, LATENT_LOADS // self.tp))

    # The shared-memory layouts, in 16-byte pieces (kernel and CPU layout test alike): rows
    # of 128 bytes in TMA's 128-byte swizzle (``swizzled``).

    def ring_piece(self, slot, sub, row, piece):
        """Piece ``piece`` (columns 8·piece..+7 of the slot's chunk) of CTA row ``row`` for
        the warps of K part ``sub``: [slot][sub][row], as TMA stores the box."""
        return swizzled((slot * self.split + sub) * self.rows, row, piece)

    def xn_piece(self, chunk, token, piece):
        """Piece ``piece`` of K chunk ``chunk`` (of the CTA's slice) of ``token``: [chunk][token]."""
        return swizzled(chunk * 8 * self.groups, token, piece)

    def a_piece(self, slot, sub, row_group, p, k16, lane):
        """``lane``'s ldmatrix.x4 row for the A fragment of tile ``p`` (of the warp's row
        group), k16 step ``k16`` of the slot: row l % 16, columns 8 · (l // 16).. of the step
        (matrices: rows 0-7 | 8-15 × columns 0-7 | 8-15, registers a0..a3)."""
        row = (row_group * TILES_PER_WARP + p) * TILE_ROWS + lane % 16
        return self.ring_piece(slot, sub, row, 2 * k16 + lane // 16)

    def b_piece(self, chunk, group, pair, lane):
        """``lane``'s ldmatrix.x4 row for the B fragments of token group ``group``, k16 steps
        2·pair and 2·pair + 1 of ``chunk``: token l % 8, piece 4·pair + l // 8 (registers b0,
        b1 of the first step, then of the second)."""
        return self.xn_piece(chunk, 8 * group + lane % 8, 4 * pair + lane // 8)

    def ss_slot(self, k_slice, token):
        """The FP64 word of ``token``'s Σ latent² over K slice ``k_slice``."""
        return k_slice * 8 * self.groups + token


class Values:
    """A DSL value made of the attributes named in ``DYNAMIC`` (their runtime parts travel
    through dynamic ifs and loops); the other attributes ride along as Python values."""

    DYNAMIC: tuple = ()

    def __extract_mlir_values__(self):
        return [v for name in self.DYNAMIC for v in cutlass.extract_mlir_values(getattr(self, name))]

    def __new_from_mlir_values__(self, values):
        new, at = copy.copy(self), 0
        for name in self.DYNAMIC:
            n = len(cutlass.extract_mlir_values(getattr(self, name)))
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[at:at + n]))
            at += n
        return new


class Stamps(Values):
    """The functional tails' phase clock for benchmarks/profile_tail.py (compiled out unless
    ``on``): thread 0 of each CTA stores (%globaltimer, %clock64) of phase k at int64 pair
    [cta][k] of the buffer that comes in as the error word (MoeTail) or stamps
    (WaveMoeTail: "latent" is its first xn chunk in, the slots its warpgroup 0's)."""

    PHASES = ("start", "waited", "latent", "clustered", "normed", "first slot", "refilled slot", "last slot",
              "projected", "ring free", "scattered", "end")

    DYNAMIC = ("buffer", "cta", "tid")

    def __init__(self, on: bool, buffer: cute.Tensor, cta, tid):
        self.on, self.buffer, self.cta, self.tid = on, buffer, cta, tid

    @cute.jit
    def at(self, phase: cutlass.Constexpr):
        if cutlass.const_expr(self.on):
            if self.tid == 0:
                address = self.buffer.iterator + (self.cta * len(self.PHASES) + self.PHASES.index(phase)) * 4
                cute.arch.inline_ptx("st.global.v2.b64 [{$r0}], { {$r1}, {$r2} };",
                                     read_only_args=[address, cute.arch.globaltimer(), cute.arch.clock64()])

    @cute.jit
    def slot(self, i, first: cutlass.Constexpr[int], depth: cutlass.Constexpr[int], chunks: cutlass.Constexpr[int]):
        """Ring slots: the projection's first (past the stash), the first refilled one and
        the last, once they landed."""
        if cutlass.const_expr(self.on):
            if i == first:
                self.at("first slot")
            if i == depth:
                self.at("refilled slot")
            if i == chunks - 1:
                self.at("last slot")


class TailFront:
    """The publish half: partial = BF16(Σ_r row_r · w_r) per (token, packet), stored as
    source ``rank`` of every rank's latent box (the tail sums the sources, then normalizes)."""

    def __init__(self, latent: int, tp: int):
        self.latent, self.tp = latent, tp
        self.packets = latent // 8

    @cute.jit
    def __call__(self, expanded: cute.Tensor, weights: cute.Tensor, peers: cute.Tensor, row0: Int32, stream):
        grid = [expanded.shape[0], -(-self.packets // FRONT_PACKETS)]
        launch(self.kernel(expanded, weights, peers, row0), grid, stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, expanded: cute.Tensor, weights: cute.Tensor, peers: cute.Tensor, row0: Int32):
        """``peers``: the latent boxes' base addresses, written at row ``row0 + token`` of
        rows of L."""
        tid, _, _ = cute.arch.thread_idx()
        token, part, _ = cute.arch.block_idx()
        packet = part * FRONT_PACKETS + tid
        # Release at once: our dependent (MoeTail) only prefetches weights before it waits
        # for us, and we wait for our predecessor before anything else.
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        if packet < self.packets:
            acc = weighted_rows(expanded, weights, token, packet * 8)
            words = [pack_bf16(acc[i], acc[i + 1]) for i in range(0, 8, 2)]
            store_to_peers(peers, self.tp, (Int64(row0 + token) * self.latent + packet * 8) * 2, words)


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
        self.launch_rows(self.kernel(expanded, weights, gamma, rows, eps), rows, stream)

    def launch_rows(self, kernel, rows, stream):
        """One CTA per row of ``rows``."""
        # min_blocks_per_mp sets ptxas's register target: 1 keeps a thread's 16 row loads in
        # flight (107 registers; unset, 40 kept ~2), 2 about 9 (72). The carveout attribute
        # lets a multi-CTA target compile without a device.
        kernel.launch(
            grid=[rows.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True,
            min_blocks_per_mp=self.per_sm, preferred_smem_carveout=-1,
        )

    @cute.kernel
    def kernel(self, expanded: cute.Tensor, weights: cute.Tensor, gamma: cute.Tensor, rows: cute.Tensor,
               eps: Float32):
        token, _, _ = cute.arch.block_idx()
        columns, scale = self.gamma_packets(gamma)
        # Release at once: our dependent (MoeTail) only prefetches weights before it waits.
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
    error word), and the previous MoE layer's parity re-armed over the grid. Its loads
    are TP packets per thread, in flight at any register target: two CTAs per SM."""

    def __init__(self, latent: int, tp: int):
        super().__init__(latent, per_sm=2)
        self.tp = tp

    @cute.jit
    def __call__(self, latent_box: cute.Tensor, shared_box: cute.Tensor, gamma: cute.Tensor, rows: cute.Tensor,
                 error: cute.Tensor, eps: Float32, parity: Int32, rearm_parity: Int32, rearm_batch: Int32, stream):
        self.launch_rows(self.kernel(latent_box, shared_box, gamma, rows, error, eps, parity, rearm_parity,
                                     rearm_batch), rows, stream)

    @cute.kernel
    def kernel(self, latent_box: cute.Tensor, shared_box: cute.Tensor, gamma: cute.Tensor, rows: cute.Tensor,
               error: cute.Tensor, eps: Float32, parity: Int32, rearm_parity: Int32, rearm_batch: Int32):
        tid, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        columns, scale = self.gamma_packets(gamma)
        # Release at once: the wave only streams weights before it waits for us.
        cute.arch.griddepcontrol_launch_dependents()
        rearm_previous(latent_box, shared_box, self.tp, rearm_parity, rearm_batch,
                       token * self.threads + tid, rows.shape[0] * self.threads)
        first_row = (parity * self.tp) * latent_box.shape[2] + token
        polled = poll_all([latent_box.iterator + (first_row + source * latent_box.shape[2]) * self.latent + column
                           for column in columns for source in range(self.tp)], error, LATENT_POLL)
        self.store_normed(rank_sums(polled, self.tp), scale, rows, token, eps)


class MoeTail:
    """latent → RMSNorm → up projection + shared, one rank's N rows (see the module doc)."""

    def __init__(self, plan: Plan, publish: bool, stamps: bool = False):
        self.plan, self.publish, self.stamps = plan, publish, stamps
        # chunks held in registers (MoeTail.stash): functional mode only, publish mode's polls
        # already take the registers (162-168 per lane at TP1-2)
        self.stashed = 0 if publish else plan.stash

    @cute.jit
    def __call__(self, latent: cute.Tensor, shared: cute.Tensor, gamma: cute.Tensor, w_up: cute.Tensor,
                 out: cute.Tensor, peers: cute.Tensor, error: cute.Tensor, eps: Float32, batch: Int32, parity: Int32,
                 rank: Int32, rearm_parity: Int32, rearm_batch: Int32, stream):
        """Functional: ``latent`` NormFront's normalized rows [B, L], ``shared`` and ``out``
        [B, N]. Publish mode: ``latent``
        and ``shared`` are the boxes [3, TP, CAP, L or N], ``peers`` the output boxes' base
        addresses, ``error`` the poll error word."""
        plan = self.plan
        # w_up's TMA descriptor (a kernel parameter): boxes of a cluster's rows × CHUNK columns
        weight_copy, weight_boxes = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w_up, self.ring_layout(1), (plan.rows, CHUNK)
        )
        self.kernel(latent, shared, gamma, weight_copy, weight_boxes, out, peers, error, eps, batch, parity,
                    rank, rearm_parity, rearm_batch).launch(
            grid=[plan.clusters * plan.cluster, 1, 1], block=[plan.threads + 32, 1, 1], cluster=[plan.cluster, 1, 1],
            stream=stream, use_pdl=True,
        )

    def ring_layout(self, stages):
        """``stages`` ring boxes of rows × CHUNK BF16 in the 128-byte swizzle (Plan.ring_piece)."""
        return swizzled_stages(self.plan.rows, stages)

    @cute.kernel
    def kernel(self, latent: cute.Tensor, shared: cute.Tensor, gamma: cute.Tensor, weight_copy: cute.CopyAtom,
               weight_boxes: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, error: cute.Tensor, eps: Float32,
               batch: Int32, parity: Int32, rank: Int32, rearm_parity: Int32, rearm_batch: Int32):
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        k_slice, cluster = cta % plan.cluster, cta // plan.cluster
        stamp = Stamps(self.stamps, error, cta, tid)
        stamp.at("start")
        smem = SmemAllocator()
        ss = smem.allocate_tensor(Float64, cute.make_layout(plan.ss_words // 2), 16).iterator
        # mbarriers: full and empty per slot; xn in (every MMA warp's loads back)
        full = smem.allocate_tensor(Int64, cute.make_layout(2 * plan.depth + 1), 16).iterator
        empty = full + plan.depth
        fronted = full + 2 * plan.depth
        # [xn | ring]; after the projection the cluster's partial sums land over both.
        xn = smem.allocate_tensor(Uint32, cute.make_layout(plan.xn_words), 1024).iterator
        stages = self.ring_layout(plan.depth * plan.split)
        boxes = smem.allocate_tensor(BFloat16, stages.outer, 1024, swizzle=stages.inner)
        if cutlass.const_expr(plan.ring_words > plan.depth * plan.slot_bytes // 4):
            smem.allocate_tensor(Uint32, cute.make_layout(plan.ring_words - plan.depth * plan.slot_bytes // 4), 4)
        ring = xn + plan.xn_words  # the boxes as 32-bit words (the allocator packs them right after xn)
        received = xn  # the cluster's partial sums: over xn and the ring, or beside them
        if cutlass.const_expr(plan.receive_words):
            received = smem.allocate_tensor(Uint32, cute.make_layout(plan.receive_words), 16).iterator

        if tid == 0:
            for slot in cutlass.range_constexpr(plan.depth):
                cute.arch.mbarrier_init(full + slot, 1)  # the producer's expect_tx
                cute.arch.mbarrier_init(empty + slot, plan.warps)  # every MMA warp has read the slot
            cute.arch.mbarrier_init(fronted, plan.warps)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # the barriers are initialized
        cute.arch.cluster_arrive_relaxed()  # DSMEM needs every CTA of the cluster started

        if warp == plan.warps:
            # The producer warp: weights from launch on, never waiting for our predecessor.
            # The cluster barriers after the start (latent ready in publish mode, ring free
            # unless the sums land beside it, sums landed) need nothing from it: it arrives
            # at the first before producing, so the MMA warps never wait on it.
            cute.arch.cluster_wait()
            if cutlass.const_expr(self.publish):
                cute.arch.cluster_arrive()
            box_in, box_out = self.partition_boxes(weight_copy, weight_boxes, boxes)
            self.produce(weight_copy, box_in, box_out, full, empty, fronted, cluster, k_slice, lane)
            if cutlass.const_expr(self.publish):
                cute.arch.cluster_wait()
            for _ in cutlass.range_constexpr(1 if plan.receive_words else 2):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
        else:
            row_group, sub = warp // plan.split, warp % plan.split
            tile = cluster * plan.tiles + row_group * TILES_PER_WARP
            scale = self.load_gamma(gamma, k_slice, lane) if self.publish else None
            stashed = self.stash(ring, full, empty, row_group, sub, lane)
            if cutlass.const_expr(self.publish):
                rearm_previous(latent, shared, plan.tp, rearm_parity, rearm_batch, cta * plan.threads + tid,
                               plan.clusters * plan.cluster * plan.threads)
            else:
                cute.arch.griddepcontrol_wait()
            stamp.at("waited")
            cute.arch.cluster_wait()  # the peers have started: DSMEM stores are safe
            shared_rows = None
            if cutlass.const_expr(self.publish):
                self.load_latent(latent, xn, ss, error, batch, parity, k_slice, warp, lane)
            else:
                self.load_normed(latent, xn, batch, k_slice, tid)
                shared_rows = self.load_shared_rows(shared, batch, cluster, k_slice, tid)
            cute.arch.sync_warp()
            cute.arch.griddepcontrol_launch_dependents()  # the CTA's release (module doc, step 4)
            if lane == 0:
                cute.arch.mbarrier_arrive(fronted)  # the warp's loads are back
            stamp.at("latent")
            if cutlass.const_expr(self.publish):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                stamp.at("clustered")
                self.normalize(xn, ss, scale, eps, batch, warp, lane)
                stamp.at("normed")
            cute.arch.barrier(barrier_id=1, number_of_threads=plan.threads)  # xn complete (MMA warps only)

            acc = self.project(stashed, xn, ring, full, empty, row_group, sub, lane, stamp)
            stamp.at("projected")

            if cutlass.const_expr(not plan.receive_words):
                cute.arch.cluster_arrive()  # every CTA is done with its ring: it becomes the receive buffer
                cute.arch.cluster_wait()
                stamp.at("ring free")
            self.scatter(acc, received, batch, tile, k_slice * plan.split + sub, lane)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            stamp.at("scattered")
            self.finish(received, shared, shared_rows, out, peers, error, batch, parity, rank, cluster, k_slice, tid)
            stamp.at("end")

    @cute.jit
    def partition_boxes(self, weight_copy, weight_boxes, boxes):
        """(ring stages, w_up boxes [cluster row block, column chunk]) for the TMA copies."""
        plan = self.plan
        return cpasync.tma_partition(
            weight_copy, 0, cute.make_layout(1), cute.group_modes(boxes, 0, 2),
            cute.group_modes(cute.local_tile(weight_boxes, (plan.rows, CHUNK), (None, None)), 0, 2),
        )

    @cute.jit
    def produce(self, weight_copy, box_in, box_out, full, empty, fronted, cluster, k_slice, lane):
        """Every chunk through the ring, evict-first: a slot is refilled once every MMA warp
        has read it, at the pace ``pace`` sets."""
        plan = self.plan
        evict_first = l2_evict_first()
        for i in cutlass.range(plan.warp_chunks, unroll=1):
            slot = i % plan.depth
            released(empty, i, plan.depth)
            if i >= PACE:
                self.pace(i, full, fronted)
            expect(full, slot, plan.slot_bytes, lane)
            for sub in cutlass.range_constexpr(plan.split):  # the copy elects its lane
                chunk = k_slice * plan.chunks + sub * plan.warp_chunks + i
                cute.copy(weight_copy, box_out[(None, cluster, chunk)], box_in[(None, slot * plan.split + sub)],
                          tma_bar_ptr=full + slot, cache_policy=evict_first)

    @cute.jit
    def pace(self, i, full, fronted):
        """Before chunk ``i``: ``paced``; publish mode paces its first fill only (its polls
        wait for the peers, not for the stream)."""
        if cutlass.const_expr(self.publish):
            if i < self.plan.depth:
                landed(full, i - PACE, self.plan.depth)
        else:
            paced(i, PACE, self.plan.depth, full, fronted)

    @cute.jit
    def load_latent(self, latent, xn, ss, error, batch, parity, k_slice, warp, lane):
        """Publish mode: latent = BF16(Σ sources, rank order) of this CTA's K slice into
        ``xn``, polled from the latent boxes; each token's Σ BF16(latent²) over the slice
        into slot ``k_slice`` of every CTA's ss. A warp per token, ``tokens_per_pass``
        tokens' polls in flight at once, ``rounds_per_pass`` rounds of them."""
        plan = self.plan
        packets, sources = plan.packets, plan.tp
        per_pass, pass_rounds = plan.tokens_per_pass, plan.rounds_per_pass
        for base in cutlass.range(warp, batch, plan.warps * per_pass, unroll=1):
            squares = cute.make_rmem_tensor((per_pass,), Float64)  # per token, over the passes
            for u in cutlass.range_constexpr(per_pass):
                squares[u] = Float64(0.0)
            for first in cutlass.range_constexpr(0, plan.rounds, pass_rounds):
                addresses = []
                for u in cutlass.range_constexpr(per_pass):
                    token = clamp(base + u * plan.warps, batch - 1)  # past the batch: read a valid row, unused
                    for q in cutlass.range_constexpr(first, first + pass_rounds):
                        column = k_slice * plan.cols + clamp(lane + 32 * q, packets - 1) * 8
                        for source in cutlass.range_constexpr(sources):
                            row = (parity * plan.tp + source) * latent.shape[2] + token
                            addresses.append(latent.iterator + row * plan.latent + column)
                packets_in = poll_all(addresses, error, LATENT_POLL)
                for u in cutlass.range_constexpr(per_pass):
                    token = base + u * plan.warps
                    for q in cutlass.range_constexpr(first, first + pass_rounds):
                        packet, at = lane + 32 * q, (u * pass_rounds + q - first) * sources
                        rounded = rank_sums(packets_in[at:at + sources], sources)[0]
                        if (packet < packets) & (token < batch):
                            squares[u] += sum_of_squares(rounded)
                            words = [pack_bf16(rounded[i], rounded[i + 1]) for i in range(0, 8, 2)]
                            store_shared(xn + self.xn_packet(token, packet) * 4, words)
                    if cutlass.const_expr(first + pass_rounds >= plan.rounds):  # the token's last pass
                        total = butterfly_sum(squares[u], 32)
                        if (lane < plan.cluster) & (token < batch):
                            store_cluster(ss + self.plan.ss_slot(k_slice, token), total, lane)

    @cute.jit
    def load_normed(self, rows, xn, batch, k_slice, tid):
        """This CTA's K slice of NormFront's xn rows into ``xn``: 16-byte cp.async copies,
        all in flight at once."""
        plan = self.plan
        for item in cutlass.range(tid, batch * plan.packets, plan.threads, unroll=1):
            token, packet = item // plan.packets, item % plan.packets
            copy_async(xn + self.xn_packet(token, packet) * 4,
                       rows.iterator + token * rows.stride[0] + k_slice * plan.cols + packet * 8)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def load_gamma(self, gamma, k_slice, lane):
        """The lane's gamma packets of the K slice (a weight: loaded before the wait)."""
        plan = self.plan
        packets, rounds = plan.packets, plan.rounds
        return [unpack_words(load_words(gamma.iterator + k_slice * plan.cols + clamp(lane + 32 * q, packets - 1) * 8))
                for q in range(rounds)]

    @cute.jit
    def normalize(self, xn, ss, scale, eps, batch, warp, lane):
        """Publish mode: xn = BF16((latent · inv) · gamma) in place, inv from the cluster's ss."""
        plan = self.plan
        packets, rounds = plan.packets, plan.rounds
        for token in cutlass.range(warp, batch, plan.warps, unroll=1):
            # every CLUSTER lanes hold the K slices' sums; any order is exact
            total = butterfly_sum(ss[self.plan.ss_slot(lane % CLUSTER, token)], CLUSTER)
            inv = inverse_rms(total, plan.latent, eps)
            for q in cutlass.range_constexpr(rounds):
                packet = lane + 32 * q
                if packet < packets:
                    address = xn + self.xn_packet(token, packet) * 4
                    store_shared(address, normalized(unpack_words(load_shared(address)), inv, scale[q]))

    def xn_packet(self, token, packet):
        """The piece of xn holding 8-column ``packet`` of ``token``."""
        return self.plan.xn_piece(packet // 8, token, packet % 8)

    @cute.jit
    def stash(self, ring, full, empty, row_group, sub, lane):
        """The A fragments of the first ``self.stashed`` chunks, taken into registers as soon
        as they land and their slots handed back, so that the ring refills while we wait
        for our predecessor: the registers deepen the ring."""
        stashed = []
        for i in cutlass.range_constexpr(self.stashed):
            landed(full, i, self.plan.depth)
            stashed.append(self.a_fragments(ring, i, sub, row_group, lane))
            release(empty + i, lane)
        return stashed

    @cute.jit
    def project(self, stashed, xn, ring, full, empty, row_group, sub, lane, stamp):
        """The warp's two tiles × all token groups over its chunks, FP32 accumulators in
        the m16n8 C layout: acc[p, n, 2h + e] = (row 8h + g of tile p, token 8n + 2t + e).
        The stashed chunks first, then the ring's; each warp tells the producer when it has
        read a slot."""
        plan = self.plan
        acc = cute.make_rmem_tensor((TILES_PER_WARP, plan.groups, 4), Float32)
        for p in cutlass.range_constexpr(TILES_PER_WARP):
            for n in cutlass.range_constexpr(plan.groups):
                for e in cutlass.range_constexpr(4):
                    acc[p, n, e] = Float32(0.0)
        for i in cutlass.range_constexpr(self.stashed):
            self.multiply(acc, stashed[i], xn, sub * plan.warp_chunks + i, lane)
        for i in cutlass.range(self.stashed, plan.warp_chunks, unroll=1):
            slot = i % plan.depth
            landed(full, i, plan.depth)
            stamp.slot(i, self.stashed, plan.depth, plan.warp_chunks)
            self.multiply(acc, self.a_fragments(ring, slot, sub, row_group, lane), xn, sub * plan.warp_chunks + i, lane)
            release(empty + slot, lane)
        return acc

    @cute.jit
    def a_fragments(self, ring, slot, sub, row_group, lane):
        """A slot's A fragments for the warp, [k16 step][tile] (Plan.a_piece)."""
        return [[load_matrices(ring + self.plan.a_piece(slot, sub, row_group, p, k16, lane) * 4)
                 for p in range(TILES_PER_WARP)] for k16 in range(CHUNK // 16)]

    @cute.jit
    def multiply(self, acc, a, xn, chunk, lane):
        """acc += the chunk's A fragments ``a`` × xn's B fragments (Plan.b_piece)."""
        plan = self.plan
        for pair in cutlass.range_constexpr(CHUNK // 32):
            b = [load_matrices(xn + plan.b_piece(chunk, n, pair, lane) * 4) for n in range(plan.groups)]
            for u in cutlass.range_constexpr(2):
                for n in cutlass.range_constexpr(plan.groups):
                    for p in cutlass.range_constexpr(TILES_PER_WARP):
                        d = mma_bf16(a[2 * pair + u][p], (b[n][2 * u], b[n][2 * u + 1]),
                                     (acc[p, n, 0], acc[p, n, 1], acc[p, n, 2], acc[p, n, 3]))
                        for e in cutlass.range_constexpr(4):
                            acc[p, n, e] = d[e]

    @cute.jit
    def scatter(self, acc, received, batch, tile, part, lane):
        """Each partial sum to its row owner's receive buffer [part][token][owned row]."""
        plan = self.plan
        g, t = lane // 4, lane % 4
        local_tile = tile - (tile // plan.tiles) * plan.tiles
        for p in cutlass.range_constexpr(TILES_PER_WARP):
            for h in cutlass.range_constexpr(2):
                row = (local_tile + p) * TILE_ROWS + 8 * h + g
                owner, index = row // plan.owned, row % plan.owned
                for n in cutlass.range_constexpr(plan.groups):
                    for e in cutlass.range_constexpr(2):
                        token = 8 * n + 2 * t + e
                        if token < batch:
                            word = (part * 8 * plan.groups + token) * plan.owned + index
                            store_cluster(bits_pointer(received, word), acc[p, n, 2 * h + e], owner)

    @cute.jit
    def finish_item(self, round, batch, cluster, k_slice, tid):
        """Owner packet ``round`` of this thread: (token, its first row among our owned rows,
        that row in the shard, whether it is one)."""
        plan = self.plan
        per_token = plan.owned // 8
        item = tid + round * plan.threads
        owned = item % per_token * 8
        row = cluster * plan.tiles * TILE_ROWS + k_slice * plan.owned + owned
        return item // per_token, owned, row, (item < batch * per_token) & (row < plan.shard)

    @cute.jit
    def load_shared_rows(self, shared, batch, cluster, k_slice, tid):
        """Functional mode: the shared expert's packets of this thread's owner packets, loaded
        once our predecessor is done (back long before the sums, off the epilogue's path)."""
        packets = []
        for r in cutlass.range_constexpr(self.plan.finish_rounds):
            token, _, row, _ = self.finish_item(r, batch, cluster, k_slice, tid)
            token, row = clamp(token, batch - 1), clamp(row, self.plan.shard - 8)  # an address to read, unused
            packets.append(load_words(shared.iterator + token * shared.stride[0] + row))
        return packets

    @cute.jit
    def finish(self, received, shared, shared_rows, out, peers, error, batch, parity, rank, cluster, k_slice, tid):
        """Owner epilogue, 8 rows per packet: up = BF16(Σ parts in K order); out =
        BF16(up + shared), shared = ``shared_rows`` (functional) or BF16(Σ reduce-scatter
        sources) (publish mode)."""
        plan = self.plan
        parts = plan.cluster * plan.split
        for r in cutlass.range_constexpr(plan.finish_rounds):
            token, owned, row, valid = self.finish_item(r, batch, cluster, k_slice, tid)
            if valid:
                acc = [Float32(0.0)] * 8
                for part in cutlass.range_constexpr(parts):
                    word = (part * 8 * plan.groups + token) * plan.owned + owned
                    sums = [bits_float(w) for h in range(2) for w in load_shared(received + word + 4 * h)]
                    acc = [acc[i] + sums[i] for i in range(8)]
                up = [Float32(BFloat16(a)) for a in acc]
                if cutlass.const_expr(self.publish):
                    extra = reduced_shared(shared, plan.tp, parity, [(token, row)], error)[0]
                    publish_out(peers, plan.tp, plan.shard, rank, token, row, output_packet(up, extra))
                else:
                    store_words(out.iterator + token * out.stride[0] + row,
                                output_packet(up, unpack_words(shared_rows[r])))


@cute.jit
def rearm_previous(latent_box, shared_box, tp: cutlass.Constexpr[int], rearm_parity, rearm_batch, first, threads):
    """Sentinels over rows [0, rearm_batch) of every source at ``rearm_parity`` of both
    boxes [3, TP, CAP, width], packet ``first`` on in steps of ``threads`` (the previous MoE
    layer's boxes: consumed before we were launched)."""
    for box in (latent_box, shared_box):
        per_row = box.shape[3] // 8
        for item in cutlass.range(first, tp * rearm_batch * per_row, threads, unroll=1):
            source, rest = item // (rearm_batch * per_row), item % (rearm_batch * per_row)
            token, packet = rest // per_row, rest % per_row
            row = (rearm_parity * tp + source) * box.shape[2] + token
            rearm(box.iterator + row * box.shape[3] + packet * 8)


@cute.jit
def reduced_shared(shared_box, tp: cutlass.Constexpr[int], parity, items, error):
    """BF16(Σ of the TP sources' shared reduce-scatter packets, rank order) at each (token,
    row) of ``items``, all polled at once (bounded, into the error word): 8 values each."""
    first = parity * tp * shared_box.shape[2]
    return rank_sums(poll_all([shared_box.iterator + (first + source * shared_box.shape[2] + token)
                               * shared_box.shape[3] + row for token, row in items for source in range(tp)],
                              error, SHARED_POLL), tp)


@cute.jit
def rank_sums(polled, tp: cutlass.Constexpr[int]):
    """Per packet of a mailbox row, its TP sources' words (``polled``, source-minor) summed
    in rank order in FP32 and rounded to BF16: 8 values each (DESIGN §3, moe_tail's
    rounding points 2 and 6)."""
    sums = []
    for u in cutlass.range_constexpr(len(polled) // tp):
        total = [Float32(0.0)] * 8
        for source in cutlass.range_constexpr(tp):
            values = unpack_words(polled[u * tp + source])
            total = [total[i] + values[i] for i in range(8)]
        sums.append([Float32(BFloat16(v)) for v in total])
    return sums


@cute.jit
def publish_out(peers, tp: cutlass.Constexpr[int], shard: cutlass.Constexpr[int], rank, token, row, words):
    """An output packet (``row`` of our shard) to columns [rank · shard, …) of ``token``'s
    row in every rank's output box [1, CAP, H]."""
    store_to_peers(peers, tp, (Int64(token) * shard * tp + rank * shard + row) * 2, words)


class WavePlan:
    """WaveMoeTail's partition (MIN_WAVE_GROUPS token groups on): a CTA
    per WAVE_ROWS rows of the shard over the whole K, so no partial sum crosses CTAs; the
    CTAs of a cluster share each xn chunk (TMA multicast, each loading 1 / WAVE_CLUSTER of
    its tokens)."""

    def __init__(self, shard: int, latent: int, groups: int):
        self.shard, self.latent, self.groups = shard, latent, groups
        # wgmma's N: whole 8-row swizzle atoms per multicasting CTA, and the same count of
        # output packets (WAVE_ROWS / 8 per token) for every consumer thread
        step = math.lcm(8 * WAVE_CLUSTER, 64 * WAVE_WARPS // (WAVE_ROWS // 8))
        self.tokens = -(-8 * groups // step) * step
        self.ctas, self.chunks = shard // WAVE_ROWS, latent // CHUNK
        self.slot_bytes, self.xn_bytes = WAVE_ROWS * CHUNK * 2, self.tokens * CHUNK * 2
        self.xn_depth = XN_BYTES // self.xn_bytes
        room = SMEM_BYTES - 2048 - XN_BYTES  # the barriers take the first KB
        self.depth = min(self.chunks, MAX_WAVE_DEPTH, room // self.slot_bytes)
        # chunks each consumer warpgroup holds in registers (16 per lane each) beside its
        # accumulators (tokens / 2 per set) and shared rows' packets (tokens / 8)
        self.sets = ACCUMULATOR_SETS if self.tokens >= SETS_TOKENS else 1
        self.accumulators = self.sets * self.tokens // 2
        self.stash = min(self.chunks // 2, (WAVE_REGISTERS - self.accumulators - self.tokens // 8) // 16)
        self.packets = self.tokens // 32  # output packets (8 rows of a token) per consumer thread
        if (latent % (2 * CHUNK) or shard % (WAVE_ROWS * WAVE_CLUSTER) or groups > MAX_WAVE_GROUPS
                or self.depth < WAVE_PACE or 8 * (2 * self.depth + 2 * self.xn_depth + 2) > 1024):
            raise ValueError(f"the wave tail does not take N={shard}, L={latent}, {8 * groups} tokens")

    def a_piece(self, slot, warp, k16, lane):
        """``lane``'s ldmatrix.x4 row for warp ``warp``'s A fragment (its 16 of wgmma's 64
        rows, the m16n8k16 A layout), k16 step ``k16`` of weight slot ``slot``."""
        return swizzled(slot * WAVE_ROWS, 16 * warp + lane % 16, 2 * k16 + lane // 16)

    # The epilogue: warpgroup c owns tokens [c·T/2, (c+1)·T/2). Its accumulators
    # acc[4j + r] hold tokens 8j..8j+7 (the m64nN C layout), so n8 blocks j < T/16 are the
    # first half.

    def partial_word(self, writer, j, r, position):
        """The FP32 word where warpgroup ``writer`` hands accumulator r of n8 block j of the
        other half (at consumer ``position``) to its owner: [writer][4j + r][position]."""
        return writer * 32 * self.tokens + (4 * j + r) * 32 * WAVE_WARPS + position

    def packet(self, q, tid):
        """Output packet ``q`` of consumer thread ``tid``: (token, first of its 8 rows), in
        its warpgroup's half of the tokens."""
        item = tid % (32 * WAVE_WARPS) + q * 32 * WAVE_WARPS
        token = tid // (32 * WAVE_WARPS) * (self.tokens // 2) + item // (WAVE_ROWS // 8)
        return token, item % (WAVE_ROWS // 8) * 8


class WaveMoeTail:
    """The one-wave tail from MIN_WAVE_GROUPS token groups on (``tp`` 0: functional, TP1;
    else publish mode, after PollNormFront): xn → up projection + shared on wgmma, a CTA
    per WAVE_ROWS rows over the whole K. MoeTail's K
    split keeps xn resident, which leaves a 3-slot ring at 64 tokens, and reduces the
    partial sums through DSMEM, 3.4 µs there; here no sum crosses a CTA (measured at 64
    tokens: 24.9 → 19.0 µs per call; at 32: 19.4 → 18.8; at 16 MoeTail stays ahead,
    16.0 against 18.9).

    1. A producer warp streams the CTA's w_up rows through a ring of ``depth`` 8 KB slots
       (TMA, evict-first, ``paced``) from launch on. Two consumer warpgroups take
       alternate chunks; each holds its first ``stash`` chunks in registers as they land
       and hands their slots back (setmaxnreg gives the consumers the producers'
       registers): about 60 % of the weights can be in before xn.
    2. A second producer warp waits for NormFront, then streams xn chunks [tokens, CHUNK]
       through ``xn_depth`` slots: each CTA of the cluster loads 1 / WAVE_CLUSTER of the
       tokens and multicasts it to every CTA (the cluster's L2 reads once), from rows
       padded to ``tokens`` (a box partly out of bounds, zero-filled by TMA, cost 1.4-1.5 µs
       per call at B = 40 / 48). A slot is refilled once the consuming warpgroup of every
       CTA of the cluster has released it.
    3. Each consumer warpgroup runs wgmma m64nNk16 (N = tokens) per K step, the stashed
       chunks' A from registers, the ring's from shared memory, FP32 accumulation in the
       tensor core's order (DESIGN §3.4), into ``sets`` accumulator sets in turn.
    4. Epilogue, each warpgroup owning half the tokens: it hands the other half of its
       sums over through shared memory, adds the other's sums of its half, stages up =
       BF16(Σ) as [token][row] over the drained ring and stores out = BF16(up + shared)
       of its half in 16-byte packets, the shared rows loaded after the wait. Publish
       mode polls them instead, BF16(Σ of the TP sources), and stores out to columns
       [rank·N, …) of every rank's output box.
    The CTA releases its dependents at entry, unlike MoeTail (step 4): a dependent
    launched once every CTA is resident lands on the 20 SMs the grid leaves free; released
    after the last chunk it lands on the SMs of our first CTAs to finish, where the next
    call's clusters would start (measured at 32 tokens: the next call's last cluster
    started 4-6 µs after its first, 0.4-0.6 µs released at entry; per call 17.0 against
    18.6 µs with clusters of 4).
    Past xn the CTA is bound by shared memory: wgmma reads A and B and TMA writes both,
    32 KB per chunk at 64 tokens, 0.14 µs at 128 bytes per clock, as measured."""

    def __init__(self, plan: WavePlan, stamps: bool = False, tp: int = 0):
        self.plan, self.stamps, self.tp = plan, stamps, tp  # tp 0: functional

    @cute.jit
    def __call__(self, normed: cute.Tensor, shared: cute.Tensor, w_up: cute.Tensor, out: cute.Tensor,
                 peers: cute.Tensor, error: cute.Tensor, stamps: cute.Tensor, batch: Int32, parity: Int32,
                 rank: Int32, stream):
        """Functional: ``shared`` and ``out`` [B, N]. Publish mode: ``shared`` the reduce-
        scatter box [3, TP, CAP, N], ``peers`` the output boxes' base addresses, ``error``
        the poll error word (``out`` unused)."""
        plan = self.plan
        weight_copy, weight_boxes = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w_up, swizzled_stages(WAVE_ROWS, 1), (WAVE_ROWS, CHUNK)
        )
        xn_copy, xn_boxes = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp(), normed, swizzled_stages(plan.tokens, 1), (plan.tokens, CHUNK),
            num_multicast=WAVE_CLUSTER,
        )
        self.kernel(weight_copy, weight_boxes, xn_copy, xn_boxes, shared, out, peers, error, stamps, batch, parity,
                    rank).launch(
            grid=[plan.ctas, 1, 1], block=[WAVE_THREADS, 1, 1], cluster=[WAVE_CLUSTER, 1, 1], stream=stream,
            use_pdl=True, min_blocks_per_mp=1,  # ptxas: the registers at entry, for setmaxnreg
        )

    @cute.kernel
    def kernel(self, weight_copy: cute.CopyAtom, weight_boxes: cute.Tensor, xn_copy: cute.CopyAtom,
               xn_boxes: cute.Tensor, shared: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, error: cute.Tensor,
               stamps: cute.Tensor, batch: Int32, parity: Int32, rank: Int32):
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        stamp = Stamps(self.stamps, stamps, cta, tid)
        stamp.at("start")
        outbox = Outbox(peers, error, parity, rank)
        cute.arch.griddepcontrol_launch_dependents()  # see the class doc
        smem = SmemAllocator()
        # mbarriers: full and empty per weight slot and per xn slot; the consumers' wait, xn in
        full = smem.allocate_tensor(Int64, cute.make_layout(2 * plan.depth + 2 * plan.xn_depth + 2), 16).iterator
        empty, xn_full = full + plan.depth, full + 2 * plan.depth
        xn_empty, waited = xn_full + plan.xn_depth, xn_full + 2 * plan.xn_depth
        fronted = waited + 1
        xn = smem.allocate_tensor(Uint32, cute.make_layout(XN_BYTES // 4), 1024).iterator
        ring = smem.allocate_tensor(Uint32, cute.make_layout(plan.depth * plan.slot_bytes // 4), 1024).iterator
        barriers = Barriers(full, empty, xn_full, xn_empty, waited, fronted)

        if tid == 0:
            for slot in cutlass.range_constexpr(plan.depth):
                cute.arch.mbarrier_init(full + slot, 1)  # the producer's expect_tx
                cute.arch.mbarrier_init(empty + slot, WAVE_WARPS)  # the consuming warpgroup's warps
            for slot in cutlass.range_constexpr(plan.xn_depth):
                cute.arch.mbarrier_init(xn_full + slot, 1)  # our producer's expect_tx; the cluster's copies
                cute.arch.mbarrier_init(xn_empty + slot, WAVE_WARPS * WAVE_CLUSTER)  # every CTA's consuming warps
            cute.arch.mbarrier_init(waited, 1)
            cute.arch.mbarrier_init(fronted, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        cute.arch.cluster_arrive_relaxed()  # multicasts and remote arrivals need the cluster's barriers initialized

        if warp >= 2 * WAVE_WARPS:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            cute.arch.cluster_wait()
            if warp == 2 * WAVE_WARPS:
                self.produce_weights(weight_copy, weight_boxes, ring, barriers, cta, lane)
            elif warp == 2 * WAVE_WARPS + 1:
                self.produce_xn(xn_copy, xn_boxes, xn, barriers, cta, lane)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            if warp < WAVE_WARPS:
                self.consume(0, xn, ring, barriers, shared, out, outbox, batch, cta, tid, stamp)
            else:
                self.consume(1, xn, ring, barriers, shared, out, outbox, batch, cta, tid, stamp)
        # No CTA leaves while a peer may still multicast into it or arrive on its barriers.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def produce_weights(self, weight_copy, weight_boxes, ring, barriers, cta, lane):
        """The CTA's rows, chunk by chunk, evict-first, ``paced``."""
        plan = self.plan
        stages = swizzled_stages(WAVE_ROWS, plan.depth)
        box_in, box_out = cpasync.tma_partition(
            weight_copy, 0, cute.make_layout(1),
            cute.group_modes(cute.make_tensor(cute.recast_ptr(ring, stages.inner, dtype=BFloat16), stages.outer), 0, 2),
            cute.group_modes(cute.local_tile(weight_boxes, (WAVE_ROWS, CHUNK), (None, None)), 0, 2),
        )
        evict_first = l2_evict_first()
        for i in cutlass.range(plan.chunks, unroll=1):
            slot = i % plan.depth
            released(barriers.empty, i, plan.depth)
            if i >= WAVE_PACE:
                paced(i, WAVE_PACE, plan.depth, barriers.full, barriers.fronted, barriers.waited)
            expect(barriers.full, slot, plan.slot_bytes, lane)
            cute.copy(weight_copy, box_out[(None, cta, i)], box_in[(None, slot)], tma_bar_ptr=barriers.full + slot,
                      cache_policy=evict_first)

    @cute.jit
    def produce_xn(self, xn_copy, xn_boxes, xn, barriers, cta, lane):
        """Once NormFront is done, our share of each xn chunk's tokens to every CTA of the
        cluster, a slot once all of them have released it."""
        plan = self.plan
        stages = swizzled_stages(plan.tokens, plan.xn_depth)
        box_in, box_out = cpasync.tma_partition(
            xn_copy, cta % WAVE_CLUSTER, cute.make_layout(WAVE_CLUSTER),
            cute.group_modes(cute.make_tensor(cute.recast_ptr(xn, stages.inner, dtype=BFloat16), stages.outer), 0, 2),
            cute.group_modes(cute.local_tile(xn_boxes, (plan.tokens, CHUNK), (None, None)), 0, 2),
        )
        cute.arch.griddepcontrol_wait()
        for i in cutlass.range(plan.chunks, unroll=1):
            slot = i % plan.xn_depth
            released(barriers.xn_empty, i, plan.xn_depth)
            expect(barriers.xn_full, slot, plan.xn_bytes, lane)
            cute.copy(xn_copy, box_out[(None, 0, i)], box_in[(None, slot)], tma_bar_ptr=barriers.xn_full + slot,
                      mcast_mask=Int32((1 << WAVE_CLUSTER) - 1))

    @cute.jit
    def consume(self, group: cutlass.Constexpr[int], xn, ring, barriers, shared, out, outbox, batch, cta, tid,
                stamp):
        """Consumer warpgroup ``group``: chunks group, group + 2, …; then the epilogue."""
        plan = self.plan
        warp, lane = tid // 32 % WAVE_WARPS, tid % 32
        stashed = []
        for j in cutlass.range_constexpr(plan.stash):
            slot = (2 * j + group) % plan.depth
            landed(barriers.full, 2 * j + group, plan.depth)
            stashed.append(self.a_fragments(ring, slot, warp, lane))
            release(barriers.empty + slot, lane)
        cute.arch.griddepcontrol_wait()
        if tid == 0:
            cute.arch.mbarrier_arrive(barriers.waited)  # after the stash: the stream's pace lets it land
        stamp.at("waited")
        shared_rows = self.shared_rows(shared, outbox, batch, cta, tid)
        cute.arch.cluster_wait()
        acc = self.project(group, stashed, xn, ring, barriers, warp, lane, stamp)
        stamp.at("projected")
        # Both warpgroups' wgmmas are done: the ring is free for the epilogue. Each warpgroup
        # owns half the tokens: it hands the other half of its sums over, adds the other's
        # sums of its half, stages up = BF16(Σ) and stores its half.
        cute.arch.barrier(barrier_id=1, number_of_threads=64 * WAVE_WARPS)
        partial = cute.recast_ptr(ring, dtype=Float32)
        position = tid % (32 * WAVE_WARPS)  # the same accumulator in both warpgroups
        half = plan.tokens // 16  # n8 blocks per half: acc[4j..4j+3] holds tokens 8j..8j+7
        for j in cutlass.range_constexpr(half):
            for r in cutlass.range_constexpr(4):
                k = 4 * ((1 - group) * half + j) + r  # the other warpgroup's half
                partial[plan.partial_word(group, j, r, position)] = acc[k]
        cute.arch.barrier(barrier_id=1, number_of_threads=64 * WAVE_WARPS)
        staging = cute.make_tensor(cute.recast_ptr(ring + plan.tokens * WAVE_ROWS, dtype=BFloat16),
                                   cute.make_layout((plan.tokens, WAVE_ROWS), stride=(WAVE_ROWS, 1)))
        g, t = lane // 4, lane % 4
        for j in cutlass.range_constexpr(half):
            for h in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    k = 4 * (group * half + j) + 2 * h + e
                    total = acc[k] + partial[plan.partial_word(1 - group, j, 2 * h + e, position)]
                    staging[8 * (group * half + j) + 2 * t + e, 16 * warp + 8 * h + g] = BFloat16(total)
        cute.arch.barrier(barrier_id=2 + group, number_of_threads=32 * WAVE_WARPS)  # our half is staged
        for q in cutlass.range_constexpr(plan.packets):
            token, row = plan.packet(q, tid)
            if token < batch:
                up = unpack_words(load_shared(staging.iterator.toint() + (token * WAVE_ROWS + row) * 2))
                words, column = output_packet(up, unpack_words(shared_rows[q])), cta * WAVE_ROWS + row
                if cutlass.const_expr(self.tp):
                    publish_out(outbox.peers, self.tp, plan.shard, outbox.rank, token, column, words)
                else:
                    store_words(out.iterator + token * out.stride[0] + column, words)
        stamp.at("end")

    @cute.jit
    def shared_rows(self, shared, outbox, batch, cta, tid):
        """The shared expert's packets of the thread's output packets as BF16x2 words, once
        our predecessor is done (off the epilogue's path): loaded (functional), or BF16(Σ
        of the TP sources) polled from the reduce-scatter box (publish mode; each rank
        pushes them before it publishes the latent our front polled)."""
        plan = self.plan
        items = [plan.packet(q, tid) for q in range(plan.packets)]
        items = [(clamp(token, batch - 1), cta * WAVE_ROWS + row) for token, row in items]  # past the batch: unused
        if cutlass.const_expr(self.tp):
            reduced = reduced_shared(shared, self.tp, outbox.parity, items, outbox.error)
            return [[pack_bf16(v[i], v[i + 1]) for i in range(0, 8, 2)] for v in reduced]
        return [load_words(shared.iterator + token * shared.stride[0] + column) for token, column in items]

    @cute.jit
    def a_fragments(self, ring, slot, warp, lane):
        """The warp's A fragments of a slot per k16 step (WavePlan.a_piece)."""
        return [load_matrices(ring + self.plan.a_piece(slot, warp, k16, lane) * 4) for k16 in range(CHUNK // 16)]

    @cute.jit
    def project(self, group: cutlass.Constexpr[int], stashed, xn, ring, barriers, warp, lane, stamp):
        """acc[4j + 2h + e] = (row 16·warp + 8h + g, token 8j + 2t + e) over the warpgroup's
        chunks, the stashed ones first, chunk j of the warpgroup into set j % sets, the sets
        summed in order; a chunk's slots go back once its wgmmas are done."""
        plan = self.plan
        acc = cute.make_rmem_tensor((plan.accumulators,), Float32)
        zeros = pinned([Float32(0.0)] * plan.accumulators)  # set before the first wgmma.fence
        for k in cutlass.range_constexpr(plan.accumulators):
            acc[k] = zeros[k]
        # Unrolled: across a loop's back edge with a chunk in flight ptxas serializes the
        # wgmmas (C7514).
        for j in cutlass.range_constexpr(plan.chunks // 2):
            i = 2 * j + group
            if cutlass.const_expr(j < plan.stash):
                a = stashed[j]
            else:
                slot = i % plan.depth
                landed(barriers.full, i, plan.depth)
                stamp.slot(i, 2 * plan.stash, plan.depth, plan.chunks - 1)  # warpgroup 0: even chunks
                a = [descriptor(ring.toint() + slot * plan.slot_bytes + 32 * k16) for k16 in range(CHUNK // 16)]
            landed(barriers.xn_full, i, plan.xn_depth)
            if cutlass.const_expr(i == 0):
                stamp.at("latent")
                if (warp == 0) & (lane == 0):
                    cute.arch.mbarrier_arrive(barriers.fronted)
            self.multiply(acc, j % plan.sets * (plan.tokens // 2), a, xn, i)
            if cutlass.const_expr(j >= WGMMA_PENDING):
                self.retire(i - 2 * WGMMA_PENDING, barriers, lane)
        warpgroup.wait_group(0)
        sets = pinned([acc[k] for k in range(plan.accumulators)])
        return [functools.reduce(operator.add, sets[k::plan.tokens // 2]) for k in range(plan.tokens // 2)]

    @cute.jit
    def multiply(self, acc, first: cutlass.Constexpr[int], a, xn, i):
        """acc[first, first + tokens / 2) += chunk ``i``'s A (four k16 steps: registers or
        descriptors) × its xn slot."""
        base = xn.toint() + (i % self.plan.xn_depth) * self.plan.xn_bytes
        n = self.plan.tokens // 2
        warpgroup.fence()
        for k16 in cutlass.range_constexpr(CHUNK // 16):
            d = wgmma_bf16([acc[first + k] for k in range(n)], a[k16], descriptor(base + 32 * k16))
            for k in cutlass.range_constexpr(n):
                acc[first + k] = d[k]
        warpgroup.commit_group()
        warpgroup.wait_group(WGMMA_PENDING)  # the warpgroup's chunk WGMMA_PENDING back is done

    @cute.jit
    def retire(self, i, barriers, lane):
        """Chunk ``i``'s wgmmas are done: its xn slot back to every producer of the cluster,
        its weight slot (unless stashed: handed back already) to ours."""
        cute.arch.sync_warp()
        if lane < WAVE_CLUSTER:
            cute.arch.mbarrier_arrive(barriers.xn_empty + i % self.plan.xn_depth, lane)
        if cutlass.const_expr(i >= 2 * self.plan.stash):
            if lane == 0:
                cute.arch.mbarrier_arrive(barriers.empty + i % self.plan.depth)


class Outbox(Values):
    """WaveMoeTail's publish side: the output boxes' base addresses, the poll error word,
    the mailbox parity and our rank (placeholders in functional mode)."""

    DYNAMIC = ("peers", "error", "parity", "rank")

    def __init__(self, peers, error, parity, rank):
        self.peers, self.error, self.parity, self.rank = peers, error, parity, rank


class Barriers(Values):
    """WaveMoeTail's mbarriers (shared-memory pointers)."""

    DYNAMIC = ("full", "empty", "xn_full", "xn_empty", "waited", "fronted")

    def __init__(self, *pointers):
        for name, pointer in zip(self.DYNAMIC, pointers):
            setattr(self, name, pointer)


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


@cute.jit
def sum_of_squares(values):
    """Σ BF16(v²) in FP64: exact for BF16 squares, so any order gives the same sum."""
    total = Float64(0.0)
    for v in values:
        total += Float64(Float32(BFloat16(v * v)))
    return total


@cute.jit
def output_packet(up, extra):
    """A packet of out = BF16(up + shared) (8 FP32 values each) as four BF16x2 words."""
    return [pack_bf16(up[i] + extra[i], up[i + 1] + extra[i + 1]) for i in range(0, 8, 2)]


def bits_pointer(words, index):
    """Word ``index`` of a Uint32 shared buffer as an FP32 pointer."""
    return cute.recast_ptr(words + index, dtype=Float32)


@cute.jit
def load_matrices(address):
    """ldmatrix.x4: lane l gives the address of row l % 8 of 8x8 matrix l // 8 (16 bytes);
    lane (g, t) receives the BF16 pair (row g, columns 2t, 2t + 1) of each matrix."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[address],
    )


@cute.jit
def mma_bf16(a, b, c):
    """D = A·B + C, mma.sync m16n8k16, BF16 inputs, FP32 accumulators."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { {$w0}, {$w1}, {$w2}, {$w3} },"
        " { {$r0}, {$r1}, {$r2}, {$r3} }, { {$r4}, {$r5} }, { {$r6}, {$r7}, {$r8}, {$r9} };",
        write_only_types=[Float32] * 4, read_only_args=[*a, *b, *c],
    )


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
        cute.arch.griddepcontrol_wait()
        if column < self.hidden:
            words = load_words(shared.iterator + token * shared.stride[0] + column)
            destination, own = column // self.shard, column % self.shard
            offset = (Int64(row0 + token) * self.shard + own) * 2
            store_words(Int64(peers[destination]) + offset, [no_neg_zero(w) for w in words], mailbox=True)
        cute.arch.griddepcontrol_launch_dependents()


def groups_of(batch: int) -> int:
    """8-token MMA groups (the N of m16n8k16) a batch needs: the compile key."""
    return -(-batch // 8)


@compiled
def compile_front(latent: int, tp: int):
    batch = cute.sym_int()
    return cute.compile(
        TailFront(latent, tp), fake(BFloat16, (batch, TOP_K, latent)), fake(BFloat16, (batch, TOP_K), align=2),
        fake(Int64, (tp,), align=8), Int32(0), fake_stream(), options=compile_options(),
    )


@compiled
def compile_norm_front(latent: int, per_sm: int):
    batch = cute.sym_int()
    return cute.compile(
        NormFront(latent, per_sm), fake(BFloat16, (batch, TOP_K, latent)), fake(BFloat16, (batch, TOP_K), align=2),
        fake(BFloat16, (latent,)), fake(BFloat16, (batch, latent)), Float32(1e-6), fake_stream(),
        options=compile_options(),
    )


@functools.cache
def plan_for(tp: int, shard: int, latent: int, groups: int) -> Plan:
    """The Plan of a shape (planned once: the dispatch asks on every call)."""
    return Plan(tp, shard, latent, groups)


@compiled
def compile_tail(tp: int, shard: int, latent: int, groups: int, publish: bool, stamps: bool = False):
    plan = plan_for(tp, shard, latent, groups)
    batch, capacity, peers = cute.sym_int(), cute.sym_int(), cute.sym_int()
    if publish:
        latent_in, shared_in = fake(BFloat16, (3, tp, capacity, latent)), fake(BFloat16, (3, tp, capacity, shard))
    else:
        latent_in, shared_in = fake(BFloat16, (batch, latent)), fake(BFloat16, (batch, shard))
    return cute.compile(
        MoeTail(plan, publish, stamps), latent_in, shared_in,
        fake(BFloat16, (latent,)), fake(BFloat16, (shard, latent)), fake(BFloat16, (batch, shard)),
        fake(Int64, (peers,), align=8), fake(Int32, (1,), align=4),
        Float32(1e-6), Int32(1), Int32(0), Int32(0), Int32(1), Int32(1), fake_stream(),
        options=compile_options(),
    )


@functools.cache
def wave_plan_for(shard: int, latent: int, groups: int) -> WavePlan | None:
    """WaveMoeTail's plan of a shape, or None where MoeTail runs (fewer than MIN_WAVE_GROUPS
    token groups, or a shape the wave does not take)."""
    try:
        return WavePlan(shard, latent, groups) if groups >= MIN_WAVE_GROUPS else None
    except ValueError:
        return None


def poll_wave_plan(tp: int, shard: int, latent: int, groups: int) -> WavePlan | None:
    """WaveMoeTail's plan for publish mode, or None where MoeTail polls instead: a CTA per
    64 rows leaves TP4's shard 28 CTAs, too few SMs to stream it at the HBM's rate."""
    return wave_plan_for(shard, latent, groups) if tp <= MAX_WAVE_TP else None


@compiled
def compile_wave_tail(shard: int, latent: int, groups: int, stamps: bool = False, tp: int = 0):
    batch = cute.sym_int()
    if tp:
        shared_in, out_in = fake(BFloat16, (3, tp, cute.sym_int(), shard)), fake(BFloat16, (cute.sym_int(), shard))
    else:
        shared_in, out_in = fake(BFloat16, (batch, shard)), fake(BFloat16, (batch, shard))
    return cute.compile(
        WaveMoeTail(wave_plan_for(shard, latent, groups), stamps, tp), fake(BFloat16, (cute.sym_int(), latent)),
        shared_in, fake(BFloat16, (shard, latent)), out_in, fake(Int64, (max(tp, 1),), align=8),
        fake(Int32, (1,), align=4), fake(Int32, (1,), align=4), Int32(1), Int32(0), Int32(0), fake_stream(),
        options=compile_options(),
    )


@compiled
def compile_poll_front(latent: int, tp: int, shard: int):
    capacity = cute.sym_int()
    return cute.compile(
        PollNormFront(latent, tp), fake(BFloat16, (3, tp, capacity, latent)), fake(BFloat16, (3, tp, capacity, shard)),
        fake(BFloat16, (latent,)), fake(BFloat16, (cute.sym_int(), latent)), fake(Int32, (1,), align=4),
        Float32(1e-6), Int32(0), Int32(1), Int32(1), fake_stream(), options=compile_options(),
    )


@functools.cache
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def front_per_sm(shard: int, latent: int, batch: int, device: int) -> int:
    """NormFront's CTAs per SM for a batch: two (72 registers, ~9 of a thread's 16 row loads
    in flight) where all its CTAs then fit on the SMs the tail's grid leaves free, so the
    next call's tail CTAs never wait for them; else one (all 16 in flight, one round trip).
    H200 op-only, µs: B = 16 / 32 two 14.75 / 15.23 against one's 15.1 / 16.6; B = 64 one
    17.8-17.9, two 18.2-19.4, three 19.3-19.7, four (all on the 20 free SMs) 20.4-20.6; one
    per SM looping over tokens on 20 / 32 / 44 CTAs 21.5 / 19.0 / 18.4: at B = 64 a round
    trip added to the front costs more than the late tail CTAs it spares (B = 40 / 48,
    before xn's rows were padded: two 19.1 / 19.6, one 19.35 / 19.0)."""
    free = multiprocessors(device) - functional_ctas(shard, latent, batch)
    return 2 if batch <= 2 * free else 1


def functional_ctas(shard: int, latent: int, batch: int) -> int:
    """The CTAs of the functional tail's launch (benchmarks/profile_tail.py's stamps)."""
    wave = wave_plan_for(shard, latent, groups_of(batch))
    return wave.ctas if wave else plan_for(1, shard, latent, groups_of(batch)).clusters * CLUSTER


@compiled
def compile_push(hidden: int, tp: int):
    return cute.compile(
        ShardPush(hidden, tp), fake(BFloat16, (cute.sym_int(), hidden)), fake(Int64, (tp,), align=8), Int32(0),
        fake_stream(), options=compile_options(),
    )


def unsupported_shape(tp: int, shard: int, latent: int, batch: int) -> str | None:
    if latent % (CLUSTER * CHUNK) or shard % (TILE_ROWS * 2) or tp > 16:
        return (f"the tail kernel needs L % {CLUSTER * CHUNK} == 0, N % {TILE_ROWS * 2} == 0 and "
                f"TP <= 16 (L={latent}, N={shard}, TP={tp})")
    try:
        plan_for(tp, shard, latent, groups_of(batch))
    except ValueError as error:
        return str(error)
    return None


class TailKernel:
    """``kimi::moe_tail`` on CUDA (TP1): NormFront, then WaveMoeTail past one token group
    (MoeTail at one) on the normalized rows. ``stamps`` (benchmarks only): an int64 buffer
    of Stamps pairs per CTA, to run the stamping variant."""

    check = staticmethod(tail_op.check_moe_tail)

    def __init__(self, stamps: torch.Tensor | None = None):
        self.stamps = stamps

    def prepare(self, latent: int, hidden: int, batches) -> None:
        """Compile what the op will run for ``batches`` (shapes the kernels do not take run
        the reference: nothing to compile)."""
        for per_sm in (1, 2):  # front_per_sm's choices
            compile_norm_front(latent, per_sm)
        stamps = self.stamps is not None
        for groups in sorted({groups_of(b) for b in batches}):
            if wave_plan_for(hidden, latent, groups):
                compile_wave_tail(hidden, latent, groups, stamps)
            elif not unsupported_shape(1, hidden, latent, 8 * groups):
                compile_tail(1, hidden, latent, groups, False, stamps)

    def unsupported(self, expanded, weights, shared, gamma, w_up, eps):
        if not aligned(expanded, shared, gamma, w_up):
            return "the tail kernel reads 16-byte packets: tensors must be 16-byte aligned"
        hidden, latent, batch = w_up.shape[0], expanded.shape[2], expanded.shape[0]
        if wave_plan_for(hidden, latent, groups_of(batch)):
            return hopper(expanded)
        return unsupported_shape(1, hidden, latent, batch) or hopper(expanded)

    def __call__(self, expanded, weights, shared, gamma, w_up, eps):
        out = shared.new_empty((expanded.shape[0], w_up.shape[0]))
        if out.shape[0]:
            front, tail = self.launches(expanded, weights, shared, gamma, w_up, eps, out)
            front()
            tail()
        return out

    def launches(self, expanded, weights, shared, gamma, w_up, eps, out):
        """The op's two kernels as calls (benchmarks/tail_parts.py times them apart):
        NormFront into a new xn buffer, then the tail from it into ``out``."""
        batch, hidden, latent = expanded.shape[0], w_up.shape[0], expanded.shape[2]
        groups = groups_of(batch)
        wave = wave_plan_for(hidden, latent, groups)
        # the wave's xn boxes span its padded tokens: rows past the batch are left
        # unwritten (they only reach accumulators of tokens never stored), since TMA's
        # out-of-bounds fill of a partial box cost 1.4-1.5 µs per call at B = 40 / 48
        normed = expanded.new_empty((wave.tokens if wave else batch, latent))
        front = compile_norm_front(latent, front_per_sm(hidden, latent, batch, expanded.device.index))
        stamps = placeholder(out if self.stamps is None else self.stamps, torch.int32)
        if wave:
            tail = compile_wave_tail(hidden, latent, groups, self.stamps is not None)
            tail_args = (normed, shared, w_up, out, placeholder(out, torch.int64), placeholder(out, torch.int32),
                         stamps, batch, 0, 0)
        else:
            tail = compile_tail(1, hidden, latent, groups, False, self.stamps is not None)
            tail_args = (normed, shared, gamma, w_up, out, placeholder(out, torch.int64), stamps, eps, batch, 0, 0, 0,
                         1)
        return lambda: front(expanded, weights, gamma, normed[:batch], eps), lambda: tail(*tail_args)


class TailPublishKernel:
    """``kimi::moe_tail_publish`` on CUDA."""

    check = staticmethod(mailbox_ops.check_moe_tail_publish)

    def prepare(self, latent: int, tp: int, peer_lists=()) -> None:
        compile_front(latent, tp)
        register_addresses(peer_lists)

    def unsupported(self, expanded, weights, latent_boxes, parity, rank):
        if expanded.shape[2] % 8 or not aligned(expanded, *latent_boxes):
            return "the publish kernel stores 16-byte packets: L % 8 == 0 and 16-byte aligned tensors"
        return hopper(expanded)

    def __call__(self, expanded, weights, latent_boxes, parity, rank):
        latent = expanded.shape[2]
        tp, capacity = len(latent_boxes), latent_boxes[0].shape[2]
        compile_front(latent, tp)(expanded, weights, addresses(latent_boxes), (parity * tp + rank) * capacity)


class TailPushKernel:
    """``kimi::moe_tail_push`` on CUDA."""

    check = staticmethod(mailbox_ops.check_moe_tail_push)

    def prepare(self, hidden: int, tp: int, peer_lists=()) -> None:
        compile_push(hidden, tp)
        register_addresses(peer_lists)

    def unsupported(self, shared, rs_boxes, parity, rank):
        if rs_boxes[0].shape[3] % 8 or not aligned(shared, *rs_boxes):
            return "the push kernel stores 16-byte packets: H/TP % 8 == 0 and 16-byte aligned tensors"
        return hopper(shared)

    def __call__(self, shared, rs_boxes, parity, rank):
        tp, capacity = len(rs_boxes), rs_boxes[0].shape[2]
        compile_push(shared.shape[1], tp)(shared, addresses(rs_boxes), (parity * tp + rank) * capacity)


class TailPollKernel:
    """``kimi::moe_tail_poll`` on CUDA: PollNormFront, then WaveMoeTail in publish mode past
    one token group at TP <= MAX_WAVE_TP; else MoeTail in publish mode."""

    check = staticmethod(mailbox_ops.check_moe_tail_poll)

    def prepare(self, tp: int, shard: int, latent: int, batches, peer_lists=()) -> None:
        for groups in sorted({groups_of(b) for b in batches}):
            if poll_wave_plan(tp, shard, latent, groups):
                compile_poll_front(latent, tp, shard)
                compile_wave_tail(shard, latent, groups, False, tp)
            elif not unsupported_shape(tp, shard, latent, 8 * groups):
                compile_tail(tp, shard, latent, groups, True)
        register_addresses(peer_lists)

    def unsupported(self, latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity,
                    rearm_batch, rank, batch):
        if not aligned(latent_box, rs_box, gamma, w_up, *out_boxes):
            return "the tail kernel reads 16-byte packets: tensors must be 16-byte aligned"
        tp, shard, latent = latent_box.shape[1], rs_box.shape[3], latent_box.shape[3]
        if poll_wave_plan(tp, shard, latent, groups_of(batch)):
            return hopper(latent_box)
        return unsupported_shape(tp, shard, latent, batch) or hopper(latent_box)

    def __call__(self, latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity,
                 rearm_batch, rank, batch):
        tp, shard, latent = latent_box.shape[1], rs_box.shape[3], latent_box.shape[3]
        out = rs_box[parity, rank]  # placeholder: publish mode writes through ``peers``
        groups = groups_of(batch)
        wave = poll_wave_plan(tp, shard, latent, groups)
        if wave:
            normed = latent_box.new_empty((wave.tokens, latent))  # padded: see TailKernel
            compile_poll_front(latent, tp, shard)(
                latent_box, rs_box, gamma, normed[:batch], error, eps, parity, rearm_parity, rearm_batch
            )
            compile_wave_tail(shard, latent, groups, False, tp)(
                normed, rs_box, w_up, out, addresses(out_boxes), error, placeholder(error, torch.int32), batch,
                parity, rank
            )
        else:
            compile_tail(tp, shard, latent, groups, True)(
                latent_box, rs_box, gamma, w_up, out, addresses(out_boxes), error,
                eps, batch, parity, rank, rearm_parity, rearm_batch,
            )


def register() -> None:
    backend.KERNELS["moe_tail"] = TailKernel()
    backend.KERNELS["moe_tail_publish"] = TailPublishKernel()
    backend.KERNELS["moe_tail_push"] = TailPushKernel()
    backend.KERNELS["moe_tail_poll"] = TailPollKernel()
