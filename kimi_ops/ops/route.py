"""Routing and the shared expert's activation (the seeds' ``RouteSitu``): ``kimi::moe_route``
and ``kimi::situ``."""

import torch

from ..checks import check_placement, check_range, check_same_device, check_tensor, fail
from ..config import MAX_EXPERTS, TOP_K
from ..mailbox import (
    PACKET,
    ROUTE_POLL,
    arm_,
    flag_missing,
)
from ..numerics import bf16, f32, ordered_key, pairwise_sum
from .boxes import check_box, check_error, check_ready


def check_moe_route(logits, bias, scale, renorm) -> int:
    """Returns B."""
    check_tensor("moe_route", "logits", logits, torch.float32, (None, None))
    check_range("moe_route", "logits.shape[1] (experts)", logits.shape[1], TOP_K, MAX_EXPERTS)
    check_tensor("moe_route", "bias", bias, torch.float32, (logits.shape[1],))
    check_same_device("moe_route", logits=logits, bias=bias)
    return logits.shape[0]


def moe_route(logits, bias, scale: float, renorm: bool):
    """Exact top-16 of sigmoid(logit) + bias per token.

    Rounding points: score = sigmoid(logit) in FP32; key = score + bias in FP32; ranked
    by the seeds' ``ordered`` key descending (NaN below every number, −0 below +0), ties to
    the lower expert id. weight_r = score_r · FP32(scale), and with ``renorm`` divided
    (IEEE) by (Σ_r score_r + 1e-20), the Σ taken as the warp butterfly does (adjacent
    pairs over ranks 0..15, FP32). The bias never enters a weight. One BF16 rounding at
    the end. Returns ids [B, 16] int32 by rank and weights [B, 16] bf16.
    """
    check_moe_route(logits, bias, scale, renorm)
    score = torch.sigmoid(logits)
    experts = logits.shape[1]
    # One int64 per expert: the ordered key above, then the lower id on ties.
    lower_first = MAX_EXPERTS - 1 - torch.arange(experts, device=logits.device)
    rank_key = ordered_key(score + bias) * MAX_EXPERTS + lower_first
    top = rank_key.topk(TOP_K, dim=1, sorted=True).indices
    picked = score.gather(1, top)
    weights = picked * scale  # a Python scalar enters FP32 math as FP32(scale)
    if renorm:
        weights = weights / (pairwise_sum(picked) + 1e-20).unsqueeze(1)
    return top.to(torch.int32), bf16(weights)


def moe_route_fake(logits, bias, scale, renorm):
    batch = check_moe_route(logits, bias, scale, renorm)
    return (
        logits.new_empty((batch, TOP_K), dtype=torch.int32),
        logits.new_empty((batch, TOP_K), dtype=torch.bfloat16),
    )


def check_situ(gate_up, beta, linear_beta) -> tuple[int, int]:
    """Returns (B, S)."""
    check_tensor("situ", "gate_up", gate_up, (torch.float32, torch.bfloat16), (None, None))
    if gate_up.shape[1] % 2 != 0:
        fail("situ", "gate_up", "of even width [B, 2S]", list(gate_up.shape))
    return gate_up.shape[0], gate_up.shape[1] // 2


def situ(gate_up, beta: float, linear_beta: float):
    """situ(g, u) = g · sigmoid(beta · g) · (u + linear_beta), [B, S] bf16.

    Rounding points: gate = gate_up[:, :S] and up = gate_up[:, S:] each rounded to BF16
    first (as RouteSitu loads them); the product in FP32, left to right; one BF16 rounding
    at the end. beta = 1, linear_beta = 0 is SwiGLU.
    """
    _, width = check_situ(gate_up, beta, linear_beta)
    gate = f32(bf16(gate_up[:, :width]))
    up = f32(bf16(gate_up[:, width:]))
    return bf16(gate * torch.sigmoid(gate * beta) * (up + linear_beta))


def situ_fake(gate_up, beta, linear_beta):
    batch, width = check_situ(gate_up, beta, linear_beta)
    return gate_up.new_empty((batch, width), dtype=torch.bfloat16)


# The mailbox ops of the family (DESIGN §4; the box checks: :mod:`.boxes`).


def check_moe_route_poll(box, bias, scale, renorm, parity, batch, error, ready=None) -> int:
    """Returns L."""
    op = "moe_route_poll"
    check_box(op, "box", box, parity, batch)
    if box.shape[1] != 1:
        fail(op, "box", "a front box with 1 source slot (every rank's shard lands in one row)", list(box.shape))
    check_tensor(op, "bias", bias, torch.float32, (None,))
    experts = bias.shape[0]
    check_range(op, "bias.shape[0] (experts)", experts, TOP_K, MAX_EXPERTS)
    check_error(op, error)
    if ready is not None:
        check_ready(op, ready)
    check_placement(op, dict(box=box, error=error, ready=ready), dict(bias=bias))
    latent = box.shape[3] - 2 * experts
    if latent <= 0 or latent % PACKET:
        fail(op, "box", f"rows of width L + 2E (E = {experts}) with L > 0 a multiple of {PACKET}", box.shape[3])
    return latent


def moe_route_poll(box, bias, scale: float, renorm: bool, parity: int, batch: int, error, ready=None):
    """The routing kernel's polled roles: poll the front row [L latent | E FP32 logits],
    route (:func:`~kimi_ops.ops.route.moe_route`), copy the latent and re-arm the row.
    Returns (ids [B, 16] int32, weights [B, 16] bf16, latent [B, L] bf16).

    ``ready`` ([2] int64, :func:`~kimi_ops.ops.boxes.check_ready`): the kernel writes its
    outputs without waiting for the end of the kernel launched before it (PDL), then adds
    its 2B CTAs to ``ready[0]``, the count ``kimi::routed_experts_counted`` waits for: for a
    caller that keeps every buffer that kernel reads alive past it (the decoder after the
    fused shared expert, whose input it owns). The values are the same either way."""
    latent_width = check_moe_route_poll(box, bias, scale, renorm, parity, batch, error, ready)
    rows = box[parity, 0, :batch]
    flag_missing(error, rows, ROUTE_POLL)
    latent = rows[:, :latent_width].clone()
    logits = rows[:, latent_width:].contiguous().view(torch.float32)
    ids, weights = moe_route(logits, bias, scale, renorm)
    arm_(box[parity, :, :batch])
    if ready is not None:
        ready[0] += 2 * batch
    return ids, weights, latent


def moe_route_poll_fake(box, bias, scale, renorm, parity, batch, error, ready=None):
    latent_width = check_moe_route_poll(box, bias, scale, renorm, parity, batch, error, ready)
    return (
        box.new_empty((batch, TOP_K), dtype=torch.int32),
        box.new_empty((batch, TOP_K)),
        box.new_empty((batch, latent_width)),
    )
