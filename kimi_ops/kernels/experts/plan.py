"""The routed experts' plan: a cluster of CTAs per (token group, expert) pair while the
grid fits the SMs, the bounds of a variant."""

import functools
import os
from typing import NamedTuple

from ...config import TOP_K
from ..launch import SMEM_BYTES, multiprocessors
from ..ring import swizzled

GATE_ROWS = 4  # gate/up rows a chunk (8·L/C bytes; a down chunk is as many bytes)
MAX_CLUSTER = 8  # portable cluster size
TOKENS = 4  # the most tokens a CTA serves in its pass over the expert's weights past one wave (call_plan)
MMA_TOKENS = 8  # by expert: a pass's tokens, the N of step 1's FP64 mma (kernels.RoutedExperts.gate_mma)
# FP64 values after each token's latent slice in the stash: a token's 16 banks from the next's
# (RoutedExperts.gate_mma reads two tokens' packets in each quarter-warp phase)
TOKEN_PAD = 8
MAX_INTERMEDIATE = 16  # I = 8 or 16: whole down rows in a thread's 4 packets
MAX_LATENT = 4096  # L/8 ≤ 512 threads at a cluster of one
MAX_BATCH = 256  # the tokens' match masks in shared memory
MAX_THREADS = 512  # a CTA's chunk groups (kernels.RoutedExperts.groups): 128 registers a thread
PAST_WAVE_PER_SM = 2  # CTAs an SM holds at once past one wave (call_plan), where MIN_RING fits
MAX_SPREAD = 2  # by expert: the most CTAs an expert (call_plan)
MIN_RING = 2  # chunks in flight a CTA keeps at least past one wave
SM_SHARED = SMEM_BYTES + 1024  # an SM's shared memory; each resident CTA's share keeps 1 KB for the system


# The most of an expert's bytes one CTA streams: past it a pair takes a cluster (bench_experts,
# a chunk group a gate chunk: at L = 512 one CTA the whole 48 KB expert, 3.9 / 7.2 / 17.8 µs at
# B = 1 / 8 / 64 against 6.8 / 17.1 / 83.0 in clusters of 8; at L = 3584, 344 KB, clusters of
# 4 at B = 1, 7.7 µs against 16.5 / 9.7 / 10.9 at C = 1 / 2 / 8: benchmarks/NOTES.md)
SLICE_BYTES = 96 * 1024


