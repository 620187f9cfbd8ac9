"""Mailbox ops (DESIGN §4): the publishing and polling halves of the fused decode path.

Every box is BF16 ``[parities, TP sources, CAP, width]`` (:mod:`kimi_ops.mailbox`). An op
that publishes takes ``boxes``, the box of every rank of the group in rank order (the
local one among them), and writes its rows into each (a multicast, or one peer store per
rank); the schema marks them all written. A poll that finds a row unwritten sets a bit of
the ``error`` word instead of hanging; the wrapper raises on its next host check.

References: every rank's rows are complete when the poll runs (the simulated TP group
runs ranks phase by phase), so a poll is a bit check of the rows, then the read.
"""

import torch

from ..checks import check_eps, check_placement, check_range, check_tensor, fail
from ..mailbox import (
    BARRIER_POLL,
    PACKET,
    ROUTE_POLL,
    TAIL_LATENT_POLL,
    TAIL_SHARED_POLL,
    TAKE_POLL,
    TWO_SHOT_POLL,
    arm_,
    flag_missing,
    no_neg_zero,
)
from ..numerics import bf16, f32, matmul_f32, rank_sum
from . import attn_res, front, oproj, route, tail


def check_box(op, name, box, parity=None, batch=None, batch_name="batch") -> None:
    """A box as :mod:`kimi_ops.mailbox` defines it: BF16 [parities, sources, CAP, width],
    contiguous, width a whole number of 16-byte packets, 16-byte aligned, no empty
    dimension; ``parity`` and ``batch`` (when given; the argument ``batch_name``, e.g. a
    tensor's rows) within it."""
    check_tensor(op, name, box, torch.bfloat16, (None, None, None, None))
    if box.shape[3] % PACKET:
        fail(op, name, f"rows of a multiple of {PACKET} BF16 values (16-byte packets)", list(box.shape))
    if box.storage_offset() % PACKET:
        fail(op, name, "16-byte aligned (a storage offset that is a multiple of 8 values)", box.storage_offset())
    if 0 in box.shape:
        fail(op, name, "a box with at least one parity, source, token and packet", list(box.shape))
    if parity is not None:
        check_range(op, "parity", parity, 0, box.shape[0] - 1)
    if batch is not None:
        check_range(op, f"{batch_name} (over the mailbox capacity?)", batch, 1, box.shape[2])


def check_boxes(op, name, boxes, rank, parity, batch, sources, batch_name="batch") -> int:
    """One box per rank, all of one shape; ``rank`` one of them; returns TP. (Devices and
    distinct memory: the op's :func:`~kimi_ops.checks.check_placement`.)"""
    if not isinstance(boxes, (list, tuple)) or len(boxes) == 0:
        fail(op, name, "a list of one box per rank", boxes if not isinstance(boxes, (list, tuple)) else "an empty list")
    for i, box in enumerate(boxes):
        check_box(op, f"{name}[{i}]", box, parity, batch, batch_name)
        if box.shape != boxes[0].shape:
            fail(op, f"{name}[{i}]", f"of the shape of {name}[0] {list(boxes[0].shape)}", list(box.shape))
    check_range(op, "rank", rank, 0, len(boxes) - 1)
    if boxes[0].shape[1] != sources:
        fail(op, name, f"boxes with {sources} source slots", list(boxes[0].shape))
    return len(boxes)


def check_error(op, error) -> None:
    check_tensor(op, "error", error, torch.int32, (1,))


def check_mailbox_arm(box) -> None:
    check_box("mailbox_arm", "box", box)


def mailbox_arm(box) -> None:
    """Arm every word of ``box`` with the sentinel."""
    check_mailbox_arm(box)
    arm_(box)


def check_mailbox_rearm(box, parity, batch) -> None:
    check_box("mailbox_rearm", "box", box, parity, batch)


def mailbox_rearm(box, parity: int, batch: int) -> None:
    """Re-arm the rows [:batch] of every source of one parity."""
    check_mailbox_rearm(box, parity, batch)
    arm_(box[parity, :, :batch])


def check_mailbox_take(box, parity, batch, error) -> None:
    check_box("mailbox_take", "box", box, parity, batch)
    check_error("mailbox_take", error)
    check_placement("mailbox_take", dict(box=box, error=error), {})


def mailbox_take(box, parity: int, batch: int, error):
    """Poll rows [:batch] of every source of one parity, return them [sources, batch,
    width] and re-arm them (the AttnRes consumer of o-proj partials and tail rows)."""
    check_mailbox_take(box, parity, batch, error)
    rows = box[parity, :, :batch].clone()
    flag_missing(error, rows, TAKE_POLL)
    arm_(box[parity, :, :batch])
    return rows


def mailbox_take_fake(box, parity, batch, error):
    check_mailbox_take(box, parity, batch, error)
    return box.new_empty((box.shape[1], batch, box.shape[3]))


