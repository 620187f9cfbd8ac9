"""One MoE decode step of a Kimi-K3-shaped layer through the kimi ops.

    python examples/decode_step.py                 # kimi_k3 shapes, B=4, default device
    python examples/decode_step.py --config tiny --batch 16 --device cpu
"""

import argparse
import time

import torch

import kimi_ops  # noqa: F401  (registers torch.ops.kimi)
from kimi_ops.config import KimiConfig
from kimi_ops.moe import MoeWeights, moe_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=["kimi_k3", "tiny"], default="kimi_k3")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = getattr(KimiConfig, args.config)()
    print(f"config {args.config}  device {args.device}  batch {args.batch}: drawing the random weights ...", flush=True)
    began = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    weights = MoeWeights.random(config, gen, args.device)
    x = torch.randn(args.batch, config.hidden, generator=gen).bfloat16().to(args.device)
    nbytes = sum(tensor.nbytes for tensor in vars(weights).values())
    print(f"  {nbytes / 1e9:.2f} GB in {time.perf_counter() - began:.1f} s; {args.repeats} steps (the first compiles "
          "or loads the kernels on a GPU) ...", flush=True)

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = moe_step(x, weights, config)
        if out.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    for name, tensor in vars(weights).items():
        print(f"  {name:15s} {str(list(tensor.shape)):22s} {tensor.dtype}")
    print(f"input  {list(x.shape)} {x.dtype}")
    print(f"output {list(out.shape)} {out.dtype}")
    print(f"checksum {out.double().sum().item():.6f}  abs {out.double().abs().sum().item():.6f}")
    print(f"step time: median {sorted(times)[len(times) // 2] * 1e3:.1f} ms over {args.repeats}")


if __name__ == "__main__":
    main()
