"""The routed experts' streamed form (``kimi::routed_experts`` where :func:`~.plan.call_plan`
picks it): expert-major, the weights streamed once a pass through one ring a CTA, the
products on tensor cores (mma.sync m16n8k16, BF16 in, FP32 out).

The pair grid (kernels.RoutedExperts) reads each routed expert once per T of its tokens but
spends ~100 µs at kimi_k3's B = 64 against a 47 µs floor: its CTAs each stream one expert
behind a ring of 2-3 chunks, and their FP64 FMA chains wait for one another a token
(benchmarks/NOTES.md). Here a grid of one CTA an SM lists the work after the wait:

1. Work list (every thread; a thread a token, its ids in four loads at once): the rank's
   experts' pair counts by shared atomics over the ids;
   warp 0 numbers the routed experts in expert order and the CTA takes numbers c, c + grid,
   … (each CTA within one expert of the others); then the pairs of its experts, listed by
   expert (a pair's place within its expert is the atomics' order: a row of the mma's M is
   one pair, and no row's sum depends on another's).
2. Stream (the producer warp, after the consumers): for each of its experts and each pass
   of up to PASS_PAIRS pairs, the expert's gate/up chunks (2I rows × GATE_COLUMNS, the rows'
   16-byte pieces in the 128-byte swizzle: conflict-free ldmatrix, every copy 32-byte
   aligned at both ends), each with the pass's latent rows of the same
   columns after them in the slot (evict-last: every expert of the token reads them), then
   its down chunks (DOWN_ROWS rows of I), through ``depth`` slots with full and empty
   barriers: the next expert's first chunks are in flight while this one's last are read.
   The copies are cp.async, 16 bytes a lane, a 512-byte row a warp instruction. (Bulk
   copies of a row each ran at ~1 µs a chunk, whatever the batch: 512-byte bulk copies
   reach a third of the HBM rate or less, bench_stream; benchmarks/NOTES.md.)
3. Serve (the STREAM_WARPS consumer warps), per pass, for each rounding point of the
   reference:
   - hidden: A is the slot's latent rows, B its gate/up rows (both by ldmatrix:
     plan.latent_piece, gate_piece); warp w takes columns [64w, 64w + 64) of each chunk,
     its four k16 steps from zero, the chunk's sum added to the warp's FP32 running sums
     (the tensor core's own accumulation is not FP32 rounding, so its chains stay short);
     the warps' sums added in warp order: FP32.
   - act = situ(BF16(gate), BF16(up)) in FP32, rounded to BF16 (the reference's step 2).
   - row: A the acts, B 16 down rows (K = I = 16: one mma), FP32, rounded to BF16 once
     and stored to the pair's output row; warp w takes rows [128w, 128w + 128) of a chunk.
   An expert with more than PASS_PAIRS pairs streams its weights once a pass.

Pairs of an expert another rank serves (or an id outside [0, E)) get zero rows: CTA c those
of pairs c, c + grid, ….

Numerics: the reference forms each dot product in FP64 and rounds it once; here the sums
are FP32 (tensor-core chunk sums added in a fixed order), so a row is within an ulp of the
reference at its terms' scale, and a small share of rows differ by that ulp (a hidden value
near a BF16 tie rounds the other way); runs are bit-identical. Products and sums must stay
within FP32's range (the FP64 forms take any finite BF16 values).

``counted``: as kernels.RoutedExperts' (the route poll's ready count instead of the PDL
wait). The grid is one wave: dependents are released at entry.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ...config import TOP_K
from ...mailbox import EXPERTS_READY
from ..launch import PDL
from ..mailbox import await_arrivals
from ..packets import clamp, situ_value
from ..ptx import (copy_async, l2_evict_first, l2_evict_last, load_matrices, load_words, mma_bf16, pack_bf16, store_word,
                   store_words)
from ..ring import hand_back, landed, wait_handed_back
from .kernels import expert_of, served
from .plan import (
    DOWN_ROWS,
    GATE_COLUMNS,
    MAX_BATCH,
    MAX_EXPERTS,
    PASS_PAIRS,
    SLOT_WORDS,
    STREAM_CHUNK,
    STREAM_WARPS,
    ZEROING_ROUND,
    act_word,
    down_piece,
    gate_piece,
    latent_piece,
    slot_row_piece,
    stream_depth,
    streams,
    sum_place,
    zeroing_pair,
)

WARP_COLUMNS = GATE_COLUMNS // STREAM_WARPS  # a warp's columns of a gate/up chunk
STEPS = WARP_COLUMNS // 16  # its k16 steps
WARP_ROWS = DOWN_ROWS // STREAM_WARPS  # a warp's rows of a down chunk


def token_experts(ids, token, rank, per_rank, experts):
    """Each of a token's TOP_K pairs' expert where this rank serves it, else −1
    (kernels.served); its ids in TOP_K / 4 vector loads all issued before any is used, so
    the work list waits one load a token, not one a pair."""
    packets = [load_words(ids.iterator + token * TOP_K + 4 * q) for q in range(TOP_K // 4)]
    return [served(Int32(packets[k // 4][k % 4]), rank, per_rank, experts) for k in range(TOP_K)]


class StreamedExperts:
    """Latent width ``latent``, expert width ``intermediate`` (plan.streams takes them)."""

    def __init__(self, latent: int, intermediate: int, counted: bool = False):
        assert streams(latent, intermediate), f"the streamed form does not take L = {latent}, I = {intermediate}"
        self.latent, self.intermediate, self.counted = latent, intermediate, counted
        self.double = 2 * intermediate
        self.gate_chunks, self.down_chunks = latent // GATE_COLUMNS, latent // DOWN_ROWS
        self.chunks = self.gate_chunks + self.down_chunks
        self.depth = stream_depth(intermediate)
        self.threads = 32 * (STREAM_WARPS + 1)

    @cute.jit
    def __call__(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
                 out: cute.Tensor, ready: cute.Tensor, error: cute.Tensor, batch: Int32, rank: Int32,
                 per_rank: Int32, experts: Int32, ctas: Int32, stream):
        """As kernels.RoutedExperts' arguments; ``ctas``: the grid (one an SM)."""
        self.kernel(latent, ids, gate_up, down, out, ready, error, batch, rank, per_rank, experts).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, latent: cute.Tensor, ids: cute.Tensor, gate_up: cute.Tensor, down: cute.Tensor,
               out: cute.Tensor, ready: cute.Tensor, error: cute.Tensor, batch: Int32, rank: Int32,
               per_rank: Int32, experts: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp, lane = tid // 32, tid % 32
        cute.arch.griddepcontrol_launch_dependents()  # one wave: see the module doc
        space = self.allocate()
        if tid == 0:
            for slot in cutlass.range_constexpr(self.depth):
                cute.arch.mbarrier_init(space.full + slot, 32)  # the producer's lanes
                cute.arch.mbarrier_init(space.empty + slot, STREAM_WARPS)
            cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.counted):  # ids and latent: the routing's
            await_arrivals(ready, Int64(2 * batch), grid, error, EXPERTS_READY)
        else:
            cute.arch.griddepcontrol_wait()
        self.list_work(ids, batch, rank, per_rank, experts, cta, grid, tid, space)
        if warp == STREAM_WARPS:
            self.produce(latent, gate_up, down, space, rank, per_rank, lane)
        else:
            self.zero_rows_of_others(ids, out, batch, rank, per_rank, experts, cta, grid, warp, lane)
            self.consume(out, space, warp, lane)

    @cute.jit
    def list_work(self, ids, batch, rank, per_rank, experts, cta, grid, tid, space):
        """Step 1 (the module doc): ``counts`` by expert, the CTA's experts in ``mine`` (their
        number in header[0]), their pairs in ``lists`` (expert j's end at ``cursors[j]``)."""
        counts, places, mine, cursors, lists = space.counts, space.places, space.mine, space.cursors, space.lists
        for e in cutlass.range(tid, per_rank, self.threads, unroll=1):
            counts[e] = Int32(0)
            places[e] = Int32(-1)
        cute.arch.sync_threads()
        first = rank * per_rank
        for token in cutlass.range(tid, batch, self.threads, unroll=1):  # a thread a token
            pairs = token_experts(ids, token, rank, per_rank, experts)
            for k in cutlass.range_constexpr(TOP_K):
                if pairs[k] >= 0:
                    cute.arch.atomic_add(counts.iterator + pairs[k] - first, Int32(1))
        cute.arch.sync_threads()
        if tid < 32:  # the routed experts numbered in order; ours are c, c + grid, …
            routed = Int32(0)
            for base in cutlass.range(0, per_rank, 32, unroll=1):
                e = base + tid
                hit = Int32(0)
                if e < per_rank:
                    if counts[e] > 0:
                        hit = Int32(1)
                ballot = cute.arch.vote_ballot_sync(hit != 0)
                if hit != 0:
                    number = routed + cute.arch.popc(ballot & ((Uint32(1) << Uint32(tid)) - Uint32(1)))
                    if number % grid == cta:
                        places[e] = number // grid
                        mine[number // grid] = e
                routed = routed + cute.arch.popc(ballot)
            if tid == 0:
                taken = Int32(0)
                if routed > cta:
                    taken = (routed - cta + grid - 1) // grid
                space.header[0] = taken
                start = Int32(0)
                for j in cutlass.range(taken, unroll=1):
                    cursors[j] = start
                    start = start + counts[mine[j]]
        cute.arch.sync_threads()
        for token in cutlass.range(tid, batch, self.threads, unroll=1):
            pairs = token_experts(ids, token, rank, per_rank, experts)
            for k in cutlass.range_constexpr(TOP_K):
                if pairs[k] >= 0:
                    j = places[pairs[k] - first]
                    if j >= 0:
                        lists[cute.arch.atomic_add(cursors.iterator + j, Int32(1))] = token * TOP_K + k
        cute.arch.sync_threads()

    @cute.jit
    def produce(self, latent, gate_up, down, space, rank, per_rank, lane):
        """Step 2: the stream of every pass of the CTA's experts, chunk i into slot i % depth
        by cp.async, 16 bytes a lane (a warp instruction a 512-byte row); a gate/up chunk's
        slot also takes the pass's latent rows of its columns. Each lane then arrives on the
        slot's full barrier once its copies land (noinc: the barrier counts the 32 lanes)."""
        policy, rows_policy = l2_evict_first(), l2_evict_last()  # weights once; latent rows for every expert
        full, empty = space.full, space.empty
        i = Int32(0)
        for j in cutlass.range(space.header[0], unroll=1):
            local = space.mine[j]
            expert = rank * per_rank + local
            count = space.counts[local]
            listed = space.cursors[j] - count
            for start in cutlass.range(0, count, PASS_PAIRS, unroll=1):
                pairs = clamp(count - start, Int32(PASS_PAIRS))
                for chunk in cutlass.range(self.chunks, unroll=1):
                    slot = i % self.depth
                    wait_handed_back(empty, i, self.depth)
                    words = space.ring + slot * SLOT_WORDS  # the lane's copies: the 16-byte piece ``lane`` of a row
                    if chunk < self.gate_chunks:
                        rows = gate_up.iterator + expert * self.double * self.latent + chunk * GATE_COLUMNS + 8 * lane
                        for row in cutlass.range_constexpr(self.double):
                            copy_async(words + slot_row_piece(0, row, lane), rows + row * self.latent, policy)
                        for r in cutlass.range(pairs, unroll=1):
                            token = space.lists[listed + start + r] // TOP_K
                            copy_async(words + slot_row_piece(self.double, r, lane),
                                       latent.iterator + token * self.latent + chunk * GATE_COLUMNS + 8 * lane, rows_policy)
                    else:
                        rows = down.iterator + (expert * self.latent + (chunk - self.gate_chunks) * DOWN_ROWS) * \
                            self.intermediate + 8 * lane
                        for piece in cutlass.range_constexpr(STREAM_CHUNK // 512):  # the chunk is contiguous
                            copy_async(words + 128 * piece + 4 * lane, rows + 256 * piece, policy)
                    cute.arch.cp_async_mbarrier_arrive_noinc(full + slot)
                    i = i + 1

    @cute.jit
    def zero_rows_of_others(self, ids, out, batch, rank, per_rank, experts, cta, grid, warp, lane):
        """The zero rows of the pairs no expert of ours serves: CTA c's pairs c + grid·j. A
        round checks ZEROING_ROUND of them at once (plan.zeroing_pair: every load in flight
        together, where one pair at a time made the consumers wait a load each before their
        first chunk), and each warp zeroes the rows its ballot found."""
        pairs = batch * TOP_K
        for first in cutlass.range(0, pairs, grid * ZEROING_ROUND, unroll=1):
            pair = zeroing_pair(cta, first, grid, warp, lane)
            other = Int32(0)
            if pair < pairs:
                if expert_of(ids, pair, rank, per_rank, experts) < 0:
                    other = Int32(1)
            found = cute.arch.vote_ballot_sync(other != 0)
            if found != Uint32(0):  # none at TP1 but ids outside [0, E)
                for source in cutlass.range(32, unroll=1):
                    if ((found >> Uint32(source)) & Uint32(1)) != Uint32(0):
                        row = out.iterator + zeroing_pair(cta, first, grid, warp, source) * self.latent
                        for packet in cutlass.range(lane, self.latent // 8, 32, unroll=1):
                            store_words(row + 8 * packet, [Uint32(0)] * 4)

    @cute.jit
    def consume(self, out, space, warp, lane):
        """Step 3 for every pass of the CTA's experts, in the producer's order."""
        i = Int32(0)
        for j in cutlass.range(space.header[0], unroll=1):
            count = space.counts[space.mine[j]]
            first = space.cursors[j] - count  # the scatter left the cursor at the list's end
            for start in cutlass.range(0, count, PASS_PAIRS, unroll=1):
                i = self.serve_pass(out, space, first + start, clamp(count - start, Int32(PASS_PAIRS)), i, warp, lane)

    @cute.jit
    def serve_pass(self, out, space, listed, count, i, warp, lane) -> Int32:
        """One pass: the ``count`` pairs listed from ``lists[listed]`` over the expert's
        chunks i, i + 1, …; returns the next chunk's number."""
        g, t = lane // 4, lane % 4
        pairs = cute.make_rmem_tensor(2, Int32)  # the pairs of the lane's D rows g, g + 8 (−1: past the count)
        for half in cutlass.range_constexpr(2):
            pairs[half] = Int32(-1)
            if 8 * half + g < count:
                pairs[half] = space.lists[listed + 8 * half + g]
        sums = cute.make_rmem_tensor((4, 4), Float32)  # [8-row group of 2I, D's four]
        for n in cutlass.range_constexpr(4):
            for k in cutlass.range_constexpr(4):
                sums[n, k] = Float32(0.0)
        for _ in cutlass.range(self.gate_chunks, unroll=1):
            landed(space.full, i, self.depth)
            words = space.ring + (i % self.depth) * SLOT_WORDS
            chunk_sums = [(Float32(0.0),) * 4] * 4  # the chunk's own sums: the tensor core's chains stay short
            for step in cutlass.range_constexpr(STEPS):
                column = warp * WARP_COLUMNS + 16 * step
                a = load_matrices(words + latent_piece(lane, column))
                b = []  # (b0, b1) of the four n8 groups of the 2I rows
                for group in cutlass.range_constexpr(2):
                    m = load_matrices(words + gate_piece(lane, group, column))
                    b += [(m[0], m[1]), (m[2], m[3])]
                chunk_sums = [mma_bf16(a, b[n], chunk_sums[n]) for n in range(4)]
            hand_back(space.empty + i % self.depth, lane)
            for n in cutlass.range_constexpr(4):
                for k in cutlass.range_constexpr(4):
                    sums[n, k] = sums[n, k] + chunk_sums[n][k]
            i = i + 1
        self.activate(space, sums, count, warp, lane)
        a = [space.acts[act_word(lane, k)] for k in range(4)]  # A of the down
        for chunk in cutlass.range(self.down_chunks, unroll=1):
            landed(space.full, i, self.depth)
            words = space.ring + (i % self.depth) * SLOT_WORDS
            for group in cutlass.range_constexpr(WARP_ROWS // 16):
                first = warp * WARP_ROWS + 16 * group  # the chunk's down rows of two n8 tiles
                m = load_matrices(words + down_piece(lane, first))
                for n in cutlass.range_constexpr(2):
                    d = mma_bf16(a, (m[2 * n], m[2 * n + 1]), (Float32(0.0),) * 4)
                    column = chunk * DOWN_ROWS + first + 8 * n + 2 * t
                    for half in cutlass.range_constexpr(2):
                        if pairs[half] >= 0:
                            store_word(out.iterator + pairs[half] * self.latent + column,
                                       pack_bf16(d[2 * half], d[2 * half + 1]))
            hand_back(space.empty + i % self.depth, lane)
            i = i + 1
        return i

    @cute.jit
    def activate(self, space, sums, count, warp, lane):
        """The warps' sums in warp order, then situ: the pass's acts (BF16 words)."""
        parts = space.parts
        for n in cutlass.range_constexpr(4):
            for k in cutlass.range_constexpr(4):
                row, column = sum_place(lane, n, k)
                parts[warp, row, column] = sums[n, k]
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * STREAM_WARPS)
        half = self.intermediate // 2
        for item in cutlass.range(warp * 32 + lane, count * half, 32 * STREAM_WARPS, unroll=1):
            row, word = item // half, item % half
            acts = []
            for u in cutlass.range_constexpr(2):
                gate, up = parts[0, row, 2 * word + u], parts[0, row, 2 * word + u + self.intermediate]
                for w in cutlass.range_constexpr(1, STREAM_WARPS):
                    gate = gate + parts[w, row, 2 * word + u]
                    up = up + parts[w, row, 2 * word + u + self.intermediate]
                acts.append(situ_value(Float32(BFloat16(gate)), Float32(BFloat16(up)), Float32(1.0), Float32(0.0)))
            space.acts[row, word] = pack_bf16(acts[0], acts[1])
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * STREAM_WARPS)

    @cute.jit
    def allocate(self) -> "StreamSpace":
        """The CTA's shared memory (:class:`StreamSpace`; plan.stream_smem_bytes counts it)."""
        smem = SmemAllocator()
        ring = smem.allocate_tensor(Uint32, cute.make_layout(self.depth * SLOT_WORDS), 128).iterator
        full = smem.allocate_tensor(Int64, cute.make_layout(self.depth), 16).iterator
        empty = smem.allocate_tensor(Int64, cute.make_layout(self.depth), 16).iterator
        counts = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), 16)
        places = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), 16)
        mine = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), 16)
        cursors = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), 16)
        lists = smem.allocate_tensor(Int32, cute.make_layout(MAX_BATCH * TOP_K), 16)
        header = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        parts = smem.allocate_tensor(
            Float32, cute.make_layout((STREAM_WARPS, PASS_PAIRS, self.double),
                                      stride=(PASS_PAIRS * self.double, self.double, 1)), 16)
        acts = smem.allocate_tensor(
            Uint32, cute.make_layout((PASS_PAIRS, self.intermediate // 2), stride=(self.intermediate // 2, 1)), 16)
        return StreamSpace(ring, full, empty, counts, places, mine, cursors, lists, header, parts, acts)


class StreamSpace(NamedTuple):
    """A CTA's shared memory, in allocation order."""

    ring: object  # the ring (words): ``depth`` slots of SLOT_WORDS
    full: object  # its full barriers
    empty: object  # its empty barriers (a consumer warp's arrival each)
    counts: object  # [MAX_EXPERTS] the pairs of each of the rank's experts
    places: object  # [MAX_EXPERTS] the expert's place among the CTA's (−1: another CTA's)
    mine: object  # [MAX_EXPERTS] the CTA's experts in order
    cursors: object  # [MAX_EXPERTS] by place: the list's scatter cursor, then its end
    lists: object  # [MAX_BATCH·16] the CTA's experts' pairs, an expert's together
    header: object  # [4] the CTA's experts' number
    parts: object  # [STREAM_WARPS, PASS_PAIRS, 2I] FP32: the warps' gate/up sums
    acts: object  # [PASS_PAIRS, I/2] the acts, BF16 pairs
