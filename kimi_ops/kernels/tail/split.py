"""The split tail (the seeds' tail half): latent → RMSNorm → up projection + shared, one
rank's N rows, K split over the CTAs of a cluster: the tail below MIN_WAVE_GROUPS token
groups, and in publish mode past MAX_WAVE_TP (else the wave, kernels/tail/wave.py).

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
   timer; two-shot's gathered box has one, summed by LatentReduce), a warp per token,
   sums the sources in rank order in FP32, rounds to BF16, sums the slice's squares in
   FP64 (as NormFront) and the slices' sums meet in every CTA through DSMEM; then it
   normalizes in place.
3. Up projection on the tensor cores: mma.sync m16n8k16 BF16 → FP32, weights as A (16
   rows), xn as B (8 tokens), fragments by ldmatrix.x4 from 128-byte rows in the 128-byte
   swizzle (xn stored the same way), conflict-free; the order of the FP32 accumulation is
   the MMA's, which DESIGN §3.4 leaves free. Each MMA warp arrives on a slot's empty
   barrier once it holds its fragments.
4. The CTA releases its dependents once its xn is in (its first MMA warp's loads back; a
   CTA's release is its first thread's), so that the next call's two launches are done
   before our last CTA is (every dependent waits before reading what follows): faster
   than a release at entry or after the producer's last chunk (benchmarks/NOTES.md).
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
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..launch import PDL
from ..mailbox import box_row, peer_bases, poll_all
from ..packets import butterfly_sum, clamp, inverse_rms, normalized, unpack_words
from ..ptx import (
    bits_float,
    copy_async,
    l2_evict_first,
    load_matrices,
    load_shared,
    load_words,
    mma_bf16,
    pack_values,
    store_cluster,
    store_shared,
    store_words,
)
from ..ring import CHUNK, expect, hand_back, landed, paced, swizzled_stages, wait_handed_back
from ..values import Stamps
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
from .split_plan import (
    CLUSTER,
    PACE,
    TILE_ROWS,
    TILES_PER_WARP,
    Plan,
)


class MoeTail:
    """latent → RMSNorm → up projection + shared, one rank's N rows (see the module doc)."""

    def __init__(self, plan: Plan, publish: bool, stamps: bool = False):
        self.plan, self.publish, self.stamps = plan, publish, stamps
        # chunks held in registers (MoeTail.stash): functional mode only, publish mode's polls
        # already take the registers (162-168 per lane at TP1-2)
        self.stashed = 0 if publish else plan.stash

    @cute.jit
    def __call__(self, latent: cute.Tensor, shared: cute.Tensor, gamma: cute.Tensor, w_up: cute.Tensor,
                 out: cute.Tensor, peers: cute.Tensor, status: cute.Tensor, parity: Int32, rank: Int32, eps: Float32,
                 batch: Int32, rearm_parity: Int32, rearm_batch: Int32, stream):
        """Functional: ``latent`` NormFront's normalized rows [B, L], ``shared`` and ``out``
        [B, N]. Publish mode: ``latent`` and ``shared`` are the boxes [3, TP, CAP, L or N];
        (``peers``, ``status``, ``parity``, ``rank``) the publish side (Outbox). ``status``:
        the error word, the Stamps after its first 16 bytes in the stamping variants (the
        functional stamping tail takes the Stamps buffer alone)."""
        plan = self.plan
        # w_up's TMA descriptor (a kernel parameter): boxes of a cluster's rows × CHUNK columns
        weight_copy, weight_boxes = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w_up, self.ring_layout(1), (plan.rows, CHUNK)
        )
        self.kernel(latent, shared, gamma, weight_copy, weight_boxes, out, peers, status, eps, batch, parity,
                    rank, rearm_parity, rearm_batch).launch(
            grid=[plan.ctas, 1, 1], block=[plan.threads + 32, 1, 1], cluster=[plan.cluster, 1, 1],
            stream=stream, use_pdl=PDL,
        )

    def ring_layout(self, stages):
        """``stages`` ring boxes of rows × CHUNK BF16 in the 128-byte swizzle (Plan.ring_piece)."""
        return swizzled_stages(self.plan.rows, stages)

    @cute.kernel
    def kernel(self, latent: cute.Tensor, shared: cute.Tensor, gamma: cute.Tensor, weight_copy: cute.CopyAtom,
               weight_boxes: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, status: cute.Tensor, eps: Float32,
               batch: Int32, parity: Int32, rank: Int32, rearm_parity: Int32, rearm_batch: Int32):
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        k_slice, cluster = cta % plan.cluster, cta // plan.cluster
        stamp = Stamps(PHASES, self.stamps, status, cta, tid)
        outbox = Outbox(peers, status, parity, rank)
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
                for box, sources in ((latent, plan.sources), (shared, plan.tp)):
                    rearm_previous(box, sources, rearm_parity, rearm_batch, cta * plan.threads + tid,
                                   plan.ctas * plan.threads)
            else:
                cute.arch.griddepcontrol_wait()
            stamp.at("waited")
            cute.arch.cluster_wait()  # the peers have started: DSMEM stores are safe
            shared_rows = None
            if cutlass.const_expr(self.publish):
                self.load_latent(latent, xn, ss, outbox, batch, k_slice, warp, lane)
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
            bases = []
            if cutlass.const_expr(self.publish):
                bases = peer_bases(outbox.peers, plan.tp)  # back by the time the scatter's barriers are through

            if cutlass.const_expr(not plan.receive_words):
                cute.arch.cluster_arrive()  # every CTA is done with its ring: it becomes the receive buffer
                cute.arch.cluster_wait()
                stamp.at("ring free")
            self.scatter(acc, received, batch, tile, k_slice * plan.split + sub, lane)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            stamp.at("scattered")
            self.finish(received, shared, shared_rows, out, bases, outbox, batch, cluster, k_slice, tid)
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
            wait_handed_back(empty, i, plan.depth)
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
    def load_latent(self, latent, xn, ss, outbox, batch, k_slice, warp, lane):
        """Publish mode: latent = BF16(Σ sources, rank order) of this CTA's K slice into
        ``xn``, polled from the latent boxes; each token's Σ BF16(latent²) over the slice
        into slot ``k_slice`` of every CTA's ss. A warp per token, ``tokens_per_pass``
        tokens' polls in flight at once, ``rounds_per_pass`` rounds of them."""
        plan = self.plan
        packets, sources = plan.packets, plan.sources
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
                            row = box_row(outbox.parity, source, token, sources, latent.shape[2])
                            addresses.append(latent.iterator + row * plan.latent + column)
                packets_in = poll_all(addresses, outbox.error, LATENT_POLL)
                for u in cutlass.range_constexpr(per_pass):
                    token = base + u * plan.warps
                    for q in cutlass.range_constexpr(first, first + pass_rounds):
                        packet, at = lane + 32 * q, (u * pass_rounds + q - first) * sources
                        rounded = rank_sums(packets_in[at:at + sources], sources)[0]
                        if (packet < packets) & (token < batch):
                            squares[u] += sum_of_squares(rounded)
                            words = pack_values(rounded)
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
            hand_back(empty + i, lane)
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
            hand_back(empty + slot, lane)
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
    def finish(self, received, shared, shared_rows, out, bases, outbox, batch, cluster, k_slice, tid):
        """Owner epilogue, 8 rows per packet: up = BF16(Σ parts in K order); out =
        BF16(up + shared), shared = ``shared_rows`` (functional) or BF16(Σ reduce-scatter
        sources) (publish mode: into every rank's output box, ``bases``)."""
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
                    extra = reduced_shared(shared, plan.tp, outbox.parity, [(token, row)], outbox.error)[0]
                    publish_out(bases, plan.shard, outbox.rank, token, row, output_packet(up, extra))
                else:
                    store_words(out.iterator + token * out.stride[0] + row,
                                output_packet(up, unpack_words(shared_rows[r])))


def bits_pointer(words, index):
    """Word ``index`` of a Uint32 shared buffer as an FP32 pointer."""
    return cute.recast_ptr(words + index, dtype=Float32)
