"""DSL values of several fields: :class:`Values`; the :class:`Stamps` and :class:`Marks`
phase clocks."""

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .launch import MARK_COUNT, MARK_FIRST, MARK_RECORD, MARK_RECORDS


class Values:
    """A DSL value made of the attributes named in ``DYNAMIC`` (their runtime parts travel
    through dynamic ifs and loops); the other attributes ride along as Python values."""

    DYNAMIC: tuple = ()

    def __extract_mlir_values__(self):
        return [v for name in self.DYNAMIC for v in cutlass.extract_mlir_values(getattr(self, name))]

    def __new_from_mlir_values__(self, values):
        new, at = copy.copy(self), 0
        for name in self.DYNAMIC:
            n = len(cutlass.extract_mlir_values(getattr(self, name)))
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[at:at + n]))
            at += n
        return new


class Stamps(Values):
    """A kernel's phase clock for benchmarks (compiled out unless ``on``): thread 0 of each
    CTA stores (%globaltimer, %clock64) of phase k of ``phases`` at int64 pair [cta][k] of
    ``buffer`` from its 16-byte piece ``first`` on (a mailbox kernel keeps its error word
    in the first; benchmarks/profile_tail.py reads the tail's, kernels.tail.common.PHASES)."""

    DYNAMIC = ("buffer", "cta", "tid")

    def __init__(self, phases: tuple, on: bool, buffer: cute.Tensor, cta, tid, first: int = 0):
        self.phases, self.on, self.buffer, self.cta, self.tid, self.first = phases, on, buffer, cta, tid, first

    def by(self, thread) -> "Stamps":
        """The same clock, stamped where ``thread`` is 0 (a warp's lane) instead of thread 0."""
        return Stamps(self.phases, self.on, self.buffer, self.cta, thread, self.first)

    @cute.jit
    def at(self, phase: cutlass.Constexpr):
        if cutlass.const_expr(self.on):
            if self.tid == 0:
                pair = self.first + self.cta * len(self.phases) + self.phases.index(phase)
                address = self.buffer.iterator + pair * 4
                cute.arch.inline_ptx("st.global.v2.b64 [{$r0}], { {$r1}, {$r2} };",
                                     read_only_args=[address, cute.arch.globaltimer(), cute.arch.clock64()])

    @cute.jit
    def slot(self, i, first: cutlass.Constexpr[int], depth: cutlass.Constexpr[int], chunks: cutlass.Constexpr[int]):
        """Ring slots (phases "first slot", "refilled slot", "last slot"): the projection's
        first (past the stash), the first refilled one and the last, once they landed."""
        if cutlass.const_expr(self.on):
            if i == first:
                self.at("first slot")
            if i == depth:
                self.at("refilled slot")
            if i == chunks - 1:
                self.at("last slot")


MARKED = {}  # a marked kernel's kind → (its name, its phases' names): benchmarks/timeline.py --marks


def marked(kind: int, kernel: str, phases: tuple) -> int:
    """Name kind ``kind`` (≥ 1) of :class:`Marks` records: ``kernel`` and its phases after
    its start."""
    MARKED[kind] = (kernel, phases)
    return kind


class Marks:
    """One launch's phase clock in a chain of launches (launch.MARKS; compiled out unless
    ``on``): :meth:`at` keeps %globaltimer in registers, and :meth:`store` has thread 0 of
    CTA 0 take the next record after the error word (launch.MARK_FIRST) and write the kind
    and the times there, int64s. Stamps instead write every CTA's phases into a buffer of
    one launch's (benchmarks/profile_tail.py)."""

    def __init__(self, kind: int, on: bool):
        self.kind, self.on, self.times = kind, on, []

    def at(self):
        if cutlass.const_expr(self.on):
            self.times.append(Int64(cute.arch.globaltimer()))

    @cute.jit
    def store(self, error: cute.Tensor):
        if cutlass.const_expr(self.on):
            assert len(self.times) == len(MARKED[self.kind][1]) + 1, "a mark for each named phase, and the start"
            assert 2 + 2 * len(self.times) <= MARK_RECORD, "the kind and the times fit a record"
            tid, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            if (tid == 0) & (cta == 0):
                record = cute.arch.atomic_add(error.iterator + MARK_COUNT, Int32(1)) & (MARK_RECORDS - 1)
                base = error.iterator + MARK_FIRST + record * MARK_RECORD
                for k, value in enumerate([Int64(self.kind)] + self.times):
                    cute.arch.inline_ptx("st.global.b64 [{$r0}], {$r1};", read_only_args=[base + 2 * k, value])
