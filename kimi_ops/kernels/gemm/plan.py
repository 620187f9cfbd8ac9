"""The engine's static plan of one (N, K, T) variant: the partition of the weight over CTAs
and clusters (:func:`partition`, by a cost per CTA measured on the H200) and the shared-
memory layout of the ring and the K parts' exchange (:class:`GemmPlan`)."""

import functools
import itertools

from ..launch import GEMM_ROOM, SMEM_BYTES
from ..ring import CHUNK

TILE = 64  # rows per wgmma (its M)
MAX_TILES = 3  # tiles per CTA (one TMA box of 192 rows; four, 256 rows, never ran on a GPU)
SPLITS = (1, 2, 4, 8)  # CTAs per cluster, each 1/split of K (portable cluster sizes)
# CTAs resident at one per SM on an H200 by cluster size (cuOccupancyMaxActiveClusters:
# 66 clusters of 2, 30 of 4, 15 of 8; clusters stay within a GPC)
RESIDENT = {1: 132, 2: 132, 4: 120, 8: 120}
# Clusters of 3 (the DSA front's K split, kernels/dsa.py; not in SPLITS): not measured; a
# GPC holds at least as many clusters of 3 as of 4, so at least the 32 of that grid
RESIDENT_3 = 96
TOKEN_TILES = (8, 16, 32, 64)  # wgmma's N: the compile buckets of the batch
MAX_BATCH = TOKEN_TILES[-1]
MAX_DEPTH = 32  # ring slots
CONSUMER_WARPS = PRODUCER_WARPS = 4  # a warpgroup each
THREADS = 32 * (CONSUMER_WARPS + PRODUCER_WARPS)  # the consumers, then the producers
PRODUCERS = 32 * PRODUCER_WARPS
# FP32 registers per consumer thread for the running sums and the chunks' own sums (wgmma's
# accumulators): tiles · T/2 each, the running sums and at least one set (ptxas: 205
# registers, no spills, at three tiles of 64 tokens)
ACCUMULATOR_REGISTERS = 192
MAX_SETS = 4  # chunks whose wgmmas are in flight at once
PACE_BYTES = 48 * 1024  # a CTA's weight bytes in flight before x's first chunk is in (x queues behind the stream)
# Plans of the 8-token bucket (B <= 8) issue their whole ring before the PDL wait; past it a CTA
# keeps PACE_BYTES in flight, whatever its tiles. TP8-rank layer A/B (H100, two runs, µs at
# B = 1 / 8 / 64; benchmarks/NOTES.md): whole ring to 8, then 3 chunks 61.9 / 67.1 / 93.6;
# 48 KB at every bucket 64.1 / 70.0 / 92.1; 3 chunks at every bucket 64.9 / 70.7 / 93.5
EARLY_TOKENS = 8
# partition's costs, from the H200 (bench_projection, benchmarks/NOTES.md): a one-tile CTA
# streamed at ~67 % of the HBM floor whatever its K (8 KB chunks: a fixed ~0.3 µs each),
# two- and three-tile CTAs at 73-95 %
CHUNK_COST = 48  # a chunk's fixed cost (barriers, fences, the wgmma chain's latency)
SPLIT_COST = 512  # a K split's (two cluster barriers, the exchange's latency)
COST_SLACK = 0.03  # partitions this close to the least cost count as ties
# At 64 tokens two tiles a CTA keep 128 accumulator registers a consumer thread (1-2 chunks'
# wgmmas in flight, where one tile keeps 3-4) and exchange twice the K parts' bytes: where a
# CTA's K is short, one tile at half the split (the same CTAs, the same bytes) ran faster on
# every shape measured (H100, bench_projection --partitions and bench_layer,
# benchmarks/NOTES.md: 0.45-0.8 µs at 3-14 chunks a CTA, 0.7 at 48), and slower at 96 chunks
# (TP1's o-proj: 3.9 µs, its x read half as often); level at 32 tokens
WIDE_TOKENS = 64
WIDE_CHUNKS = 48  # the most chunks a two-tile CTA has where the swap applies
RECEIVE_PAD = 4  # FP32 words after each received row of T tokens (fewer bank conflicts)
NORM_REGISTERS = 160  # words of x and gamma packets a producer thread holds in raw-row mode


def token_tile(batch: int) -> int:
    """wgmma's N for a batch: the compile bucket."""
    return next(t for t in TOKEN_TILES if batch <= t)


