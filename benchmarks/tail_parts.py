"""Where kimi::moe_tail's time goes between its two kernels: the op (NormFront, then the
tail), the tail alone (on xn made once) and NormFront alone, each CUDA-graph replayed with
w_up L2-cold and in bench_tail's state (after a graph of the composite). The op's
excess over the tail alone is what the front costs on the tail's path: its latency where
the tail's prefetch does not cover it, and the SMs its CTAs hold when the next call's
tail CTAs would start.

    python -m benchmarks.tail_parts [B ...]
"""

import argparse

import kimi_ops  # noqa: F401
from kimi_ops.kernels.tail import host
from kimi_ops.testing.composite import tail_composite

from .common import COPIES, activations, graph_us, layer_weights, print_table

BATCHES = (1, 8, 16, 32, 64)
FRONT, TAIL = 0, 1  # TailKernel.launches' calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", type=int, nargs="*", help=f"B (default: {' '.join(map(str, BATCHES))})")
    args = parser.parse_args(argv)
    w_ups, gamma = layer_weights()
    expanded, weights, shared = activations(1)
    graph_us(lambda: tail_composite(expanded, weights, shared, gamma, w_ups[0], 1e-6))  # bench_tail's state
    kernel, rows = host.TailKernel(), []
    for batch in args.batches or BATCHES:
        expanded, weights, shared = activations(batch)
        out = shared.new_empty((batch, w_ups[0].shape[0]))
        # one pair of launches per w_up copy, each with its own xn rows, made once for the tail alone
        launches = [kernel.launches(expanded, weights, shared, gamma, w_up, 1e-6, out) for w_up in w_ups]
        for front, _ in launches:
            front()
        turn = [0]

        def rotating(*parts):
            def call():
                for part in parts:
                    launches[turn[0] % COPIES][part]()
                turn[0] += 1
            return call

        graphs = [rotating(FRONT, TAIL), rotating(TAIL), rotating(FRONT)]
        rows.append((batch, *(graph_us(call, calls=COPIES * 4) for call in graphs)))
    print("kimi::moe_tail TP1 by kernel, median µs per call, CUDA-graph replay, L2-cold w_up")
    print_table(rows, ("B", "op", "tail alone", "front alone"))


if __name__ == "__main__":
    main()