def check_attn_res_take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps) -> int:
    """Returns H."""
    op = "attn_res_take"
    check_box(op, "box", box, parity, batch)
    check_error(op, error)
    hidden = box.shape[3]
    check_tensor(op, "partial", partial, torch.bfloat16, (batch, hidden))
    attn_res.check_attn_res(blocks, partial, None, query, key_norm_w, out_norm_w, eps, op)
    check_placement(op, dict(box=box, error=error), dict(blocks=blocks, partial=partial, query=query,
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
    return attn_res.attn_res(blocks, partial, rows, query, key_norm_w, out_norm_w, eps)


def attn_res_take_fake(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps):
    hidden = check_attn_res_take(box, parity, batch, error, blocks, partial, query, key_norm_w, out_norm_w, eps)
    return tuple(partial.new_empty((batch, hidden)) for _ in range(3))


def check_oproj_publish(x, w, boxes, rank) -> int:
    batch, _ = oproj.check_oproj(x, w, "oproj_publish")
    check_boxes("oproj_publish", "boxes", boxes, rank, 0, batch, len(boxes), "x.shape[0] (batch)")
    if boxes[0].shape[3] != w.shape[0]:
        fail("oproj_publish", "boxes", f"rows of width N = {w.shape[0]}", boxes[0].shape[3])
    check_placement("oproj_publish", dict(boxes=boxes), dict(x=x, w=w))
    return batch


def oproj_publish(x, w, boxes, rank: int) -> None:
    """The o-proj producer: partial = BF16(x @ w.T) (this rank's K shard), stored as
    source ``rank`` of every rank's AttnRes box [1, TP, CAP, H]."""
    batch = check_oproj_publish(x, w, boxes, rank)
    partial = no_neg_zero(oproj.oproj(x, w))
    for box in boxes:
        box[0, rank, :batch].copy_(partial)


def check_moe_front_publish(x, w, n_logits, boxes, parity, rank) -> tuple[int, int]:
    """Returns (B, L/TP)."""
    op = "moe_front_publish"
    batch, latent_shard = front.check_moe_front(x, w, n_logits, op)
    # Each rank's latent and logit columns start on a packet: L/TP % 8, (2·E/TP) % 8.
    if latent_shard % PACKET:
        fail(op, "w", f"{n_logits} router rows, then a multiple of {PACKET} latent rows", list(w.shape))
    if n_logits % (PACKET // 2):
        fail(op, "n_logits", f"a multiple of {PACKET // 2} (its FP32 words fill 16-byte packets)", n_logits)
    tp = check_boxes(op, "boxes", boxes, rank, parity, batch, 1, "x.shape[0] (batch)")
    width = tp * (latent_shard + 2 * n_logits)
    if boxes[0].shape[3] != width:
        fail(op, "boxes", f"rows of width L + 2E = {width}", boxes[0].shape[3])
    check_placement(op, dict(boxes=boxes), dict(x=x, w=w))
    return batch, latent_shard


def moe_front_publish(x, w, n_logits: int, boxes, parity: int, rank: int) -> None:
    """The front GEMM over this rank's [router shard; down shard]: its E/TP logits (FP32
    words) and L/TP latent columns go into the row of every rank's front box
    [3, 1, CAP, L + 2E], latent at columns [rank·L/TP, …), logits at L + 2·rank·E/TP."""
    batch, latent_shard = check_moe_front_publish(x, w, n_logits, boxes, parity, rank)
    logits, latent = front.moe_front(x, w, n_logits)
    latent_at = rank * latent_shard
    logits_at = len(boxes) * latent_shard + 2 * rank * n_logits
    words = no_neg_zero(logits).view(torch.bfloat16)
    for box in boxes:
        box[parity, 0, :batch, latent_at : latent_at + latent_shard].copy_(no_neg_zero(latent))
        box[parity, 0, :batch, logits_at : logits_at + 2 * n_logits].copy_(words)


def check_moe_route_poll(box, bias, scale, renorm, parity, batch, error) -> int:
    """Returns L."""
    op = "moe_route_poll"
    check_box(op, "box", box, parity, batch)
    if box.shape[1] != 1:
        fail(op, "box", "a front box with 1 source slot (every rank's shard lands in one row)", list(box.shape))
    check_tensor(op, "bias", bias, torch.float32, (None,))
    experts = bias.shape[0]
    check_range(op, "bias.shape[0] (experts)", experts, route.TOP_K, route.MAX_EXPERTS)
    check_error(op, error)
    check_placement(op, dict(box=box, error=error), dict(bias=bias))
    latent = box.shape[3] - 2 * experts
    if latent <= 0 or latent % PACKET:
        fail(op, "box", f"rows of width L + 2E (E = {experts}) with L > 0 a multiple of {PACKET}", box.shape[3])
    return latent


def moe_route_poll(box, bias, scale: float, renorm: bool, parity: int, batch: int, error):
    """The routing kernel's polled roles: poll the front row [L latent | E FP32 logits],
    route (:func:`~kimi_ops.ops.route.moe_route`), copy the latent and re-arm the row.
    Returns (ids [B, 16] int32, weights [B, 16] bf16, latent [B, L] bf16)."""
    latent_width = check_moe_route_poll(box, bias, scale, renorm, parity, batch, error)
    rows = box[parity, 0, :batch]
    flag_missing(error, rows, ROUTE_POLL)
    latent = rows[:, :latent_width].clone()
    logits = rows[:, latent_width:].contiguous().view(torch.float32)
    ids, weights = route.moe_route(logits, bias, scale, renorm)
    arm_(box[parity, :, :batch])
    return ids, weights, latent


def moe_route_poll_fake(box, bias, scale, renorm, parity, batch, error):
    latent_width = check_moe_route_poll(box, bias, scale, renorm, parity, batch, error)
    return (
        box.new_empty((batch, route.TOP_K), dtype=torch.int32),
        box.new_empty((batch, route.TOP_K)),
        box.new_empty((batch, latent_width)),
    )


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
    tp = check_moe_tail_push(shared, rs_boxes, parity, rank)
    for box, columns in zip(rs_boxes, no_neg_zero(shared).chunk(tp, dim=1)):
        box[parity, rank, : shared.shape[0]].copy_(columns)


def check_moe_tail_publish(expanded, weights, latent_boxes, parity, rank, op="moe_tail_publish",
                           placement: bool = True) -> None:
    """``placement``: that no written box overlaps an input (moe_tail_serve checks it once for both halves)."""
    check_tensor(op, "expanded", expanded, torch.bfloat16, (None, route.TOP_K, None))
    check_tensor(op, "weights", weights, torch.bfloat16, (expanded.shape[0], route.TOP_K))
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
    partial = no_neg_zero(tail.finalize(expanded, weights))
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
    chunk = no_neg_zero(rank_sum(rows))
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
    xn = tail.tail_norm(rank_sum(latent_rows), gamma, eps)
    out = bf16(f32(bf16(matmul_f32(xn, w_up))) + f32(rank_sum(shared_rows)))
    columns = slice(rank * w_up.shape[0], (rank + 1) * w_up.shape[0])
    for box in out_boxes:
        box[0, 0, :batch, columns].copy_(no_neg_zero(out))
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


def check_group_barrier(boxes, ticket, error, rank) -> None:
    op = "group_barrier"
    check_boxes(op, "boxes", boxes, rank, 0, 1, len(boxes))
    if boxes[0].shape[2:] != (1, PACKET):
        fail(op, "boxes", f"sync boxes [1, TP, 1, {PACKET}] (one packet per rank)", list(boxes[0].shape))
    check_tensor(op, "ticket", ticket, torch.int64, (1,))
    check_error(op, error)
    check_placement(op, dict(boxes=boxes, ticket=ticket, error=error), {})


def ticket_words(box, rank=slice(None)):
    """The int64 ticket of rank ``rank``'s slot (all slots: [TP, 1]) of a sync box: the
    first 8 bytes of its packet. An armed slot reads as a negative ticket."""
    return box[0, rank, 0, :4].view(torch.int64)


def group_barrier(boxes, ticket, error, rank: int) -> None:
    """A bounded barrier of the TP group's processes, between the decoder's phases (the
    stores of every rank before it are done after it). A monotonic ticket, never reset per
    call (CUDA graphs replay it): ticket += 1, written into slot ``rank`` of every rank's
    sync box [1, TP, 1, 8]; then every slot of this rank's own box must hold at least
    the ticket, else (past the poll bound, on CUDA) the error word gets BARRIER_POLL.
    The reference runs after every rank's store (a simulated group has nothing to wait
    for: its phases run one after the other, and it never calls this)."""
    check_group_barrier(boxes, ticket, error, rank)
    ticket.add_(1)
    for box in boxes:
        ticket_words(box, rank).copy_(ticket)
    arrived = (ticket_words(boxes[rank]) >= ticket).all()
    error.bitwise_or_((~arrived).to(torch.int32) * BARRIER_POLL)


def fake_of(check):
    """The fake of a mutating op: its checks (metadata only), no result."""

    def fake(*args) -> None:
        check(*args)

    return fake


OPS = {
    "mailbox_arm": (mailbox_arm, fake_of(check_mailbox_arm)),
    "mailbox_rearm": (mailbox_rearm, fake_of(check_mailbox_rearm)),
    "mailbox_take": (mailbox_take, mailbox_take_fake),
    "attn_res_take": (attn_res_take, attn_res_take_fake),
    "oproj_publish": (oproj_publish, fake_of(check_oproj_publish)),
    "moe_front_publish": (moe_front_publish, fake_of(check_moe_front_publish)),
    "moe_route_poll": (moe_route_poll, moe_route_poll_fake),
    "moe_tail_push": (moe_tail_push, fake_of(check_moe_tail_push)),
    "moe_tail_publish": (moe_tail_publish, fake_of(check_moe_tail_publish)),
    "moe_latent_reduce": (moe_latent_reduce, fake_of(check_moe_latent_reduce)),
    "moe_tail_poll": (moe_tail_poll, fake_of(check_moe_tail_poll)),
    "moe_tail_serve": (moe_tail_serve, fake_of(check_moe_tail_serve)),
    "group_barrier": (group_barrier, fake_of(check_group_barrier)),
}
