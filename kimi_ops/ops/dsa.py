"""The DSA indexer front (the seeds' ``dsa/front_mma.py`` ``IndexFrontMma`` and DsaIndex's
key insert): ``kimi::dsa_index_front``, ``kimi::dsa_index_key_insert``, and both in one
call, ``kimi::dsa_index_front_keys`` (one launch on CUDA, as the seeds' front does)."""

import torch

from ..checks import check_eps, check_placement, check_same_device, check_tensor, fail
from ..config import INDEX_DIM, INDEX_HEADS
from ..numerics import bf16, f32, matmul_f32, quantize_e4m3, rms_norm, sum_f32

KEY_BYTES = INDEX_DIM + 4  # e4m3 bytes, then the FP32 scale (little endian)


def check_dsa_index_front(rows, wq_b, head_in, q_norm_w, eps, op: str = "dsa_index_front") -> int:
    """Returns B; errors in the name of ``op`` (the fused op reuses the checks)."""
    check_tensor(op, "rows", rows, torch.bfloat16, (None, None), rows=True)
    check_tensor(op, "wq_b", wq_b, torch.bfloat16, (INDEX_HEADS * INDEX_DIM, rows.shape[1]))
    check_tensor(op, "head_in", head_in, torch.bfloat16, (rows.shape[0], INDEX_HEADS), rows=True)
    if q_norm_w is not None:
        check_tensor(op, "q_norm_w", q_norm_w, torch.bfloat16, (rows.shape[1],))
    check_same_device(op, rows=rows, wq_b=wq_b, head_in=head_in, q_norm_w=q_norm_w)
    check_eps(op, eps)  # checked without q_norm_w too: one rule for the op's argument
    return rows.shape[0]


def dsa_index_front(rows, wq_b, head_in, q_norm_w, eps: float):
    """The indexer query: q [B, 32, 128] float8_e4m3fn and head_w [B, 32] bf16.

    Rounding points: with ``q_norm_w`` the rows are first BF16((x · rr) · gamma)
    (QueryNorm, :func:`~kimi_ops.numerics.rms_norm`); proj = BF16(FP32 rows @ wq_b.T);
    per (token, head) amax = max(1e-10, max_c |proj_c|), scale = the smallest power of two
    ≥ amax / 448, q = e4m3(proj / scale) (exact); head_w = BF16((head_in · scale) ·
    (32·128)^-0.5).
    """
    check_dsa_index_front(rows, wq_b, head_in, q_norm_w, eps)
    if q_norm_w is not None:
        rows = rms_norm(rows, q_norm_w, eps)
    proj = bf16(matmul_f32(rows, wq_b)).view(rows.shape[0], INDEX_HEADS, INDEX_DIM)
    q, scale = quantize_e4m3(proj)
    return q, bf16((f32(head_in) * scale.squeeze(-1)) * (INDEX_HEADS * INDEX_DIM) ** -0.5)


def dsa_index_front_fake(rows, wq_b, head_in, q_norm_w, eps):
    batch = check_dsa_index_front(rows, wq_b, head_in, q_norm_w, eps)
    return (
        rows.new_empty((batch, INDEX_HEADS, INDEX_DIM), dtype=torch.float8_e4m3fn),
        rows.new_empty((batch, INDEX_HEADS), dtype=torch.bfloat16),
    )


def check_dsa_index_key_insert(k_in, norm_w, norm_b, eps, cache, slots, op: str = "dsa_index_key_insert",
                               norms=("norm_w", "norm_b"), reads=None) -> None:
    """Errors in the name of ``op``, the norm's weights named ``norms``; ``reads``: the
    fused op's other inputs, none of which may share the cache's memory."""
    check_tensor(op, "k_in", k_in, torch.bfloat16, (None, INDEX_DIM), rows=True)
    check_tensor(op, norms[0], norm_w, torch.bfloat16, (INDEX_DIM,))
    check_tensor(op, norms[1], norm_b, torch.bfloat16, (INDEX_DIM,))
    check_tensor(op, "cache", cache, torch.uint8, (None, KEY_BYTES))
    check_tensor(op, "slots", slots, torch.int64, (k_in.shape[0],))
    check_placement(op, dict(cache=cache),
                    dict(k_in=k_in, **{norms[0]: norm_w, norms[1]: norm_b}, slots=slots, **(reads or {})))
    check_eps(op, eps)


