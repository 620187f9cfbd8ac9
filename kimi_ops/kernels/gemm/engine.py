"""The decode-GEMM engine on Hopper (the seeds' ``oproj/producer.py`` and the front GEMM of
``moe/front.py``, re-derived for 132 SMs): out[B, N] = x[B, K] @ w[N, K]ᵀ for B ≤ 64,
BF16 in, FP32 accumulation, one main loop under several epilogues.

Partition (:class:`GemmPlan`, static per (N, K, T)): a CTA owns ``tiles`` 64-row tiles
(one TMA box of ``rows`` = 64·tiles rows) over 1/``split`` of K; the ``split`` CTAs of one
row block form a cluster. :func:`partition` picks the (tiles, split) of least cost per CTA
(weight bytes, x's L2 reads, per-chunk and per-split fixed costs measured on the H200)
with the whole grid resident at one CTA per SM (clusters stay within a GPC: RESIDENT),
so every SM of the grid streams its share at once.

1. The producer warpgroup: its first warp streams the CTA's weight chunks (rows × CHUNK
   columns, 128-byte swizzle, L2 evict-first) by TMA through a ring of ``depth`` slots,
   ``pace`` of them before ``griddepcontrol.wait`` (the weights do not depend on the previous
   kernel; the whole ring at B <= 8), then ``paced`` until x's first chunk is in (x's loads would queue behind a
   whole ring), then as slots come back. Once the wait is over its second warp copies
   each chunk's x rows [tokens, CHUNK] by TMA too (the rows past the batch come as zeros),
   so a slot's full barrier takes two arrivals and their bytes, and wgmma reads the slot
   with no proxy fence (x by cp.async took 128 threads' arrivals and a fence a chunk).
2. The consumer warpgroup runs wgmma m64nTk16 (T = ``tokens``, the batch rounded up to
   TOKEN_TILES) per 16 columns, A (weights) and B (x) from shared memory. Each chunk's
   four k16 steps start from zero in an accumulator set of its own (``sets`` chunks in
   flight) and the chunk's sum is added to the FP32 running sums in chunk order: the
   tensor core's accumulation is not FP32 rounding, and its error grows with the chain
   (H200, 12288 × 7168 at 64 tokens: one accumulator over the CTA's K was up to 409 BF16
   ulps off near zero; chunk sums: 0.018 % of the outputs not bit-equal to the exact
   sum's rounding). No wgmma is in flight across the loop's back edge (ptxas would
   serialize).
3. K parts meet in fixed order (the same bits on every run): each CTA stores its FP32
   sums of the rows CTA q owns (rows/split of the block) as block q of a staging area in
   its own shared memory, over its drained ring (its own block straight into its receive
   buffer), then after a cluster barrier (every ring drained) sends each block to its
   owner's receive buffer as one bulk copy (DSMEM) that completes on the owner's
   ``received`` barrier; the owner adds parts 0, 1, … in order. (Stores into the peers'
   shared memory, one word or pair a thread at a time, then a cluster barrier whose
   release waits for them at GPU scope, took ~30 % of the DSA front's consumer time at
   64 tokens: ncu, benchmarks/NOTES.md.) A last cluster barrier (arrived once our blocks
   are in, waited on at the end) keeps every staging area until the copies out of it are
   in. No workspace crosses calls: the functional ops need none (DESIGN §4). A plan
   ``by_token`` (the DSA front's) gives owner q tokens [q·P, (q+1)·P) of every row of the
   block instead, so a block's rows meet in one CTA.
4. Epilogue (:class:`Outputs`): per 8-row packet of a token, BF16 rows to ``out``
   (``kimi::oproj``); FP32 logits (never rounded) for rows below ``n_logits`` and BF16
   latent rows above (``kimi::moe_front``); or the same words into every rank's box
   through ``store_to_peers`` (−0 and NaN canonical, FP32-wise for logits):
   ``kimi::oproj_publish`` (slot = rank) and ``kimi::moe_front_publish`` (the front row
   layout of :func:`~kimi_ops.ops.front.moe_front_publish`); or ``situ`` of each gate packet
   and the up packet after it (``kimi::gate_up_situ``: the rows interleaved in packets, so
   an owner's rows hold both), 8 BF16 activations a pair.

Raw rows (``body``'s ``norm``: the DSA front's q_c, ``kimi::normed_oproj``'s x): the
producers load x by plain loads, store the ring's chunks into their slots, share each
token's Σ x² over the cluster (DSMEM) and normalize the slots in place before arriving;
chunks past the ring go in normalized once their slots come back, held in registers or
loaded again (:meth:`DecodeGemm.produce_normalized`); the consumer side is unchanged.

PDL: dependents are released at entry (a dependent may only prefetch its own weights
before it waits for us, and lands on the SMs our grid leaves free); the weights' first
slots are in flight before our own wait.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from ..launch import PDL
from ..mailbox import owner_base, peer_bases, store_to_owner, store_to_peers
from ..packets import butterfly_sum, clamp, situ_value, unpack_words
from ..ptx import (
    copy_to_peer,
    divide,
    double_words,
    float_bits,
    l2_evict_first,
    load_shared,
    load_words,
    pack_values,
    pinned,
    rsqrt_like_torch,
    store_shared,
    store_shared_floats,
    store_words,
    wgmma_bf16,
)
from ..ring import CHUNK, descriptor, expect, hand_back, landed, paced, swizzled, swizzled_stages, wait_handed_back
from .plan import (
    CONSUMER_WARPS,
    PRODUCERS,
    THREADS,
    TILE,
    GemmPlan,
)


class Outputs:
    """Where the rows go: ``front`` rows [0, n_logits) are FP32 logits, the rest BF16
    latent (else every row BF16); ``tp`` 0 to tensors, else into ``tp`` peers' boxes of
    rows of ``width`` (oproj_publish: [1, TP, CAP, N]; moe_front_publish: [3, 1, CAP,
    TP·(L/TP + 2·E/TP)]); ``scatter``: row n only into its owner's box, rank n // (N/TP),
    rows of N/TP (oproj_push: the shared expert's reduce-scatter boxes [3, TP, CAP, N/TP];
    a CTA's owned rows lie in one owner's shard: :func:`~.host.gemm_variant` checks it);
    ``situ`` (beta, linear_beta): rows of N/2 activations to ``first``, one of each gate
    packet and its up packet (a CTA owns whole pairs: gemm_variant checks it)."""

    def __init__(self, n: int, front: bool = False, n_logits: int = 0, tp: int = 0, scatter: bool = False,
                 situ: tuple | None = None):
        self.n, self.front, self.n_logits, self.tp, self.scatter, self.situ = n, front, n_logits, tp, scatter, situ
        self.width = tp * (n + n_logits) if front else n // tp if scatter else n
        self.packets = 2 if situ else 1  # an item's packets: a situ's gate and up

    def bases(self, peers: cute.Tensor, first_row):
        """The peers' box bases (none to tensors; ``scatter``: the owner's of our first owned
        row ``first_row``, clamped: the last block's parts past N store nothing), loaded
        before the epilogue's stores."""
        if cutlass.const_expr(self.scatter):
            return [owner_base(peers, self.width, clamp(first_row, self.n - 1))]
        return peer_bases(peers, self.tp) if self.tp else []  # self.tp: a Python int

    @cute.jit
    def store(self, values, token, n0, first: cute.Tensor, second: cute.Tensor, bases, row0: Int32, col0: Int32,
              col1: Int32):
        """The packet of rows [n0, n0 + 8) of ``token`` (8 FP32 values). Tensors: ``first``
        BF16 rows (out, or the front's latent), ``second`` the front's FP32 logits; boxes
        (``bases``): row ``row0 + token``, latent at column ``col0``, logits at ``col1``."""
        bf16 = pack_values(values)
        box_row = Int64(row0 + token) * self.width
        if cutlass.const_expr(self.situ is not None):
            store_words(first.iterator + token * first.stride[0] + n0 // 2, bf16)
        elif cutlass.const_expr(self.scatter):
            store_to_owner(bases[0], self.width, row0 + token, n0, bf16)
        elif cutlass.const_expr(not self.front):
            if cutlass.const_expr(self.tp):
                store_to_peers(bases, (box_row + n0) * 2, bf16)
            else:
                store_words(first.iterator + token * first.stride[0] + n0, bf16)
        else:
            if n0 < self.n_logits:
                words = [float_bits(v) for v in values]
                if cutlass.const_expr(self.tp):
                    store_to_peers(bases, (box_row + col1 + 2 * n0) * 2, words, fp32=True)
                else:
                    logits = second.iterator + token * second.stride[0] + n0
                    store_words(logits, words[:4])
                    store_words(logits + 4, words[4:])
            else:
                if cutlass.const_expr(self.tp):
                    store_to_peers(bases, (box_row + col0 + n0 - self.n_logits) * 2, bf16)
                else:
                    store_words(first.iterator + token * first.stride[0] + n0 - self.n_logits, bf16)


# raw rows past the registers (GemmPlan.holds_raw): chunks past the ring whose x and gamma loads
# are in flight at once (an L2 round trip each, against a weight chunk's ~0.25 µs a CTA)
RELOADS_AHEAD = 4


def raw_chunk(gamma, rows, column0, chunk: int):
    """Raw rows: chunk ``chunk``'s gamma packet (unpacked) and the x packets of ``rows`` (a
    producer's tokens) at the producer's columns ``column0`` of the CTA's first chunk."""
    return (unpack_words(load_words(gamma.iterator + column0 + chunk * CHUNK)),
            [load_words(row + chunk * CHUNK) for row in rows])


class DecodeGemm:
    """One variant of the engine: a :class:`GemmPlan` and its :class:`Outputs`. A kernel that
    runs this plan after another one (kernels/gemm/shared.py) gives ``cluster``, its launch's
    CTAs per cluster (a K group is then ``split`` consecutive CTAs of it), and ``waiter``,
    whose ``wait(*inputs)`` stands for the PDL wait (x is then in) and releases the
    dependents itself; the plan before it gives ``release_waited``: its consumers release
    the dependents once the PDL wait is over; ``offset``: the launch's CTAs before this
    plan's (whole clusters: a plan beside another one in one grid)."""

    def __init__(self, plan: GemmPlan, outputs: Outputs, cluster: int | None = None, waiter=None,
                 release_waited: bool = False, offset: int = 0):
        self.plan, self.outputs, self.offset = plan, outputs, offset
        self.cluster, self.waiter, self.release_waited = cluster or plan.split, waiter, release_waited
        assert self.cluster % plan.split == 0, "a K group is split consecutive CTAs of a cluster"
        assert offset % self.cluster == 0, "a plan starts on a cluster"

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, first: cute.Tensor, second: cute.Tensor, peers: cute.Tensor,
                 row0: Int32, col0: Int32, col1: Int32, stream):
        w_copy, w_boxes = self.weight_copy(w)
        x_copy, x_boxes = self.x_copy(x)
        self.launch(self.kernel(w_copy, w_boxes, x_copy, x_boxes, x, first, second, peers, row0, col0, col1), stream)

    def weight_copy(self, w):
        """w's TMA descriptor (a kernel parameter): boxes of a block's rows × CHUNK columns."""
        plan = self.plan
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w, swizzled_stages(plan.rows, 1), (plan.rows, CHUNK)
        )

    def x_copy(self, x):
        """x's TMA descriptor: boxes of the token tile's rows × CHUNK columns (past the
        batch's rows TMA writes zeros)."""
        plan = self.plan
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), x, swizzled_stages(plan.tokens, 1), (plan.tokens, CHUNK)
        )

    def launch(self, kernel, stream, extra=0):
        """``extra``: CTAs after the plan's (whole clusters) for a variant's other work."""
        plan = self.plan
        kernel.launch(grid=[plan.ctas + extra, 1, 1], block=[THREADS, 1, 1], cluster=[plan.split, 1, 1], stream=stream,
                      use_pdl=PDL, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, w_copy: cute.CopyAtom, w_boxes: cute.Tensor, x_copy: cute.CopyAtom, x_boxes: cute.Tensor,
               x: cute.Tensor, first: cute.Tensor, second: cute.Tensor, peers: cute.Tensor, row0: Int32, col0: Int32,
               col1: Int32):
        self.body(w_copy, w_boxes, (x_copy, x_boxes), x, (first, second, peers, row0, col0, col1))

    @cute.jit
    def body(self, w_copy, w_boxes, x_load, x, outs, norm=None, storage=None, inputs=None, stamped=None):
        """The engine, whatever the epilogue: ``x_load`` x's TMA descriptor and boxes;
        ``outs`` :meth:`finish`'s arguments; ``norm`` (gamma, eps): x holds raw rows,
        RMS-normalized on their way into shared memory by the producers' loads
        (:meth:`produce_normalized`; ``x_load`` unused: None will do). A kernel that runs two plans
        (kernels/gemm/shared.py) gives ``storage``, the barriers and the ring sized for
        both, and for the second ``inputs``, the waiter's arguments; ``stamped`` (its
        :class:`~..values.Stamps`, the names of three phases): x in (the waiter's copier),
        the MMAs done and the stores issued (the consumers' thread 0)."""
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.offset):
            cta = cta - self.offset
        warp, lane = tid // 32, tid % 32
        block, part = cta // plan.split, cta % plan.split
        if cutlass.const_expr(storage is None):
            cute.arch.griddepcontrol_launch_dependents()  # see the module doc
            storage = self.allocate(self.plan.depth, self.plan.ring_bytes)
        full, ring = storage
        empty = full + plan.depth
        factored = empty + plan.depth  # norm: every K part's Σ x² of every token is in
        received = SmemAllocator().allocate_tensor(Int64, cute.make_layout(1), 8).iterator  # the peers' blocks are in
        squares = None
        if cutlass.const_expr(norm is not None):
            squares = SmemAllocator().allocate_tensor(Float64, cute.make_layout(plan.split * plan.tokens), 16)  # [part][token]
        if tid == 0:
            for slot in cutlass.range_constexpr(plan.depth):
                # the weights' expect_tx and x's (raw rows: the producers' stores)
                cute.arch.mbarrier_init(full + slot, 1 + (PRODUCERS if norm is not None else 1))
                cute.arch.mbarrier_init(empty + slot, CONSUMER_WARPS)
            if cutlass.const_expr(norm is not None):
                cute.arch.mbarrier_init(factored, 1)
                cute.arch.mbarrier_arrive_and_expect_tx(factored, plan.split * plan.tokens * 8)
            cute.arch.mbarrier_init(received, 1)
            expected = Int32((plan.split - 1) * plan.block_bytes)
            if part >= plan.receivers:  # we own nothing: no block comes
                expected = Int32(0)
            cute.arch.mbarrier_arrive_and_expect_tx(received, expected)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(norm is not None):
            cute.arch.cluster_arrive_relaxed()  # our barriers are initialized before peers store into them
        if warp >= CONSUMER_WARPS:
            producer = tid - 32 * CONSUMER_WARPS
            if cutlass.const_expr(norm is not None):
                self.produce_normalized(w_copy, w_boxes, x, ring, full, empty, factored, squares, block, part, producer,
                                        *norm)
            else:
                self.produce(w_copy, w_boxes, x_load, ring, full, empty, block, part, producer, inputs, stamped)
            cute.arch.cluster_arrive()  # the consumers' two cluster barriers
            cute.arch.cluster_wait()
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            if cutlass.const_expr(norm is not None):
                cute.arch.cluster_wait()
            cute.arch.griddepcontrol_wait()  # before our stores (x arrives after the producers')
            if cutlass.const_expr(self.release_waited):
                cute.arch.griddepcontrol_launch_dependents()
            acc = self.consume(ring, full, empty, warp, lane)
            if cutlass.const_expr(stamped is not None):
                stamped[0].at(stamped[1][1])
            prefetched = self.prefetched(outs, block, part)
            receive = cute.recast_ptr(ring, dtype=Float32)  # our ring is drained: our blocks go over it
            self.stage(acc, receive, part, tid)
            cute.arch.cluster_arrive()  # every ring of the cluster is drained: the peers' receive buffers are free
            cute.arch.cluster_wait()
            self.send(receive, received, part, tid, self.group(part))
            cute.arch.mbarrier_wait(received, 0)
            cute.arch.cluster_arrive_relaxed()  # the copies into us are in (their sources may go)
            self.finish(cute.make_tensor(receive, cute.make_layout(plan.receive_bytes // 4)), x.shape[0], block, part,
                        tid, *prefetched)
            if cutlass.const_expr(stamped is not None):
                stamped[0].at(stamped[1][2])
            cute.arch.cluster_wait()  # every copy out of our staging is in

    @staticmethod
    def allocate(depth: int, ring_bytes: int):
        """Shared memory for plans of up to ``depth`` slots and ``ring_bytes``: the full and
        empty barriers (and norm's one more), then the ring."""
        smem = SmemAllocator()
        full = smem.allocate_tensor(Int64, cute.make_layout(2 * depth + 1), 16).iterator
        return full, smem.allocate_tensor(Uint32, cute.make_layout(ring_bytes // 4), 1024).iterator

    @cute.jit
    def group(self, part):
        """The cluster rank of our K group's part 0 (0 where the cluster is the group)."""
        if cutlass.const_expr(self.cluster == self.plan.split):
            return 0
        return cute.arch.block_idx_in_cluster() - part

    @cute.jit
    def produce(self, w_copy, w_boxes, x_load, ring, full, empty, block, part, producer, inputs=None, stamped=None):
        """Producer thread ``producer`` of the warpgroup. Warp 0 streams the CTA's weight
        chunks by TMA: the plan's ``pace`` before the PDL wait, then ``paced`` until x's first chunk is in
        (a full ring queued ahead of x would hold x's loads behind it), then as the
        consumers hand slots back. Warp 1 copies each chunk's x box by TMA once the wait is
        over and the slot is free (issued apart from the weights: never behind them)."""
        plan = self.plan
        stream = self.start_stream(w_copy, w_boxes, ring, full, block, part, producer)
        box_in, box_out, evict_first, first_chunk, streamer, pace, lane = stream
        x_copy, x_boxes = x_load
        stages = swizzled_stages(plan.tokens, plan.depth)
        x_in, x_out = cpasync.tma_partition(
            x_copy, 0, cute.make_layout(1),
            cute.group_modes(cute.make_tensor(cute.recast_ptr(ring + plan.depth * plan.w_slot // 4, stages.inner,
                                                              dtype=BFloat16), stages.outer), 0, 2),
            cute.group_modes(cute.local_tile(x_boxes, (plan.tokens, CHUNK), (None, None)), 0, 2),
        )
        copier = producer // 32 == 1
        if copier:
            if lane == 0:
                cpasync.prefetch_descriptor(x_copy)  # x's first copy, after the wait, finds it fetched
        if cutlass.const_expr(self.waiter is None):
            cute.arch.griddepcontrol_wait()
        elif copier:  # the one warp that reads x
            self.waiter.wait(*inputs)
        if cutlass.const_expr(stamped is not None):
            if copier:
                stamped[0].by(lane).at(stamped[1][0])
        if producer < 64:  # the other two warps have no copies to issue
            for i in cutlass.range(plan.chunks, unroll=1):
                slot = i % plan.depth
                if streamer:
                    if i >= pace:
                        wait_handed_back(empty, i, plan.depth)
                        # slot 0's first phase says x's first chunk is in; from chunk depth on,
                        # chunk 0 was handed back (x is in) and the slot's later phases flip
                        # the parity the test reads: paced then held every other ring's worth
                        # of chunks to ``pace`` past the last landed
                        if i < plan.depth:
                            paced(i, pace, plan.depth, full, full)
                        self.load_weights(w_copy, box_in, box_out, full, block, first_chunk, i, lane, evict_first)
                if copier:
                    wait_handed_back(empty, i, plan.depth)
                    expect(full, slot, plan.x_slot, lane)
                    cute.copy(x_copy, x_out[(None, 0, first_chunk + i)], x_in[(None, slot)], tma_bar_ptr=full + slot)

    @cute.jit
    def start_stream(self, w_copy, w_boxes, ring, full, block, part, producer):
        """The streamer warp (the producers' first) issues the plan's first ``pace`` weight chunks: the
        weights do not depend on our predecessor. Returns what the producer loops use."""
        plan = self.plan
        lane = producer % 32
        box_in, box_out = self.weight_boxes(w_copy, w_boxes, ring)
        evict_first = l2_evict_first()
        first_chunk = part * plan.chunks
        streamer = producer < 32
        pace = plan.pace
        if streamer:
            for i in cutlass.range_constexpr(pace):
                self.load_weights(w_copy, box_in, box_out, full, block, first_chunk, i, lane, evict_first)
        return box_in, box_out, evict_first, first_chunk, streamer, pace, lane

    @cute.jit
    def weight_boxes(self, w_copy, w_boxes, ring):
        """The TMA partition of the ring's weight slots and of w's (rows × CHUNK) boxes."""
        plan = self.plan
        stages = swizzled_stages(plan.rows, plan.depth)
        return cpasync.tma_partition(
            w_copy, 0, cute.make_layout(1),
            cute.group_modes(cute.make_tensor(cute.recast_ptr(ring, stages.inner, dtype=BFloat16), stages.outer), 0, 2),
            cute.group_modes(cute.local_tile(w_boxes, (plan.rows, CHUNK), (None, None)), 0, 2),
        )

    @cute.jit
    def load_weights(self, w_copy, box_in, box_out, full, block, first_chunk, i, lane, evict_first):
        """The streamer warp: chunk ``i``'s weight box into its slot (its full barrier armed)."""
        slot = i % self.plan.depth
        expect(full, slot, self.plan.w_slot, lane)
        cute.copy(w_copy, box_out[(None, block, first_chunk + i)], box_in[(None, slot)], tma_bar_ptr=full + slot,
                  cache_policy=evict_first)

    @cute.jit
    def produce_normalized(self, w_copy, w_boxes, x, ring, full, empty, factored, squares, block, part, producer, gamma,
                           eps):
        """Producer thread ``producer`` when x holds raw rows (the DSA front's q_c;
        ``kimi::normed_oproj``'s): xn = BF16((x · rr) · gamma) with rr = rsqrt(Σ x² / K + eps),
        QueryNorm's rounding points (:func:`~kimi_ops.numerics.rms_norm`). After the wait every
        thread loads its x packets of every chunk (the same 8 columns of a chunk for each of
        its tokens), warp 0 then queues the rest of the ring; each token's Σ x² over our
        slice (FP64: BF16 squares are exact in FP32 and their sum in FP64, so any order gives
        the reference's FP32 ss) goes to every CTA of the cluster (st.async on ``factored``).
        The packets of the ring's chunks go into their slots raw at once (the swizzle TMA
        would write; x leaves the registers), and once every part's sums are in they are
        normalized in place and the slot's full barrier is arrived on. A chunk past the ring
        waits for its slot to be handed back; the streamer then queues its weights, and its
        packets go in normalized: held in registers since the sums where the plan's
        ``holds_raw`` (they and gamma's fit: :func:`~.plan.raw_rows_fit`), else loaded again
        (L2 hits), gamma's with them, RELOADS_AHEAD chunks ahead of the slots. The sums'
        loads keep ``raw_window`` chunks in flight (all of them where they are held)."""
        plan = self.plan
        stream = self.start_stream(w_copy, w_boxes, ring, full, block, part, producer)
        box_in, box_out, evict_first, first_chunk, streamer, pace, lane = stream
        piece = producer % (CHUNK // 8)
        column0 = first_chunk * CHUNK + piece * 8
        held = plan.chunks if plan.holds_raw else plan.depth  # chunks whose gamma and x stay in registers
        gammas = [unpack_words(load_words(gamma.iterator + column0 + i * CHUNK)) for i in range(held)]
        cute.arch.griddepcontrol_wait()
        batch = x.shape[0]
        tokens = [producer // (CHUNK // 8) + PRODUCERS // (CHUNK // 8) * j for j in range(plan.x_items)]
        rows = [x.iterator + clamp(token, batch - 1) * x.stride[0] + column0 for token in tokens]
        # the sums' loads, plan.raw_window chunks in flight (every chunk where they all fit)
        packets = [[load_words(row + i * CHUNK) for row in rows] for i in range(plan.raw_window)]
        packets = packets + [None] * (plan.chunks - plan.raw_window)
        if streamer:  # after x's loads: they do not queue behind the rest of the ring
            for i in cutlass.range_constexpr(pace, plan.depth):
                self.load_weights(w_copy, box_in, box_out, full, block, first_chunk, i, lane, evict_first)
        x_words = plan.depth * plan.w_slot // 4
        slots = [[ring + x_words + i % plan.depth * (plan.x_slot // 4) + swizzled(0, token, piece) * 4
                  for token in tokens] for i in range(plan.chunks)]
        totals = [Float64(0.0)] * plan.x_items
        for i in cutlass.range_constexpr(plan.chunks):
            for j in cutlass.range_constexpr(plan.x_items):
                if cutlass.const_expr(i < plan.depth):
                    if tokens[j] < plan.tokens:
                        store_shared(slots[i][j], packets[i][j])
                for v in unpack_words(packets[i][j]):
                    totals[j] = totals[j] + Float64(v * v)
            if cutlass.const_expr(i + plan.raw_window < plan.chunks):
                packets[i + plan.raw_window] = [load_words(row + (i + plan.raw_window) * CHUNK) for row in rows]
        cute.arch.cluster_wait()  # every CTA's barriers are initialized
        for j in cutlass.range_constexpr(plan.x_items):
            total = butterfly_sum(totals[j], CHUNK // 8)  # the token's 8 pieces
            if (piece == 0) & (tokens[j] < plan.tokens):
                words = double_words(total)
                for cta in cutlass.range_constexpr(plan.split):
                    cute.arch.store_async_dsmem(squares.iterator + part * plan.tokens + tokens[j], words, factored, cta)
        cute.arch.mbarrier_wait(factored, 0)
        inverse = []
        for j in cutlass.range_constexpr(plan.x_items):
            ss = Float64(0.0)  # the parts' exact sums: any order
            for p in cutlass.range_constexpr(plan.split):
                ss += squares[p * plan.tokens + clamp(tokens[j], plan.tokens - 1)]
            inverse.append(rsqrt_like_torch(divide(Float32(ss), Float32(plan.k)) + eps))
        gammas = gammas + [None] * (plan.chunks - held)
        for i in cutlass.range_constexpr(plan.chunks):
            # the chunks past the ring loaded again (not held), RELOADS_AHEAD chunks ahead
            for c in cutlass.range_constexpr(held, plan.chunks):
                if cutlass.const_expr(max(0, c - RELOADS_AHEAD) == i):
                    gammas[c], packets[c] = raw_chunk(gamma, rows, column0, c)
            if cutlass.const_expr(i >= plan.depth):
                wait_handed_back(empty, i, plan.depth)
                if streamer:
                    self.load_weights(w_copy, box_in, box_out, full, block, first_chunk, i, lane, evict_first)
            for j in cutlass.range_constexpr(plan.x_items):
                if tokens[j] < plan.tokens:
                    raw = load_shared(slots[i][j]) if cutlass.const_expr(i < plan.depth) else packets[i][j]
                    values = unpack_words(raw)
                    normed = [(values[e] * inverse[j]) * gammas[i][e] for e in range(8)]
                    store_shared(slots[i][j], pack_values(normed))
            cute.arch.fence_proxy("async.shared", space="cta")  # our stores, then wgmma's reads (async proxy)
            cute.arch.mbarrier_arrive(full + i % plan.depth)

    @cute.jit
    def consume(self, ring, full, empty, warp, lane):
        """acc[tile·T/2 + 4j + 2h + e] = (row 64·tile + 16·warp + 8h + g, token 8j + 2t + e)
        over the CTA's chunks (the m64nT C layout). Each chunk's wgmmas start from zero in
        its own accumulator set (``sets`` chunks in flight at once) and its sum is added to
        the running FP32 sums in chunk order: the tensor core's accumulation (not exact
        FP32: its error grows with the steps it chains) spans 4 k16 steps only."""
        plan = self.plan
        n = plan.tokens // 2
        count = plan.tiles * n
        sums = cute.make_rmem_tensor((count,), Float32)
        chunk_sums = cute.make_rmem_tensor((plan.sets, count), Float32)
        zeros = pinned([Float32(0.0)] * count)
        for k, zero in enumerate(zeros):  # a static loop (range_constexpr warns from 64 on)
            sums[k] = zero
            for s in cutlass.range_constexpr(plan.sets):
                chunk_sums[s, k] = zero
        base = ring.toint()
        for first in cutlass.range(0, plan.chunks, plan.sets, unroll=1):
            for s in cutlass.range_constexpr(plan.sets):
                i = first + s
                slot = i % plan.depth
                landed(full, i, plan.depth)  # TMA's bytes (raw rows: the producers fenced their stores)
                w_slot = base + slot * plan.w_slot
                x_slot = base + plan.depth * plan.w_slot + slot * plan.x_slot
                warpgroup.fence()
                for k16 in cutlass.range_constexpr(CHUNK // 16):
                    b = descriptor(x_slot + 32 * k16)
                    for t in cutlass.range_constexpr(plan.tiles):
                        a = descriptor(w_slot + t * TILE * 128 + 32 * k16)
                        d = wgmma_bf16([chunk_sums[s, t * n + k] for k in range(n)], a, b, accumulate=k16 > 0)
                        for k in cutlass.range_constexpr(n):
                            chunk_sums[s, t * n + k] = d[k]
                warpgroup.commit_group()
            for s in cutlass.range_constexpr(plan.sets):
                warpgroup.wait_group(plan.sets - 1 - s)
                done = pinned([chunk_sums[s, k] for k in range(count)])
                for k, value in enumerate(done):
                    chunk_sums[s, k] = value
                    sums[k] = sums[k] + value
                hand_back(empty + (first + s) % plan.depth, lane)
        return [sums[k] for k in range(count)]

    @cute.jit
    def stage(self, acc, receive, part, tid):
        """Our FP32 sums by owner, a block each: [owned row][token] (by_token: [row][the
        owner's token index]), a token pair a store; our own block into ``receive`` at our
        part, owner q's into the staging (after the receive buffer) at q (the module doc's
        step 3)."""
        plan = self.plan
        n = plan.tokens // 2
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        # every warp's wgmmas are done (a warp's wait_group covers its own), then the ring is ours
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * CONSUMER_WARPS)
        for tile in cutlass.range_constexpr(plan.tiles):
            for h in cutlass.range_constexpr(2):
                row = tile * TILE + 16 * warp + 8 * h + g
                for j in cutlass.range_constexpr(plan.tokens // 8):
                    k = tile * n + 4 * j + 2 * h
                    token = 8 * j + 2 * t
                    if cutlass.const_expr(plan.by_token):  # tokens 2t and 2t + 1: one owner (per_owner is even)
                        owner, index = plan.owner(token)
                        word = plan.receive_word(owner, row, index)
                    else:
                        owner = row // plan.owned
                        word = plan.receive_word(owner, row - owner * plan.owned, token)
                    if owner != part:
                        word = word + plan.staging_word
                    store_shared_floats(receive + word, [acc[k], acc[k + 1]])
        if cutlass.const_expr(plan.split > 1):
            cute.arch.fence_proxy("async.shared", space="cta")  # our stores, then the bulk copies' reads
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * CONSUMER_WARPS)

    @cute.jit
    def send(self, receive, received, part, tid, group):
        """Each staged block q to CTA ``group`` + q's receive buffer at our part, one bulk copy
        on its ``received`` barrier (thread 0; the peers' rings are drained); none to the
        parts that own nothing (GemmPlan.receivers)."""
        plan = self.plan
        if cutlass.const_expr(plan.split > 1):
            if tid == 0:
                block = plan.block_bytes // 4
                for q in cutlass.range_constexpr(plan.receivers):
                    if q != part:
                        copy_to_peer(receive + part * block, receive + plan.staging_word + q * block,
                                     Int32(plan.block_bytes), received, group + q)

    @cute.jit
    def prefetched(self, outs, block, part):
        """:meth:`finish`'s arguments with the peers' bases loaded: issued before the cluster
        barriers, they are back by the first store."""
        first, second, peers, *rest = outs
        return (first, second, self.outputs.bases(peers, block * self.plan.rows + part * self.plan.owned), *rest)

    @cute.jit
    def finish(self, receive, batch, block, part, tid, first, second, bases, row0, col0, col1):
        """Owner epilogue: per 8-row packet of a token, Σ of the K parts in order, stored."""
        plan = self.plan
        packets = self.outputs.packets  # (no Python object may cross the loop's back edge)
        per_token = plan.owned // 8 // packets
        items = batch * per_token
        if cutlass.const_expr(plan.receivers < plan.split):
            if part >= plan.receivers:  # an uneven plan's last parts own no rows (GemmPlan.unit)
                items = Int32(0)
        for item in cutlass.range(tid, items, 32 * CONSUMER_WARPS, unroll=1):
            token, packet = item // per_token, item % per_token * packets
            n0 = block * plan.rows + part * plan.owned + 8 * packet
            if n0 < plan.n:
                values = self.reduced(receive, packet, token)
                if cutlass.const_expr(self.outputs.situ is not None):
                    ups = self.reduced(receive, packet + 1, token)
                    values = [situ_value(Float32(BFloat16(g)), Float32(BFloat16(u)), Float32(self.outputs.situ[0]),
                                         Float32(self.outputs.situ[1])) for g, u in zip(values, ups)]
                self.outputs.store(values, token, n0, first, second, bases, row0, col0, col1)

    @cute.jit
    def reduced(self, receive, packet, token):
        """Σ over the K parts, in part order, of owned rows [8·packet, +8) of ``token``."""
        plan = self.plan
        values = [receive[plan.receive_word(0, 8 * packet + i, token)] for i in range(8)]
        for p in cutlass.range_constexpr(1, plan.split):
            values = [values[i] + receive[plan.receive_word(p, 8 * packet + i, token)] for i in range(8)]
        return values


class NormedGemm(DecodeGemm):
    """``kimi::normed_oproj``: the engine over raw rows of x, RMS-normalized by the producers
    on their way into the ring (:meth:`DecodeGemm.produce_normalized`), BF16 rows out."""

    def __init__(self, plan: GemmPlan):
        super().__init__(plan, Outputs(plan.n))

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, out: cute.Tensor, eps: Float32, stream):
        w_copy, w_boxes = self.weight_copy(w)
        self.launch(self.kernel(w_copy, w_boxes, x, gamma, out, eps), stream)

    @cute.kernel
    def kernel(self, w_copy: cute.CopyAtom, w_boxes: cute.Tensor, x: cute.Tensor, gamma: cute.Tensor,
               out: cute.Tensor, eps: Float32):
        # the producers load x's raw rows themselves (no x descriptor); out stands in for the
        # epilogue's unused tensors (rows go to ``first`` alone)
        self.body(w_copy, w_boxes, None, x, (out, out, out, Int32(0), Int32(0), Int32(0)), (gamma, eps))
