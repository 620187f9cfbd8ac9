"""One eager decode step of bench_layer's decoder between cudaProfilerStart and Stop, so that
Nsight Compute profiles every kernel of that step and nothing before it (the compiles and
first calls run first, unprofiled):

    ncu --clock-control none --profile-from-start off --section SourceCounters --page source \\
        --print-source sass --csv python3 -m benchmarks.ncu_step --tp8-rank --batch 64 > step.csv
    python -m benchmarks.ncu_hotspots step.csv [--kernel DecodeGemm]

ncu runs the kernels one at a time (no PDL overlap): each kernel's samples are its own
work and its waits for its inputs' flags, which its predecessors set before it started.
"""

import argparse

import torch

from kimi_ops import KimiDecoder

from .bench_layer import LAYERS, config_for, inputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp8-rank", action="store_true", help="one TP8 rank's shard shapes, TP1 mailboxes")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--expert-intermediate", type=int, default=16, help="the routed experts' width (a stand-in)")
    args = parser.parse_args()
    args.smoke = False
    config = config_for(args)
    decoder = KimiDecoder(config, LAYERS, tp=1, seed=0, device="cuda")
    hidden, slots = inputs(config, args.batch, "cuda")
    with torch.no_grad():
        for _ in range(3):
            decoder(hidden, slots)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        decoder(hidden, slots)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    decoder.check()  # no kernel reported an error (a poll's bound under the profiler's replays)


if __name__ == "__main__":
    main()