def check_slot_values(cache, slots, op: str = "dsa_index_key_insert") -> None:
    """Slots in [-1, num_slots) and no slot twice (host check: skipped while capturing)."""
    if slots.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    num_slots = cache.shape[0]
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        fail(op, "slots", f"in [-1, {num_slots}) (-1 = skip)", slots[bad].tolist())
    used = slots[slots >= 0]
    if used.unique().numel() != used.numel():
        fail(op, "slots", "distinct (apart from -1)", slots.tolist())


def index_key(k_in, norm_w, norm_b, eps) -> torch.Tensor:
    """The cache rows [B, 132] uint8 of keys k_in: key = BF16(LayerNorm(k_in) · w + b) in
    FP32 (mean and variance over 128 values), then e4m3 bytes with the power-of-two scale
    of :func:`~kimi_ops.numerics.quantize_e4m3`, then that scale's four FP32 bytes."""
    x = f32(k_in)
    centered = x - (sum_f32(x, -1) / INDEX_DIM).unsqueeze(-1)
    rstd = torch.rsqrt(sum_f32(centered * centered, -1) / INDEX_DIM + eps).unsqueeze(-1)
    q, scale = quantize_e4m3(bf16(centered * rstd * f32(norm_w) + f32(norm_b)))
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dsa_index_key_insert(k_in, norm_w, norm_b, eps: float, cache, slots) -> None:
    """Quantize each token's indexer key (:func:`index_key`) into ``cache[slots[b]]``.

    Slot −1 skips the token (padding). Out-of-range or repeated slots raise before
    anything is written; while a CUDA graph is being captured (no host check possible) an
    out-of-range token writes nothing rather than a wild row. The write adds uint8 deltas
    with ``index_put_(accumulate=True)``, so skipped tokens add zero and nothing syncs.
    """
    check_dsa_index_key_insert(k_in, norm_w, norm_b, eps, cache, slots)
    check_slot_values(cache, slots)
    if cache.shape[0] == 0:  # every slot is -1 (checked): nothing to write, no row to index
        return
    valid = ((slots >= 0) & (slots < cache.shape[0])).unsqueeze(-1)
    target = slots.clamp(0, cache.shape[0] - 1)
    delta = index_key(k_in, norm_w, norm_b, eps) - cache[target]
    cache.index_put_((target,), delta * valid, accumulate=True)


def dsa_index_key_insert_fake(k_in, norm_w, norm_b, eps, cache, slots) -> None:
    check_dsa_index_key_insert(k_in, norm_w, norm_b, eps, cache, slots)


def check_dsa_index_front_keys(rows, wq_b, head_in, q_norm_w, k_in, k_norm_w, k_norm_b, eps, cache, slots) -> int:
    """Both ops' checks in the fused op's name; returns B."""
    op = "dsa_index_front_keys"
    batch = check_dsa_index_front(rows, wq_b, head_in, q_norm_w, eps, op)
    check_dsa_index_key_insert(k_in, k_norm_w, k_norm_b, eps, cache, slots, op, ("k_norm_w", "k_norm_b"),
                               dict(rows=rows, wq_b=wq_b, head_in=head_in, q_norm_w=q_norm_w))
    if k_in.shape[0] != batch:
        fail(op, "k_in", f"rows of the batch's {batch} tokens", k_in.shape[0])
    return batch


def dsa_index_front_keys(rows, wq_b, head_in, q_norm_w, k_in, k_norm_w, k_norm_b, eps: float, cache, slots):
    """:func:`dsa_index_front` of the rows and :func:`dsa_index_key_insert` of the keys
    (LayerNorm ``k_norm_w``, ``k_norm_b``) in one call, one ``eps`` for both norms; every
    check (the slots' values included) before the cache is written. Returns (q, head_w)."""
    check_dsa_index_front_keys(rows, wq_b, head_in, q_norm_w, k_in, k_norm_w, k_norm_b, eps, cache, slots)
    check_slot_values(cache, slots, "dsa_index_front_keys")
    dsa_index_key_insert(k_in, k_norm_w, k_norm_b, eps, cache, slots)
    return dsa_index_front(rows, wq_b, head_in, q_norm_w, eps)


def dsa_index_front_keys_fake(rows, wq_b, head_in, q_norm_w, k_in, k_norm_w, k_norm_b, eps, cache, slots):
    check_dsa_index_front_keys(rows, wq_b, head_in, q_norm_w, k_in, k_norm_w, k_norm_b, eps, cache, slots)
    return dsa_index_front_fake(rows, wq_b, head_in, q_norm_w, eps)
