"""The split tail's static plan (:class:`Plan`): one rank's up projection [N, L] over
clusters of CLUSTER CTAs, their warps and MMA tiles, and the shared-memory layout of the
ring, xn and the K parts' exchange (the kernel: :mod:`.split`)."""

from ..launch import SMEM_BYTES
from ..ring import CHUNK, swizzled

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
LATENT_LOADS = 32  # latent packets a lane polls at once (MoeTail.load_latent)


class Plan:
    """Static partition of one rank's up projection [N, L] over clusters, CTAs and warps:
    one CTA per SM, all clusters co-resident, the rest of shared memory for the weight
    ring (measured: a deep ring beats two CTAs per SM with half the ring each)."""

    def __init__(self, tp: int, shard: int, latent: int, groups: int, sources: int = 0):
        """``sources``: the latent box's (publish mode): TP, or 1 for two-shot's gathered rows."""
        self.tp, self.shard, self.latent, self.groups = tp, shard, latent, groups
        self.sources = sources or tp
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
        self.ctas = self.clusters * CLUSTER
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
        self.tokens_per_pass = max(1, 4 // self.sources)  # latent loads in flight per lane: 16 × this
        self.packets = self.cols // 8  # 8-column packets of the CTA's K slice
        self.rounds = -(-self.packets // 32)  # of them per lane
        # a pass's rounds: at most LATENT_LOADS packets in flight per lane (TP16 polled all 64
        # at once: ptxas fell back to 32 registers and 7 KB of spills)
        self.rounds_per_pass = max(1, min(self.rounds, LATENT_LOADS // self.sources))

    def xn_rows(self, batch: int) -> int:
        """Rows of the functional xn buffer NormFront writes: the batch's (MoeTail copies
        those)."""
        return batch

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
