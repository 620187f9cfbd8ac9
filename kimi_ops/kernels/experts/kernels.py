"""The routed experts' stand-in on Hopper (``kimi::routed_experts``; not a seed kernel).

One cluster of C CTAs a (token, expert) pair: the grid is B·16·C CTAs, which the hardware
hands to SMs as others end (a balanced schedule, no persistent loop). For pair (b, k),
expert e = ids[b, k]: if e is this rank's, k is e's first slot in token b, and b is e's
token number 0, T, 2·T, … (token-major; the CTA's threads count the tokens before it
that hold e; T: ``tokens``), the cluster serves e for that token and the next T − 1
routed to it; any other pair of e ends at once. So each routed expert's weights are read
once a step per T of its tokens, with no gather and no sort, and a popular expert's
tokens spread over clusters. CTA r of a cluster takes 1/C of L (:func:`cluster_size`):
gate/up columns [r·L/C, (r+1)·L/C) and the same down rows, so a token's FP64 sums and the
expert's bytes spread over C SMs while the SMs would otherwise idle (:func:`cluster_for`:
B ≤ 2 at L = 3584), and a CTA takes the whole expert (C = 1) past that; the gate/up partial sums meet
over DSMEM, added in rank order in every CTA (the same bits in each). A pair of another
rank's expert (or an id outside [0, E)) gets a zero row, each CTA its slice. A CTA streams its slice of the
expert (2I rows of L/C gate/up values, L/C down rows of I) by bulk copies (TMA, no tensor
map) through a ring of chunks of 8·L/C bytes, the whole slice in flight where shared
memory allows (the version with plain loads kept few in flight: benchmarks/NOTES.md).

For each token of e, the reference's rounding points:

1. hidden_r = FP32(Σ_l gate_up[e, r, l] · latent[b, l]) for the 2I rows: each product of
   BF16 values exact in FP64, added by one FMA — a thread's 4 packets in order, the row's
   lanes in a warp (butterfly), the warps in order (shared memory), then the cluster's CTAs
   in rank order (DSMEM) — rounded once.
2. act_j = situ(hidden_j, hidden_{I+j}): gate and up rounded to BF16, FP32 math, BF16.
3. row_l = BF16(FP32(Σ_j act_j · down[e, l, j])), the sum in FP64 alike.

The FP64 operands cost no conversion unit a product (16 cvt an SM a clock, which bounded
the FP32 products' conversions: benchmarks/NOTES.md): a weight is widened from its bits
(ptx.widened_bf16: the value times 2^-896, exact for every finite BF16; infinite weights are
not supported) once for all the CTA's tokens, and the latent and acts, converted once a
token, are stored times 2^896 (packets.wide_operand), so each product is the exact one.

A group of P = L/(8C) threads takes a chunk, P a CTA's packets of a row (rounded up to
whole warps: the butterflies need every lane); with the whole slice in flight G groups take
chunks g, g + G, … at once (:attr:`RoutedExperts.groups`). A gate/up chunk is 4 rows of the slice: thread t < P takes row t % 4 and
packets t // 4 + (P/4)·j (j < 4), rows padded by 2 packets in the slot (conflict-free
reads). A down chunk is 4L/(C·I) rows of the slice: thread t takes the 32/I rows t·32/I …
(4 packets). The serve first issues the
ring's first chunks, then finds its tokens (masks, then warp 0's ballots list the matched
tokens in order, up to T; at T = 1 its own token alone) and widens their latent slices into
shared memory once, each packet's pairs beside the warp's other packets' (conflict-free
reads): every gate/up chunk reads them there, not from L2.

By expert (``by_expert``: past one wave where a CTA holds a whole expert, the TP8 rank's L =
512; :func:`~.plan.call_plan`): the grid is the rank's E/TP experts, ``spread`` CTAs each,
one wave. A CTA knows its expert at launch, so its whole stream is in flight before the
wait; then it lists the expert's tokens (masks, warp 0's ballots, in token order), takes
share s of ``spread`` of them and serves them T = 8 at a time over the weights in shared
memory, the same steps 1-3, step 1 on tensor cores (:meth:`RoutedExperts.gate_mma`: FP64
mma, each product exact, every token slot of the pass at once, where the per-token FMA
chains each waited for the one before); CTA c writes the zero rows of pairs c, c + grid, …
that no expert of the rank serves. No CTA is spent on a pair another serves (the pair grid's ~700
of 1024 CTAs at the TP8 rank's B = 64 each ran a prologue for nothing).

``counted`` (the decoder's routing beside the fused shared expert, runtime/prepared.py):
the ids and latent are the route poll's, which counts its 2B CTAs into ``ready`` once
stored; each CTA waits for that count (mailbox.await_arrivals, bounded) instead of the PDL
wait, which would also wait for every grid launched before the route poll.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ...config import TOP_K
from ...mailbox import EXPERTS_READY
from ..launch import PDL
from ..mailbox import await_arrivals
from ..packets import (
    butterfly,
    clamp,
    cluster_barrier,
    cluster_total,
    send_to_cluster,
    situ_value,
    unpack_words,
    wide_dot,
    wide_operand,
    widened_packet,
)
from ..ptx import (
    bulk_copy,
    l2_evict_first,
    load_shared,
    load_shared_doubles,
    load_words,
    mma_f64,
    pack_values,
    store_shared_doubles,
    store_word,
    store_words,
)
from .plan import (
    GATE_ROWS,
    MAX_BATCH,
    MAX_THREADS,
    MMA_TOKENS,
    cluster_size,
    slot_words,
    smem_bytes,
    stash_doubles,
    smem_share,
)


class RoutedExperts:
    """Latent width ``latent``, expert width ``intermediate`` (see the module doc)."""

    def __init__(self, latent: int, intermediate: int, cluster: int | None, per_sm: int, tokens: int,
                 counted: bool = False, by_expert: bool = False):
        """``cluster``: C (None: :func:`cluster_size`'s); ``per_sm``: the CTAs an SM is to
        hold at once: each takes at most 1/per_sm of its shared memory and registers, and of
        its threads past one chunk group; ``tokens``: T, the most of an expert's tokens a CTA
        serves (by expert: a pass; :func:`~.plan.call_plan` picks both); ``counted``: see the
        module doc; ``by_expert``: a grid of the rank's experts (the module doc)."""
        self.latent, self.intermediate, self.per_sm, self.tokens = latent, intermediate, per_sm, tokens
        self.counted, self.by_expert = counted, by_expert
        self.cluster = cluster or cluster_size(latent, intermediate)
        self.slice = latent // self.cluster  # a CTA's columns of gate/up and rows of down
        self.packets = self.slice // 8  # P: a slice row's packets
        self.group_threads = -(-self.packets // 32) * 32  # whole warps: the butterflies need every lane
        self.group_warps = self.group_threads // 32
        self.row_threads = self.packets // GATE_ROWS  # a gate/up row's threads in a chunk
        self.gate_chunks = 2 * intermediate // GATE_ROWS
        self.chunks = self.gate_chunks + intermediate // GATE_ROWS  # then L·I/(4L) down chunks
        self.slot_words = slot_words(latent, self.cluster)
        self.row_words = self.slot_words // GATE_ROWS  # a gate/up row in a slot
        self.token_doubles = stash_doubles(self.packets)  # a token's stride in the latent stash
        self.down_rows = 32 // intermediate  # a thread's rows of a down chunk
        # the whole slice in flight where it fits (a B ≤ 8 step is the stream's latency)
        self.depth = max((d for d in range(1, self.chunks + 1) if self.smem_bytes(d) <= smem_share(per_sm)), default=0)
        if not self.depth:
            raise ValueError(f"the routed experts' CTA does not fit 1/{per_sm} of an SM's shared memory with a ring "
                             f"(L={latent}, I={intermediate}, C={self.cluster}, T={tokens})")
        # With the whole slice in flight, groups of P threads take chunks g, g + G, … at once
        # (a chunk's serial ~400 clocks, benchmarks/NOTES.md, G times fewer); a ring shorter
        # than the stream is one group's, its slots re-issued in chunk order
        self.groups = 1
        if self.depth == self.chunks:
            self.groups = max((g for g in range(1, self.gate_chunks + 1)
                               if self.gate_chunks % g == 0 and g * self.group_threads <= MAX_THREADS // per_sm),
                              default=1)
        self.threads = self.groups * self.group_threads
        self.warps = self.threads // 32
        assert not by_expert or (self.cluster == 1 and self.depth == self.chunks and tokens == MMA_TOKENS), \
            "by expert: whole experts a CTA, passes of the mma's N tokens"

    def smem_bytes(self, depth: int | None = None) -> int:
        """What :meth:`allocate` takes with a ring of ``depth`` (ours by default)."""
        return smem_bytes(self.latent, self.intermediate, self.cluster, self.tokens, depth or self.depth)

    @cute.jit
    def __call__(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
                 out: cute.Tensor, ready: cute.Tensor, error: cute.Tensor, batch: Int32, rank: Int32,
                 per_rank: Int32, experts: Int32, wave: Int32, spread: Int32, stream):
        """``ids`` [B·16]; ``gate_up`` [E·2I, L]; ``down`` [E·L, I]; ``out`` [B·16, L]; ``ready``
        [2] and ``error`` [1] (``counted`` only); ``wave``: 1 where the CTAs served are one
        wave (:attr:`~.plan.CallPlan.wave`); ``spread``: by expert, the CTAs an expert."""
        grid = per_rank * spread if cutlass.const_expr(self.by_expert) else batch * TOP_K * self.cluster
        self.kernel(latent, ids, gate_up, down, out, ready, error, batch, rank, per_rank, experts, wave,
                    spread).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
                                   stream=stream, use_pdl=PDL, **shares_sm(self.per_sm))

    @cute.kernel
    def kernel(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
               out: cute.Tensor, ready: cute.Tensor, error: cute.Tensor, batch: Int32, rank: Int32,
               per_rank: Int32, experts: Int32, wave: Int32, spread: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        pair, part = cta // self.cluster, cta % self.cluster
        if wave != 0:
            # A dependent launches once every CTA of ours has released or ended: with the
            # pairs served in one wave (the others end at once) that is at once, and it
            # streams its weights beside our latency-bound CTAs.
            cute.arch.griddepcontrol_launch_dependents()
        space = self.allocate()
        full = space.full
        if cutlass.const_expr(self.by_expert):
            expert = rank * per_rank + cta // spread  # ours
        if tid == 0:
            for slot in cutlass.range_constexpr(self.depth):
                cute.arch.mbarrier_init(full + slot, 1)
            cute.arch.mbarrier_init_fence()
            if cutlass.const_expr(self.by_expert):  # the weights do not depend on the routing
                self.issue_ring(gate_up, down, expert, 0, space.ring, full)
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_arrive_relaxed()  # DSMEM needs every CTA of the cluster started
        if cutlass.const_expr(self.counted):  # ids and latent: the routing's
            await_arrivals(ready, Int64(2 * batch), grid, error, EXPERTS_READY)
        else:
            cute.arch.griddepcontrol_wait()
        served = Int32(0)
        if cutlass.const_expr(self.by_expert):
            self.zero_rows_of_others(out, ids, batch, rank, per_rank, experts, cta, grid, tid)
            self.serve_expert(latent, ids, gate_up, down, out, batch, expert, cta % spread, spread, tid, space)
        else:
            served = self.take(latent, ids, gate_up, down, out, batch, rank, per_rank, experts, pair, part, tid,
                               space)
        if cutlass.const_expr(self.cluster > 1):
            if served == 0:
                cute.arch.cluster_wait()  # the relaxed arrive's (serve waits before its DSMEM stores)
        if wave == 0:
            # At the end, not at entry (launch.py): kernels launched beside a grid of several
            # waves shared the SMs of its last wave (3-5 µs slower at B <= 8, benchmarks/timeline.py).
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def take(self, latent, ids, gate_up, down, out, batch, rank, per_rank, experts, pair, part, tid, space) -> Int32:
        """Pair ``pair``: its zero row, nothing (another pair of its expert serves it), or its
        expert's service; 1 if it served. Every CTA of a cluster decides alike (the same
        pair): all serve, or none."""
        expert = expert_of(ids, pair, rank, per_rank, experts)
        serves = Int32(0)
        if expert < 0:
            self.zero_row(out, pair, part, tid)
        elif self.leads_its_tokens(ids, expert, pair, space.counts, tid) != 0:
            self.serve(latent, ids, gate_up, down, out, batch, expert, pair // TOP_K, part, tid, space)
            serves = Int32(1)
        return serves

    @cute.jit
    def zero_row(self, out, pair, part, tid):
        """The zero row of a pair no expert of ours serves: our slice of it."""
        if tid < self.packets:
            store_words(out.iterator + pair * self.latent + part * self.slice + 8 * tid, [Uint32(0)] * 4)

    @cute.jit
    def leads_its_tokens(self, ids, expert, pair, counts, tid) -> Int32:
        """1 if slot k of token b (``pair``) is ``expert``'s first in b and the tokens before b
        that hold it are a multiple of T: the CTA's warps count them by ballots (the
        barrier before the warps' sum also publishes the ring's initialized barriers)."""
        token, slot = pair // TOP_K, pair % TOP_K
        warp, lane = tid // 32, tid % 32
        total = Int32(0)  # the tokens before ours that hold the expert (T = 1: every token leads)
        if cutlass.const_expr(self.tokens > 1):
            before = Int32(0)  # lane 0's running count of the warp's tokens
            for base in cutlass.range(0, token, self.threads, unroll=1):
                b = base + tid
                hit = Int32(0)
                if b < token:
                    if slot_mask(ids, b, expert) != 0:
                        hit = Int32(1)
                before = before + cute.arch.popc(cute.arch.vote_ballot_sync(hit != 0))
            if lane == 0:
                counts[warp] = before
        # an earlier slot of the token holds the expert (a repeated id)
        earlier = slot_mask(ids, token, expert) & ((Int32(1) << slot) - Int32(1))
        cute.arch.sync_threads()
        if cutlass.const_expr(self.tokens > 1):
            for w in cutlass.range_constexpr(self.warps):
                total = total + counts[w]
        leads = Int32(0)
        if (earlier == 0) & (total % self.tokens == 0):
            leads = Int32(1)
        return leads

    @cute.jit
    def serve(self, latent, ids, gate_up, down, out, batch, expert, token, part, tid, space):
        """``token`` and the next T − 1 tokens routed to ``expert`` (their masks: which
        of a token's 16 slots hold it): our slice's stream, steps 1-3."""
        masks, matched = space.masks, space.matched
        if tid == 0:  # the first ring of chunks at once
            self.issue_ring(gate_up, down, expert, part, space.ring, space.full)
        count = Int32(1)
        if cutlass.const_expr(self.tokens == 1):  # our token alone: no scan of the later ones
            if tid == 0:
                masks[token] = slot_mask(ids, token, expert)
                matched[1] = token
            cute.arch.sync_threads()
        else:
            count = clamp(self.list_tokens(ids, expert, token, batch, masks, matched, tid), Int32(self.tokens))
        self.serve_tokens(latent, gate_up, down, out, expert, 0, count, part, tid, space)

    @cute.jit
    def serve_expert(self, latent, ids, gate_up, down, out, batch, expert, share, spread, tid, space):
        """By expert: share ``share`` of ``spread`` of the tokens routed to ``expert`` (in
        token order), in passes of T over the weights in shared memory (issued at entry)."""
        count = self.list_tokens(ids, expert, Int32(0), batch, space.masks, space.matched, tid)
        each = (count + spread - 1) // spread
        first = share * each
        last = clamp(first + each, count)
        for start in cutlass.range(first, last, self.tokens, unroll=1):
            cute.arch.sync_threads()  # the previous pass's reads of xs and acts are done
            self.serve_tokens(latent, gate_up, down, out, expert, start, clamp(last - start, Int32(self.tokens)),
                              0, tid, space)
        if tid == 0:  # the stream has landed before the CTA ends (a share with no tokens read none of it)
            for slot in cutlass.range_constexpr(self.depth):
                cute.arch.mbarrier_wait(space.full + slot, 0)

    @cute.jit
    def list_tokens(self, ids, expert, start, batch, masks, matched, tid) -> Int32:
        """The tokens from ``start`` on that hold ``expert``: masks[b] (which of b's 16 slots),
        and matched[n] the n-th in order; returns their count (every thread)."""
        for b in cutlass.range(start + tid, batch, self.threads, unroll=1):
            masks[b] = slot_mask(ids, b, expert)
        cute.arch.sync_threads()  # the masks
        if tid < 32:
            count = Int32(0)
            for base in cutlass.range(start, batch, 32, unroll=1):
                b = base + tid
                hit = Int32(0)
                if b < batch:
                    if masks[b] != 0:
                        hit = Int32(1)
                ballot = cute.arch.vote_ballot_sync(hit != 0)
                if hit != 0:
                    matched[1 + count + cute.arch.popc(ballot & ((Uint32(1) << Uint32(tid)) - Uint32(1)))] = b
                count = count + cute.arch.popc(ballot)
            if tid == 0:
                matched[0] = count
        cute.arch.sync_threads()
        return matched[0]

    @cute.jit
    def serve_tokens(self, latent, gate_up, down, out, expert, first, count, part, tid, space):
        """Steps 1-3 for ``count`` (≤ T) matched tokens from the ``first``-th over our slice's
        stream (its first ring issued; a ring shorter than the stream re-issued here)."""
        ring, full, xs, parts, received, hidden, acts, masks, matched, _ = space
        policy = l2_evict_first()
        self.stash_latent(latent, xs, matched, first, count, part, tid)  # every gate/up chunk reads them
        group, local = tid // self.group_threads, tid % self.group_threads
        if cutlass.const_expr(self.by_expert):  # the whole expert in shared memory: step 1 at once, then the down
            for chunk in cutlass.range_constexpr(self.gate_chunks):
                cute.arch.mbarrier_wait(full + chunk, 0)
            self.gate_mma(xs, ring, parts, tid)
            cute.arch.sync_threads()
            self.activate(parts, received, hidden, acts, part, tid)
            for chunk in cutlass.range(self.gate_chunks + group, self.chunks, self.groups, unroll=1):
                cute.arch.mbarrier_wait(full + chunk, 0)
                self.down_chunk(out, ring + chunk * self.slot_words, acts, masks, matched, first, count, part,
                                chunk - self.gate_chunks, local)
            return
        for chunk in cutlass.range(group, self.chunks, self.groups, unroll=1):
            slot = chunk % self.depth
            cute.arch.mbarrier_wait(full + slot, (chunk // self.depth) % 2)
            words = ring + slot * self.slot_words
            if chunk < self.gate_chunks:
                self.gate_chunk(xs, words, parts, count, chunk, local)
            else:
                self.down_chunk(out, words, acts, masks, matched, first, count, part, chunk - self.gate_chunks,
                                local)
            # every group's last gate chunk is its iteration gate_chunks / G − 1 (G divides them)
            last_gate = (chunk < self.gate_chunks) & (chunk + self.groups >= self.gate_chunks)
            if cutlass.const_expr(self.depth < self.chunks):
                cute.arch.sync_threads()  # the slot is read (and the chunk's partials are in)
                if tid == 0:
                    if chunk + self.depth < self.chunks:
                        self.issue(gate_up, down, expert, part, chunk + self.depth, words, full + slot, policy)
            elif last_gate:
                cute.arch.sync_threads()  # the whole slice in flight: only the partials need one
            if last_gate:
                self.activate(parts, received, hidden, acts, part, tid)

    @cute.jit
    def issue_ring(self, gate_up, down, expert, part, ring, full):
        """The stream's first ``depth`` chunks (thread 0)."""
        policy = l2_evict_first()
        for i in cutlass.range_constexpr(self.depth):
            self.issue(gate_up, down, expert, part, i, ring + i * self.slot_words, full + i, policy)

    @cute.jit
    def zero_rows_of_others(self, out, ids, batch, rank, per_rank, experts, cta, grid, tid):
        """By expert: the zero rows of the pairs no expert of ours serves, CTA c those of
        pairs c, c + grid, … (threads//P rows at once)."""
        rows = self.threads // self.packets
        if tid < rows * self.packets:
            for pair in cutlass.range(cta + grid * (tid // self.packets), batch * TOP_K, grid * rows, unroll=1):
                if expert_of(ids, pair, rank, per_rank, experts) < 0:
                    self.zero_row(out, pair, 0, tid % self.packets)

    @cute.jit
    def issue(self, gate_up, down, expert, part, chunk, words, barrier, policy: Int64):
        """Chunk ``chunk`` of ``expert``'s stream over slice ``part`` into the slot at ``words``
        (thread 0): 4 gate/up rows' columns of the slice, or 4L/(C·I) of its down rows."""
        cute.arch.mbarrier_arrive_and_expect_tx(barrier, 8 * self.slice)
        if chunk < self.gate_chunks:
            for r in cutlass.range_constexpr(GATE_ROWS):
                row = expert * 2 * self.intermediate + chunk * GATE_ROWS + r
                bulk_copy(words + r * self.row_words, gate_up.iterator + row * self.latent + part * self.slice,
                          Int32(2 * self.slice), barrier, policy)
        else:
            first_row = expert * self.latent + part * self.slice  # of down's [E·L, I] rows
            first = first_row * self.intermediate + (chunk - self.gate_chunks) * 4 * self.slice
            bulk_copy(words, down.iterator + first, Int32(8 * self.slice), barrier, policy)

    @cute.jit
    def stash_latent(self, latent, xs, matched, first, count, part, tid):
        """Slice ``part`` of the latent rows of the ``count`` matched tokens from the
        ``first``-th into ``xs`` [T, 4, P, 2] (tokens ``token_doubles`` apart) as FP64 times 2^896
        (:func:`~..packets.wide_operand`: the other operand of every widened weight), then
        the barrier."""
        for item in cutlass.range(tid, count * self.packets, self.threads, unroll=1):
            n, c = item // self.packets, item % self.packets
            token = matched[1 + first + n]
            values = unpack_words(load_words(latent.iterator + token * self.latent + part * self.slice + c * 8))
            for q in cutlass.range_constexpr(4):
                store_shared_doubles(xs + n * self.token_doubles + (q * self.packets + c) * 2,
                                     wide_operand(values[2 * q]), wide_operand(values[2 * q + 1]))
        cute.arch.sync_threads()

    @cute.jit
    def gate_chunk(self, xs, words, parts, count, chunk, tid):
        """Step 1's share of gate/up chunk ``chunk`` for the ``count`` stashed tokens: each
        token's 4 row sums of the warp into ``parts`` (``tid``: the thread's in its group). A
        weight packet is widened once for every token (token n's sum in the packets' order:
        the module doc's step 1)."""
        r, group = tid % GATE_ROWS, tid // GATE_ROWS
        totals = cute.make_rmem_tensor(self.tokens, Float64)
        for n in cutlass.range_constexpr(self.tokens):
            totals[n] = Float64(0.0)
        if tid < self.packets:
            for j in cutlass.range_constexpr(4):
                column = group + self.row_threads * j
                weights = widened_packet(load_shared(words + r * self.row_words + column * 4))
                for n in cutlass.range_constexpr(self.tokens):
                    if n < count:
                        totals[n] = wide_dot(weights, xs + n * self.token_doubles + column * 2, totals[n],
                                             2 * self.packets)
        for n in cutlass.range_constexpr(self.tokens):
            if n < count:
                total = butterfly(totals[n], 32, stride=GATE_ROWS)  # the warp's lanes of row r
                if tid % 32 < GATE_ROWS:
                    parts[n, chunk * GATE_ROWS + r, tid // 32] = total

    @cute.jit
    def gate_mma(self, xs, ring, parts, tid):
        """By expert, step 1 for the pass's T = 8 token slots at once by FP64 mma (m8n8k4:
        each product exact, as :meth:`gate_chunk`'s): a warp's task is 8 gate/up rows over
        a group warp's share of the columns (its sums go where that warp's would, so
        :meth:`activate` adds them alike). K goes in blocks of 4 packets, k-step s of a
        block taking value s of the packet of lane % 4, so A (the widened weights) and B
        (the stashed latent) are a 16-byte load a lane each 8 k-steps; two accumulators
        take alternate k-steps, added at the end. A's row g is the tile's row (g & 4) + 2·(g &
        1) + (g & 2) / 2, so that the two rows of a quarter-warp's loads sit 2 rows (16 banks)
        apart, as the stash's tokens do (plan.TOKEN_PAD). Slots past the pass's count read
        stale xs: D's column n is B's column n alone, and those sums are never used."""
        warp, lane = tid // 32, tid % 32
        splits, blocks = self.group_warps, self.packets // 4
        token, g = lane // 4, lane // 4  # B's column, A's row
        for task in cutlass.range(warp, 2 * self.intermediate // 8 * splits, self.warps, unroll=1):
            split = task % splits
            row = task // splits * 8 + (g & 4) + (g & 1) * 2 + (g & 2) // 2  # the weight row of A's row g
            weights_row = ring + row // GATE_ROWS * self.slot_words + row % GATE_ROWS * self.row_words
            even0, even1, odd0, odd1 = Float64(0.0), Float64(0.0), Float64(0.0), Float64(0.0)
            for block in cutlass.range(split * blocks // splits, (split + 1) * blocks // splits, unroll=1):
                packet = block * 4 + lane % 4
                weights = widened_packet(load_shared(weights_row + packet * 4))
                for q in cutlass.range_constexpr(4):
                    low, high = load_shared_doubles(xs + token * self.token_doubles + (q * self.packets + packet) * 2)
                    even0, even1 = mma_f64(weights[2 * q], low, (even0, even1))
                    odd0, odd1 = mma_f64(weights[2 * q + 1], high, (odd0, odd1))
            parts[2 * (lane % 4), row, split] = even0 + odd0
            parts[2 * (lane % 4) + 1, row, split] = even1 + odd1

    @cute.jit
    def activate(self, parts, received, hidden, acts, part, tid):
        """Steps 1-2's ends for the T token slots (unused slots: values never stored):
        our slice's sums (the warps in order) to every CTA of the cluster, their sum in rank
        order."""
        double = 2 * self.intermediate
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_wait()  # every CTA of the cluster has started (the relaxed arrive)
        for item in cutlass.range(tid, self.tokens * double, self.threads, unroll=1):
            total = Float64(0.0)
            for w in cutlass.range_constexpr(self.group_warps):
                total += parts[item // double, item % double, w]
            send_to_cluster(received, item, total, part, self.cluster)
        cluster_barrier(self.cluster)
        for item in cutlass.range(tid, self.tokens * double, self.threads, unroll=1):
            hidden[item // double, item % double] = Float32(cluster_total(received, item, self.cluster))
        cute.arch.sync_threads()
        for item in cutlass.range(tid, self.tokens * self.intermediate, self.threads, unroll=1):
            n, j = item // self.intermediate, item % self.intermediate
            gate = Float32(BFloat16(hidden[n, j]))
            up = Float32(BFloat16(hidden[n, j + self.intermediate]))
            act = Float32(BFloat16(situ_value(gate, up, Float32(1.0), Float32(0.0))))  # SwiGLU
            acts[n, j] = wide_operand(act)
        cute.arch.sync_threads()

    @cute.jit
    def down_chunk(self, out, words, acts, masks, matched, first, count, part, chunk, tid):
        """Step 3 on down chunk ``chunk`` of slice ``part`` (its rows chunk·4L/(C·I) …) for
        the ``count`` matched tokens from the ``first``-th (``tid``: the thread's in its group)."""
        if tid < self.packets:
            words_of_row = self.intermediate // 2
            packed_words = [w for m in range(4) for w in load_shared(words + (4 * tid + m) * 4)]
            rows = cute.make_rmem_tensor((self.tokens, self.down_rows), Float32)
            for i in cutlass.range_constexpr(self.down_rows):  # a row widened once for every token
                weights = widened_packet(packed_words[i * words_of_row:(i + 1) * words_of_row])
                for n in cutlass.range_constexpr(self.tokens):
                    if n < count:
                        rows[n, i] = Float32(wide_dot(weights, acts.iterator + n * self.intermediate, Float64(0.0)))
            column = part * self.slice + chunk * (4 * self.slice // self.intermediate) + tid * self.down_rows
            for n in cutlass.range_constexpr(self.tokens):
                if n < count:
                    b = matched[1 + first + n]
                    mask = masks[b]
                    packed = pack_values([rows[n, i] for i in range(self.down_rows)])
                    for k in cutlass.range_constexpr(TOP_K):
                        if ((mask >> k) & Int32(1)) != 0:
                            address = out.iterator + (b * TOP_K + k) * self.latent + column
                            if cutlass.const_expr(len(packed) == 1):
                                store_word(address, packed[0])
                            else:
                                store_words(address, packed)

    @cute.jit
    def allocate(self) -> "ExpertsSpace":
        """The CTA's shared memory (:class:`ExpertsSpace`)."""
        smem = SmemAllocator()
        double = 2 * self.intermediate
        ring = smem.allocate_tensor(Uint32, cute.make_layout(self.depth * self.slot_words), 16).iterator
        full = smem.allocate_tensor(Int64, cute.make_layout(self.depth), 16).iterator
        xs = smem.allocate_tensor(Float64, cute.make_layout(self.tokens * self.token_doubles), 16).iterator
        parts = smem.allocate_tensor(
            Float64, cute.make_layout((self.tokens, double, self.group_warps),
                                      stride=(double * self.group_warps, self.group_warps, 1)), 16)
        received = smem.allocate_tensor(
            Float64, cute.make_layout((self.tokens * double, self.cluster), stride=(self.cluster, 1)), 16)
        hidden = smem.allocate_tensor(Float32, cute.make_layout((self.tokens, double), stride=(double, 1)), 16)
        acts = smem.allocate_tensor(Float64, cute.make_layout((self.tokens, self.intermediate), stride=(self.intermediate, 1)),
                                    16)
        masks = smem.allocate_tensor(Int32, cute.make_layout(MAX_BATCH), 16)
        matched = smem.allocate_tensor(Int32, cute.make_layout(1 + MAX_BATCH), 16)
        counts = smem.allocate_tensor(Int32, cute.make_layout(32), 16)
        return ExpertsSpace(ring, full, xs, parts, received, hidden, acts, masks, matched, counts)


def shares_sm(per_sm: int) -> dict:
    """Launch attributes of a CTA that shares its SM: ptxas's register target (the carveout
    attribute lets it compile without a device: tail/fronts.py); none for a CTA an SM."""
    return {"min_blocks_per_mp": per_sm, "preferred_smem_carveout": -1} if per_sm > 1 else {}


class ExpertsSpace(NamedTuple):
    """A CTA's shared memory, in allocation order."""

    ring: object  # the ring (words)
    full: object  # its full barriers
    # the matched tokens' latent slices [T, 4, P, 2] (a warp's packets' pairs side by side,
    # tokens plan.stash_doubles apart), FP64 times 2^896 (packets.wide_operand)
    xs: object
    parts: object  # [T, 2I, a group's warps] FP64
    received: object  # [T·2I, C] FP64: the cluster's slice sums
    hidden: object  # [T, 2I] FP32
    acts: object  # [T, I] FP64 times 2^896 (packets.wide_operand)
    masks: object  # [MAX_BATCH]
    matched: object  # the matched tokens: count, then the list
    counts: object  # the warps' token counts


@cute.jit
def expert_of(ids, pair, rank, per_rank, experts) -> Int32:
    """The pair's expert where this rank serves it, else −1 (another rank's, or an id
    outside [0, E)); the streamed form's too."""
    return served(ids[pair], rank, per_rank, experts)


@cute.jit
def served(expert, rank, per_rank, experts) -> Int32:
    """``expert`` where this rank serves it, else −1."""
    mine = Int32(-1)
    if expert >= 0:
        if expert < experts:
            if expert // per_rank == rank:
                mine = expert
    return mine


@cute.jit
def slot_mask(ids, token, expert) -> Int32:
    """Bit k set where slot k of ``token`` holds ``expert`` (its 16 ids, 4 a load)."""
    mask = Int32(0)
    for q in cutlass.range_constexpr(TOP_K // 4):
        words = load_words(ids.iterator + token * TOP_K + 4 * q)
        for u in cutlass.range_constexpr(4):
            if Int32(words[u]) == expert:
                mask = mask | Int32(1 << (4 * q + u))
    return mask
