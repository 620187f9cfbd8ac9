"""kimi::attn_res at H = 7168 on one GPU, CUDA-graph replayed: the CuTe kernel at each
cluster size (CTAs per token) against the eager composite (the reference) and
torch.compile of it; N completed blocks, TP sublayer sources. The kernel's plan
(kernels/attn_res/plan.py) takes its cluster from this sweep (benchmarks/NOTES.md).

    python -m benchmarks.bench_attn_res [--batches 1 8 64] [--counts 0 1 4]
"""

import argparse

import torch

import kimi_ops  # noqa: F401
from kimi_ops.kernels.attn_res import host
from kimi_ops.kernels.attn_res.plan import CLUSTERS, stash_rows
from kimi_ops.ops import attn_res

from .common import graph_us, print_table

HIDDEN = 7168


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--counts", type=int, nargs="+", default=[0, 1, 4])
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64  # a compiled graph per (B, N)
    compiled = torch.compile(attn_res.attn_res, fullgraph=True, dynamic=False)
    rows = []
    for batch in args.batches:
        for count in args.counts:
            blocks = torch.randn(count, batch, HIDDEN, device="cuda").bfloat16()
            partial, sublayer = (torch.randn(batch, HIDDEN, device="cuda").bfloat16(),
                                 torch.randn(args.tp, batch, HIDDEN, device="cuda").bfloat16())
            weights = [torch.randn(HIDDEN, device="cuda").bfloat16() for _ in range(3)]
            outputs = [partial.new_empty((batch, HIDDEN)) for _ in range(3)]
            want = attn_res.attn_res(blocks, partial, sublayer, *weights, 1e-6)
            call_args = (host.block_rows(blocks, partial), partial, sublayer.view(-1, HIDDEN), *weights, *outputs,
                         count, 1e-6)
            times = []
            for cluster in CLUSTERS:
                kernel = host.compile_attn_res(HIDDEN, args.tp, cluster, stash_rows(count))
                kernel(*call_args)
                same = torch.equal(outputs[0], want[0])  # new_partial: h within ulps (the tests' bounds)
                times.append(f"{graph_us(lambda kernel=kernel: kernel(*call_args)):.2f}" + ("" if same else "≠"))
            rows.append((batch, count, *times,
                         graph_us(lambda: attn_res.attn_res(blocks, partial, sublayer, *weights, 1e-6)),
                         graph_us(lambda: compiled(blocks, partial, sublayer, *weights, 1e-6))))
    print(f"{torch.cuda.get_device_name()}, kimi::attn_res H = {HIDDEN}, TP = {args.tp}, median µs per call "
          "(≠: new_partial not bit-equal to the reference)")
    print_table(rows, ("B", "N", *(f"cluster {c}" for c in CLUSTERS), "eager", "compiled"))


if __name__ == "__main__":
    main()
