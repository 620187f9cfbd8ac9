"""The TMA ↔ MMA ring of the tail and the projection engine: a producer streams CHUNK-column
boxes into ``depth`` shared-memory slots (full and empty mbarriers per slot), the MMA warps
read them; the slots' 128-byte swizzle and wgmma's descriptor of it.

Not CUTLASS's ``pipeline.PipelineTmaAsync``: its stage is armed once, for one ``tx_count``,
by the producer's acquire, while a slot here takes the weights' bytes and x's from two warps
at different times (x's only after the PDL wait, the first slots' weights before it), or
the raw-rows producers' plain arrivals after generic-proxy stores (gemm/engine.py), and the
producer itself reads the full barriers to pace its stream (:func:`paced`); its phases
would be the same mbarrier waits as these helpers'."""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

CHUNK = 64  # K columns per ring slot: one 128-byte row, the width of TMA's 128-byte swizzle


@cute.jit
def paced(i, lag: cutlass.Constexpr[int], depth: cutlass.Constexpr[int], full, fronted, waited=None):
    """Before chunk ``i`` of a weight stream through ``depth`` slots: a whole ring queued at
    once (21 MB) holds every other load 2-5 µs behind it (measured), and the front's and
    xn's loads are the critical path. So until xn is in (``fronted``), ``lag`` slots stay
    in flight (chunk i - lag has landed); with ``waited``, none once our predecessor is
    done, so that xn's loads queue behind at most ``lag`` slots (the hold pays where xn is
    the critical path, the wave's: benchmarks/NOTES.md). ``fronted``'s phase 0 is the signal:
    a barrier that completes later phases (a ring slot's) says it only until its next one."""
    if not cute.arch.mbarrier_test_wait(fronted, 0):  # lanes may differ: each only waits
        landed(full, i - lag, depth)
        if cutlass.const_expr(waited is not None):
            if cute.arch.mbarrier_test_wait(waited, 0):
                cute.arch.mbarrier_wait(fronted, 0)


@cute.jit
def landed(full, i, depth: cutlass.Constexpr[int]):
    """Wait until chunk ``i`` of a ring of ``depth`` slots has landed (phase i // depth of
    its slot's full barrier)."""
    cute.arch.mbarrier_wait(full + i % depth, (i // depth) % 2)


@cute.jit
def wait_handed_back(empty, i, depth: cutlass.Constexpr[int]):
    """Before chunk ``i`` goes into a ring of ``depth`` slots: wait until the readers of the
    slot's previous chunk have handed it back."""
    if i >= depth:
        cute.arch.mbarrier_wait(empty + i % depth, (i // depth + 1) % 2)


@cute.jit
def expect(full, slot, size: cutlass.Constexpr[int], lane):
    """Lane 0 arms slot ``slot``'s full barrier for ``size`` bytes of TMA copies, which the
    warp then issues."""
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(full + slot, size)
    cute.arch.sync_warp()


@cute.jit
def hand_back(empty, lane):
    """The warp is done with its part of a slot: the producer may refill it."""
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.mbarrier_arrive(empty)


def swizzled(first, row, piece, pieces=8):
    """The 16-byte piece ``piece`` of row ``first + row`` (``first`` a multiple of 8; rows of
    ``pieces`` pieces, 128 bytes unless said) in TMA's 128-byte swizzle (at piece XOR row % 8,
    within its 128 bytes), so that the eight rows of an ldmatrix 8x8 matrix fall in distinct
    banks."""
    return (first + row) * pieces + (piece ^ (row % 8))


def swizzled_stages(rows, stages):
    """``stages`` boxes of rows × CHUNK BF16 in the 128-byte swizzle (``swizzled``), as TMA
    stores them and wgmma's descriptors read them."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    return cute.tile_to_shape(atom, (rows, CHUNK, stages), (0, 1, 2))


# wgmma's shared-memory matrix descriptor, all but the start address: the 128-byte swizzle
# (bits 62-63), 8-row groups 1024 bytes apart (stride, bits 32-45), leading offset unused (1)
DESCRIPTOR_FIELDS = (1 << 62) | ((1024 >> 4) << 32) | (1 << 16)


@cute.jit
def descriptor(address: Int32) -> Int64:
    """wgmma's descriptor of a K-major [rows, 64] BF16 tile in the 128-byte swizzle at
    shared ``address`` (a 1024-aligned box, + 32 bytes per k16 step within its rows)."""
    return Int64(DESCRIPTOR_FIELDS) | Int64((address >> 4) & 0x3FFF)
