import os

import pytest
import torch

if not torch.cuda.is_available():
    # Compile-only on CPU machines: CuTe DSL fixes its target when cutlass is first
    # imported (else sm_100a, where wgmma and setmaxnreg do not exist).
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import kimi_ops  # noqa: E402, F401  (registers torch.ops.kimi)
from kimi_ops import backend  # noqa: E402

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
    actual, expected = actual.cpu(), expected.cpu()
    ulps = bf16_ulps(actual, expected).double()
    if magnitude is not None:
        exponent = torch.floor(torch.log2(magnitude.cpu().double().abs().clamp_min(1e-30)))
        term_ulps = ((actual.double() - expected.double()).abs() / torch.exp2(exponent - 7)).ceil()
        both_nan = torch.isnan(actual) & torch.isnan(expected)  # NaN on one side only stays NaN: fails
        # fmin: a NaN magnitude (a NaN token's rows served elsewhere, equal zeros) keeps the plain ulps
        ulps = torch.where(both_nan, torch.zeros_like(ulps), torch.fmin(ulps, term_ulps))
    assert float(ulps.max()) <= max_ulps, f"max {float(ulps.max())} ulps"
    flipped = float((ulps > 0).double().mean())
    assert flipped <= max_flipped, f"{flipped:.2%} of elements not bit-equal"


def assert_tail_close(got, want, shared):
    """The tail's out = up + shared (DESIGN §7, issue 5): 2 BF16 ulps counted at the larger
    term's size (CUDA's rsqrt may flip an xn, and so a row of up, by one ulp: many ulps of a
    cancelled out; that flip plus out's own rounding make two), ≤ 3% not bit-equal."""
    shared = shared.cpu().double()
    terms = torch.maximum((want.cpu().double() - shared).abs(), shared.abs()) * (1 + 2**-7)
    assert_bf16_close(got, want, max_ulps=2, max_flipped=0.03, magnitude=terms)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
on_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")


def armed_box(*shape):
    """A BF16 mailbox of ``shape`` on the GPU, every word the sentinel."""
    box = torch.empty(*shape, dtype=torch.bfloat16, device="cuda")
    torch.ops.kimi.mailbox_arm(box)
    return box


@pytest.fixture
def clean_ptxas(monkeypatch, capfd):
    """For compile tests: ptxas reports what the test compiles (KIMI_OPS_PTXAS_REMARKS, see
    kernels.common.compile_options); ``clean_ptxas(kernels)`` then checks that as many
    kernels reported, none spills and none carries a C75xx performance note (C7512, wgmma
    serialized for want of registers, cost a wave variant about 1 µs a call on the H200
    before anyone read the report)."""
    monkeypatch.setenv("KIMI_OPS_PTXAS_REMARKS", "1")

    def check(kernels: int = 1):
        report = capfd.readouterr().err.splitlines()
        if log := os.environ.get("KIMI_OPS_PTXAS_LOG"):  # a refactor's check: reports before and after, diffed
            with open(log, "a") as f:
                f.write(f"== {os.environ['PYTEST_CURRENT_TEST'].split(' ')[0]}\n")
                f.writelines(line.split("ptxas info    :")[-1].strip() + "\n" for line in report
                             if "ptxas" in line and "Compiling entry" not in line and "Function properties" not in line)
        used = [line for line in report if "Used " in line and " registers" in line]
        assert len(used) >= kernels, f"ptxas reported {len(used)} kernels, expected {kernels}"
        notes = [line for line in report if "(C75" in line]
        spills = [line for line in report if "spill stores" in line and " 0 bytes spill stores, 0 bytes spill" not in line]
        assert not notes and not spills, "\n".join(notes + spills)

    return check


@pytest.fixture
def dirty_shared_memory():
    """Every SM's shared memory filled with 0xFF bytes before a kernel test (see
    scribble.py); nothing to do without an sm_90 GPU."""
    if HOPPER:
        from scribble import scribble_shared_memory

        scribble_shared_memory()


def reference(op, *args):
    """``op(*args)`` under the reference backend (the oracle on the same device)."""
    with backend.forced("reference"):
        return op(*args)


def deliver_staged(staging, received, part, block, owners):
    """The K-part exchange's CPU models, DecodeGemm.send: each staged block of an owner below
    ``owners`` (ours aside) whole into that owner's receive buffer at our ``part`` (``block``
    words a block; ``staging`` and ``received`` map words to values)."""
    for owner in range(owners):
        if owner != part:
            for word in range(owner * block, (owner + 1) * block):
                if word in staging:
                    received[owner][part * block + word - owner * block] = staging[word]
