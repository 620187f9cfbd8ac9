"""The group barrier's host side: its compile and the adapter of ``kimi::group_barrier``."""

import functools

import cutlass.cute as cute
from cutlass import Int32, Int64

from ... import backend
from ...ops import boxes as boxes_op
from ..arguments import addresses, register_addresses
from ..compile import compile_options, compiled, fake, fake_stream, hopper
from ..variant import Variant, prepare_all, single
from .kernels import GroupBarrier


@compiled
def compile_barrier(tp: int):
    return cute.compile(
        GroupBarrier(tp), fake(Int64, (tp,), align=8), fake(Int64, (1,), align=8), fake(Int32, (1,), align=4),
        Int32(0), Int64(0), fake_stream(), options=compile_options(),
    )


@functools.cache
def barrier_variant(tp: int) -> Variant:
    return single(lambda: compile_barrier(tp))


class GroupBarrierKernel:
    """``kimi::group_barrier`` on CUDA; a group's heartbeat page (runtime/heartbeat.py) is
    registered with its sync boxes at prepare, like their address table."""

    check = staticmethod(boxes_op.check_group_barrier)
    pulses: dict[tuple, int] = {}  # the sync boxes' addresses → their group's heartbeat page

    def prepare(self, tp: int, peer_lists=(), pulses: int = 0) -> None:
        prepare_all([lambda: barrier_variant(tp)])
        register_addresses(peer_lists)
        for boxes in peer_lists:
            self.pulses[tuple(box.data_ptr() for box in boxes)] = pulses

    def unsupported(self, boxes, ticket, error, rank):
        return hopper(ticket)

    def __call__(self, boxes, ticket, error, rank):
        pulses = self.pulses.get(tuple(box.data_ptr() for box in boxes), 0)
        barrier_variant(len(boxes)).run(addresses(boxes), ticket, error, rank, pulses)


def register() -> None:
    backend.KERNELS["group_barrier"] = GroupBarrierKernel()
