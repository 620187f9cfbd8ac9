"""The Kimi decode stack (KimiDecoder) eager, torch.compile'd (fullgraph) and replayed
from a CUDA graph; prints a timing table and checks the three agree.

    python examples/decode_layer.py                       # tiny on CPU, kimi_k3 on CUDA
    python examples/decode_layer.py --config tiny --tp 2 --layers 6 --batch 8
    python -m kimi_ops.launch --tp 2 examples/decode_layer.py --config tiny --layers 6

Under ``kimi_ops.launch`` every rank is a process (a SymmMemGroup over gloo; ranks may
share a GPU) and rank 0 prints the table: each mode equal to eager on every rank.
"""

import argparse
import time

import torch

from kimi_ops import KimiConfig, KimiDecoder, backend, launch


def median_ms(fn, steps: int, cuda: bool) -> float:
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=["kimi_k3", "tiny"], default="kimi_k3" if cuda else "tiny")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="ranks, simulated in this process (not under kimi_ops.launch)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    group = launch.group_from_env()  # one process per rank, under kimi_ops.launch
    device = group.device if group else "cuda" if cuda else "cpu"
    config = getattr(KimiConfig, args.config)()

    def build():
        return KimiDecoder(config, args.layers, tp=group or args.tp, seed=0, device=device)

    x = torch.randn(args.batch, config.hidden, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    tp = group.tp if group else args.tp
    eager = build()
    want = eager(x)
    rows = [("eager", median_ms(lambda: eager(x), args.steps, cuda), True)]

    start = time.perf_counter()
    module = build()
    compiled = torch.compile(module, fullgraph=True)
    compiled(x)  # compiles; ranks of a group finish at different times, beyond the barrier's bound:
    module.reset()  # re-arm, clear what that skew may have flagged (a no-op after a clean step)
    same = torch.equal(compiled(x), want)
    print(f"compile: {time.perf_counter() - start:.1f} s")
    rows.append(("torch.compile (fullgraph)", median_ms(lambda: compiled(x), args.steps, cuda), same))

    if cuda:
        graphed, static_x = build(), x.clone()
        graphed(static_x)  # warm-up call outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = graphed(static_x)
        graph.replay()
        rows.append(("CUDA graph replay", median_ms(graph.replay, args.steps, cuda), torch.equal(static_out, want)))

    if group:  # every rank's verdicts, rank 0's times
        import torch.distributed as dist

        verdicts = [None] * group.tp
        dist.all_gather_object(verdicts, [equal for _, _, equal in rows])
        rows = [(name, ms, all(v[i] for v in verdicts)) for i, (name, ms, _) in enumerate(rows)]
    agree = all(equal for _, _, equal in rows)
    if not group or group.rank == 0:
        kernels = ", ".join(sorted(backend.KERNELS)) if cuda and backend.selected() != "reference" else "none"
        ranks = f"{tp} processes" if group else "simulated in one process"
        print(f"{args.config}, {args.layers} layers, TP{tp} ({ranks}), B={args.batch}, {device}; CuTe kernels: {kernels}")
        print(f"{'mode':28s} {'ms/step':>9s}  equal to eager{' (every rank)' if group else ''}")
        for name, ms, equal in rows:
            print(f"{name:28s} {ms:9.2f}  {equal}")
    if group:
        launch.finish(0 if agree else 1)
    if not agree:
        raise SystemExit("modes disagree")


if __name__ == "__main__":
    main()