def partition(n: int, k: int, tokens: int, owned: int = 8) -> tuple[int, int] | None:
    """(tiles, split) of an (N, K) weight at T tokens: among the partitions whose grid is
    resident at once (RESIDENT) and whose CTAs own a multiple of ``owned`` rows each (8: a
    packet; situ's epilogue: 16, a gate and an up packet), the smallest split, then fewest
    tiles, of those within COST_SLACK of the least cost per CTA; None if none fits
    (K % CHUNK, N % 8, or too many rows for one wave).

    Cost, in 128-byte rows of a chunk: per chunk the CTA's weight rows, x's rows at a
    quarter (L2 hits, read by every block: more tiles per CTA read x fewer times) and
    CHUNK_COST; for a K split SPLIT_COST plus its DSMEM exchange (rows × T FP32 at half).
    At WIDE_TOKENS a two-tile choice of at most WIDE_CHUNKS chunks a CTA goes to one tile at
    half the split."""
    costs = {key: cost for key, (ctas, cost) in partitions(n, k, tokens, owned).items()
             if ctas <= RESIDENT[key[0]]}
    if not costs:
        return None
    least = min(costs.values())
    split, tiles = min(key for key, cost in costs.items() if cost <= least * (1 + COST_SLACK))
    narrow = (split // 2, tiles // 2)
    if tokens >= WIDE_TOKENS and tiles == 2 and k // CHUNK // split <= WIDE_CHUNKS and narrow in costs:
        split, tiles = narrow
    return tiles, split


def partitions(n: int, k: int, tokens: int, owned: int = 8, uneven: bool = False) -> dict:
    """(split, tiles) → (CTAs, cost per CTA) of every partition of an (N, K) weight whose
    CTAs own a multiple of ``owned`` rows each (``uneven``: the rows a CTA owns rounded up to
    one, the cluster's last CTAs owning none: :class:`GemmPlan`'s ``unit``)."""
    if k % CHUNK or n % 8 or n <= 0:
        return {}
    chunks, row_tiles = k // CHUNK, -(-n // TILE)
    return {
        (split, tiles): (-(-n // (TILE * tiles)) * split, cta_cost(chunks, tiles, split, tokens))
        for tiles in range(1, min(MAX_TILES, row_tiles) + 1) for split in SPLITS
        if chunks % split == 0 and (uneven or (TILE * tiles // split) % owned == 0)
        and 2 * tiles * tokens // 2 <= ACCUMULATOR_REGISTERS
    }


def joint_partition(weights: list[tuple[int, int]], k: int, tokens: int) -> list[tuple[int, int]] | None:
    """(tiles, split) of each of several weights (N, owned) of one K that one grid streams
    side by side (the fused shared expert's front and gate/up): each weight's CTAs in whole
    clusters of the largest split, all resident at once together, a CTA's owned rows rounded
    up (uneven: the grid is short of SMs for even owners). The least cost of the slowest CTA
    (within COST_SLACK), then the least cost of each weight in turn (the first's outputs are
    awaited first), then the fewest CTAs; None if none fits."""
    options = [partitions(n, k, tokens, owned, uneven=True) for n, owned in weights]
    fits = []
    for keys in itertools.product(*options):
        cluster = max(split for split, _ in keys)
        ctas, costs = zip(*(option[key] for option, key in zip(options, keys)))
        if all(c % cluster == 0 for c in ctas) and sum(ctas) <= RESIDENT[cluster]:
            fits.append((max(costs), costs, sum(ctas), keys))
    if not fits:
        return None
    least = min(fit[0] for fit in fits)
    *_, keys = min(fit for fit in fits if fit[0] <= least * (1 + COST_SLACK))
    return [(tiles, split) for split, tiles in keys]


def cta_cost(chunks: int, tiles: int, split: int, tokens: int) -> float:
    """:func:`partition`'s cost of a CTA of ``tiles`` tiles over 1/``split`` of ``chunks``."""
    return (chunks // split * (TILE * tiles + tokens / 4 + CHUNK_COST)
            + (split > 1) * (SPLIT_COST + TILE * tiles * tokens / 64))


class GemmPlan:
    """The static partition and shared-memory layout of one (N, K, T) variant."""

    def __init__(self, n: int, k: int, tokens: int, parts: tuple[int, int] | None = None, by_token: bool = False,
                 reserve: int = 0, room: int | None = None, whole: bool = False, unit: int = 8):
        """``parts``: (tiles, split) instead of :func:`partition`'s; ``by_token``: a K split's
        owners take token ranges of every row of the block (a head's rows stay in one CTA:
        kernels/dsa.py) instead of row ranges; ``reserve``: shared bytes a mode adds;
        ``room``: shared bytes the ring leaves the SM for another kernel's CTAs (None:
        launch.GEMM_ROOM), at most what leaves one slot, or with ``whole`` (raw rows: the CTA's
        whole K slice stays in the ring) every chunk's (the K parts' exchange over the ring
        may take more); ``unit``: a CTA owns a multiple of this many rows (rows/split rounded
        up: the cluster's last CTAs may own none, :func:`joint_partition`'s uneven plans)."""
        parts = parts or partition(n, k, tokens)
        if parts is None or tokens not in TOKEN_TILES or k % (CHUNK * parts[1]):
            raise ValueError(f"the decode GEMM does not take N={n}, K={k}, {tokens} tokens")
        self.n, self.k, self.tokens = n, k, tokens
        self.tiles, self.split = parts
        self.by_token = by_token
        self.rows = TILE * self.tiles  # of a block: the TMA box's rows
        self.blocks = -(-n // self.rows)
        self.ctas = self.blocks * self.split
        self.chunks = k // CHUNK // self.split  # per CTA
        self.x_items = raw_items(tokens)
        # raw rows: a producer holds every chunk's x and gamma packets from the sums to the slots,
        # else the sums keep raw_window chunks' loads in flight beside the ring's gamma packets
        self.holds_raw = raw_rows_fit(self.chunks, tokens)
        if by_token:
            # tokens per owner, even: an accumulator pair (tokens 2t, 2t + 1) has one owner
            self.per_owner = -(-tokens // self.split) + (-(-tokens // self.split)) % 2
            self.owned = self.rows  # every row of the block, for per_owner tokens
            # ≡ 2 (mod 4): a warp's rows (thread = row) read their token pairs (8 bytes) in distinct banks
            self.stride = self.per_owner + (2 if self.per_owner % 4 == 0 else 0)
        else:
            self.per_owner = tokens
            # output rows each CTA of a cluster reduces and stores
            self.owned = -(-(self.rows // self.split) // unit) * unit
            self.stride = tokens + RECEIVE_PAD  # FP32 words per received row
        self.w_slot, self.x_slot = self.rows * CHUNK * 2, tokens * CHUNK * 2  # bytes, 1024-multiples
        stage = self.w_slot + self.x_slot
        self.reserve = reserve
        free = SMEM_BYTES - 2048 - reserve  # 2 KB: barriers, alignment
        self.room = max(0, min(GEMM_ROOM if room is None else room, free - (self.chunks if whole else 1) * stage))
        self.depth = min(self.chunks, MAX_DEPTH, (free - self.room) // stage)
        if self.depth < 1:
            raise ValueError(f"the decode GEMM's ring does not fit shared memory (N={n}, K={k}, {tokens} tokens)")
        self.raw_window = self.chunks if self.holds_raw else max(
            1, min(self.chunks, (NORM_REGISTERS - 4 * self.depth) // (4 * self.x_items)))
        # chunks in flight (each into its own accumulator set and ring slot): as many as the
        # registers hold beside the running sums and the ring's slots, that divide the CTA's chunks
        sets = min(MAX_SETS, ACCUMULATOR_REGISTERS // (self.tiles * tokens // 2) - 1, self.depth)
        self.sets = max(s for s in range(1, sets + 1) if self.chunks % s == 0)
        # weight chunks issued before the PDL wait
        self.pace = self.depth if tokens <= EARLY_TOKENS else max(1, min(PACE_BYTES // self.w_slot, self.depth))
        self.block_bytes = self.owned * self.stride * 4  # a part's sums of one owner's rows (by_token: tokens)
        # the parts that own rows (tokens): an uneven plan's or a small batch's last parts own none
        self.receivers = min(self.split, -(-tokens // self.per_owner) if by_token else -(-self.rows // self.owned))
        self.receive_bytes = self.split * self.block_bytes  # [part][owned row][token], over the ring
        self.staging_word = self.receive_bytes // 4  # the staging's first FP32 word: after the receive buffer
        # a K split's staging after it, [owner][owned row][token]: the blocks that go to the peers
        self.ring_bytes = max(self.depth * stage, self.receive_bytes * (2 if self.split > 1 else 1))
        if self.ring_bytes + 2048 + reserve > SMEM_BYTES:
            raise ValueError(f"the decode GEMM's ring does not fit shared memory (N={n}, K={k}, {tokens} tokens)")
        self.room = min(self.room, free - self.ring_bytes)  # what the exchange leaves of it, where it needs more

    def owner(self, token):
        """by_token: the CTA of the cluster that reduces ``token`` (and its index there)."""
        owner = token // self.per_owner
        return owner, token - owner * self.per_owner

    def receive_word(self, part, index, token):
        """The FP32 word of K part ``part``'s sum of owned row ``index``, ``token`` (by_token:
        the owner's index of the token)."""
        return (part * self.owned + index) * self.stride + token


def raw_items(tokens: int) -> int:
    """Raw rows: the x packets a producer thread loads of each chunk."""
    return -(-tokens * (CHUNK // 8) // PRODUCERS)


def raw_rows_fit(chunks: int, tokens: int) -> bool:
    """Raw rows (``DecodeGemm.produce_normalized``): a producer thread holds its x packets
    and gamma's of each of the CTA's ``chunks`` chunks in registers until the K parts'
    Σ x² are in."""
    return chunks * (raw_items(tokens) + 1) * 4 <= NORM_REGISTERS


@functools.cache
def raw_rows_plan(n: int, k: int, tokens: int) -> GemmPlan:
    """``kimi::normed_oproj``'s plan: :func:`partition`'s, with the K parts' Σ x² [part][token]
    (FP64) beside the ring (past :func:`raw_rows_fit` the chunks beyond the ring load x
    again: GemmPlan.holds_raw)."""
    parts = partition(n, k, tokens)
    if parts is None:
        raise ValueError(f"the decode GEMM does not take raw rows of N={n}, K={k} at {tokens} tokens")
    return GemmPlan(n, k, tokens, parts, reserve=8 * parts[1] * tokens + 64)


@functools.cache
def gemm_plan(n: int, k: int, tokens: int, owned: int = 8) -> GemmPlan:
    """``owned``: :func:`partition`'s."""
    return GemmPlan(n, k, tokens, partition(n, k, tokens, owned))


