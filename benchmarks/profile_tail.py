"""Where the time of kimi::moe_tail goes: the phase clock (kernels.common.Stamps) of MoeTail or
WaveMoeTail at TP1, CUDA-graph replayed with the weights L2-cold as in bench_tail.py. Per phase,
µs from the call's first CTA start: earliest / median / latest CTA (median over the
graph's calls), and the CTAs' median by their own SM clock from their own start.

    python benchmarks/profile_tail.py [B ...]
"""

import os
import sys

import torch

import kimi_ops  # noqa: F401
from kimi_ops.kernels.tail import host
from kimi_ops.kernels.tail.common import PHASES

sys.path.insert(0, os.path.dirname(__file__))
from bench_tail import COPIES, HIDDEN, LATENT, activations, layer_weights  # noqa: E402
from timing import graph_us  # noqa: E402

CALLS = COPIES * 4


def profile(batch: int, w_ups, gamma) -> None:
    ctas = host.functional_ctas(HIDDEN, LATENT, batch)
    phases = len(PHASES)
    buffers = torch.zeros(CALLS, ctas * phases * 2, dtype=torch.int64, device="cuda")
    kernel = host.TailKernel()
    expanded, weights, shared = activations(batch)
    turn = [0]

    def call():
        kernel.stamps = buffers[turn[0] % CALLS]  # each captured call stamps its own row
        kernel(expanded, weights, shared, gamma, w_ups[turn[0] % COPIES], 1e-6)
        turn[0] += 1

    us = graph_us(call, calls=CALLS)
    stamps = buffers.view(CALLS, ctas, phases, 2).cpu()
    stamped = stamps[..., 0].ne(0).any(1).all(0).tolist()  # publish mode's phases stay out of functional runs
    table, overlap, ghz = phase_table(stamps[:, :, [i for i, s in enumerate(stamped) if s]])
    print(f"B={batch}: {us:.2f} µs per call; the next call starts {overlap:.2f} µs before the last CTA "
          f"ends; SM clock {ghz:.2f} GHz")
    print(f"{'phase':>14s} {'first':>7s} {'median':>7s} {'last':>7s} {'own clock':>9s}")
    for name, row in zip([n for n, s in zip(PHASES, stamped) if s], table):
        print(f"{name:>14s} " + " ".join(f"{v:7.2f}" for v in row[:3]) + f" {row[3]:9.2f}")


def phase_table(stamps: torch.Tensor):
    """``stamps`` [calls, CTAs, phases, (ns, clock)] of one replay → per phase (first,
    median, last CTA: µs from the call's first start; the CTAs' median by their own clock
    from their own start), each a median over the calls but the first (which waits for
    nothing); the median µs by which a call's first start precedes the previous call's
    last end; the SM clock in GHz."""
    stamps = stamps - stamps.flatten(0, 2).min(0).values  # in int64: float64 holds ns since 1970 to 256 ns only
    stamps = stamps[stamps[:, :, 0, 0].min(1).values.argsort()].double()  # calls in launch order
    timer, clock = stamps[..., 0], stamps[..., 1]
    start = timer[:, :, 0].min(1).values
    since = (timer - start[:, None, None])[1:] / 1e3
    ghz = ((clock[..., -1] - clock[..., 0]) / (timer[..., -1] - timer[..., 0])).median()
    own = ((clock - clock[:, :, :1]) / ghz / 1e3)[1:]
    table = torch.stack([since.min(1).values.median(0).values, since.median(1).values.median(0).values,
                         since.max(1).values.median(0).values, own.flatten(0, 1).median(0).values], dim=1)
    overlap = ((timer[:-1, :, -1].max(1).values - start[1:]) / 1e3).median()
    return table.tolist(), float(overlap), float(ghz)


def main() -> None:
    w_ups, gamma = layer_weights()
    for batch in [int(b) for b in sys.argv[1:]] or [1, 8, 64]:
        profile(batch, w_ups, gamma)


if __name__ == "__main__":
    main()
