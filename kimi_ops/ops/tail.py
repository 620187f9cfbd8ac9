"""The MoE tail (the seeds' ``moe/tail.py`` ``MoeTail``): ``kimi::moe_tail`` at TP1, and the
tail's mailbox ops (push, publish, the two-shot reduce, poll, serve)."""

import torch

from ..checks import (
    check_eps,
    check_placement,
    check_range,
    check_same_device,
    check_tensor,
    fail,
)
from ..config import TOP_K
from ..mailbox import (
    TAIL_LATENT_POLL,
    TAIL_SHARED_POLL,
    TWO_SHOT_POLL,
    arm_,
    canonical,
    flag_missing,
)
from ..numerics import bf16, f32, matmul_f32, rank_sum, sum_f32
from .boxes import check_box, check_boxes, check_error, store_shards


def check_moe_tail(expanded, weights, shared, gamma, w_up, eps) -> tuple[int, int]:
    """Returns (B, H)."""
    check_tensor("moe_tail", "expanded", expanded, torch.bfloat16, (None, TOP_K, None))
    batch, _, latent = expanded.shape
    check_tensor("moe_tail", "weights", weights, torch.bfloat16, (batch, TOP_K))
    check_tensor("moe_tail", "gamma", gamma, torch.bfloat16, (latent,))
    check_tensor("moe_tail", "w_up", w_up, torch.bfloat16, (None, latent))
    check_tensor("moe_tail", "shared", shared, torch.bfloat16, (batch, w_up.shape[0]))
    check_same_device(
        "moe_tail", expanded=expanded, weights=weights, shared=shared, gamma=gamma, w_up=w_up
    )
    check_eps("moe_tail", eps)
    return batch, w_up.shape[0]


