"""Launching the kernels: the CTA shape, the SM budget, programmatic dependent launch
(PDL) and its trigger."""

import functools
import os

import cutlass
import cutlass.cute as cute
import torch

THREADS = 256  # every kernel's CTA (launch)


SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per SM


# KIMI_OPS_PDL=0: every kernel launched without programmatic dependent launch (each starts
# when its predecessor has ended): bench_layer's "without PDL" row. Part of the cache key.
PDL = os.environ.get("KIMI_OPS_PDL", "1") != "0"


def launch(kernel, grid, stream, min_blocks_per_mp: int = 0) -> None:
    """Launch a traced ``kernel(...)`` call over ``grid`` CTAs of THREADS threads, with
    programmatic dependent launch; ``min_blocks_per_mp`` 1 lets ptxas take the registers
    to keep a thread's loads in flight (see tail.fronts.weighted_rows)."""
    kernel.launch(grid=[*grid, *[1] * (3 - len(grid))], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL,
                  min_blocks_per_mp=min_blocks_per_mp)


class PdlTrigger:
    """When a kernel triggers its dependent grid (``griddepcontrol.launch_dependents``):
    ``early`` at entry (for dependents that must start at once, e.g. persistent ones that
    first drain other work), else once this grid's outputs are written (dependents cannot
    take its SMs)."""

    def __init__(self, early: bool):
        self.early = early

    @cute.jit
    def trigger_at_entry(self):
        if cutlass.const_expr(self.early):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def trigger_when_written(self):
        if cutlass.const_expr(not self.early):
            cute.arch.griddepcontrol_launch_dependents()


@functools.cache
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
