"""The attention output projection (the seeds' ``oproj/producer.py``): ``kimi::oproj``, and
the other projections on its engine: over RMS-normalized raw rows (``kimi::normed_oproj``);
with their own epilogues, the shared expert's gate/up
with ``situ`` (``kimi::gate_up_situ``), its down with the reduce-scatter push
(``kimi::oproj_push``), and the two in one launch (``kimi::shared_expert_push``, the seeds'
fused ``SharedFront``), with the MoE front's publish beside them (``kimi::moe_front_shared_push``)."""

import torch

from ..checks import check_eps, check_placement, check_same_device, check_tensor, fail
from ..mailbox import (
    canonical,
)
from ..numerics import bf16, matmul_f32, rms_norm
from . import front as front_op
from .boxes import check_boxes, check_error, store_shards
from .route import situ

PAIRED = 8  # gate/up rows interleaved in packets: 8 gate rows, then the same 8 up rows


def check_oproj(x, w, op: str = "oproj", w_name: str = "w") -> tuple[int, int]:
    """Returns (B, N); errors in the name of ``op`` (the publishing op reuses the checks)
    and of its weight argument ``w_name``."""
    check_tensor(op, "x", x, torch.bfloat16, (None, None), rows=True)
    check_tensor(op, w_name, w, torch.bfloat16, (None, x.shape[1]))
    check_same_device(op, **{"x": x, w_name: w})
    return x.shape[0], w.shape[0]


def oproj(x, w):
    """x [B, K] @ w[N, K].T → [B, N] bf16: FP32 accumulation, rounded once (the seeds
    reduce K parts in a fixed order; the reference takes the exact sum)."""
    check_oproj(x, w)
    return bf16(matmul_f32(x, w))


def oproj_fake(x, w):
    return x.new_empty(check_oproj(x, w), dtype=torch.bfloat16)


def check_normed_oproj(x, w, norm_w, eps) -> tuple[int, int]:
    op = "normed_oproj"
    shape = check_oproj(x, w, op)
    check_tensor(op, "norm_w", norm_w, torch.bfloat16, (x.shape[1],))
    check_same_device(op, x=x, norm_w=norm_w)
    check_eps(op, eps)
    return shape


def normed_oproj(x, w, norm_w, eps: float):
    """``kimi::oproj(rms_norm(x; norm_w), w)`` in one launch: x holds raw rows, each
    BF16((x · rr) · norm_w) with rr = rsqrt(Σ x² / K + eps) (QueryNorm's rounding points,
    :func:`~kimi_ops.numerics.rms_norm`) before the projection. The decoder's first layer
    takes the embedding so: the embedding's AttnRes (no blocks, a zero partial) is then
    h = the embedding and h_normed = rms_norm(h; out_norm_w), with no launch of its own."""
    check_normed_oproj(x, w, norm_w, eps)
    return oproj(rms_norm(x, norm_w, eps), w)


def normed_oproj_fake(x, w, norm_w, eps):
    return x.new_empty(check_normed_oproj(x, w, norm_w, eps), dtype=torch.bfloat16)


# The mailbox ops of the family (DESIGN §4; the box checks: :mod:`.boxes`).


def check_oproj_publish(x, w, boxes, rank) -> int:
    batch, _ = check_oproj(x, w, "oproj_publish")
    check_boxes("oproj_publish", "boxes", boxes, rank, 0, batch, len(boxes), "x.shape[0] (batch)")
    if boxes[0].shape[3] != w.shape[0]:
        fail("oproj_publish", "boxes", f"rows of width N = {w.shape[0]}", boxes[0].shape[3])
    check_placement("oproj_publish", dict(boxes=boxes), dict(x=x, w=w))
    return batch


def oproj_publish(x, w, boxes, rank: int) -> None:
    """The o-proj producer: partial = BF16(x @ w.T) (this rank's K shard), stored as
    source ``rank`` of every rank's AttnRes box [1, TP, CAP, H]."""
    batch = check_oproj_publish(x, w, boxes, rank)
    partial = canonical(oproj(x, w))
    for box in boxes:
        box[0, rank, :batch].copy_(partial)


def check_oproj_push(x, w, rs_boxes, parity, rank) -> int:
    op = "oproj_push"
    batch, _ = check_oproj(x, w, op)
    check_rs_boxes(op, w, rs_boxes, parity, rank, batch)
    check_placement(op, dict(rs_boxes=rs_boxes), dict(x=x, w=w))
    return batch


def check_rs_boxes(op, w, rs_boxes, parity, rank, batch) -> None:
    """The reduce-scatter boxes [3, TP, CAP, N/TP] of a down projection ``w`` [N, I]."""
    tp = check_boxes(op, "rs_boxes", rs_boxes, rank, parity, batch, len(rs_boxes), "x.shape[0] (batch)")
    if rs_boxes[0].shape[3] * tp != w.shape[0]:
        fail(op, "rs_boxes", f"rows of width N/TP = {w.shape[0]}/{tp}", rs_boxes[0].shape[3])


def oproj_push(x, w, rs_boxes, parity: int, rank: int) -> None:
    """``kimi::moe_tail_push(kimi::oproj(x, w), ...)`` in one op (the shared expert's down
    projection and its reduce-scatter stores): column shard d of BF16(x @ w.T) [B, N]
    goes to source ``rank`` of rank d's box [3, TP, CAP, N/TP]."""
    check_oproj_push(x, w, rs_boxes, parity, rank)
    store_shards(oproj(x, w), rs_boxes, parity, rank)