@functools.cache
def cluster_size(latent: int, intermediate: int) -> int:
    """C, the CTAs of a pair: the fewest with whole 4-row chunks a CTA (L/8 % 4C == 0) whose
    slice of the expert (3I values of L/C) is at most SLICE_BYTES (the most where none is)."""
    sizes = [c for c in range(1, MAX_CLUSTER + 1) if (latent // 8) % (GATE_ROWS * c) == 0]
    return next((c for c in sizes if 6 * intermediate * latent // c <= SLICE_BYTES), sizes[-1])


def cluster_for(latent: int, intermediate: int, batch: int, device: int, tp: int = 1) -> int:
    """A call's C: :func:`cluster_size`'s while the pairs this rank is expected to serve
    (B·16/TP: a uniform routing; the other ranks' pairs end at once) fit the SMs at a CTA
    each (B ≤ 2 at L = 3584), else 1 — then the SMs have other pairs
    to serve, and each CTA of a cluster repeats the pair's prologue (measured by cluster
    size at 21c3e9d: benchmarks/NOTES.md). A routing that sends a rank more pairs than
    expected runs in more waves of clusters, not wrong."""
    cluster = cluster_size(latent, intermediate)
    return cluster if one_wave(batch, cluster, device, tp) else 1


def one_wave(batch: int, cluster: int, device: int, tp: int, per_sm: int = 1) -> bool:
    """The pairs this rank is expected to serve (B·16/TP), C CTAs each, fit the SMs at once
    (``per_sm`` CTAs an SM)."""
    return -(-batch * TOP_K // tp) * cluster <= per_sm * multiprocessors(device)


class CallPlan(NamedTuple):
    """A call's variant and its release (:func:`call_plan`)."""

    cluster: int  # C, the CTAs of a pair (cluster_for)
    per_sm: int  # the CTAs an SM holds at once
    tokens: int  # T, the most of an expert's tokens a CTA serves (by expert: a pass)
    # the CTAs served are one wave: the dependents are released at entry, and share SMs only
    # with those CTAs (bench_layer at the TP8 rank against a release at the end: 67.9 / 78.8 /
    # 107.2 against 68.3 / 81.5 / 107.0 µs at B = 1 / 8 / 64, benchmarks/NOTES.md)
    wave: bool
    spread: int = 0  # by expert: the CTAs of each of the rank's experts (0: a cluster a pair)
    stream: bool = False  # the streamed form (stream.py: a CTA an SM, T its pass)

    @property
    def variant(self) -> tuple[int, int, int, bool, bool]:
        """The compile key past (L, I): C, CTAs an SM, T, by expert, streamed."""
        return self.cluster, self.per_sm, self.tokens, self.spread > 0, self.stream


def call_plan(latent: int, intermediate: int, batch: int, device: int, tp: int = 1, experts: int = 0) -> CallPlan:
    """From STREAM_FROM tokens on (where set), where it takes the call, the streamed form
    (:data:`STREAMED`); else :func:`pair_plan`'s."""
    if STREAM_FROM and batch >= STREAM_FROM and streams(latent, intermediate) and 0 < experts // tp <= MAX_EXPERTS:
        return STREAMED
    return pair_plan(latent, intermediate, batch, device, tp, experts)


def pair_plan(latent: int, intermediate: int, batch: int, device: int, tp: int = 1, experts: int = 0) -> CallPlan:
    """The pair grid's and by-expert forms' plan (kernels.RoutedExperts). While the pairs
    served are one wave, each CTA takes its SM's whole share and serves one token: a pair
    of a repeated expert re-reads its weights from L2, the grid ends with its slowest pair
    (with T = TOKENS a CTA served up to 4 tokens one after another: a TP8 rank at B = 8
    took 8.45 µs against 3.85 at B = 1). While they are one wave at
    :func:`per_sm_for` CTAs an SM (more than one), each still serves one token (B = 16:
    a TP8 rank's 6.07 µs against 8.48 at T = TOKENS, kimi_k3's 32.45 against 41.16).
    Past that most pairs' CTAs end at once, so each CTA serves TOKENS tokens (an expert's
    weights read once per TOKENS) and up to PAST_WAVE_PER_SM share an SM: a serving CTA's
    latency (its stream, its barriers) leaves its SM idle unless another CTA shares it (a
    TP8 rank's, L = 512, at B = 64: 15.5 µs against 20.0 a CTA an SM; bench_experts,
    benchmarks/NOTES.md). There, where a CTA holds a whole expert, the grid goes by
    expert instead (``experts``: E; :func:`spread_for`): one wave, each CTA's weights in
    flight before the wait, no CTA for a pair another serves."""
    cluster = cluster_for(latent, intermediate, batch, device, tp)
    _, shared, past, by_expert = variants(latent, intermediate)
    if one_wave(batch, cluster, device, tp):
        return CallPlan(cluster, 1, 1, True)
    if shared and one_wave(batch, 1, device, tp, shared[1]):
        return CallPlan(*shared[:3], False)
    spread = spread_for(latent, intermediate, experts // tp, device)
    return CallPlan(*by_expert[:3], True, spread) if spread else CallPlan(*past[:3], False)


def spread_for(latent: int, intermediate: int, per_rank: int, device: int) -> int:
    """By expert (the rank's experts known at launch, each streamed before the wait, its
    tokens served in passes of MMA_TOKENS over its weights in shared memory): the CTAs an
    expert, up to MAX_SPREAD, at which the rank's experts fit the SMs at once at
    :func:`per_sm_for`'s CTAs an SM, where a CTA holds its expert's whole slice; 0 where
    none does (kimi_k3's 344 KB experts)."""
    by_expert = variants(latent, intermediate)[3]
    if per_rank <= 0 or by_expert is None:
        return 0
    return min(MAX_SPREAD, by_expert[1] * multiprocessors(device) // per_rank)


@functools.cache
def whole_slice(latent: int, intermediate: int, per_sm: int) -> bool:
    """A CTA of a cluster of one serving passes of MMA_TOKENS tokens holds the whole expert at
    ``per_sm`` CTAs an SM."""
    return smem_bytes(latent, intermediate, 1, MMA_TOKENS, 3 * intermediate // GATE_ROWS) <= smem_share(per_sm)


@functools.cache
def variants(latent: int, intermediate: int) -> tuple:
    """:func:`call_plan`'s variants past C: in one wave (C, 1 an SM, T = 1); while the pairs
    fit :func:`per_sm_for` CTAs an SM (None where that is one) (1, that many, 1); past that
    (1, :func:`per_sm_for`'s at TOKENS, TOKENS), or by expert (1, :func:`per_sm_for`'s at
    MMA_TOKENS, MMA_TOKENS; None where a CTA does not hold the whole expert)."""
    shared = per_sm_for(latent, intermediate, 1)
    past = (1, per_sm_for(latent, intermediate, TOKENS), TOKENS)
    by_expert = (1, per_sm_for(latent, intermediate, MMA_TOKENS), MMA_TOKENS)
    return ((cluster_size(latent, intermediate), 1, 1, False), (1, shared, 1, False) if shared > 1 else None,
            (*past, False), (*by_expert, True) if whole_slice(latent, intermediate, by_expert[1]) else None)


@functools.cache
def per_sm_for(latent: int, intermediate: int, tokens: int) -> int:
    """The most CTAs an SM, up to PAST_WAVE_PER_SM, at which a CTA of a cluster of one serving
    ``tokens`` tokens keeps a ring of MIN_RING chunks (kimi_k3's FP64 latent slices at
    T = 4, 115 KB, allow one)."""
    return max((p for p in range(1, PAST_WAVE_PER_SM + 1)
                if smem_bytes(latent, intermediate, 1, tokens, MIN_RING) <= smem_share(p)), default=1)


def slot_words(latent: int, cluster: int) -> int:
    """A ring slot: GATE_ROWS gate/up rows of a CTA's slice, each padded by 2 packets
    (conflict-free reads)."""
    return GATE_ROWS * (latent // cluster // 8 + 2) * 4


def stash_doubles(packets: int) -> int:
    """A token's FP64 values in the latent stash: its slice's 8 a packet, then TOKEN_PAD."""
    return 8 * packets + TOKEN_PAD


def smem_bytes(latent: int, intermediate: int, cluster: int, tokens: int, depth: int) -> int:
    """A CTA's shared memory with a ring of ``depth`` (kernels.RoutedExperts.allocate, each
    piece 16-byte aligned): the ring, its barriers, the tokens' latent slices and sums in
    FP64, hidden, the acts in FP64, masks, matched, counts."""
    packets, double = latent // cluster // 8, 2 * intermediate
    group_warps = -(-packets // 32)
    pieces = (4 * depth * slot_words(latent, cluster), 8 * depth, 8 * tokens * stash_doubles(packets),
              8 * tokens * double * group_warps, 8 * tokens * double * cluster, 4 * tokens * double,
              8 * tokens * intermediate, 4 * MAX_BATCH, 4 * (1 + MAX_BATCH), 4 * 32)
    return sum(-(-piece // 16) * 16 for piece in pieces)


def smem_share(per_sm: int) -> int:
    """The shared bytes a CTA may take so that ``per_sm`` of them are resident on an SM."""
    return SM_SHARED // per_sm - 1024


# The streamed form (kernels/experts/stream.py): expert-major on tensor cores, a CTA an SM
STREAM_INTERMEDIATE = 16  # I: down's K is one m16n8k16 step
STREAM_WARPS = 4  # consumer warps; a producer warp after them
GATE_COLUMNS = 256  # a gate/up chunk: the expert's 2I rows × 256 columns (16 KB)
DOWN_ROWS = 512  # a down chunk: 512 rows of I (16 KB)
STREAM_CHUNK = 2 * 2 * STREAM_INTERMEDIATE * GATE_COLUMNS  # weight bytes a chunk, either kind
PASS_PAIRS = 16  # an expert's pairs a pass over its weights: the mma's M
# A gate/up slot's rows: GATE_COLUMNS unpadded, their 16-byte pieces in the 128-byte swizzle
# (ring.swizzled), so that ldmatrix's eight rows fall in distinct banks while every piece lands
# 32-byte aligned, as its global row is. (Rows padded by 16 bytes instead left every other
# row's cp.async copies half a sector off: twice the L2 sectors and 3-4× the shared
# wavefronts of a copy, ncu at kimi_k3 B = 64; benchmarks/NOTES.md, thirty-fifth session.)
ROW_PIECES = GATE_COLUMNS // 8
# a slot: the chunk's 2I gate/up rows, then the pass's latent rows of its columns (or a down chunk)
SLOT_WORDS = (2 * STREAM_INTERMEDIATE + PASS_PAIRS) * 4 * ROW_PIECES
MAX_EXPERTS = 1024  # a rank's experts (the work list's per-expert arrays)


# The streamed form serves calls of STREAM_FROM tokens or more where it takes them; below,
# the pair grid's bands. 32 from the H100 (benchmarks/NOTES.md, thirty-fifth session): alone
# it wins from 32 tokens at kimi_k3 (56.1 / 83.8 µs at B = 32 / 64 against 65.1 / 102.6)
# and ties or wins slightly at a TP8 rank (7.4 / 10.8 against 8.0 / 10.7), loses at 16 at
# kimi_k3 (36.2 against 31.3); in the layer at B = 64, TP1 365.7 against 383.0 µs, a TP8
# rank 91.8 against 93.2. KIMI_OPS_STREAM_FROM=B overrides it (0: never), the A/B knob of
# bench_layer and bench_experts, part of no cache key (both forms are prepared either way).
STREAM_FROM = int(os.environ.get("KIMI_OPS_STREAM_FROM") or 32)
STREAMED = CallPlan(1, 1, PASS_PAIRS, True, 0, True)  # one wave: a CTA an SM, passes of PASS_PAIRS


def stream_smem_bytes(intermediate: int, depth: int) -> int:
    """The streamed form's shared memory (kernels.StreamedExperts.allocate, each piece 16-byte
    aligned): the ring, its full and empty barriers, the counts, places, the CTA's experts and
    list cursors, the pair lists, the header, the warps' gate/up sums, the acts."""
    pieces = (4 * depth * SLOT_WORDS, 8 * depth, 8 * depth, 4 * 4 * MAX_EXPERTS, 4 * MAX_BATCH * TOP_K, 16,
              4 * STREAM_WARPS * PASS_PAIRS * 2 * intermediate, 2 * PASS_PAIRS * intermediate)
    return sum(-(-piece // 16) * 16 for piece in pieces)


@functools.cache
def stream_depth(intermediate: int) -> int:
    """The streamed form's ring: as many slots as a CTA an SM holds."""
    return max(d for d in range(1, 64) if stream_smem_bytes(intermediate, d) <= smem_share(1))


def streams(latent: int, intermediate: int) -> bool:
    """The streamed form takes the shape: I = 16, whole gate/up and down chunks."""
    return intermediate == STREAM_INTERMEDIATE and latent % DOWN_ROWS == 0


# The streamed form's fragments (ldmatrix.x4: lane l gives row l % 8 of matrix q = l // 8;
# mma m16n8k16: lane (g, t) = (l // 4, l % 4) holds A's (g | g + 8, 2t | 2t + 8), B's (2t | 2t + 8,
# g) and D's (g | g + 8, 2t | 2t + 1)), as word offsets in a slot; kernels and the CPU model
# (tests/test_experts_kernels.py) take them from here.

def slot_row_piece(first, row, piece):
    """Word offset of the 16-byte piece ``piece`` of a gate/up slot's row ``first + row``
    (``first`` a multiple of 8), as the producer's copies place it."""
    return 4 * swizzled(first, row, piece, ROW_PIECES)


def latent_piece(lane, column):
    """A of a gate/up chunk's k16 step at ``column``: matrix q is the pass's latent rows
    8·(q % 2).. (after the 2I weight rows), columns column + 8·(q // 2) (registers a0-a3)."""
    return slot_row_piece(2 * STREAM_INTERMEDIATE, lane // 8 % 2 * 8 + lane % 8, (column + lane // 16 * 8) // 8)


def gate_piece(lane, group, column):
    """B of the same step for n8 groups 2·``group`` and 2·``group`` + 1 of the 2I rows: matrix
    q is rows 16·group + 8·(q // 2).., columns column + 8·(q % 2) (b0, b1 of each group)."""
    return slot_row_piece(16 * group, lane // 16 * 8 + lane % 8, (column + lane // 8 % 2 * 8) // 8)


def down_piece(lane, first):
    """B of a down chunk's rows ``first``.. (two n8 groups; K = I): matrix q is rows
    first + 8·(q // 2).., columns 8·(q % 2) (b0, b1 of each group)."""
    return (first + lane // 16 * 8 + lane % 8) * (STREAM_INTERMEDIATE // 2) + lane // 8 % 2 * 4


ZEROING_ROUND = 32 * STREAM_WARPS  # pairs a CTA checks at once for zero rows


def zeroing_pair(cta, first, grid, warp, lane):
    """The pair that lane ``lane`` of consumer warp ``warp`` checks in the zeroing round at
    ``first`` (StreamedExperts.zero_rows_of_others; rounds ZEROING_ROUND · grid apart): CTA
    c's pairs are c + grid·j, j = STREAM_WARPS·lane + warp within the round."""
    return cta + first + grid * (STREAM_WARPS * lane + warp)


def sum_place(lane, group, k):
    """Where D's register ``k`` of n8 group ``group`` goes in a warp's [pair, 2I] sums."""
    return 8 * (k // 2) + lane // 4, 8 * group + 2 * (lane % 4) + k % 2


def act_word(lane, k):
    """A's register ``k`` of the down step: its [pair, I/2] word of the acts."""
    return 8 * (k % 2) + lane // 4, lane % 4 + 4 * (k // 2)
