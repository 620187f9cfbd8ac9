"""Block Attention Residuals on Hopper (``kimi::attn_res``, DESIGN §3.8; not in the seeds).

A cluster of ``cluster`` CTAs per token (grid B · cluster); CTA c of token b's cluster owns
the packets (8 columns, 16 bytes) [c·P, (c+1)·P) of H, P = H / 8 / cluster, a thread per
packet (``rounds`` packets a thread past 1024). Every sum over H is formed in FP64 from
terms that are exact in FP32 — x² and K·q of BF16 values have 16 significant bits, so
FP64 adds them without rounding and every order gives the reference's float64 sum — in
a fixed order all the same (lane butterfly, warps in order, the cluster's CTAs in rank
order through DSMEM), then rounded once to FP32 as ``numerics.sum_f32`` does. The
reference's rounding points, in order:

1. Before ``griddepcontrol.wait`` (the seeds' block statistics): the weights' packets and
   the N completed blocks' rows (cp.async into a shared-memory stash of ``rows`` ≥ N rows,
   all in flight at once; read three times, so HBM serves them once); per block
   ss_n = Σ x² → rr_n = rsqrt.approx(ss_n / H + eps) (div.rn, the instruction torch.rsqrt
   runs on CUDA); K = BF16((x · rr_n) · key_norm_w) in FP32; logit_n = Σ K · query. The
   blocks depend only on earlier layers: their writer must be complete when our
   predecessor releases us (the decoder writes them by torch.cat, a plain launch).
2. After the wait: new_partial = BF16(partial + Σ_tp sublayer_out[tp]) as an FP32 chain
   in rank order (stored at once), then its ss, rr, key and logit as above: two rounds.
3. Softmax over the N + 1 logits in FP32 by warp 0: m = max, e_n = exp(l_n − m) (the
   accurate exp), s = Σ e_n (lanes' sums, then a butterfly), α_n = e_n / s (div.rn, as
   torch's CUDA softmax divides), into shared memory.
4. h = BF16(FP32(Σ_n FP64(α_n · V_n))): FP32 products (the reference's
   ``alpha * f32(values)``) summed in FP64 in n order, rounded to FP32, then BF16.
5. h_normed = BF16((h · rr_h) · out_norm_w), rr_h from Σ h² of the rounded h: one round.

A round of the exchange: each warp's butterfly sum to shared memory, a CTA barrier, one
thread per value adds the warps in order and sends the CTA's sum into slot [value, c] of
every CTA of the cluster (st.async, counted on the round's mbarrier in the receiver),
every thread waits on its CTA's barrier of the round, then adds the slots in rank order.
Each round has its own slots and barrier: nothing is reused within a launch. Three rounds
follow the wait; the two of the blocks precede it. Not a cluster barrier: its release
waits for every global store issued before it (new_partial's, h's) to be performed, in the
queues the next kernel's prefetch fills (benchmarks/NOTES.md, nineteenth session).

``AttnResTake`` (``kimi::attn_res_take``, ``mailbox_take`` fused): the same kernel, the
sublayer's rows polled from the box after step 1 (bounded, into the error word), re-armed,
and only then the wait (for ``partial`` and the outputs).

Shared memory a CTA: the stash (H = 7168: 1.75 KB a row), 8 bytes a slot per warp and per
CTA of the cluster. At B = 64 the grid is 512 CTAs of 128 threads: one wave (4 CTAs an
SM) while the stash bucket is ≤ 24 rows (N ≤ 24); deeper stacks run in two (not measured).

PDL: the dependents are released at entry (kernels/launch.py says why), AttnResTake's once
its packets are re-armed.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ...mailbox import TAKE_POLL
from ..launch import MARKS, PDL
from ..mailbox import box_row, poll_all, rearm, release_consumed
from ..packets import (
    butterfly,
    butterfly_sum,
    clamp,
    cluster_total,
    exact_dot,
    inverse_rms,
    normalized,
    send_to_cluster,
    unpack_words,
)
from ..ptx import copy_async, divide, load_shared, load_words, pack_values, store_words
from ..values import Marks, marked
from .plan import (
    MAX_THREADS,
    NEG_INF,
)

# The exchange rounds, each with its own mbarrier: the blocks' Σ x² and logits (N values
# each), then new_partial's Σ x², its logit and h's Σ x² (one value each)
BLOCK_SS, BLOCK_DOT, PARTIAL_SS, PARTIAL_DOT, H_SS = range(5)
EXCHANGES = H_SS + 1
# KIMI_OPS_MARKS: AttnResTake's phases after its start (benchmarks/timeline.py --marks)
# (block stats, rows polled, PDL wait over, the three rounds, h_normed stored)
TAKE_MARKS = marked(1, "attn_res_take", ("stats", "polled", "waited", "partial ss", "logit", "h ss", "stored"))


class AttnRes:
    """One token per cluster of ``cluster`` CTAs (see the module doc); N ≤ ``rows``
    completed blocks (a runtime count), ``tp`` sublayer sources."""

    def __init__(self, hidden: int, tp: int, cluster: int, rows: int):
        self.hidden, self.tp, self.cluster, self.rows = hidden, tp, cluster, rows
        self.packets = hidden // 8 // cluster  # per CTA
        self.threads = min(MAX_THREADS, -(-self.packets // 32) * 32)
        self.rounds = -(-self.packets // self.threads)  # packets per thread
        self.warps = self.threads // 32
        # exchange slots: the blocks' ss and logits, then new_partial's ss and logit, h's ss
        self.block_ss, self.block_dot = 0, rows
        self.partial_ss, self.partial_dot, self.h_ss = 2 * rows, 2 * rows + 1, 2 * rows + 2
        self.slots = 2 * rows + 3
        self.first_slot = (self.block_ss, self.block_dot, self.partial_ss, self.partial_dot, self.h_ss)  # by round

    @cute.jit
    def __call__(self, blocks: cute.Tensor, partial: cute.Tensor, sublayer: cute.Tensor, query: cute.Tensor,
                 key_norm_w: cute.Tensor, out_norm_w: cute.Tensor, new_partial: cute.Tensor, h: cute.Tensor,
                 h_normed: cute.Tensor, count: Int32, eps: Float32, stream):
        """``blocks`` [N·B, H] (N = ``count``), ``sublayer`` [TP·B, H]: rows by (block or
        source, token); the rest [B, H] or [H]."""
        self.launch(self.kernel(blocks, partial, sublayer, query, key_norm_w, out_norm_w, new_partial, h, h_normed,
                                count, eps), partial, stream)

    def launch(self, kernel, partial, stream):
        """A cluster per token (partial's rows), with programmatic dependent launch."""
        kernel.launch(grid=[partial.shape[0] * self.cluster, 1, 1], block=[self.threads, 1, 1],
                      cluster=[self.cluster, 1, 1], stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, blocks: cute.Tensor, partial: cute.Tensor, sublayer: cute.Tensor, query: cute.Tensor,
               key_norm_w: cute.Tensor, out_norm_w: cute.Tensor, new_partial: cute.Tensor, h: cute.Tensor,
               h_normed: cute.Tensor, count: Int32, eps: Float32):
        cute.arch.griddepcontrol_launch_dependents()  # at entry (launch.py: PDL)
        at, space, columns, weights = self.start(blocks, partial, query, key_norm_w, out_norm_w, count, eps)
        token = at.token
        cute.arch.griddepcontrol_wait()
        rows = []  # per round: partial, then the TP sources in rank order (loads in flight together)
        for q in cutlass.range_constexpr(self.rounds):
            own = [partial.iterator + token * self.hidden + columns[q]]
            sources = [sublayer.iterator + (s * partial.shape[0] + token) * self.hidden + columns[q]
                       for s in range(self.tp)]
            rows.append([load_words(address) for address in own + sources])
        self.finish(rows, at, space, columns, weights, new_partial, h, h_normed, count, eps, Marks(0, False))

    @cute.jit
    def start(self, blocks, partial, query, key_norm_w, out_norm_w, count, eps):
        """What precedes the wait: the weights' packets and step 1. Returns the thread's
        :class:`Place`, its :class:`AttnResSpace`, each round's first column and the
        :class:`Weights`' packets."""
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        token, part = cta // self.cluster, cta % self.cluster
        space = self.allocate()
        self.arm_rounds(space.arrived, count, tid)
        columns = self.columns(part, tid)
        weights = Weights(self.weights(query, columns), self.weights(key_norm_w, columns),
                          self.weights(out_norm_w, columns))
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_arrive_relaxed()  # DSMEM needs every CTA of the cluster started
        if cutlass.const_expr(self.rows > 0):
            self.block_statistics(blocks, space, columns, weights, count, partial.shape[0], token, part, tid, eps)
        elif cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_wait()
        return Place(token, part, tid), space, columns, weights

    @cute.jit
    def finish(self, rows, at, space, columns, weights, new_partial, h, h_normed, count, eps, marks):
        """Steps 2-5 of the module doc from each round's rows (partial and the sources);
        ``marks`` at each round's end and after the last store."""
        token, part, tid = at.token, at.part, at.tid
        query_v, key_w, out_w = weights.query, weights.key_norm, weights.out_norm
        stash, partials, received, alpha = space.stash, space.partials, space.received, space.alpha
        valid = self.valid(tid)
        values = []  # new_partial's rounded values (FP32) per round
        squares = Float64(0.0)
        for q in cutlass.range_constexpr(self.rounds):
            acc = unpack_words(rows[q][0])
            for source in cutlass.range_constexpr(self.tp):
                extra = unpack_words(rows[q][1 + source])
                acc = [acc[i] + extra[i] for i in range(8)]
            words = pack_values(acc)
            squares += self.stored(new_partial, words, token, columns[q], valid[q])
            values.append(unpack_words(words))
        self.warp_sum(partials, self.partial_ss, squares, tid)
        self.share(space, PARTIAL_SS, 1, part, tid)
        marks.at()
        inv = inverse_rms(self.total(received, self.partial_ss), self.hidden, eps)
        dot = Float64(0.0)
        for q in cutlass.range_constexpr(self.rounds):
            if valid[q]:
                dot += key_dot(values[q], inv, key_w[q], query_v[q])
        self.warp_sum(partials, self.partial_dot, dot, tid)
        self.share(space, PARTIAL_DOT, 1, part, tid)
        marks.at()
        self.softmax(received, alpha, count, tid)
        squares = Float64(0.0)
        mixed = []  # h's rounded values (FP32) per round
        for q in cutlass.range_constexpr(self.rounds):
            acc = cute.make_rmem_tensor(8, Float64)  # carried through the runtime loop over N
            for i in cutlass.range_constexpr(8):
                acc[i] = Float64(0.0)
            if cutlass.const_expr(self.rows > 0):
                for n in cutlass.range(count, unroll=1):
                    weight = alpha[n]
                    block = unpack_words(load_shared(stash + self.stash_word(n, q, tid)))
                    for i in cutlass.range_constexpr(8):
                        acc[i] = acc[i] + Float64(weight * block[i])
            weight = alpha[count]
            total = [acc[i] + Float64(weight * values[q][i]) for i in range(8)]
            words = pack_values([Float32(t) for t in total])
            squares += self.stored(h, words, token, columns[q], valid[q])
            mixed.append(unpack_words(words))
        self.warp_sum(partials, self.h_ss, squares, tid)
        self.share(space, H_SS, 1, part, tid)
        marks.at()
        inv = inverse_rms(self.total(received, self.h_ss), self.hidden, eps)
        for q in cutlass.range_constexpr(self.rounds):
            if valid[q]:
                store_words(h_normed.iterator + token * self.hidden + columns[q], normalized(mixed[q], inv, out_w[q]))
        marks.at()

    @cute.jit
    def stored(self, out, words, token, column, valid) -> Float64:
        """A packet of BF16 words into ``out`` where ``valid``; returns Σ x² of its values
        (0 elsewhere)."""
        squares = Float64(0.0)
        if valid:
            store_words(out.iterator + token * self.hidden + column, words)
            values = unpack_words(words)
            squares = exact_dot(values, values)
        return squares

    @cute.jit
    def block_statistics(self, blocks, space, columns, weights, count, batch, token, part, tid, eps):
        """Step 1: the N blocks' rows into the stash, their ss and then their logits over
        the cluster (two rounds, N values each)."""
        query_v, key_w = weights.query, weights.key_norm
        stash, partials, received = space.stash, space.partials, space.received
        valid = self.valid(tid)
        for n in cutlass.range(count, unroll=1):
            for q in cutlass.range_constexpr(self.rounds):
                if valid[q]:
                    copy_async(stash + self.stash_word(n, q, tid),
                               blocks.iterator + (n * batch + token) * self.hidden + columns[q])
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)  # a thread reads back only its own packets
        for n in cutlass.range(count, unroll=1):
            squares = Float64(0.0)
            for q in cutlass.range_constexpr(self.rounds):
                if valid[q]:
                    block = unpack_words(load_shared(stash + self.stash_word(n, q, tid)))
                    squares += exact_dot(block, block)
            self.warp_sum(partials, self.block_ss + n, squares, tid)
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_wait()  # every CTA of the cluster has started (the relaxed arrive)
        self.share(space, BLOCK_SS, count, part, tid)
        for n in cutlass.range(count, unroll=1):
            inv = inverse_rms(self.total(received, self.block_ss + n), self.hidden, eps)
            dot = Float64(0.0)
            for q in cutlass.range_constexpr(self.rounds):
                if valid[q]:
                    block = unpack_words(load_shared(stash + self.stash_word(n, q, tid)))
                    dot += key_dot(block, inv, key_w[q], query_v[q])
            self.warp_sum(partials, self.block_dot + n, dot, tid)
        self.share(space, BLOCK_DOT, count, part, tid)

    @cute.jit
    def softmax(self, received, alpha, count, tid):
        """Step 3: α_n for n ≤ N (N: new_partial's logit) into ``alpha``, by warp 0."""
        lanes = -(-(self.rows + 1) // 32)  # logits per lane
        if tid < 32:
            logits = []
            top = Float32(NEG_INF)
            for j in cutlass.range_constexpr(lanes):
                n = tid + 32 * j
                logit = Float32(NEG_INF)
                if cutlass.const_expr(self.rows > 0):
                    if n < count:
                        logit = Float32(self.total(received, self.block_dot + clamp(n, self.rows - 1)))
                if n == count:
                    logit = Float32(self.total(received, self.partial_dot))
                top = cute.arch.fmax(top, logit)  # NaN-quiet: a NaN logit's s is NaN, so every α
                logits.append(logit)
            top = butterfly(top, 32, cute.arch.fmax)
            exps = []
            total = Float32(0.0)
            for j in cutlass.range_constexpr(lanes):
                e = Float32(0.0)
                if tid + 32 * j <= count:
                    e = cute.math.exp(logits[j] - top)
                total += e
                exps.append(e)
            total = butterfly_sum(total, 32)
            for j in cutlass.range_constexpr(lanes):
                if tid + 32 * j <= count:
                    alpha[tid + 32 * j] = divide(exps[j], total)
        cute.arch.sync_threads()

    @cute.jit
    def warp_sum(self, partials, slot, value: Float64, tid):
        """The warp's sum of ``value`` into slot ``slot`` (lane 0 stores it)."""
        total = butterfly_sum(value, 32)
        if tid % 32 == 0:
            partials[slot, tid // 32] = total

    @cute.jit
    def arm_rounds(self, arrived, count, tid):
        """Thread 0 arms each exchange round's barrier for the bytes the cluster's CTAs send
        this CTA in it (the blocks' rounds: N values), before the cluster's first arrive."""
        if cutlass.const_expr(self.cluster > 1):
            if tid == 0:
                for round_ in cutlass.range_constexpr(EXCHANGES):
                    values = count if round_ < PARTIAL_SS else 1
                    cute.arch.mbarrier_init(arrived + round_, 1)
                    cute.arch.mbarrier_arrive_and_expect_tx(arrived + round_, values * (self.cluster * 8))
                cute.arch.mbarrier_init_fence()

    @cute.jit
    def share(self, space, round_: cutlass.Constexpr[int], count, part, tid):
        """Exchange round ``round_`` over its ``count`` slots: the CTA's sums (warps in
        order) into slot [·, part] of every CTA of the cluster; on return every thread may
        read them all."""
        partials, received, first = space.partials, space.received, self.first_slot[round_]
        arrived = space.arrived + round_
        cute.arch.sync_threads()  # every warp's sum is in
        for n in cutlass.range(tid, count, self.threads, unroll=1):
            total = Float64(0.0)
            for w in cutlass.range_constexpr(self.warps):
                total += partials[first + n, w]
            send_to_cluster(received, first + n, total, part, self.cluster, arrived)
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.mbarrier_wait(arrived, 0)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def total(self, received, slot) -> Float64:
        return cluster_total(received, slot, self.cluster)

    @cute.jit
    def allocate(self) -> "AttnResSpace":
        """The CTA's shared memory (:class:`AttnResSpace`)."""
        smem = SmemAllocator()
        partials = smem.allocate_tensor(Float64, cute.make_layout((self.slots, self.warps), stride=(self.warps, 1)), 16)
        received = smem.allocate_tensor(Float64, cute.make_layout((self.slots, self.cluster), stride=(self.cluster, 1)),
                                        16)
        alpha = smem.allocate_tensor(Float32, cute.make_layout(self.rows + 1), 16)
        arrived = smem.allocate_tensor(Int64, cute.make_layout(EXCHANGES), 16).iterator
        stash = smem.allocate_tensor(Uint32, cute.make_layout(max(self.stash_words(), 4)), 16).iterator
        return AttnResSpace(partials, received, alpha, arrived, stash)

    def stash_words(self) -> int:
        return self.rows * self.packets * 4

    def smem_bytes(self) -> int:
        """What :meth:`allocate` takes (each piece 16-byte aligned)."""
        pieces = (8 * self.slots * self.warps, 8 * self.slots * self.cluster, 4 * (self.rows + 1),
                  8 * EXCHANGES, 4 * max(self.stash_words(), 4))
        return sum(-(-piece // 16) * 16 for piece in pieces)

    @cute.jit
    def stash_word(self, n, q, tid):
        """Word of block ``n``'s packet (16 bytes) of thread ``tid``'s round ``q``, rows of
        the CTA's packets: consecutive threads adjacent, conflict-free. Clamped: a thread
        past the packets reads a valid one it never uses."""
        return (n * self.packets + clamp(tid + self.threads * q, self.packets - 1)) * 4

    def valid(self, tid):
        return [tid + self.threads * q < self.packets for q in range(self.rounds)]

    @cute.jit
    def columns(self, part, tid):
        """Each round's first column (clamped: past the CTA's packets a thread reads a valid
        packet it never uses)."""
        return [(part * self.packets + clamp(tid + self.threads * q, self.packets - 1)) * 8
                for q in range(self.rounds)]

    @cute.jit
    def weights(self, weight, columns):
        """The rounds' packets of a weight [H] as FP32 (loaded before the wait)."""
        return [unpack_words(load_words(weight.iterator + column)) for column in columns]


class AttnResTake(AttnRes):
    """``kimi::attn_res_take``: AttnRes with the sublayer's rows polled from the box
    (``mailbox_take`` fused). After step 1 each thread polls its packet of every source
    (Lamport, the loads in flight together, bounded: TAKE_POLL into the error word) and
    re-arms it; only then does it release its dependents (mailbox.release_consumed) and
    wait for the previous grid, before it reads ``partial`` (the previous AttnRes's) and
    writes the outputs. A thread past its CTA's packets polls
    nothing: its clamped packet is another thread's, which re-arms it."""

    @cute.jit
    def __call__(self, blocks: cute.Tensor, partial: cute.Tensor, box: cute.Tensor, error: cute.Tensor,
                 query: cute.Tensor, key_norm_w: cute.Tensor, out_norm_w: cute.Tensor, new_partial: cute.Tensor,
                 h: cute.Tensor, h_normed: cute.Tensor, count: Int32, first_row: Int32, capacity: Int32, eps: Float32,
                 stream):
        """``box`` [parities · TP · CAP, H]: source s of token b at row first_row + s · CAP + b."""
        self.launch(self.kernel(blocks, partial, box, error, query, key_norm_w, out_norm_w, new_partial, h, h_normed,
                                count, first_row, capacity, eps), partial, stream)

    @cute.kernel
    def kernel(self, blocks: cute.Tensor, partial: cute.Tensor, box: cute.Tensor, error: cute.Tensor,
               query: cute.Tensor, key_norm_w: cute.Tensor, out_norm_w: cute.Tensor, new_partial: cute.Tensor,
               h: cute.Tensor, h_normed: cute.Tensor, count: Int32, first_row: Int32, capacity: Int32, eps: Float32):
        marks = Marks(TAKE_MARKS, MARKS)
        marks.at()
        at, space, columns, weights = self.start(blocks, partial, query, key_norm_w, out_norm_w, count, eps)
        marks.at()
        token, tid = at.token, at.tid
        valid = self.valid(tid)
        polled = cute.make_rmem_tensor((self.rounds, max(self.tp, 1), 4), Uint32)
        for q in cutlass.range_constexpr(self.rounds):
            if valid[q]:
                packets = [box.iterator + (first_row + box_row(0, source, token, self.tp, capacity)) * self.hidden + columns[q]
                           for source in range(self.tp)]
                words = poll_all(packets, error, TAKE_POLL)
                for source in cutlass.range_constexpr(self.tp):
                    rearm(packets[source])
                    for k in cutlass.range_constexpr(4):
                        polled[q, source, k] = words[source][k]
        marks.at()
        release_consumed()
        cute.arch.griddepcontrol_wait()
        marks.at()
        rows = [[load_words(partial.iterator + token * self.hidden + columns[q])]
                + [[polled[q, source, k] for k in range(4)] for source in range(self.tp)] for q in range(self.rounds)]
        self.finish(rows, at, space, columns, weights, new_partial, h, h_normed, count, eps, marks)
        marks.store(error)


@cute.jit
def key_dot(values, inv: Float32, key_w, query_v) -> Float64:
    """Σ K · q over a packet, K = BF16((x · inv) · key_norm_w): FP32 products of BF16
    values (exact) added in FP64."""
    total = Float64(0.0)
    for i in cutlass.range_constexpr(8):  # each key's product at once: the kernel's verified schedule
        key = Float32(BFloat16((values[i] * inv) * key_w[i]))
        total += Float64(key * query_v[i])
    return total


class Place(NamedTuple):
    """A thread's place: its token, its CTA's part of the token's cluster, its thread."""

    token: object
    part: object
    tid: object


class Weights(NamedTuple):
    """The rounds' FP32 packets of the [H] weights, loaded before the wait."""

    query: list
    key_norm: list
    out_norm: list


class AttnResSpace(NamedTuple):
    """A CTA's shared memory, in allocation order."""

    partials: object  # [slot, warp] FP64: the warps' sums
    received: object  # [slot, CTA] FP64: the cluster's sums
    alpha: object  # [rows + 1] FP32: the softmax weights
    arrived: object  # the exchange rounds' mbarriers (Int64 pointer)
    stash: object  # the N blocks' rows (words)