def interleave_gate_up(w):
    """[gate; up] rows [2I, K] → the layout ``kimi::gate_up_situ`` takes: rows 16p … 16p + 7
    are gate rows 8p … 8p + 7, rows 16p + 8 … 16p + 15 the same up rows (I % 8 == 0)."""
    double, k = w.shape
    return w.view(2, double // (2 * PAIRED), PAIRED, k).transpose(0, 1).reshape(double, k)


def deinterleave_gate_up(h):
    """Columns [B, 2I] of the interleaved rows back to [gate | up]."""
    batch, double = h.shape
    return h.view(batch, double // (2 * PAIRED), 2, PAIRED).transpose(1, 2).reshape(batch, double)


def check_gate_up_situ(x, w, beta, linear_beta, op: str = "gate_up_situ", w_name: str = "w") -> tuple[int, int]:
    """Returns (B, I)."""
    batch, double = check_oproj(x, w, op, w_name)
    if double % (2 * PAIRED):
        fail(op, w_name, f"[2I, K] with 2I a multiple of {2 * PAIRED} (gate and up rows interleaved in packets of "
             f"{PAIRED})", list(w.shape))
    return batch, double // 2


def gate_up_situ(x, w, beta: float, linear_beta: float):
    """The shared expert's gate/up projection and its activation in one op:
    ``kimi::situ`` of BF16(x @ w.T) with ``w``'s rows interleaved (:func:`interleave_gate_up`:
    on the GPU a CTA's rows hold its gate and up rows alike, so the GEMM's epilogue applies
    situ). [B, I] bf16; the rounding points of the two ops."""
    check_gate_up_situ(x, w, beta, linear_beta)
    return situ(deinterleave_gate_up(oproj(x, w)), beta, linear_beta)


def gate_up_situ_fake(x, w, beta, linear_beta):
    return x.new_empty(check_gate_up_situ(x, w, beta, linear_beta), dtype=torch.bfloat16)


def check_shared_expert_push(x, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity, rank, error,
                             op: str = "shared_expert_push") -> int:
    """Returns B. ``act``: a model-owned [CAP, I] workspace (CAP >= B) that the down reads;
    ``ticket``: the grid barrier's int64 counter [1] (DecodeBoxes.shared_ticket)."""
    batch, inner = check_gate_up_situ(x, w_gate_up, beta, linear_beta, op, "w_gate_up")
    check_tensor(op, "w_down", w_down, torch.bfloat16, (None, inner))
    check_rs_boxes(op, w_down, rs_boxes, parity, rank, batch)
    check_tensor(op, "act", act, torch.bfloat16, (None, inner))
    if act.shape[0] < batch:
        fail(op, "act", f"at least x.shape[0] = {batch} rows", list(act.shape))
    check_tensor(op, "ticket", ticket, torch.int64, (1,))
    check_error(op, error)
    check_placement(op, dict(act=act, ticket=ticket, rs_boxes=rs_boxes, error=error),
                    dict(x=x, w_gate_up=w_gate_up, w_down=w_down))
    return batch


def shared_expert_push(x, w_gate_up, w_down, beta: float, linear_beta: float, act, ticket, rs_boxes, parity: int,
                       rank: int, error) -> None:
    """``kimi::oproj_push(kimi::gate_up_situ(x, w_gate_up, beta, linear_beta), w_down, ...)``
    in one op: the activations land in ``act[:B]`` (the down reads them there), the down's
    column shards in the reduce-scatter boxes. On the GPU one launch: a grid barrier on
    ``ticket`` (monotonic, restarted by ``DecodeBoxes.reset``; its timeout sets ``error``)
    parts the gate/up from the down, whose weights stream in before it. The reference
    leaves ``ticket`` and ``error`` as they are."""
    batch = check_shared_expert_push(x, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity, rank,
                                     error)
    act[:batch].copy_(gate_up_situ(x, w_gate_up, beta, linear_beta))
    oproj_push(act[:batch], w_down, rs_boxes, parity, rank)


def check_moe_front_shared_push(x, w_front, n_logits, front_boxes, w_gate_up, w_down, beta, linear_beta, act, ticket,
                                rs_boxes, parity, rank, error) -> int:
    """Returns B: both ops' checks, and no buffer written twice or read where written."""
    op = "moe_front_shared_push"
    front_op.check_moe_front_publish(x, w_front, n_logits, front_boxes, parity, rank, op, ("w_front", "front_boxes"))
    batch = check_shared_expert_push(x, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity, rank,
                                     error, op)
    check_placement(op, dict(front_boxes=front_boxes, act=act, ticket=ticket, rs_boxes=rs_boxes, error=error),
                    dict(x=x, w_front=w_front, w_gate_up=w_gate_up, w_down=w_down))
    return batch


def moe_front_shared_push(x, w_front, n_logits: int, front_boxes, w_gate_up, w_down, beta: float, linear_beta: float,
                          act, ticket, rs_boxes, parity: int, rank: int, error) -> None:
    """``kimi::moe_front_publish(x, w_front, n_logits, front_boxes, parity, rank)`` and
    ``kimi::shared_expert_push(x, w_gate_up, w_down, …, rs_boxes, parity, rank, error)``
    in one op: both read the same x. On the GPU one launch, the front's CTAs beside the
    gate/up's before the grid barrier (kernels/gemm/shared.py), so both weights stream at
    once. Nothing is written unless every argument passes."""
    check_moe_front_shared_push(x, w_front, n_logits, front_boxes, w_gate_up, w_down, beta, linear_beta, act, ticket,
                                rs_boxes, parity, rank, error)
    front_op.moe_front_publish(x, w_front, n_logits, front_boxes, parity, rank)
    shared_expert_push(x, w_gate_up, w_down, beta, linear_beta, act, ticket, rs_boxes, parity, rank, error)
