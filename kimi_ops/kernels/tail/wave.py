"""The wave tail from MIN_WAVE_GROUPS token groups on (kernels/tail/split.py's MoeTail
below): ``WaveMoeTail``, all its CTAs in one wave, a CTA per WAVE_ROWS rows over the whole
K on wgmma, xn multicast across a cluster; its plan and its mbarriers."""

import functools
import math
import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from ..launch import PDL, SMEM_BYTES
from ..mailbox import box_row, peer_bases, poll_all
from ..packets import butterfly_sum, clamp, inverse_rms, normalized, unpack_words
from ..ptx import (
    l2_evict_first,
    load_matrices,
    load_shared,
    load_words,
    pack_values,
    pinned,
    store_shared,
    store_words,
    wgmma_bf16,
)
from ..ring import CHUNK, descriptor, expect, hand_back, landed, paced, swizzled, swizzled_stages, wait_handed_back
from ..values import Stamps, Values
from .common import (
    LATENT_POLL,
    PHASES,
    Outbox,
    output_packet,
    publish_out,
    rank_sums,
    rearm_previous,
    reduced_shared,
    sum_of_squares,
)

WAVE_ROWS = 64  # rows per WaveMoeTail CTA: wgmma's M
# WaveMoeTail CTAs sharing each xn chunk by multicast. Pairs: clusters of 2 fit 66 at a
# time, of 4 only 30 (the wave needs 28), so NormFront's CTAs block fewer of its
# placements (faster at 32 and 64 tokens: benchmarks/NOTES.md).
WAVE_CLUSTER = 2
WAVE_WARPS = 4  # per WaveMoeTail consumer warpgroup (two, taking alternate chunks)
WAVE_THREADS = 3 * 32 * WAVE_WARPS  # the consumers, then the producers' warpgroup
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232  # setmaxnreg: 128 · 40 + 256 · 232 <= 64 K
XN_BYTES = 96 * 1024  # the xn ring (L2 hits: slots in flight cover the cluster's round trip)
WGMMA_PENDING = 1  # chunks whose wgmmas stay in flight while the next chunk issues (measured: 1-3 alike)
# Accumulator sets per consumer warpgroup from SETS_TOKENS tokens on, taken by its chunks
# in turn and summed in set order at the end; one set below, where two lost (their stash
# is a chunk shorter: benchmarks/NOTES.md).
ACCUMULATOR_SETS, SETS_TOKENS = 2, 64
# 8 KB slots in flight before xn is in (MoeTail's PACE bytes): the best of 2-12 at 64
# tokens (benchmarks/NOTES.md).
WAVE_PACE = 8
MAX_WAVE_DEPTH = 32
MIN_WAVE_GROUPS, MAX_WAVE_GROUPS = 3, 8  # WaveMoeTail's batches (MoeTail is faster up to 16 tokens)
# publish mode's: the wave from one token group on, since PollNormFront spreads its re-arm over
# its grid (1.5-8 µs faster than MoeTail at B = 1-16 at a TP8 rank, benchmarks/NOTES.md)
MIN_POLL_WAVE_GROUPS = 1
FRONT_PACKETS = 8  # packets a lane of the wave's own front polls at once, over its warp's rows
WAVE_REGISTERS = 184  # of CONSUMER_REGISTERS for the stash, accumulators and shared packets (ptxas: no spills)


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

    @property
    def holds_xn(self) -> bool:
        """Whether every xn chunk fits the xn slots at once: what the wave's own front needs."""
        return self.xn_depth >= self.chunks

    def xn_rows(self, batch: int) -> int:
        """Rows of the xn buffer the front writes: the padded tokens, since the xn boxes span
        them. Rows past the batch are left unwritten: they only reach accumulators of
        tokens never stored."""
        return self.tokens

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
    per WAVE_ROWS rows over the whole K. MoeTail's K split keeps xn resident, which leaves
    a 3-slot ring at 64 tokens, and reduces the partial sums through DSMEM, 3.4 µs there;
    here no sum crosses a CTA (faster from 32 tokens on, slower at 16: benchmarks/NOTES.md).

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
    call's clusters would start, and those then start µs apart (benchmarks/NOTES.md).
    Past xn the CTA is bound by shared memory: wgmma reads A and B and TMA writes both,
    32 KB per chunk at 64 tokens, 0.14 µs at 128 bytes per clock, as measured.

    ``front`` (publish mode, the seeds' wave with its front inside; where every xn chunk
    fits the xn slots at once, :attr:`WavePlan.holds_xn`): no PollNormFront launch. Before
    the stash each consumer warp polls whole latent rows of the batch from the latent box
    (a row a warp, every packet of its rows in flight at once, bounded), sums the sources
    in rank order, normalizes as PollNormFront does (the same bits) and stores xn into the
    slots in TMA's swizzle; the consumers then meet at a barrier and project. The
    producers' spare warps re-arm the previous MoE layer's boxes over the grid. Every CTA
    computes the whole batch's xn: a front a CTA, no exchange."""

    def __init__(self, plan: WavePlan, stamps: bool = False, tp: int = 0, front: bool = False):
        assert not front or (tp and plan.holds_xn), "the wave's own front: publish mode, every xn chunk in its slots"
        self.plan, self.stamps, self.tp, self.front = plan, stamps, tp, front  # tp 0: functional

    @cute.jit
    def __call__(self, xn_in: cute.Tensor, shared: cute.Tensor, w_up: cute.Tensor, out: cute.Tensor,
                 peers: cute.Tensor, error: cute.Tensor, parity: Int32, rank: Int32, stamps: cute.Tensor,
                 batch: Int32, gamma: cute.Tensor, eps: Float32, rearm_parity: Int32, rearm_batch: Int32, stream):
        """Functional: ``shared`` and ``out`` [B, N]. Publish mode: ``shared`` the reduce-
        scatter box [3, TP, CAP, N]; (``peers``, ``error``, ``parity``, ``rank``) the publish
        side (Outbox; ``out`` unused). ``xn_in``: the normalized rows [rows, L], or with
        ``front`` the latent box [3, TP, CAP, L], whose rows ``gamma``, ``eps`` normalize and
        whose (and ``shared``'s) parity ``rearm_parity`` it re-arms for ``rearm_batch``
        tokens (unused without ``front``)."""
        plan = self.plan
        weight_copy, weight_boxes = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w_up, swizzled_stages(WAVE_ROWS, 1), (WAVE_ROWS, CHUNK)
        )
        if cutlass.const_expr(self.front):
            kernel = self.kernel_front(weight_copy, weight_boxes, xn_in, gamma, shared, out, peers, error, stamps, batch,
                                       parity, rank, eps, rearm_parity, rearm_batch)
        else:
            xn_copy, xn_boxes = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(), xn_in, swizzled_stages(plan.tokens, 1),
                (plan.tokens, CHUNK), num_multicast=WAVE_CLUSTER,
            )
            kernel = self.kernel(weight_copy, weight_boxes, xn_copy, xn_boxes, shared, out, peers, error, stamps, batch,
                                 parity, rank)
        kernel.launch(
            grid=[plan.ctas, 1, 1], block=[WAVE_THREADS, 1, 1], cluster=[WAVE_CLUSTER, 1, 1], stream=stream,
            use_pdl=PDL, min_blocks_per_mp=1,  # ptxas: the registers at entry, for setmaxnreg
        )

    @cute.kernel
    def kernel(self, weight_copy: cute.CopyAtom, weight_boxes: cute.Tensor, xn_copy: cute.CopyAtom,
               xn_boxes: cute.Tensor, shared: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, error: cute.Tensor,
               stamps: cute.Tensor, batch: Int32, parity: Int32, rank: Int32):
        self.body(weight_copy, weight_boxes, (xn_copy, xn_boxes), shared, out, peers, error, stamps, batch, parity,
                  rank)

    @cute.kernel
    def kernel_front(self, weight_copy: cute.CopyAtom, weight_boxes: cute.Tensor, latent: cute.Tensor,
                     gamma: cute.Tensor, shared: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, error: cute.Tensor,
                     stamps: cute.Tensor, batch: Int32, parity: Int32, rank: Int32, eps: Float32, rearm_parity: Int32,
                     rearm_batch: Int32):
        self.body(weight_copy, weight_boxes, Front(latent, gamma, eps, rearm_parity, rearm_batch), shared, out, peers,
                  error, stamps, batch, parity, rank)

    @cute.jit
    def body(self, weight_copy, weight_boxes, xn_source, shared, out, peers, error, stamps, batch, parity, rank):
        """The kernel, whatever brings xn in: ``xn_source`` the xn TMA descriptor and boxes,
        or (``front``) the :class:`Front`."""
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        stamp = Stamps(PHASES, self.stamps, stamps, cta, tid)
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
            elif cutlass.const_expr(self.front):
                self.rearm(xn_source, shared, cta, tid - 32 * (2 * WAVE_WARPS + 1))
            elif warp == 2 * WAVE_WARPS + 1:
                self.produce_xn(*xn_source, xn, barriers, cta, lane)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            front = xn_source if cutlass.const_expr(self.front) else None
            if warp < WAVE_WARPS:
                self.consume(0, xn, ring, barriers, shared, out, outbox, batch, cta, tid, stamp, front)
            else:
                self.consume(1, xn, ring, barriers, shared, out, outbox, batch, cta, tid, stamp, front)
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
            wait_handed_back(barriers.empty, i, plan.depth)
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
            wait_handed_back(barriers.xn_empty, i, plan.xn_depth)
            expect(barriers.xn_full, slot, plan.xn_bytes, lane)
            cute.copy(xn_copy, box_out[(None, 0, i)], box_in[(None, slot)], tma_bar_ptr=barriers.xn_full + slot,
                      mcast_mask=Int32((1 << WAVE_CLUSTER) - 1))

    @cute.jit
    def rearm(self, front, shared, cta, thread):
        """The producers' spare warps (``thread`` of their 96 threads, with ``front``):
        the previous MoE layer's latent and reduce-scatter rows re-armed over the grid."""
        threads = 32 * (WAVE_WARPS - 1)
        for box in (front.latent, shared):
            rearm_previous(box, self.tp, front.rearm_parity, front.rearm_batch, cta * threads + thread,
                           self.plan.ctas * threads)

    @cute.jit
    def consume(self, group: cutlass.Constexpr[int], xn, ring, barriers, shared, out, outbox, batch, cta, tid,
                stamp, front=None):
        """Consumer warpgroup ``group``: chunks group, group + 2, …; then the epilogue.
        With ``front``, first the batch's xn rows into the slots (:meth:`front_rows`: its
        polls beside the weight stream, no stash live yet); the PDL wait and ``waited``
        stay after the stash (``paced`` holds the stream on ``fronted`` once they came)."""
        plan = self.plan
        warp, lane = tid // 32 % WAVE_WARPS, tid % 32
        if cutlass.const_expr(self.front):
            self.front_rows(front, xn, outbox, batch, tid)
            cute.arch.fence_proxy("async.shared", space="cta")  # our stores, then wgmma's reads (async proxy)
            cute.arch.barrier(barrier_id=1, number_of_threads=64 * WAVE_WARPS)  # every row's packets are in
        stashed = []
        for j in cutlass.range_constexpr(plan.stash):
            slot = (2 * j + group) % plan.depth
            landed(barriers.full, 2 * j + group, plan.depth)
            stashed.append(self.a_fragments(ring, slot, warp, lane))
            hand_back(barriers.empty + slot, lane)
        cute.arch.griddepcontrol_wait()
        if tid == 0:
            cute.arch.mbarrier_arrive(barriers.waited)  # after the stash: the stream's pace lets it land
        stamp.at("waited")
        shared_rows = self.shared_rows(shared, outbox, batch, cta, tid)
        cute.arch.cluster_wait()
        acc = self.project(group, stashed, xn, ring, barriers, warp, lane, stamp)
        stamp.at("projected")
        bases = []
        if cutlass.const_expr(self.tp):
            bases = peer_bases(outbox.peers, self.tp)  # back by the stores
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
                    publish_out(bases, plan.shard, outbox.rank, token, column, words)
                else:
                    store_words(out.iterator + token * out.stride[0] + column, words)
        stamp.at("end")

    @cute.jit
    def shared_rows(self, shared, outbox, batch, cta, tid):
        """The shared expert's packets of the thread's output packets as BF16x2 words, once
        our predecessor is done (off the epilogue's path): loaded (functional), or BF16(Σ
        of the TP sources) polled from the reduce-scatter box (publish mode; a shared
        expert may still be pushing them: the fused one runs beside routing)."""
        plan = self.plan
        items = [plan.packet(q, tid) for q in range(plan.packets)]
        items = [(clamp(token, batch - 1), cta * WAVE_ROWS + row) for token, row in items]  # past the batch: unused
        if cutlass.const_expr(self.tp):
            reduced = reduced_shared(shared, self.tp, outbox.parity, items, outbox.error)
            return [pack_values(v) for v in reduced]
        return [load_words(shared.iterator + token * shared.stride[0] + column) for token, column in items]

    @cute.jit
    def front_rows(self, front, xn, outbox, batch, tid):
        """The wave's own front: xn = BF16((latent · inv) · gamma) of every token of the
        batch into the xn slots, latent = BF16(Σ of the TP sources in rank order), each row's
        Σ BF16(latent²) in FP64 (exact) over its warp, inv from it (PollNormFront's
        rounding points). Consumer warp w takes tokens w, w + 8, …, a packet a lane and
        round; every packet of ``rows_at_once`` rows (FRONT_PACKETS a lane) is polled at once (bounded,
        into the error word; past the batch a row's polls repeat the last token's and store
        nothing)."""
        plan, tp = self.plan, self.tp
        warp, lane = tid // 32, tid % 32
        packets = plan.latent // 8
        rounds = -(-packets // 32)
        warps = 2 * WAVE_WARPS
        rows_at_once = max(1, FRONT_PACKETS // (tp * rounds))
        capacity = front.latent.shape[2]
        columns = [clamp(lane + 32 * q, packets - 1) * 8 for q in range(rounds)]
        scale = [unpack_words(load_words(front.gamma.iterator + column)) for column in columns]
        for first in cutlass.range(warp, batch, warps * rows_at_once, unroll=1):
            tokens = [first + warps * j for j in range(rows_at_once)]
            rows = [front.latent.iterator + box_row(outbox.parity, source, clamp(token, batch - 1), tp, capacity)
                    * plan.latent for token in tokens for source in range(tp)]
            polled = poll_all([row + column for row in rows for column in columns], outbox.error, LATENT_POLL)
            # polled[(j·TP + source)·rounds + q]: rank_sums wants the sources innermost
            latents = rank_sums([polled[(j * tp + source) * rounds + q] for j in range(rows_at_once)
                                 for q in range(rounds) for source in range(tp)], tp)
            for j in cutlass.range_constexpr(rows_at_once):
                squares = Float64(0.0)
                for q in cutlass.range_constexpr(rounds):
                    if lane + 32 * q < packets:
                        squares += sum_of_squares(latents[j * rounds + q])
                inv = inverse_rms(butterfly_sum(squares, 32), plan.latent, front.eps)
                if tokens[j] < batch:
                    for q in cutlass.range_constexpr(rounds):
                        if lane + 32 * q < packets:
                            packet = lane + 32 * q
                            slot = xn + packet // (CHUNK // 8) * (plan.xn_bytes // 4)
                            store_shared(slot + swizzled(0, tokens[j], packet % (CHUNK // 8)) * 4,
                                         normalized(latents[j * rounds + q], inv, scale[q]))

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
        for k, zero in enumerate(zeros):  # a static loop (range_constexpr warns from 64 on)
            acc[k] = zero
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
            if cutlass.const_expr(not self.front):  # (the front's rows are in: consume's barrier)
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
        if cutlass.const_expr(not self.front):  # (no xn slot is refilled after the front's rows)
            if lane < WAVE_CLUSTER:
                cute.arch.mbarrier_arrive(barriers.xn_empty + i % self.plan.xn_depth, lane)
        if cutlass.const_expr(i >= 2 * self.plan.stash):
            if lane == 0:
                cute.arch.mbarrier_arrive(barriers.empty + i % self.plan.depth)


class Front(Values):
    """The wave's own front (WaveMoeTail ``front``): the latent box, the RMS weight and
    eps, and the previous MoE layer's parity and batch to re-arm."""

    DYNAMIC = ("latent", "gamma", "eps", "rearm_parity", "rearm_batch")

    def __init__(self, latent, gamma, eps, rearm_parity, rearm_batch):
        self.latent, self.gamma, self.eps = latent, gamma, eps
        self.rearm_parity, self.rearm_batch = rearm_parity, rearm_batch


class Barriers(Values):
    """WaveMoeTail's mbarriers (shared-memory pointers)."""

    DYNAMIC = ("full", "empty", "xn_full", "xn_empty", "waited", "fronted")

    def __init__(self, *pointers):
        for name, pointer in zip(self.DYNAMIC, pointers):
            setattr(self, name, pointer)
