"""The MoE tail (the seeds' ``moe/tail.py`` ``MoeTail``), one rank at TP1: ``kimi::moe_tail``."""

import torch

from ..checks import check_eps, check_same_device, check_tensor
from ..numerics import bf16, f32, matmul_f32, sum_f32
from .route import TOP_K


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
