"""kimi::moe_tail at TP1 (L = 3584, H = 7168) on one GPU, CUDA-graph replayed with the
weights L2-cold (each call of the graph reads its own copy of w_up; the copies exceed L2):
the CuTe kernels vs the eager PyTorch composite (BF16 cuBLAS up projection), torch.compile
of it, the library peer (cuBLAS: the up projection GEMM alone, a lower bound for any
cuBLAS-based tail) and the HBM floor (w_up + the expert rows + shared, at 4.26 TB/s).

    python -m benchmarks.bench_tail [B ...]   # default: B in BATCHES
"""

import argparse

import torch
import torch.nn.functional as F

import kimi_ops  # noqa: F401
from kimi_ops.mailbox import parities
from kimi_ops.testing.composite import tail_composite
from kimi_ops.testing.tail_boxes import TailBoxes

from .common import COPIES, HIDDEN, LATENT, activations, floor_us, graph_us, layer_weights, print_table

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def mailbox_chain(expanded, weights, shared, gamma, w_ups, calls):
    """The serving path (push, then moe_tail_serve: publish and polled tail, the decoder's
    at TP1) over TP1 boxes, ``calls`` MoE layers with rotating parities; returns one call
    per layer."""
    boxes, turn = TailBoxes(64, LATENT, HIDDEN, "cuda"), [0]

    def call():
        parity, rearm = parities(turn[0] % calls, calls)
        boxes.tail(expanded, weights, shared, gamma, w_ups[turn[0] % COPIES], 1e-6, parity, rearm, expanded.shape[0],
                   serve=True)
        turn[0] += 1

    return call


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", type=int, nargs="*", help=f"B (default: {' '.join(map(str, BATCHES))})")
    args = parser.parse_args(argv)
    compiled = torch.compile(tail_composite, fullgraph=True, dynamic=False)  # one specialized graph per batch
    w_ups, gamma = layer_weights()
    # Every column in the same state, a serving process's: on an H200 the first graphs of a
    # process run ours 0.15-0.3 µs faster at B <= 8 than after other graphs (ours' own
    # included) or a cuBLAS call, whose PDL launches come later (cause not found), so one
    # untimed graph of the composite first.
    expanded, weights, shared = activations(1)
    graph_us(lambda: tail_composite(expanded, weights, shared, gamma, w_ups[0], 1e-6))
    rows = []
    for batch in args.batches or BATCHES:
        expanded, weights, shared = activations(batch)
        turn = [0]

        def rotating(fn):
            def call():
                fn(expanded, weights, shared, gamma, w_ups[turn[0] % COPIES], 1e-6)
                turn[0] += 1
            return call

        nbytes = w_ups[0].nbytes + expanded.nbytes + 2 * shared.nbytes
        rows.append((
            batch,
            graph_us(rotating(torch.ops.kimi.moe_tail), calls=COPIES * 4),
            graph_us(mailbox_chain(expanded, weights, shared, gamma, w_ups, COPIES * 4), calls=COPIES * 4),
            graph_us(rotating(tail_composite), calls=COPIES * 4),
            graph_us(rotating(compiled), calls=COPIES * 4),
            graph_us(rotating(lambda e, w, s, g, w_up, eps: F.linear(s[:, : w_up.shape[1]], w_up)), calls=COPIES * 4),
            floor_us(nbytes),
        ))
    print(f"{torch.cuda.get_device_name()}, moe_tail TP1, median µs per call, CUDA-graph replay, L2-cold w_up")
    print("ours: kimi::moe_tail; ours serve: moe_tail_push + moe_tail_serve (publish, then poll; TP1 mailboxes)")
    print_table(rows, ("B", "ours", "ours serve", "eager", "compiled", "cuBLAS", "floor"))


if __name__ == "__main__":
    main()
