"""The box protocol's ops and checks (DESIGN §4), which every family's mailbox ops share:
the checks of a box and of a box list, arm and re-arm, take, the group barrier.

Every box is BF16 ``[parities, TP sources, CAP, width]`` (:mod:`kimi_ops.mailbox`). An op
that publishes takes ``boxes``, the box of every rank of the group in rank order (the
local one among them), and writes its rows into each (a multicast, or one peer store per
rank); the schema marks them all written. A poll that finds a row unwritten sets a bit of
the ``error`` word instead of hanging; the wrapper raises on its next host check.

References: every rank's rows are complete when the poll runs (the simulated TP group
runs ranks phase by phase), so a poll is a bit check of the rows, then the read.
"""

import torch

from ..checks import check_placement, check_range, check_tensor, fail
from ..mailbox import (
    BARRIER_POLL,
    PACKET,
    TAKE_POLL,
    arm_,
    canonical,
    flag_missing,
)


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


def store_shards(rows, rs_boxes, parity: int, rank: int) -> None:
    """Column shard d of ``rows`` [B, N] (canonical) as source ``rank`` of rank d's box
    [3, TP, CAP, N/TP]: the reduce-scatter stores of moe_tail_push and oproj_push."""
    for box, columns in zip(rs_boxes, canonical(rows).chunk(len(rs_boxes), dim=1)):
        box[parity, rank, : rows.shape[0]].copy_(columns)


def check_error(op, error) -> None:
    check_tensor(op, "error", error, torch.int32, (1,))


def check_ready(op, ready) -> None:
    """The route poll's ready counter for routed experts that wait for it: [producer CTAs
    arrived, consumer CTAs past the wait], int64, zeroed by the consumer."""
    check_tensor(op, "ready", ready, torch.int64, (2,))


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
