"""The mailbox protocol on the device (:mod:`kimi_ops.mailbox` is the host's): Lamport
polls of 16-byte packets against the sentinel, bounded by the global timer, re-arms,
stores to every peer's box in the writers' canonical form, and a box row's layout."""

import os

import cutlass
import cutlass.cute as cute
from cutlass import Int64, Uint32

from .ptx import load_words, nap, store_words

SENTINEL = 0x80000000  # the armed word (kimi_ops.mailbox.SENTINEL as uint32)


def box_row(parity, source, token, sources, capacity):
    """The row of a box [parities, sources, CAP, width] viewed as rows that holds (parity,
    source, token), for DSL values or constants (:func:`kimi_ops.mailbox.box_row`, the
    host's side of this layout, gives the first rows that the host passes in)."""
    return (parity * sources + source) * capacity + token


def bound_ns(variable: str, default_ms: float) -> int:
    return int(float(os.environ.get(variable, default_ms)) * 1_000_000)


# How long a poll that sees nothing waits before it gives up and reports (compiled in, so
# the kernel cache is keyed by them). A mailbox poll's data is one phase away: 50 ms. The
# group barrier (kernels/group.py) also absorbs the ranks' host-side skew between steps
# (first calls, lazy module loads), so it waits 1 s: a dead peer is still reported within
# 2 s, since polls after a recorded fault do not wait.
POLL_TIMEOUT_NS = bound_ns("KIMI_OPS_POLL_TIMEOUT_MS", 50)


BARRIER_TIMEOUT_NS = bound_ns("KIMI_OPS_BARRIER_TIMEOUT_MS", 1000)
# With the group's heartbeat (runtime/heartbeat.py) the barrier's bound is a peer's silence
# (BARRIER_TIMEOUT_NS without a tick), and a live peer may take up to this long.
BARRIER_ALIVE_NS = bound_ns("KIMI_OPS_BARRIER_ALIVE_MS", 60_000)


@cute.jit
def peer_bases(peers: cute.Tensor, count: cutlass.Constexpr[int]):
    """The first ``count`` peers' box base addresses of ``peers``, for :func:`store_to_peers`:
    loaded once, before a kernel's first mailbox store (a load after a system-scope store
    waits for it: ptxas keeps the order, and per packet that was a round trip each)."""
    return [Int64(peers[peer]) for peer in range(count)]


@cute.jit
def store_to_peers(bases, offset: Int64, words, fp32: cutlass.Constexpr[bool] = False):
    """One mailbox packet (four words; eight: two packets, 16 bytes apart) to byte
    ``offset`` of each peer's box (``bases``: :func:`peer_bases`), made unable to equal
    the sentinel: BF16 pairs by :func:`canonical_pair`, ``fp32`` words (logits) by
    :func:`canonical_word`."""
    clean = [canonical_word(w) if fp32 else canonical_pair(w) for w in words]
    for base in bases:
        for first in cutlass.range_constexpr(0, len(clean), 4):
            store_words(base + offset + 4 * first, clean[first:first + 4], mailbox=True)


