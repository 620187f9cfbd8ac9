"""The attention output projection (the seeds' ``oproj/producer.py``): ``kimi::oproj``."""

import torch

from ..checks import check_same_device, check_tensor
from ..numerics import bf16, matmul_f32


def check_oproj(x, w, op: str = "oproj") -> tuple[int, int]:
    """Returns (B, N); errors in the name of ``op`` (the publishing op reuses the checks)."""
    check_tensor(op, "x", x, torch.bfloat16, (None, None), rows=True)
    check_tensor(op, "w", w, torch.bfloat16, (None, x.shape[1]))
    check_same_device(op, x=x, w=w)
    return x.shape[0], w.shape[0]


def oproj(x, w):
    """x [B, K] @ w[N, K].T → [B, N] bf16: FP32 accumulation, rounded once (the seeds
    reduce K parts in a fixed order; the reference takes the exact sum)."""
    check_oproj(x, w)
    return bf16(matmul_f32(x, w))


def oproj_fake(x, w):
    return x.new_empty(check_oproj(x, w), dtype=torch.bfloat16)
