"""Where the time of kimi::moe_tail goes: MoeTail's phase clock (kernels.tail.Stamps)
at TP1, CUDA-graph replayed with the weights L2-cold as in bench_tail.py. Per phase,
µs from the call's first CTA start: earliest / median / latest CTA (median over the
graph's calls), and the CTAs' median by their own SM clock from their own start.

    python benchmarks/profile_tail.py [B ...]
"""

import os
import sys

import torch

import kimi_ops  # noqa: F401
from kimi_ops.kernels import tail

sys.path.insert(0, os.path.dirname(__file__))
from bench_tail import COPIES, HIDDEN, LATENT  # noqa: E402
from timing import graph_us  # noqa: E402

CALLS = COPIES * 4


def profile(batch: int, w_ups, gamma) -> None:
    ctas = tail.plan_for(1, HIDDEN, LATENT, tail.groups_of(batch)).clusters * tail.CLUSTER
    phases = len(tail.Stamps.PHASES)
    buffers = torch.zeros(CALLS, ctas * phases * 2, dtype=torch.int64, device="cuda")
    kernel = tail.TailKernel()
    expanded = torch.randn(batch, 16, LATENT, device="cuda").bfloat16()
    weights = torch.rand(batch, 16, device="cuda").bfloat16()
    shared = torch.randn(batch, HIDDEN, device="cuda").bfloat16()
    turn = [0]

    def call():
        kernel.stamps = buffers[turn[0] % CALLS]  # each captured call stamps its own row
        kernel(expanded, weights, shared, gamma, w_ups[turn[0] % COPIES], 1e-6)
        turn[0] += 1

    us = graph_us(call, calls=CALLS)  # 3 warm-up calls, then the graph's calls from row 3 on
    order = [(3 + j) % CALLS for j in range(CALLS)]
    stamps = buffers[order].view(CALLS, ctas, phases, 2).double().cpu()
    timer, clock = stamps[..., 0], stamps[..., 1]
    start = timer[:, :, 0].min(1).values
    since = (timer - start[:, None, None]) / 1e3
    ghz = ((clock[:, :, -1] - clock[:, :, 0]) / (timer[:, :, -1] - timer[:, :, 0])).median()
    overlap = (timer[:-1, :, -1].max(1).values - start[1:]) / 1e3
    print(f"B={batch}: {us:.2f} µs per call; the next call starts {overlap.median():.2f} µs before the last CTA "
          f"ends; SM clock {ghz:.2f} GHz")
    print(f"{'phase':>14s} {'first':>7s} {'median':>7s} {'last':>7s} {'own clock':>9s}")
    for k, name in enumerate(tail.Stamps.PHASES):
        after = since[1:, :, k]
        own = ((clock[1:, :, k] - clock[1:, :, 0]) / ghz / 1e3).median()
        print(f"{name:>14s} {after.min(1).values.median():7.2f} {after.median(1).values.median():7.2f} "
              f"{after.max(1).values.median():7.2f} {own:9.2f}")


def main() -> None:
    w_ups = [torch.randn(HIDDEN, LATENT, device="cuda").bfloat16() * LATENT**-0.5 for _ in range(COPIES)]
    gamma = torch.ones(LATENT, device="cuda").bfloat16()
    for batch in [int(b) for b in sys.argv[1:]] or [1, 8, 64]:
        profile(batch, w_ups, gamma)


if __name__ == "__main__":
    main()
