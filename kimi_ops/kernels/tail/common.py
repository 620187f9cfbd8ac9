"""What the tail's kernels share (kernels/common.py: what every family shares): the device
side of its mailbox boxes — the TP sources summed in rank order, the reduce-scatter
sources polled, the previous layer's boxes re-armed, output packets into every rank's box,
the publish arguments (:class:`Outbox`) — the rounding points its kernels share, and the
phases of the tails' clock."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int64

from ...mailbox import TAIL_LATENT_POLL as LATENT_POLL  # noqa: F401  (the error word's bits, for the tail's kernels)
from ...mailbox import TAIL_SHARED_POLL as SHARED_POLL
from ...mailbox import TWO_SHOT_POLL  # noqa: F401
from ..mailbox import box_row, poll_all, rearm, store_to_peers
from ..packets import unpack_words
from ..ptx import pack_values
from ..values import Values

# The functional tails' phases (kernels.Stamps, for benchmarks/profile_tail.py),
# stamped into the buffer that comes in as the error word (MoeTail) or stamps (WaveMoeTail:
# "latent" is its first xn chunk in, the slots its warpgroup 0's).
PHASES = ("start", "waited", "latent", "clustered", "normed", "first slot", "refilled slot", "last slot",
          "projected", "ring free", "scattered", "end")


class Outbox(Values):
    """Both tails' publish side: the output boxes' base addresses, the poll error word, the
    mailbox parity and our rank (placeholders in functional mode)."""

    DYNAMIC = ("peers", "error", "parity", "rank")

    def __init__(self, peers, error, parity, rank):
        self.peers, self.error, self.parity, self.rank = peers, error, parity, rank


@cute.jit
def rearm_previous(box, sources: cutlass.Constexpr[int], rearm_parity, rearm_batch, first, threads):
    """Sentinels over rows [0, rearm_batch) of every source at ``rearm_parity`` of a box
    [3, sources, CAP, width]: of the sources' packets in a row, packet ``first`` on in steps
    of ``threads`` (the previous MoE layer's box: consumed before we were launched). A
    source's rows are contiguous, one run of packets each, so a store costs no division (a
    flat index's runtime divisions: its lines held 36 % of PollNormFront's samples at B = 64)."""
    packets = rearm_batch * (box.shape[3] // 8)
    for source in cutlass.range(sources, unroll=1):
        run = box.iterator + box_row(rearm_parity, source, 0, sources, box.shape[2]) * box.shape[3]
        # our first packet of this run: the flat index source · packets + packet ≡ first (mod threads)
        for packet in cutlass.range((first + source * (threads - packets % threads)) % threads, packets, threads,
                                    unroll=1):
            rearm(run + packet * 8)


@cute.jit
def reduced_shared(shared_box, tp: cutlass.Constexpr[int], parity, items, error):
    """BF16(Σ of the TP sources' shared reduce-scatter packets, rank order) at each (token,
    row) of ``items``, all polled at once (bounded, into the error word): 8 values each."""
    capacity = shared_box.shape[2]
    return rank_sums(poll_all([shared_box.iterator + box_row(parity, source, token, tp, capacity) * shared_box.shape[3] + row for token, row in items for source in range(tp)],
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
def publish_out(bases, shard: cutlass.Constexpr[int], rank, token, row, words):
    """An output packet (``row`` of our shard) to columns [rank · shard, …) of ``token``'s
    row in every rank's output box [1, CAP, H] (``bases``: theirs, kernels.peer_bases)."""
    store_to_peers(bases, (Int64(token) * shard * len(bases) + rank * shard + row) * 2, words)


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
    return pack_values([up[i] + extra[i] for i in range(8)])
