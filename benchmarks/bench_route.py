"""kimi::moe_route (E = 896) and kimi::situ (S = 6144) on one GPU, CUDA-graph replayed:
the CuTe kernels vs the eager PyTorch composite (the reference) and torch.compile of it.
No fused top-k routing library is installed on the benchmark machine, so no peer column.

    python -m benchmarks.bench_route
"""

import argparse

import torch

import kimi_ops  # noqa: F401
from kimi_ops.ops import route

from .common import floor_us, graph_us, print_table

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    experts, width = 896, 6144
    compiled_route = torch.compile(route.moe_route, fullgraph=True, dynamic=False)
    compiled_situ = torch.compile(route.situ, fullgraph=True, dynamic=False)
    rows = []
    for batch in BATCHES:
        logits = torch.randn(batch, experts, device="cuda")
        bias = torch.randn(experts, device="cuda") * 0.1
        gate_up = torch.randn(batch, 2 * width, device="cuda")
        rows.append((
            "moe_route", batch,
            graph_us(lambda: torch.ops.kimi.moe_route(logits, bias, 2.827, True)),
            graph_us(lambda: route.moe_route(logits, bias, 2.827, True)),
            graph_us(lambda: compiled_route(logits, bias, 2.827, True)),
            floor_us(logits.nbytes + bias.nbytes),
        ))
        rows.append((
            "situ", batch,
            graph_us(lambda: torch.ops.kimi.situ(gate_up, 1.0, 0.0)),
            graph_us(lambda: route.situ(gate_up, 1.0, 0.0)),
            graph_us(lambda: compiled_situ(gate_up, 1.0, 0.0)),
            floor_us(gate_up.nbytes + gate_up.nbytes // 4),
        ))
    print(f"{torch.cuda.get_device_name()}, median µs per call, CUDA-graph replay")
    print_table(rows, ("op", "B", "ours", "eager", "compiled", "floor"))


if __name__ == "__main__":
    main()
