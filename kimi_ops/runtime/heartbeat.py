"""A TP group's pulse on one host, for its device barrier (``kimi::group_barrier``): a page
of shared memory (``/dev/shm``) with a 64-byte word per rank, mapped for the GPU. Each
rank's ticker — a child process of a few lines of plain Python, no torch — adds one to its
word every PERIOD seconds while its parent lives, and exits once it is orphaned; the
barrier kernel fails a peer only once the peer's word has stopped moving for the barrier's
bound, so a rank that is alive but slow on the host (compiling, paging, paused in a
debugger, blocked in a call that holds the GIL while its GPU waits) does not trip the
group, and a dead one still does within the bound. (A thread of the rank's own process
stalls with its GIL: a peer blocked in ``tensor.item()`` behind its own barrier fell silent.)

The pulse is plain host memory written by another process: no CUDA call, so it cannot break
a CUDA-graph capture (a side stream's copies would, in torch's default global capture mode).
"""

import ctypes
import mmap
import os
import subprocess
import sys
import uuid
import warnings

import torch

from ..mailbox import PULSE_STRIDE as STRIDE

PERIOD = 0.1  # seconds between ticks (the barrier's silence bound is 10 of them)

TICKER = """
import ctypes, mmap, os, sys, time
path, offset, period, parent = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), os.getppid()
fd = os.open(path, os.O_RDWR)
word = ctypes.c_int64.from_buffer(mmap.mmap(fd, 0), offset)
os.close(fd)
print(flush=True)  # the page is open: its name may go
while os.getppid() == parent:
    word.value += 1
    time.sleep(period)
"""


class Heartbeat:
    """The page ``name`` (``/dev/shm/<name>``) of ``tp`` words; this process ticks word
    ``rank``. ``create``: make and size the page (one rank does, before the others open
    it). ``address``: the page's device-visible address (0 without CUDA: no GPU reads it)."""

    def __init__(self, name: str, tp: int, rank: int, create: bool, period: float = PERIOD):
        self.path, self.tp, self.rank = f"/dev/shm/{name}", tp, rank
        size = tp * STRIDE
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.page = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words = (ctypes.c_int64 * (size // 8)).from_buffer(self.page)
        self.address = 0
        self.ticker = subprocess.Popen([sys.executable, "-S", "-c", TICKER, self.path, str(rank * STRIDE), str(period)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        try:
            if not self.ticker.stdout.readline():
                raise RuntimeError(f"the heartbeat's ticker exited ({self.ticker.wait()})")
            self.address = self.map_for_cuda(size)
        except RuntimeError:
            self.close()
            if create:
                os.unlink(self.path)
            raise

    def map_for_cuda(self, size: int) -> int:
        """Register the page as mapped, portable pinned memory; its device address."""
        if not torch.cuda.is_available():
            return 0
        from cuda.bindings import driver

        torch.cuda.synchronize()  # the device's primary context exists and is current
        host = ctypes.addressof(self.words)
        flags = driver.CU_MEMHOSTREGISTER_DEVICEMAP | driver.CU_MEMHOSTREGISTER_PORTABLE
        (error,) = driver.cuMemHostRegister(host, size, flags)
        if error == driver.CUresult.CUDA_SUCCESS:
            error, device = driver.cuMemHostGetDevicePointer(host, 0)
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"the group's heartbeat page: {error}")
        return int(device)

    def beat(self, rank: int) -> int:
        """Rank ``rank``'s count so far."""
        return self.words[rank * STRIDE // 8]

    def stop(self) -> None:
        """Stop ticking (this rank then reads as dead to its peers' barriers)."""
        self.ticker.kill()
        self.ticker.wait()
        self.ticker.stdout.close()

    def close(self) -> None:
        """Stop, and give the page's CUDA registration and mapping back (no kernel may read
        ``address`` after: a later page at the same host address could not be registered)."""
        self.stop()
        if self.address:
            from cuda.bindings import driver

            driver.cuMemHostUnregister(ctypes.addressof(self.words))
            self.address = 0
        del self.words  # the page's last export, so the mapping can close
        self.page.close()

    def unlink(self) -> None:
        """Remove the page's name (every rank has it open: the mappings stay)."""
        os.unlink(self.path)


def start(group, tp: int, rank: int) -> Heartbeat | None:
    """The page of a process group on one host (torch.distributed ``group``: every rank calls
    this): rank 0 makes it, every rank maps it and ticks its word. None on every rank where
    some rank cannot (no /dev/shm, a rank on another host, no mapping): the barrier then
    keeps its fixed bound, and every rank warns, naming the ranks that could not and why."""
    import torch.distributed as dist

    name = [f"kimi_ops_heartbeat_{os.getpid()}_{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)

    def opened(create: bool) -> tuple[Heartbeat | None, str | None]:
        try:
            return Heartbeat(name[0], tp, rank, create), None
        except (OSError, RuntimeError) as error:
            return None, f"{type(error).__name__}: {error}"

    heartbeat, why = opened(create=True) if rank == 0 else (None, None)
    dist.barrier(group=group)  # the page exists (or rank 0 could not make it) before the others open it
    if rank:
        heartbeat, why = opened(create=False)
    reasons = [None] * tp
    dist.all_gather_object(reasons, why, group=group)
    if rank == 0 and heartbeat:
        heartbeat.unlink()  # every rank that could has it open
    if not any(reasons):
        return heartbeat
    if heartbeat:
        heartbeat.close()
    failed = "; ".join(f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason)
    warnings.warn(f"kimi_ops: the TP group's heartbeat did not start ({failed}); kimi::group_barrier keeps its fixed "
                  "bound (KIMI_OPS_BARRIER_TIMEOUT_MS, 1 s): a rank slower than that on the host trips the group")
    return None
