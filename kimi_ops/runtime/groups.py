"""TP groups (DESIGN §4): who owns which boxes, and how a rank addresses its peers'.

One interface, two implementations. ``allocate`` returns, for every rank this process
drives, the list of every rank's box as that rank addresses it (its own one at its rank):
the ``boxes`` argument of the publishing ops. ``owned`` are the buffers this process
allocated (registered as module buffers: static addresses for CUDA graphs).
"""

import os
from dataclasses import dataclass

import torch

from ..checks import fail_setting, is_int
from ..mailbox import arm_
from . import heartbeat


@dataclass
class Boxes:
    owned: list[torch.Tensor]  # one per local rank
    peers: dict[int, list[torch.Tensor]]  # local rank → every rank's box, rank order


class SimulatedGroup:
    """N ranks in one process (TP1: one rank, one box): every box is a local tensor and
    the decoder runs the ranks phase by phase, so TP2/TP8/TP16 semantics run on one
    device, the CPU included. Phases run one after the other: no barrier between them."""

    barrier = False  # the decoder's phases need no kimi::group_barrier
    device = None  # the decoder's ``device`` argument decides

    def __init__(self, tp: int):
        if tp < 1:
            raise ValueError(f"SimulatedGroup: tp must be ≥ 1, got {tp}")
        self.tp, self.ranks = tp, tuple(range(tp))

    def allocate(self, shape, device) -> Boxes:
        boxes = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in self.ranks]
        for box in boxes:
            arm_(box)
        return Boxes(boxes, {rank: boxes for rank in self.ranks})

    def agree(self, settings: dict) -> None:
        """Every rank is built from the same settings: one process, nothing to compare."""

    def host_barrier(self) -> None:
        """Every rank's host-side work is done: one process, nothing to wait for."""


class SymmMemGroup:
    """One rank per process over torch.distributed symmetric memory: boxes from
    ``symm_mem.empty``, peers' boxes from ``rendezvous`` on the TP ``group`` (default
    WORLD; pass the TP subgroup when the world is larger) through ``get_buffer``.

    ``group`` may be a gloo group, with several ranks on one GPU
    (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``; NCCL refuses that). The rank's device
    is ``device``, else global rank % device_count. The decoder's phases end in
    ``kimi::group_barrier`` (a bounded device barrier: a dead peer sets the error word
    rather than hanging). Multicast is used only when the handle's ``multicast_ptr`` is
    non-zero; otherwise (and always in the reference backend) a multicast store is one
    peer store per rank. The group turns torch's multicast off before its first rendezvous
    (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, unless the caller set it): no multicast object is
    created unless a caller asks for one."""

    barrier = True

    def __init__(self, group=None, device=None):
        import torch.distributed as dist

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # read at rendezvous
        self.group = group or dist.group.WORLD
        self.tp = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.ranks = (self.rank,)
        if not torch.cuda.is_available():
            fail_setting("SymmMemGroup", "device", "a CUDA device (torch symmetric memory)", "no CUDA device")
        if device is None:
            device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        self.device = torch.device(device)
        torch.cuda.set_device(self.device)
        self.handles = []
        self.heartbeat = heartbeat.start(self.group, self.tp, self.rank)
        self.pulses = self.heartbeat.address if self.heartbeat else 0  # group_barrier's page (0: none)

    def allocate(self, shape, device) -> Boxes:
        import torch.distributed._symmetric_memory as symm_mem

        box = symm_mem.empty(shape, dtype=torch.bfloat16, device=device)
        arm_(box)
        handle = symm_mem.rendezvous(box, self.group)
        self.handles.append(handle)
        peers = [handle.get_buffer(p, tuple(shape), torch.bfloat16) for p in range(self.tp)]
        return Boxes([box], {self.rank: peers})

    def agree(self, settings: dict) -> None:
        """Every rank of the group was built from the same ``settings`` (a dict of
        picklable values), else a clear error on every rank, before any box exists (one
        rank's boxes of another capacity would make the peers' stores land wrong)."""
        import torch.distributed as dist

        everyone = [None] * self.tp
        dist.all_gather_object(everyone, settings, group=self.group)
        for rank, theirs in enumerate(everyone):
            for name, value in settings.items():
                if theirs.get(name) != value:
                    fail_setting("KimiDecoder", name, f"the same on every rank (rank {self.rank}: {value!r})",
                                 f"{theirs.get(name)!r} on rank {rank}")

    def host_barrier(self) -> None:
        """This rank's queued GPU work is done, and so is every other rank's (the device
        barrier's bound covers only the ranks' skew within and between steps)."""
        import torch.distributed as dist

        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    @property
    def multicast(self) -> bool:
        return bool(self.handles) and self.handles[0].multicast_ptr != 0


GROUP_INTERFACE = ("tp", "ranks", "barrier", "device", "allocate", "agree", "host_barrier")


def make_group(tp) -> SimulatedGroup | SymmMemGroup:
    """``tp``: a rank count ≥ 1 (all ranks in this process), or a group object (the
    interface of SimulatedGroup / SymmMemGroup)."""
    if is_int(tp):
        if tp < 1:
            fail_setting("KimiDecoder", "tp", "a rank count ≥ 1 or a TP group", tp)
        return SimulatedGroup(tp)
    if not all(hasattr(tp, name) for name in GROUP_INTERFACE):
        fail_setting("KimiDecoder", "tp", "an int rank count ≥ 1 or a TP group (SimulatedGroup, SymmMemGroup)",
                     f"{tp!r} ({type(tp).__name__})")
    return tp
