"""The MoE front GEMM (the seeds' ``moe/front.py`` publish GEMM): ``kimi::moe_front``."""

import torch

from ..checks import check_range, check_same_device, check_tensor
from ..numerics import bf16, matmul_f32


def check_moe_front(x, w, n_logits, op: str = "moe_front") -> tuple[int, int]:
    """Returns (B, n_latent); errors in the name of ``op`` (the publishing op reuses the checks)."""
    check_tensor(op, "x", x, torch.bfloat16, (None, None))
    check_tensor(op, "w", w, torch.bfloat16, (None, x.shape[1]))
    check_range(op, "n_logits", n_logits, 0, w.shape[0])
    check_same_device(op, x=x, w=w)
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
