"""Host cost of calling a kimi op on the CPU: the plain reference function, our
``Library.define``/``impl`` registration (torch.ops.kimi.*), and the same function behind a
``torch.library.custom_op`` decorator. Tiny tensors, so the table is the per-call overhead.

    python -m benchmarks.bench_dispatch
"""

import argparse
import timeit

import torch

import kimi_ops  # noqa: F401
from kimi_ops.ops import route


@torch.library.custom_op("kimi_bench::situ", mutates_args=())
def situ_custom_op(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return route.situ(gate_up, beta, linear_beta)


def median_us(fn, number=2000, repeat=7) -> float:
    return sorted(timeit.repeat(fn, number=number, repeat=repeat))[repeat // 2] / number * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    x = torch.randn(1, 32)
    rows = [
        ("reference function (no dispatch)", lambda: route.situ(x, 1.0, 0.0)),
        ("torch.ops.kimi.situ (Library.impl)", lambda: torch.ops.kimi.situ(x, 1.0, 0.0)),
        ("torch.ops.kimi.situ.default", lambda: torch.ops.kimi.situ.default(x, 1.0, 0.0)),
        ("custom_op decorator", lambda: situ_custom_op(x, 1.0, 0.0)),
    ]
    times = [median_us(fn) for _, fn in rows]
    print(f"{'path':38s} {'µs/call':>8s} {'overhead µs':>12s}")
    for (name, _), t in zip(rows, times):
        print(f"{name:38s} {t:8.2f} {t - times[0]:12.2f}")


if __name__ == "__main__":
    main()