def owner_base(peers: cute.Tensor, width: int, column):
    """The box base of the rank that owns ``column`` of rows split into chunks of ``width``,
    one a rank (the reduce-scatter and two-shot receive boxes; ``peers``: the bases)."""
    return Int64(peers[column // width])


@cute.jit
def store_to_owner(owner, width: cutlass.Constexpr[int], row, column, words):
    """A packet at ``column`` into its owner's box, row ``row`` of rows of ``width``, made
    unable to equal the sentinel. ``owner``: the peers' bases (the owner's looked up here,
    after the offset) or the owner's base already loaded (:func:`owner_base`)."""
    offset = (Int64(row) * width + column % width) * 2
    if cutlass.const_expr(isinstance(owner, cute.Tensor)):
        owner = owner_base(owner, width, column)
    store_words(owner + offset, [canonical_pair(w) for w in words], mailbox=True)


@cute.jit
def canonical_pair(word: Uint32) -> Uint32:
    """A BF16 pair made unable to equal the sentinel: −0 halves become +0 and NaN halves
    the canonical NaN (kimi_ops.mailbox.canonical)."""
    return canonical_half(word & Uint32(0xFFFF)) | (canonical_half(word >> Uint32(16)) << Uint32(16))


@cute.jit
def canonical_word(word: Uint32) -> Uint32:
    """An FP32 word made unable to equal the sentinel: −0 becomes +0 and NaN the canonical
    NaN (kimi_ops.mailbox.canonical on float32)."""
    result = word
    if word == Uint32(SENTINEL):
        result = Uint32(0)
    if (word & Uint32(0x7FFFFFFF)) > Uint32(0x7F800000):
        result = Uint32(0x7FC00000)
    return result


@cute.jit
def canonical_half(half: Uint32) -> Uint32:
    result = half
    if half == Uint32(0x8000):
        result = Uint32(0)
    if (half & Uint32(0x7FFF)) > Uint32(0x7F80):
        result = Uint32(0x7FC0)
    return result


@cute.jit
def rearm(address):
    """Write the sentinel over a consumed packet (relaxed, system scope)."""
    armed = Uint32(SENTINEL)
    store_words(address, [armed] * 4, mailbox=True)


@cute.jit
def release_consumed():
    """The PDL release of a kernel that takes rows from a box before its
    griddepcontrol.wait: only once every thread of the CTA has re-armed what it took. A
    kernel two launches on may start before this one ends (each releases at entry), and
    one that polls this box again (the next step's, a benchmark's loop) would take these
    rows a second time (launch.py: PDL)."""
    cute.arch.fence_acq_rel_gpu()  # the re-arms visible before the release
    cute.arch.sync_threads()
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def poll(address, error: cute.Tensor, code: cutlass.Constexpr[int]):
    """Lamport poll of one packet (see :func:`poll_all`)."""
    return poll_all([address], error, code)[0]


@cute.jit
def poll_all(addresses, error: cute.Tensor, code: cutlass.Constexpr[int]):
    """Lamport poll of several packets at once (their loads in flight together) until no
    word holds the sentinel, bounded by the global timer: past POLL_TIMEOUT_NS it sets
    ``code`` in the error word and returns what it read (the wrapper raises on its next
    host check). Returns each packet's four words."""
    count = len(addresses)
    values = cute.make_rmem_tensor((count, 4), Uint32)
    start = cute.arch.globaltimer()
    waiting = cutlass.Boolean(True)
    first = cutlass.Boolean(True)
    faulted = error[0] != cutlass.Int32(0)  # a fault is recorded: one look, no wait (the step is lost)
    while waiting:
        if not first:
            nap()
        first = cutlass.Boolean(False)
        waiting = cutlass.Boolean(False)
        for i in cutlass.range_constexpr(count):
            words = load_words(addresses[i], polled=True)
            for k in cutlass.range_constexpr(4):
                values[i, k] = words[k]
            waiting = waiting | (arrived(words) == cutlass.Boolean(False))
        if waiting & (faulted | (cute.arch.globaltimer() - start > POLL_TIMEOUT_NS)):
            cute.arch.atomic_or(error.iterator, cutlass.Int32(code))
            waiting = cutlass.Boolean(False)
    return [[values[i, k] for k in range(4)] for i in range(count)]


@cute.jit
def arrived(words):
    sentinel = Uint32(SENTINEL)
    return (words[0] != sentinel) & (words[1] != sentinel) & (words[2] != sentinel) & (words[3] != sentinel)


@cute.jit
def count_arrival(counter: cute.Tensor):
    """This CTA's outputs stored (every thread's): one arrival on ``counter[0]`` (release,
    GPU scope), for a consumer that waits for the count instead of our end
    (:func:`await_arrivals`)."""
    cute.arch.sync_threads()
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add(counter.iterator, Int64(1), sem="release", scope="gpu")


@cute.jit
def await_arrivals(counter: cute.Tensor, goal, ctas, error: cute.Tensor, code: cutlass.Constexpr[int]):
    """Thread 0 waits until ``counter[0]`` reaches ``goal`` (acquire; bounded as
    :func:`poll_all`: past POLL_TIMEOUT_NS ``code`` goes into the error word), then counts
    its CTA on ``counter[1]``; the last of the grid's ``ctas`` zeroes both words for the
    next call, whose producer counts only after this grid's CTAs are all past: by the data
    it consumes (ours, or a grid's that waited for ours), not by a PDL wait of its own. Every
    thread then waits at the CTA barrier, so the producer's stores are visible to all. After
    a bound passed the word is zeroed early and a late count carries over: the error word is
    set, and reset() clears both."""
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
        start = cute.arch.globaltimer()
        faulted = error[0] != cutlass.Int32(0)
        waiting = cute.arch.load(counter.iterator, Int64, sem="acquire", scope="gpu") < goal
        while waiting:
            nap()
            waiting = cute.arch.load(counter.iterator, Int64, sem="acquire", scope="gpu") < goal
            if waiting & (faulted | (cute.arch.globaltimer() - start > POLL_TIMEOUT_NS)):
                cute.arch.atomic_or(error.iterator, cutlass.Int32(code))
                waiting = cutlass.Boolean(False)
        passed = cute.arch.atomic_add(counter.iterator + 1, Int64(1), sem="relaxed", scope="gpu")
        if passed == Int64(ctas) - Int64(1):
            counter[0] = Int64(0)
            counter[1] = Int64(0)
    cute.arch.sync_threads()
