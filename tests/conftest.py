import os

import pytest
import torch

import kimi_ops  # noqa: F401  (registers torch.ops.kimi)

BATCHES = (1, 3, 8, 64)
KERNEL_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # the batches every kernel is checked at, up to CAP
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bf16_ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in BF16 ulps (bit patterns on one monotone line; NaN = NaN)."""

    def line(x):
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    distance = (line(actual) - line(expected)).abs()
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    return torch.where(both_nan, torch.zeros_like(distance), distance)


def assert_bf16_close(actual, expected, max_ulps=1, max_flipped=0.01, magnitude=None):
    """Every element within ``max_ulps`` BF16 ulps, at most ``max_flipped`` not bit-equal.

    ``magnitude``: for a rounded sum whose terms may cancel, ulps may instead be counted at
    the terms' magnitude (a one-ulp flip of a term is then one ulp, not many)."""
    assert actual.dtype == expected.dtype == torch.bfloat16
    assert actual.shape == expected.shape
    ulps = bf16_ulps(actual.cpu(), expected.cpu())
    if magnitude is not None:
        exponent = torch.floor(torch.log2(magnitude.cpu().double().abs().clamp_min(1e-30)))
        term_ulps = (actual.cpu().double() - expected.cpu().double()).abs() / torch.exp2(exponent - 7)
        ulps = torch.minimum(ulps, term_ulps.ceil().to(torch.int32))
    assert int(ulps.max()) <= max_ulps, f"max {int(ulps.max())} ulps"
    flipped = float((ulps > 0).float().mean())
    assert flipped <= max_flipped, f"{flipped:.2%} of elements not bit-equal"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


on_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU"
)


@pytest.fixture
def dirty_shared_memory():
    """Every SM's shared memory filled with 0xFF bytes before a kernel test (see
    scribble.py); nothing to do without an sm_90 GPU."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        from scribble import scribble_shared_memory

        scribble_shared_memory()


def reference(op, *args):
    """``op(*args)`` under the reference backend (the oracle on the same device)."""
    os.environ["KIMI_OPS_BACKEND"] = "reference"
    try:
        return op(*args)
    finally:
        del os.environ["KIMI_OPS_BACKEND"]