def finalize(expanded: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """BF16(Σ_r row_r · w_r), an FP32 FMA chain in rank order. A product of two BF16
    values is exact in FP32, so product-then-add rounds once per step, as an FMA does."""
    acc = torch.zeros(expanded.shape[0], expanded.shape[2], device=expanded.device)
    for r in range(expanded.shape[1]):
        acc = acc + f32(expanded[:, r]) * f32(weights[:, r : r + 1])
    return bf16(acc)


def tail_norm(latent: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """The tail's RMSNorm: ss = Σ_k BF16(latent_k²) in FP32; inv = rsqrt(ss / L + eps);
    xn_k = BF16((latent_k · inv) · gamma_k)."""
    latent = f32(latent)
    ss = sum_f32(f32(bf16(latent * latent)), -1)
    inv = torch.rsqrt(ss / latent.shape[-1] + eps)
    return bf16((latent * inv.unsqueeze(-1)) * f32(gamma))


def moe_tail(expanded, weights, shared, gamma, w_up, eps: float):
    """The fused tail at TP1: [B, H] bf16.

    Rounding points, in order (DESIGN §3.4): partial = BF16(Σ_r row_r · w_r) (FP32 FMA
    chain in rank order); latent = the partial (TP1: one source); the RMSNorm of
    :func:`tail_norm`; up_n = BF16(Σ_k w_up[n, k] · xn_k) (FP32 accumulation);
    out_n = BF16(up_n + shared_n).
    """
    check_moe_tail(expanded, weights, shared, gamma, w_up, eps)
    xn = tail_norm(finalize(expanded, weights), gamma, eps)
    up = bf16(matmul_f32(xn, w_up))
    return bf16(f32(up) + f32(shared))


def moe_tail_fake(expanded, weights, shared, gamma, w_up, eps):
    return expanded.new_empty(check_moe_tail(expanded, weights, shared, gamma, w_up, eps))


# The mailbox ops of the family (DESIGN §4; the box checks: :mod:`.boxes`).


def check_moe_tail_push(shared, rs_boxes, parity, rank) -> int:
    op = "moe_tail_push"
    check_tensor(op, "shared", shared, torch.bfloat16, (None, None))
    tp = check_boxes(op, "rs_boxes", rs_boxes, rank, parity, shared.shape[0], len(rs_boxes), "shared.shape[0] (batch)")
    if rs_boxes[0].shape[3] * tp != shared.shape[1]:
        fail(op, "rs_boxes", f"rows of width H/TP = {shared.shape[1]}/{tp}", rs_boxes[0].shape[3])
    check_placement(op, dict(rs_boxes=rs_boxes), dict(shared=shared))
    return tp


def moe_tail_push(shared, rs_boxes, parity: int, rank: int) -> None:
    """The shared expert's reduce-scatter stores: column shard d of this rank's partial
    shared output [B, H] goes to source ``rank`` of rank d's box [3, TP, CAP, H/TP]."""
    check_moe_tail_push(shared, rs_boxes, parity, rank)
    store_shards(shared, rs_boxes, parity, rank)


def check_moe_tail_publish(expanded, weights, latent_boxes, parity, rank, op="moe_tail_publish",
                           placement: bool = True) -> None:
    """``placement``: that no written box overlaps an input (moe_tail_serve checks it once for both halves)."""
    check_tensor(op, "expanded", expanded, torch.bfloat16, (None, TOP_K, None))
    check_tensor(op, "weights", weights, torch.bfloat16, (expanded.shape[0], TOP_K))
    tp = check_boxes(op, "latent_boxes", latent_boxes, rank, parity, expanded.shape[0], len(latent_boxes),
                     "expanded.shape[0] (batch)")
    latent, width = expanded.shape[2], latent_boxes[0].shape[3]
    if width != latent and width * tp != latent:
        chunk = f"L/TP = {latent // tp}" if latent % tp == 0 else f"L/TP (L = {latent} over TP = {tp})"
        fail(op, "latent_boxes", f"rows of width L = {latent} (latent boxes) or {chunk} "
             "(two-shot receive boxes [3, TP, CAP, L/TP])", list(latent_boxes[0].shape))
    if placement:
        check_placement(op, dict(latent_boxes=latent_boxes), dict(expanded=expanded, weights=weights))


def moe_tail_publish(expanded, weights, latent_boxes, parity: int, rank: int) -> None:
    """The tail's front: partial = BF16(Σ_r row_r · w_r) (:func:`~kimi_ops.ops.tail.finalize`)
    as source ``rank`` of every rank's latent box [3, TP, CAP, L]; or, into two-shot receive
    boxes [3, TP, CAP, L/TP], column chunk c of it as source ``rank`` of rank c's box (its
    owner sums the chunk: :func:`moe_latent_reduce`)."""
    check_moe_tail_publish(expanded, weights, latent_boxes, parity, rank)
    partial = canonical(finalize(expanded, weights))
    width = latent_boxes[0].shape[3]
    for owner, box in enumerate(latent_boxes):
        columns = slice(owner * width, (owner + 1) * width) if width != partial.shape[1] else slice(None)
        box[parity, rank, : expanded.shape[0]].copy_(partial[:, columns])


def check_moe_latent_reduce(recv_box, gathered_boxes, error, parity, rearm_parity, rearm_batch, rank, batch) -> None:
    """The receive box [P, TP, CAP, L/TP]; TP gathered boxes [P, 1, CAP, L]; parities,
    batch and rank in range; no box passed twice."""
    op = "moe_latent_reduce"
    check_box(op, "recv_box", recv_box, parity, batch)
    parities, tp, capacity, chunk = recv_box.shape
    if isinstance(gathered_boxes, (list, tuple)) and len(gathered_boxes) != tp:
        fail(op, "gathered_boxes", f"one box per source of recv_box (TP = {tp})", f"{len(gathered_boxes)} boxes")
    check_boxes(op, "gathered_boxes", gathered_boxes, rank, parity, batch, 1)
    if list(gathered_boxes[0].shape) != [parities, 1, capacity, tp * chunk]:
        fail(op, "gathered_boxes", f"[{parities}, 1, {capacity}, L = TP · recv_box width = {tp * chunk}]",
             list(gathered_boxes[0].shape))
    check_error(op, error)
    check_range(op, "rearm_batch", rearm_batch, 1, capacity)
    check_range(op, "rearm_parity", rearm_parity, 0, parities - 1)
    if rearm_parity == parity:
        fail(op, "rearm_parity", f"not the published parity {parity}", rearm_parity)
    check_placement(op, dict(recv_box=recv_box, gathered_boxes=gathered_boxes, error=error), {})


def moe_latent_reduce(recv_box, gathered_boxes, error, parity: int, rearm_parity: int, rearm_batch: int, rank: int,
                      batch: int) -> None:
    """The two-shot latent all-reduce's second half on rank ``rank``, the owner of latent
    columns [rank·L/TP, …): its chunk = BF16(Σ of the TP sources of ``recv_box`` [3, TP,
    CAP, L/TP] in rank order) — moe_tail_poll's sum over these columns, bit for bit — into
    those columns of every rank's gathered box [3, 1, CAP, L], which moe_tail_poll then
    reads as its one-source latent box. Then rows [:rearm_batch] of the previous MoE
    layer's parity of ``recv_box`` are re-armed."""
    check_moe_latent_reduce(recv_box, gathered_boxes, error, parity, rearm_parity, rearm_batch, rank, batch)
    rows = recv_box[parity, :, :batch]
    flag_missing(error, rows, TWO_SHOT_POLL)
    chunk = canonical(rank_sum(rows))
    columns = slice(rank * recv_box.shape[3], (rank + 1) * recv_box.shape[3])
    for box in gathered_boxes:
        box[parity, 0, :batch, columns].copy_(chunk)
    arm_(recv_box[rearm_parity, :, :rearm_batch])


def check_moe_tail_poll(
    latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch, rank, batch,
    op="moe_tail_poll", placement: bool = True,
) -> None:
    check_box(op, "latent_box", latent_box, parity, batch)
    check_box(op, "rs_box", rs_box, parity, batch)
    check_boxes(op, "out_boxes", out_boxes, rank, 0, batch, 1)
    latent = latent_box.shape[3]
    check_tensor(op, "gamma", gamma, torch.bfloat16, (latent,))
    check_tensor(op, "w_up", w_up, torch.bfloat16, (None, latent))
    check_eps(op, eps)
    check_error(op, error)
    if placement:
        check_placement(op, dict(latent_box=latent_box, rs_box=rs_box, out_boxes=out_boxes, error=error),
                        dict(gamma=gamma, w_up=w_up))
    parities, sources, capacity = latent_box.shape[:3]
    tp = rs_box.shape[1] if sources == 1 else sources  # one source: two-shot's gathered rows (moe_latent_reduce)
    if rs_box.shape[:3] != (parities, tp, capacity):
        fail(op, "rs_box", f"[parities, TP, CAP] = {[parities, tp, capacity]} (latent_box's, whose sources are TP "
             "or 1), then H/TP", list(rs_box.shape))
    if len(out_boxes) != tp:
        fail(op, "out_boxes", f"one box per rank (TP = {tp})", f"{len(out_boxes)} boxes")
    if out_boxes[0].shape[3] != tp * rs_box.shape[3]:
        fail(op, "out_boxes", f"rows of width H = TP · rs_box width = {tp * rs_box.shape[3]}", list(out_boxes[0].shape))
    if w_up.shape[0] != rs_box.shape[3]:
        fail(op, "w_up", f"[H/TP = {rs_box.shape[3]} (rs_box width), {latent}]", list(w_up.shape))
    check_range(op, "rearm_batch", rearm_batch, 1, capacity)
    check_range(op, "rearm_parity", rearm_parity, 0, parities - 1)
    if rearm_parity == parity:
        fail(op, "rearm_parity", f"not the published parity {parity}", rearm_parity)


def moe_tail_poll(
    latent_box, rs_box, gamma, w_up, eps: float, out_boxes, error,
    parity: int, rearm_parity: int, rearm_batch: int, rank: int, batch: int,
) -> None:
    """The tail's polled half on one rank: latent = BF16(Σ of the TP sources in rank
    order; a one-source box: two-shot's gathered rows, summed already); the RMSNorm of
    :func:`~kimi_ops.ops.tail.tail_norm`; up = BF16(xn @ w_up.T) over this rank's H/TP
    rows; out = BF16(up + BF16(Σ of the shared reduce-scatter sources)); out goes to columns [rank·H/TP, …) of every rank's output box
    [1, 1, CAP, H]. Then the previous MoE layer's parity (rows [:rearm_batch]) of the
    latent and shared boxes is re-armed."""
    check_moe_tail_poll(
        latent_box, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch, rank, batch
    )
    latent_rows, shared_rows = latent_box[parity, :, :batch], rs_box[parity, :, :batch]
    flag_missing(error, latent_rows, TAIL_LATENT_POLL)
    flag_missing(error, shared_rows, TAIL_SHARED_POLL)
    xn = tail_norm(rank_sum(latent_rows), gamma, eps)
    out = bf16(f32(bf16(matmul_f32(xn, w_up))) + f32(rank_sum(shared_rows)))
    columns = slice(rank * w_up.shape[0], (rank + 1) * w_up.shape[0])
    for box in out_boxes:
        box[0, 0, :batch, columns].copy_(canonical(out))
    arm_(latent_box[rearm_parity, :, :rearm_batch])
    arm_(rs_box[rearm_parity, :, :rearm_batch])


def check_moe_tail_serve(
    expanded, weights, latent_boxes, rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch,
    rank,
) -> None:
    """moe_tail_publish's and moe_tail_poll's checks (the own latent box: latent_boxes[rank]),
    named for this op, and no written buffer shared with another argument."""
    op = "moe_tail_serve"
    check_moe_tail_publish(expanded, weights, latent_boxes, parity, rank, op, placement=False)
    if latent_boxes[0].shape[3] != expanded.shape[2]:
        fail(op, "latent_boxes", f"latent boxes of rows of width L = {expanded.shape[2]} (two-shot receive boxes "
             "go to moe_tail_publish, then moe_latent_reduce and moe_tail_poll)", list(latent_boxes[0].shape))
    check_moe_tail_poll(latent_boxes[rank], rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity,
                        rearm_batch, rank, expanded.shape[0], op, placement=False)
    check_placement(op, dict(latent_boxes=latent_boxes, rs_box=rs_box, out_boxes=out_boxes, error=error),
                    dict(expanded=expanded, weights=weights, gamma=gamma, w_up=w_up))


def moe_tail_serve(
    expanded, weights, latent_boxes, rs_box, gamma, w_up, eps: float, out_boxes, error,
    parity: int, rearm_parity: int, rearm_batch: int, rank: int,
) -> None:
    """The tail's serving path on one rank in one op: :func:`moe_tail_publish` (this rank's
    partial latent into every rank's latent box), then :func:`moe_tail_poll` on the own
    box ``latent_boxes[rank]`` for the batch ``expanded.shape[0]``. The reference's polls
    do not wait: the peers' rows must be in already (the kernel's polls wait, bounded)."""
    check_moe_tail_serve(expanded, weights, latent_boxes, rs_box, gamma, w_up, eps, out_boxes, error, parity,
                         rearm_parity, rearm_batch, rank)
    moe_tail_publish(expanded, weights, latent_boxes, parity, rank)
    moe_tail_poll(latent_boxes[rank], rs_box, gamma, w_up, eps, out_boxes, error, parity, rearm_parity, rearm_batch,
                  rank, expanded.shape[0])
