"""The MoE front GEMM (the seeds' ``moe/front.py`` publish GEMM): ``kimi::moe_front``."""

import torch

from ..checks import check_placement, check_range, check_same_device, check_tensor, fail
from ..mailbox import (
    PACKET,
    canonical,
)
from ..numerics import bf16, matmul_f32
from .boxes import check_boxes


def check_moe_front(x, w, n_logits, op: str = "moe_front", w_name: str = "w") -> tuple[int, int]:
    """Returns (B, n_latent); errors in the name of ``op`` (the publishing ops reuse the
    checks) and of its weight argument ``w_name``."""
    check_tensor(op, "x", x, torch.bfloat16, (None, None))
    check_tensor(op, w_name, w, torch.bfloat16, (None, x.shape[1]))
    check_range(op, "n_logits", n_logits, 0, w.shape[0])
    check_same_device(op, **{"x": x, w_name: w})
    return x.shape[0], w.shape[0] - n_logits


def moe_front(x, w, n_logits: int):
    """One GEMM over the stacked weights ``w = [router rows; down rows]`` ([N, H] bf16).

    logits = x @ w[:n_logits].T [B, n_logits] FP32 (FP32 accumulation, not rounded);
    latent = x @ w[n_logits:].T [B, N − n_logits] bf16 (FP32 accumulation, rounded once).
    """
    check_moe_front(x, w, n_logits)
    return matmul_f32(x, w[:n_logits]), bf16(matmul_f32(x, w[n_logits:]))


def moe_front_fake(x, w, n_logits):
    batch, n_latent = check_moe_front(x, w, n_logits)
    return (
        x.new_empty((batch, n_logits), dtype=torch.float32),
        x.new_empty((batch, n_latent), dtype=torch.bfloat16),
    )


# The mailbox ops of the family (DESIGN §4; the box checks: :mod:`.boxes`).


def check_moe_front_publish(x, w, n_logits, boxes, parity, rank, op: str = "moe_front_publish",
                            names: tuple[str, str] = ("w", "boxes")) -> tuple[int, int]:
    """Returns (B, L/TP); errors in the name of ``op`` and of its weight and boxes
    arguments ``names`` (the fused op, ``kimi::moe_front_shared_push``, reuses the checks)."""
    w_name, boxes_name = names
    batch, latent_shard = check_moe_front(x, w, n_logits, op, w_name)
    # Each rank's latent and logit columns start on a packet: L/TP % 8, (2·E/TP) % 8.
    if latent_shard % PACKET:
        fail(op, w_name, f"{n_logits} router rows, then a multiple of {PACKET} latent rows", list(w.shape))
    if n_logits % (PACKET // 2):
        fail(op, "n_logits", f"a multiple of {PACKET // 2} (its FP32 words fill 16-byte packets)", n_logits)
    tp = check_boxes(op, boxes_name, boxes, rank, parity, batch, 1, "x.shape[0] (batch)")
    width = tp * (latent_shard + 2 * n_logits)
    if boxes[0].shape[3] != width:
        fail(op, boxes_name, f"rows of width L + 2E = {width}", boxes[0].shape[3])
    check_placement(op, {boxes_name: boxes}, {"x": x, w_name: w})
    return batch, latent_shard


def moe_front_publish(x, w, n_logits: int, boxes, parity: int, rank: int) -> None:
    """The front GEMM over this rank's [router shard; down shard]: its E/TP logits (FP32
    words) and L/TP latent columns go into the row of every rank's front box
    [3, 1, CAP, L + 2E], latent at columns [rank·L/TP, …), logits at L + 2·rank·E/TP."""
    batch, latent_shard = check_moe_front_publish(x, w, n_logits, boxes, parity, rank)
    logits, latent = moe_front(x, w, n_logits)
    latent_at = rank * latent_shard
    logits_at = len(boxes) * latent_shard + 2 * rank * n_logits
    words = canonical(logits).view(torch.bfloat16)
    for box in boxes:
        box[parity, 0, :batch, latent_at : latent_at + latent_shard].copy_(canonical(latent))
        box[parity, 0, :batch, logits_at : logits_at + 2 * n_logits].copy_(words)
