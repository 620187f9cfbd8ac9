"""Block Attention Residuals (DESIGN §3.8; not in the seeds): ``kimi::attn_res``."""

import torch

from ..checks import check_eps, check_placement, check_same_device, check_tensor, fail
from ..mailbox import (
    TAKE_POLL,
    arm_,
    flag_missing,
)
from ..numerics import bf16, f32, rank_sum, rms_norm, sum_f32
from .boxes import check_box, check_error


def check_attn_res(blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps, op="attn_res"):
    """Returns (B, H). ``sublayer_out`` None: ``op`` takes the rows from a box it checks
    itself (attn_res_take)."""
    check_tensor(op, "partial", partial, torch.bfloat16, (None, None))
    batch, hidden = partial.shape
    check_tensor(op, "blocks", blocks, torch.bfloat16, (None, batch, hidden))
    if sublayer_out is not None:
        check_tensor(op, "sublayer_out", sublayer_out, torch.bfloat16, (None, batch, hidden))
    for name, weight in (("query", query), ("key_norm_w", key_norm_w), ("out_norm_w", out_norm_w)):
        check_tensor(op, name, weight, torch.bfloat16, (hidden,))
    check_same_device(
        op, partial=partial, blocks=blocks, sublayer_out=sublayer_out, query=query,
        key_norm_w=key_norm_w, out_norm_w=out_norm_w,
    )
    check_eps(op, eps)
    return batch, hidden


def attn_res(blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps: float):
    """(new_partial, h, h_normed), each [B, H] bf16.

    Rounding points: new_partial = BF16(partial + Σ_tp sublayer_out[tp]), an FP32 sum
    in rank order; V = [blocks…, new_partial];
    keys K_n = BF16 RMSNorm(V_n; key_norm_w) (:func:`~kimi_ops.numerics.rms_norm`);
    logit_n = ⟨query, K_n⟩ in FP32; α = softmax_n(logit) in FP32; h = BF16(Σ_n α_n V_n)
    (FP32); h_normed = BF16 RMSNorm(h; out_norm_w).
    """
    check_attn_res(blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps)
    new_partial = rank_sum(torch.cat([partial.unsqueeze(0), sublayer_out]))
    values = torch.cat([blocks, new_partial.unsqueeze(0)], dim=0)  # [N + 1, B, H]
    keys = rms_norm(values, key_norm_w, eps)
    logits = sum_f32(f32(keys) * f32(query), -1)  # [N + 1, B]
    alpha = torch.softmax(logits, dim=0)
    h = bf16(sum_f32(alpha.unsqueeze(-1) * f32(values), 0))
    return new_partial, h, rms_norm(h, out_norm_w, eps)


def attn_res_fake(blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps):
    shape = check_attn_res(blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps)
    return tuple(partial.new_empty(shape) for _ in range(3))


# The mailbox ops of the family (DESIGN §4; the box checks: :mod:`.boxes`).


def check_attn_res_take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps,
                        h_normed=None, op="attn_res_take") -> int:
    """Returns H. ``h_normed`` (attn_res_take_into): the buffer whose rows [:batch] it writes."""
    check_box(op, "box", box, parity, batch)
    check_error(op, error)
    hidden = box.shape[3]
    check_tensor(op, "partial", partial, torch.bfloat16, (batch, hidden))
    check_attn_res(blocks, partial, None, query, key_norm_w, out_norm_w, eps, op)
    written = dict(box=box, error=error)
    if h_normed is not None:
        check_tensor(op, "h_normed", h_normed, torch.bfloat16, (None, hidden))
        if h_normed.shape[0] < batch:
            fail(op, "h_normed", f"a buffer of at least batch = {batch} rows", list(h_normed.shape))
        written["h_normed"] = h_normed
    check_placement(op, written, dict(blocks=blocks, partial=partial, query=query,
                                      key_norm_w=key_norm_w, out_norm_w=out_norm_w))
    return hidden


def attn_res_take(box, parity: int, batch: int, error, blocks, partial, query, key_norm_w, out_norm_w, eps: float):
    """:func:`mailbox_take` and :func:`~kimi_ops.ops.attn_res.attn_res` in one: the
    sublayer's rows [:batch] of every source of one parity (o-proj partials or tail
    output rows) are polled, re-armed, and summed in rank order into new_partial; the
    rounding points are attn_res's. Returns (new_partial, h, h_normed), each [B, H] bf16."""
    check_attn_res_take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps)
    rows = box[parity, :, :batch].clone()
    flag_missing(error, rows, TAKE_POLL)
    arm_(box[parity, :, :batch])
    return attn_res(blocks, partial, rows, query, key_norm_w, out_norm_w, eps)


def attn_res_take_fake(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps):
    hidden = check_attn_res_take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps)
    return tuple(partial.new_empty((batch, hidden)) for _ in range(3))


def check_attn_res_take_into(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps,
                             h_normed) -> int:
    return check_attn_res_take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps,
                               h_normed, "attn_res_take_into")


def attn_res_take_into(box, parity: int, batch: int, error, blocks, partial, query, key_norm_w, out_norm_w,
                       eps: float, h_normed):
    """:func:`attn_res_take` with h_normed written into rows [:batch] of a buffer the
    caller owns (the decoder's MoE input: the fused shared expert may still read it while
    kernels launched after it allocate). Returns (new_partial, h)."""
    check_attn_res_take_into(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps, h_normed)
    new_partial, h, normed = attn_res_take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w,
                                           eps)
    h_normed[:batch].copy_(normed)
    return new_partial, h


def attn_res_take_into_fake(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps, h_normed):
    hidden = check_attn_res_take_into(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps,
                                      h_normed)
    return tuple(partial.new_empty((batch, hidden)) for _ in range(2))
