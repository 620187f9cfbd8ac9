"""The DSA index front's plan: a head's rows a CTA block over a K split (the engine's
GemmPlan with the front's reserve), the key insert's CTA shape."""

import functools

from ...config import INDEX_DIM, INDEX_HEADS
from ..gemm.plan import (
    CONSUMER_WARPS,
    RESIDENT,
    RESIDENT_3,
    THREADS,
    TILE,
    GemmPlan,
    cta_cost,
    raw_rows_fit,
)
from ..launch import SMEM_BYTES
from ..ring import CHUNK

N = INDEX_HEADS * INDEX_DIM  # wq_b's rows
TILES = INDEX_DIM // TILE  # a head's rows: one CTA's block
SPLITS = (1, 2, 3)  # K parts per head (cluster sizes; 4 would need 128 CTAs in clusters of 4: 120 resident)
FOLD = (INDEX_HEADS * INDEX_DIM) ** -0.5  # 2^-6
KEY_WARPS = THREADS // 32  # tokens per key-insert CTA, a warp each (the front's CTA shape: one grid holds both)


def resident(split: int) -> int:
    return RESIDENT_3 if split == 3 else RESIDENT[split]


def reserve(tokens: int, split: int) -> int:
    """Shared bytes beside the ring: the raw-row mode's Σ x² [part][token] (FP64) and the
    epilogue's amax [warp][token] and 1/scale [token] (FP32), with alignment."""
    per_owner = -(-tokens // split) + (-(-tokens // split)) % 2
    return 8 * split * tokens + 4 * (CONSUMER_WARPS + 1) * per_owner + 64


def index_partition(k: int, tokens: int, norm: bool) -> tuple[int, int] | None:
    """(tiles, split) of the front at T tokens: a head per row block (TILES tiles), the K
    split of least :func:`~kimi_ops.kernels.gemm.plan.cta_cost` whose grid is resident at once;
    raw-row mode keeps the whole K slice in the ring (depth = chunks: no slot waits for the
    factors, the form measured) and needs its packets in registers (``raw_rows_fit``)."""
    if k % CHUNK or k <= 0:
        return None
    chunks = k // CHUNK
    fits = []
    for split in SPLITS:
        per_cta = chunks // split
        if chunks % split or INDEX_HEADS * split > resident(split):
            continue
        stage = (TILE * TILES + tokens) * CHUNK * 2
        if norm and (per_cta * stage + 2048 + reserve(tokens, split) > SMEM_BYTES
                     or not raw_rows_fit(per_cta, tokens)):
            continue
        fits.append((cta_cost(chunks, TILES, split, tokens), split))
    return (TILES, min(fits)[1]) if fits else None


@functools.cache
def index_plan(k: int, tokens: int, norm: bool) -> GemmPlan:
    parts = index_partition(k, tokens, norm)
    if parts is None:
        raise ValueError(f"the DSA front does not take K={k} at {tokens} tokens (norm={norm})")
    return GemmPlan(N, k, tokens, parts, by_token=True, reserve=reserve(tokens, parts[1]), whole=norm)


# Device helpers: IEEE where torch is IEEE, bit-exact where the reference works on bits.
