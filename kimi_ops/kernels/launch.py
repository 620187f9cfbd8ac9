"""Launching the kernels: the CTA shape, the SM budget, programmatic dependent launch
(PDL)."""

import functools
import os

import torch

THREADS = 256  # every kernel's CTA (launch)


SMEM_BYTES = 227 * 1024  # sm_90 opt-in shared memory per SM


# PDL: kernels release their dependents at entry (griddepcontrol.launch_dependents first):
# a dependent's grid launches once every CTA of ours has released it, so ours are all
# resident by then and the dependent cannot take SMs we still need; its
# griddepcontrol.wait still waits for our whole grid to finish and flush. In between it
# prefetches its weights on the SMs we leave free (benchmarks/timeline.py shows it).
# So a kernel two or more launches on may run beside us: one that takes rows from a box
# before its wait releases only after re-arming them (mailbox.release_consumed), or a later
# poll of the same box could take them again. A grid launched early is complete only after
# the grid before it, so a wait reaches every earlier grid, not only the predecessor
# (benchmarks/NOTES.md, seventeenth session). A kernel that skips its wait (the route poll
# after the fused shared expert, runtime/prepared.py) is not ordered after its predecessor
# at all: its caller keeps what that grid reads alive, and whatever needs its results
# polls for them (the routed experts its ready count: mailbox.await_arrivals).
# KIMI_OPS_PDL=0: every kernel launched without programmatic dependent launch (each starts
# when its predecessor has ended): bench_layer's "without PDL" row. Part of the cache key.
PDL = os.environ.get("KIMI_OPS_PDL", "1") != "0"


def percent_setting(variable: str) -> int | None:
    value = os.environ.get(variable, "")
    if not value:
        return None
    if not (value.isdigit() and int(value) <= 100):
        raise ValueError(f"{variable} must be a percentage 0..100 (unset: the driver's choice), got {value!r}")
    return int(value)


def kb_setting(variable: str) -> int:
    value = os.environ.get(variable, "0") or "0"
    if not (value.isdigit() and int(value) * 1024 < SMEM_BYTES):
        raise ValueError(f"{variable} must be whole KB below {SMEM_BYTES // 1024}, got {value!r}")
    return int(value) * 1024


def flag_setting(variable: str) -> bool:
    value = os.environ.get(variable, "0") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{variable} must be 0 or 1, got {value!r}")
    return value == "1"


# KIMI_OPS_SMEM_CARVEOUT=P: every kernel prefers P % of the SM's unified L1 / shared memory
# as shared memory (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, set as its module
# loads: compile.export_carveout). Unset, the driver sets an SM up by each kernel's own
# need; the suspect (benchmarks/NOTES.md, fifteenth session) is that an SM holds CTAs of
# one setup at a time, so a kernel that set SMs up small keeps a successor's CTAs off them
# although both would fit. 100 on every kernel is its A/B: it moves CTAs (the DSA front
# beside the stacked GEMM) but made the layer 3 µs slower on an H100. Part of the cache key.
CARVEOUT = percent_setting("KIMI_OPS_SMEM_CARVEOUT")
# KIMI_OPS_GEMM_ROOM=KB: shared memory every decode-GEMM ring (kernels/gemm, the DSA front,
# the shared expert) leaves its SM, so that the next kernel's CTAs can be resident beside
# ours and stream their weights before our end (issue 37: two CTAs an SM, half the ring
# each). 0: the rings take the SM. An A/B, slower at 140 KB on an H100; part of the cache key.
GEMM_ROOM = kb_setting("KIMI_OPS_GEMM_ROOM")

# KIMI_OPS_MARKS=1: kernels that carry marks (AttnResTake) record %globaltimer at each phase
# of CTA 0 into the words after their rank's error word (kernels.values.Marks), and the
# fused shared expert every CTA's phases (kernels.values.Stamps; benchmarks/timeline.py
# --marks prints both): the CTA-level view CUPTI's kernel records lack. Off: compiled out,
# and the error word is one word. Part of the cache key.
MARKS = flag_setting("KIMI_OPS_MARKS")
# The marks' words (int32) after the error word: word MARK_COUNT counts the records taken,
# records of MARK_RECORD words (the kind, then each phase's time, int64) from word
# MARK_FIRST on, MARK_RECORDS of them (a power of 2: the count wraps into them); then from
# word STAMP_FIRST the stamps, up to STAMP_CTAS CTAs × STAMP_PHASES phases of int64 pairs
# (%globaltimer, %clock64), each launch's over the last's
MARK_COUNT, MARK_FIRST, MARK_RECORD, MARK_RECORDS = 1, 16, 32, 4096
STAMP_FIRST, STAMP_CTAS, STAMP_PHASES = MARK_FIRST + MARK_RECORD * MARK_RECORDS, 256, 8
MARK_WORDS = STAMP_FIRST + STAMP_CTAS * STAMP_PHASES * 4


def check_marks_room(op: str, error) -> None:
    """With MARKS, a marked kernel writes after its error word: ``error`` must be the first
    of MARK_WORDS int32 words (DecodeBoxes.marks)."""
    if MARKS and error.untyped_storage().nbytes() // 4 - error.storage_offset() < MARK_WORDS:
        raise ValueError(f"{op}: with KIMI_OPS_MARKS=1 the kernel records its marks after the error word: error "
                         f"must be the first of {MARK_WORDS} int32 words (DecodeBoxes.marks)")


def launch(kernel, grid, stream, min_blocks_per_mp: int = 0) -> None:
    """Launch a traced ``kernel(...)`` call over ``grid`` CTAs of THREADS threads, with
    programmatic dependent launch; ``min_blocks_per_mp`` 1 lets ptxas take the registers
    to keep a thread's loads in flight (see tail.fronts.weighted_rows)."""
    kernel.launch(grid=[*grid, *[1] * (3 - len(grid))], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL,
                  min_blocks_per_mp=min_blocks_per_mp)


@functools.cache
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
