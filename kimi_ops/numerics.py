"""Rounding-point helpers of the reference backend (plain PyTorch, any device).

FP32 accumulations are idealized: sums and dot products are formed in float64 and
rounded once to FP32, so the reference is the FP32 result nearest the exact one and does
not depend on a library's summation order. Kernels that accumulate in FP32 in a fixed
order land within the tolerances of DESIGN §7 of it.
"""

import torch

E4M3_MAX = 448.0


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to BF16 (round to nearest even)."""
    return x.to(torch.bfloat16)


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def sum_f32(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ over ``dim``, exact in float64, rounded once to FP32."""
    return x.double().sum(dim).float()


def matmul_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for row-major weights ``w [N, K]``: FP32 accumulation, not rounded further."""
    return (x.double() @ w.double().transpose(-1, -2)).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """BF16((x · rr) · weight) with rr = rsqrt(Σ x² / n + eps), all in FP32 (QueryNorm)."""
    x = f32(x)
    rr = torch.rsqrt(sum_f32(x * x, -1) / x.shape[-1] + eps)
    return bf16((x * rr.unsqueeze(-1)) * f32(weight))


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ≥ v for positive normal FP32 v (exact, on the bits)."""
    bits = v.view(torch.int32)
    mantissa = bits & 0x007FFFFF
    up = (bits & 0x7F800000) + 0x00800000
    return torch.where(mantissa == 0, bits, up).view(torch.float32)


def quantize_e4m3(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 of the last dim: amax = max(1e-10, max |v|), scale = pow2_ceil(amax / 448),
    q = e4m3(v / scale) (exact division: power of two), saturated at ±448.

    Returns (q float8_e4m3fn, scale FP32 with the last dim kept as 1)."""
    values = f32(values)
    amax = values.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    scale = pow2_ceil(amax / E4M3_MAX)
    q = (values / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def ordered_key(x: torch.Tensor) -> torch.Tensor:
    """The seeds' ``ordered``: a monotone uint32 key of FP32 x (as int64), NaN → 0.

    Negative values map to ~bits, the others to bits | 0x80000000, so −0 ranks just
    below +0 and every number ranks above NaN."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return torch.where(torch.isnan(x), torch.zeros_like(key), key)


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ of the last dim (a power of two) as the warp butterfly does: adjacent pairs, then
    pairs of pairs, each addition rounded in x's dtype."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def rank_sum(rows: torch.Tensor) -> torch.Tensor:
    """BF16(Σ_i rows[i]): an FP32 sum over the first dim in rank order (TP sources)."""
    acc = f32(rows[0])
    for i in range(1, rows.shape[0]):
        acc = acc + f32(rows[i])
    return bf16(acc)
