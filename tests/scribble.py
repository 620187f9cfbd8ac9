"""Shared memory left dirty on every SM, as the earlier kernels of a serving process leave
it: a kernel that reads shared memory it did not write fails its test here, not only
when some other test happened to run first."""

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Uint32
from cutlass.memory import SmemAllocator

from kimi_ops.kernels.compile import fake, fake_stream
from kimi_ops.kernels.launch import SMEM_BYTES, THREADS

WORDS = SMEM_BYTES // 4  # sm_90's opt-in shared memory per CTA: one CTA fills an SM


class Scribble:
    """Fill the shared memory of every SM with 0xFF bytes: NaN as floats, −1 as counts,
    the largest key as a rank word."""

    def __init__(self, sms: int):
        self.sms = sms

    @cute.jit
    def __call__(self, device_tensor: cute.Tensor, stream):
        """``device_tensor``: any tensor on the GPU (TVM-FFI finds the device and stream by it)."""
        self.kernel().launch(grid=[2 * self.sms, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self):
        tid, _, _ = cute.arch.thread_idx()
        words = SmemAllocator().allocate_tensor(Uint32, cute.make_layout(WORDS), 16)
        for i in cutlass.range(tid, WORDS, THREADS, unroll=4):
            words[i] = Uint32(0xFFFFFFFF)


@functools.cache
def compiled_scribble():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return cute.compile(Scribble(sms), fake(Uint32, (1,), align=4), fake_stream(), options="--enable-tvm-ffi")


def scribble_shared_memory() -> None:
    compiled_scribble()(torch.zeros(1, dtype=torch.int32, device="cuda"))
