"""Mailbox words (DESIGN §4): the sentinel, the writers' canonical form, the readers' check.

A box is BF16 ``[parities, TP sources, CAP, width]``, armed with the 32-bit word
0x80000000 (the BF16 pair (+0, −0); as FP32, −0.0). Writers make data unable to equal
it: −0 becomes +0 and NaN becomes the canonical quiet NaN. Readers compare bits, a row
at a time, never values.

What a box must be (every mailbox op and its fake check it, :func:`~kimi_ops.ops.boxes.check_box`):
contiguous BF16 of rank 4; ``width`` a multiple of :data:`PACKET` BF16 values and the
box 16-byte aligned (storage offset a multiple of PACKET), since kernels poll and store
whole 16-byte packets and the reference reads word pairs; at least one parity (the
decoder's front, latent and shared boxes have 3, its AttnRes and output boxes 1), one
source and one token. A call's parity is below the box's parities and its batch in
[1, CAP]. The boxes of one list are alike (shape, device), one per rank in rank order,
and no box is passed twice, in a list or across arguments.
"""

import torch

SENTINEL = -0x80000000  # as int32
PACKET = 8  # BF16 values per 16-byte packet: box widths and offsets are multiples of it
PULSE_STRIDE = 64  # bytes a rank in a group's heartbeat page (runtime/heartbeat.py): a cache line each

# Error word bits: which poll found its row unwritten.
ROUTE_POLL, TAIL_LATENT_POLL, TAIL_SHARED_POLL, TAKE_POLL, BARRIER_POLL, TWO_SHOT_POLL = 1, 2, 4, 8, 16, 32
SHARED_BARRIER = 64  # not a box: the fused shared expert's grid barrier (kernels/gemm/shared.py)
EXPERTS_READY = 128  # not a box: the routed experts' wait for the route poll's count (kernels/experts)
POLL_NAMES = {
    ROUTE_POLL: "the routing kernel's front row",
    TAIL_LATENT_POLL: "the tail's latent sources",
    TAIL_SHARED_POLL: "the tail's shared reduce-scatter sources",
    TAKE_POLL: "a consumer's rows (o-proj partials or tail output)",
    BARRIER_POLL: "a peer's ticket in the group barrier's sync box (a rank stopped between phases)",
    TWO_SHOT_POLL: "the two-shot latent chunks pushed to their owner (moe_latent_reduce's receive box)",
    SHARED_BARRIER: "the fused shared expert's grid barrier (a CTA of its grid was not resident: another grid held "
                    "its SM; or its ticket was moved outside the op)",
    EXPERTS_READY: "the routed experts' wait for the route poll's outputs (its ready count never reached 2B)",
}


class KimiMailboxError(RuntimeError):
    """A poll found a mailbox row that was never written (a dead peer, a mis-armed box).
    The error word stays set, and the boxes may hold rows of the failed step, until
    :meth:`KimiDecoder.reset() <kimi_ops.runtime.decoder.KimiDecoder.reset>`."""


def arm_(box: torch.Tensor) -> None:
    box.view(torch.int32).fill_(SENTINEL)


def canonical(x: torch.Tensor) -> torch.Tensor:
    """x (bf16 or fp32) in the writers' canonical form, which can never equal the
    sentinel: −0 → +0 and every NaN → the canonical quiet NaN."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x)


def arrived(rows: torch.Tensor) -> torch.Tensor:
    """Per row (all dims but the last): no 32-bit word still holds the sentinel."""
    return (rows.view(torch.int32) != SENTINEL).all(-1)


def flag_missing(error: torch.Tensor, rows: torch.Tensor, code: int) -> None:
    """error |= code where some row has not arrived (no host sync)."""
    missing = (~arrived(rows)).any().to(torch.int32) * code
    error.bitwise_or_(missing)


def box_row(parity, source, token, sources: int, capacity: int):
    """The row of ``box.view(-1, width)`` holding (parity, source, token) of a box
    [parities, sources, capacity, width] (ints, or tensors of them). The kernels' side of
    this layout is :func:`kimi_ops.kernels.mailbox.box_row`."""
    return (parity * sources + source) * capacity + token


def raise_if_error(error: torch.Tensor) -> None:
    """The host check of a device error word (syncs)."""
    code = int(error.max())
    if code:
        polls = [name for bit, name in POLL_NAMES.items() if code & bit]
        raise KimiMailboxError(
            f"mailbox poll timed out (error word {code:#x}): {'; '.join(polls)} never "
            "arrived — a peer did not publish or a box was not armed. The error word stays set "
            "and the boxes may hold the failed step's rows: call KimiDecoder.reset() (on every "
            "rank) to re-arm every box and clear the error words before the next step"
        )


def parities(ordinal: int, count: int) -> tuple[int, int]:
    """(publish, rearm) parities of MoE layer ``ordinal`` of ``count``: layer i publishes
    into i % 3 and re-arms the previous MoE layer's (i − 1) mod count % 3. A layer count
    whose first layer would re-arm the parity it publishes to is rejected."""
    parity, rearm = ordinal % 3, (ordinal - 1) % count % 3
    if parity == rearm:
        raise ValueError(
            f"MoE tail parities collide for {count} MoE layers: layer {ordinal} would "
            f"re-arm parity {parity}, which it publishes to (counts ≡ 1 mod 3 collide)"
        )
    return parity, rearm
