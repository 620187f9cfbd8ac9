"""The TP group's bounded barrier between the decoder's phases (``kimi::group_barrier``)
for multi-process groups (:class:`~kimi_ops.runtime.groups.SymmMemGroup`).

One CTA; thread p < TP serves peer p. Every thread reads the rank's monotonic ticket t + 1
(thread 0 stores it back), waits for the previous grid (its stores, the peer stores of the
phase, are then done), fences at system scope, stores the ticket into slot ``rank`` of
peer p's sync box, then polls slot p of the rank's own box until it holds at least the
ticket — bounded by the global timer, and not at all once the error word is set (a fault
already recorded: the later barriers of the step return at once, so a dead peer costs
one poll bound, not one per phase). The bound: with the group's heartbeat page
(``pulses``, runtime/heartbeat.py) BARRIER_TIMEOUT_NS of peer p's silence (its word did
not move), at most BARRIER_ALIVE_NS in all; without it (``pulses`` 0) BARRIER_TIMEOUT_NS.
A second system fence orders the phase after it behind the peers' stores.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from ...mailbox import BARRIER_POLL, PULSE_STRIDE
from ..launch import launch
from ..mailbox import BARRIER_ALIVE_NS, BARRIER_TIMEOUT_NS
from ..ptx import fence_system, load_words, nap, store_words

SLOT_BYTES = 16  # one packet per rank in a sync box


class GroupBarrier:
    def __init__(self, tp: int):
        self.tp = tp

    @cute.jit
    def __call__(self, peers: cute.Tensor, ticket: cute.Tensor, error: cute.Tensor, rank: Int32, pulses: Int64,
                 stream):
        launch(self.kernel(peers, ticket, error, rank, pulses), [1], stream)

    @cute.kernel
    def kernel(self, peers: cute.Tensor, ticket: cute.Tensor, error: cute.Tensor, rank: Int32, pulses: Int64):
        tid, _, _ = cute.arch.thread_idx()
        mine = ticket[0] + Int64(1)
        cute.arch.griddepcontrol_wait()
        cute.arch.sync_threads()  # every thread has read the old ticket before thread 0 stores
        if tid == 0:
            ticket[0] = mine
        if tid < self.tp:
            fence_system()
            words = [Uint32(mine & Int64(0xFFFFFFFF)), Uint32(mine >> Int64(32))]
            store_words(Int64(peers[tid]) + Int64(rank * SLOT_BYTES), words, mailbox=True)
            slot = Int64(peers[rank]) + Int64(tid * SLOT_BYTES)
            pulse = pulses + Int64(tid * PULSE_STRIDE)
            start = cute.arch.globaltimer()
            heard, beat = start, self.beat(pulses, pulse)
            waiting = error[0] == Int32(0)
            while waiting:
                seen = load_words(slot, polled=True)
                value = (Int64(seen[1]) << Int64(32)) | Int64(seen[0])
                waiting = value < mine
                if waiting:
                    now = cute.arch.globaltimer()
                    latest = self.beat(pulses, pulse)
                    if latest != beat:
                        heard, beat = now, latest
                    if (now - heard > BARRIER_TIMEOUT_NS) | (now - start > BARRIER_ALIVE_NS):
                        cute.arch.atomic_or(error.iterator, Int32(BARRIER_POLL))
                        waiting = cutlass.Boolean(False)
                    else:
                        nap()
            fence_system()
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def beat(self, pulses: Int64, pulse: Int64) -> Int64:
        """Peer's heartbeat count (0 without a page: the silence bound is then the bound)."""
        count = Int64(0)
        if pulses != Int64(0):
            words = load_words(pulse, polled=True)
            count = (Int64(words[1]) << Int64(32)) | Int64(words[0])
        return count
