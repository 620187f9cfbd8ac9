"""The decoder guard (issue 35): the composed decoder against its reference, judged by the
reference's own sensitivity measured in the same run.

Per op, every kernel is held to its reference; the composed decoder cannot be held to
bits: one ulp of rounding anywhere moves a routing near-tie, and the model amplifies it
(at kimi_k3 a one-ulp nudge of 0.1 % of the input moves the output by ~1 % after 2-3
layers). So the guard measures that amplification — the spread of the reference
decoder's outputs when a small share of each step's inputs moves by one BF16 ulp, over
several draws — and asks that the candidate's drift from the reference sit inside it:
each of :data:`QUANTILES` of the candidate's per-token relative L2 errors at most
:data:`FACTOR` times the same quantile of the spread. A composition bug (a stale row, a
dropped expert, a missing rank's share) moves whole rows, far past rounding.

    steps = [torch.randn(B, H).bfloat16() for _ in range(3)]
    verdict = guard(decoder, steps)        # candidate: the decoder's own backend
    assert verdict.passed, verdict
"""

import contextlib
from dataclasses import dataclass

import torch

from .. import backend

SHARE = 1e-3  # of a step's input elements moved by one BF16 ulp (at least one a token)
DRAWS = 4  # nudge draws: the spread pools their per-token errors
QUANTILES = (0.5, 0.9)
FACTOR = 2.0


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per-token (row) relative L2 distance of got from want, in FP64."""
    got, want = got.double(), want.double()
    return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-300)


def nudged(x: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """x (BF16 [B, H]) with max(1, round(share · H)) elements of each row moved one ulp up
    or down in magnitude (a zero becomes the smallest subnormal of its sign)."""
    rows, width = x.shape
    count = max(1, round(share * width))
    where = torch.stack([torch.randperm(width, generator=gen)[:count] for _ in range(rows)]).to(x.device)
    step = (torch.randint(0, 2, where.shape, generator=gen, dtype=torch.int16) * 2 - 1).to(x.device)
    bits = x.contiguous().view(torch.int16).clone()
    chosen = bits.gather(1, where)
    magnitude = chosen & 0x7FFF
    magnitude = torch.where(magnitude == 0, torch.ones_like(magnitude), magnitude + step)
    bits.scatter_(1, where, (chosen & -0x8000) | magnitude)
    return bits.view(torch.bfloat16)


def random_steps(decoder, batch: int, count: int = 3, seed: int = 5) -> list[torch.Tensor]:
    """``count`` steps of randn hidden rows [batch, H] (BF16) on the decoder's device."""
    gen = torch.Generator().manual_seed(seed)
    device = decoder.boxes.error(decoder.group.ranks[0]).device
    return [torch.randn(batch, decoder.config.hidden, generator=gen).bfloat16().to(device) for _ in range(count)]


def run(decoder, steps, context=contextlib.nullcontext) -> list[torch.Tensor]:
    """The decoder's outputs for ``steps`` (eager, in order) within ``context()``."""
    with torch.no_grad(), context():
        return [decoder(x).clone() for x in steps]


def reference(decoder, steps) -> list[torch.Tensor]:
    return run(decoder, steps, lambda: backend.forced("reference"))


def sensitivity(decoder, steps, want, draws: int = DRAWS, share: float = SHARE, seed: int = 0) -> torch.Tensor:
    """Per-token relative L2 of the reference decoder on nudged steps against ``want`` (its
    outputs on the steps themselves), pooled over ``draws`` draws."""
    gen = torch.Generator().manual_seed(seed)
    spread = []
    for _ in range(draws):
        outputs = reference(decoder, [nudged(x, share, gen) for x in steps])
        spread += [rel_l2(got, ref) for got, ref in zip(outputs, want)]
    return torch.cat(spread).cpu()


@dataclass
class Verdict:
    """The candidate's drift and the reference's spread at :data:`QUANTILES` (and their
    maxima, shown, not judged); ``margin``: the largest drift / bound over the quantiles
    (≤ 1 passes)."""

    drift: tuple
    spread: tuple
    drift_max: float
    spread_max: float
    factor: float

    @property
    def margin(self) -> float:
        return max(d / (self.factor * s) if s > 0 else (0.0 if d == 0 else float("inf"))
                   for d, s in zip(self.drift, self.spread))

    @property
    def passed(self) -> bool:
        return self.margin <= 1

    def __str__(self) -> str:
        quantiles = ", ".join(f"q{round(100 * q)} {d:.4f} vs {s:.4f}" for q, d, s in zip(QUANTILES, self.drift, self.spread))
        return (f"drift {quantiles} (spread); max {self.drift_max:.4f} vs {self.spread_max:.4f}; "
                f"margin {self.margin:.2f} ({'inside' if self.passed else 'OUTSIDE'} {self.factor}x the spread)")


def judge(drift: torch.Tensor, spread: torch.Tensor, factor: float = FACTOR) -> Verdict:
    quantile = lambda v: tuple(float(v.quantile(q)) for q in QUANTILES)  # noqa: E731
    return Verdict(quantile(drift), quantile(spread), float(drift.max()), float(spread.max()), factor)


def guard(decoder, steps, context=contextlib.nullcontext, draws: int = DRAWS, share: float = SHARE) -> Verdict:
    """The decoder run within ``context()`` (its own backend: the kernels on a GPU; an
    injected bug) against the same decoder under the reference backend, judged by the
    reference's spread under nudges. The boxes are reset after the candidate's steps (an
    injected bug may leave rows a correct step would not)."""
    want = reference(decoder, steps)
    spread = sensitivity(decoder, steps, want, draws, share)
    try:
        got = run(decoder, steps, context)
    finally:
        decoder.reset()
    drift = torch.cat([rel_l2(g, w) for g, w in zip(got, want)]).cpu()
    return judge(drift, spread)
