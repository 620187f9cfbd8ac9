"""The routed experts' stand-in kernel (kernels/experts.py) by cluster size: median µs per
call of ``kimi::routed_experts``'s kernel, CUDA-graph replayed, each call on its own
routing (16 distinct experts a token, so the experts a call reads are mostly not in L2),
against the floor of the distinct experts' bytes; with ``--composites`` also the op's
reference on the GPU (eager: the plain PyTorch composite, FP64 einsums over the gathered
experts) and ``torch.compile`` of it, on the same routings. The torch forms of the stand-in are in
benchmarks/NOTES.md ("Torch forms of the stand-in experts"): none comes near the floor.

    python -m benchmarks.bench_experts [--batches 1 8 64] [--clusters 1 8] [--per-sm 1 2]
                                       [--tokens 1 4] [--spreads -1 1 2] [--shapes kimi_k3 tp8_rank]
                                       [--stream] [--composites]
"""

import argparse

import torch

import kimi_ops  # noqa: F401

from .common import floor_us, graph_us, print_table, rotating

SHAPES = {"kimi_k3": (3584, 16, 896), "tp8_rank": (512, 16, 112)}  # (L, I, E): a TP8 rank's E/8 experts
CALLS = 20


def measure(batches, clusters, shapes, per_sms=(0,), tokens_list=(0,), spreads=(0,), composites=False,
            stream=False) -> list[tuple]:
    """Columns: every (C, CTAs an SM, T, spread) of the lists (0: the call's own, call_plan's;
    a bare letter in the header; spread −1: a cluster a pair, s > 0: by expert, s CTAs an
    expert), then (``stream``) the streamed form, then (``composites``) eager and compiled."""
    from kimi_ops.kernels.experts import host as experts
    from kimi_ops.kernels.launch import multiprocessors
    from kimi_ops.kernels.experts import plan as experts_plan
    from kimi_ops.ops.experts import routed_experts as composite

    torch._dynamo.config.cache_size_limit = 64  # a graph per (shape, batch): more than the default 8
    compiled = torch.compile(composite, dynamic=False)

    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for name in shapes:
        width, intermediate, count = SHAPES[name]
        gate_up = (torch.randn(count, 2 * intermediate, width, device="cuda", generator=gen) * width**-0.5).bfloat16()
        down = (torch.randn(count, width, intermediate, device="cuda", generator=gen) * intermediate**-0.5).bfloat16()
        per_expert = (gate_up[0].numel() + down[0].numel()) * 2
        for batch in batches:
            latent = torch.randn(batch, width, device="cuda", generator=gen).bfloat16()
            routings = [torch.stack([torch.randperm(count, device="cuda", generator=gen)[:16] for _ in range(batch)])
                        .int().view(-1) for _ in range(CALLS)]
            out = latent.new_empty((batch * 16, width))
            unused = torch.zeros(2, dtype=torch.int64, device="cuda")  # the ready counter (read only when counted)
            error = torch.zeros(1, dtype=torch.int32, device="cuda")
            floor = floor_us(per_expert * sum(int(ids.unique().numel()) for ids in routings) / CALLS)
            times = []
            plan = experts_plan.pair_plan(width, intermediate, batch, 0, 1, count)  # the stream has its column
            _, _, pairs, by_expert = experts_plan.variants(width, intermediate)
            for cluster, per_sm, tokens, spread in ((c, p, t, s) for c in clusters for p in per_sms
                                                    for t in tokens_list for s in spreads):
                if spread > 0:
                    own = by_expert and by_expert[:3]  # by expert (T: the mma's N)
                elif spread < 0 and plan.spread:
                    own = pairs[:3]  # a cluster a pair where the call goes by expert
                else:
                    own = plan.variant[:3]
                spread = plan.spread if spread == 0 else max(spread, 0)
                if not own or (spread and (tokens or own[2]) != experts_plan.MMA_TOKENS):
                    times.append("-")  # no such variant
                    continue
                cluster, per_sm, tokens = cluster or own[0], per_sm or own[1], tokens or own[2]
                key = (width, intermediate, cluster, per_sm, tokens, spread > 0, False)
                try:
                    launch = experts.compile_routed_experts(*key)  # the adapter's cache key
                except ValueError:  # its CTA does not fit the SM share asked
                    times.append("-")
                    continue
                wave = spread > 0 or experts_plan.one_wave(batch, cluster, 0, 1)
                times.append(graph_us(rotating(lambda ids: launch(
                    latent, ids, gate_up.view(-1, width), down.view(-1, intermediate), out, unused, error, batch, 0,
                    count, count, int(wave), spread), routings), calls=CALLS))
            if stream:
                launch = experts.compile_streamed_experts(width, intermediate, False)
                times.append(graph_us(rotating(lambda ids: launch(
                    latent, ids, gate_up.view(-1, width), down.view(-1, intermediate), out, unused, error, batch, 0,
                    count, count, multiprocessors(0)), routings), calls=CALLS))
            if composites:
                for form in (composite, compiled):
                    times.append(graph_us(rotating(lambda ids: form(
                        latent, ids.view(batch, 16), gate_up, down, 0, 1), routings), calls=CALLS))
            rows.append((name, batch, *times, floor))
    columns = [f"{f'C={c}' if c else 'C'} {f'{p}/SM' if p else '-/SM'} {f'T={t}' if t else 'T'}"
               f"{'' if s == 0 else ' pairs' if s < 0 else f' E×{s}'}"
               for c in clusters for p in per_sms for t in tokens_list for s in spreads]
    print_table(rows, ("shape", "B", *columns, *(("stream",) if stream else ()),
                       *(("eager", "compiled") if composites else ()), "floor"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--clusters", type=int, nargs="+", default=[1, 0],
                        help="cluster sizes to time (0: the call's own, call_plan)")
    parser.add_argument("--per-sm", type=int, nargs="+", default=[0],
                        help="CTAs an SM holds at once (0: the call's own, call_plan)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[0],
                        help="the most of an expert's tokens a CTA serves (0: the call's own)")
    parser.add_argument("--spreads", type=int, nargs="+", default=[0],
                        help="by expert, CTAs an expert (0: the call's own; -1: a cluster a pair)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--composites", action="store_true", help="time the eager and compiled composites too")
    parser.add_argument("--stream", action="store_true", help="time the streamed form too (kernels/experts/stream.py)")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, median µs per call, CUDA-graph replay, a fresh routing each call")
    measure(args.batches, args.clusters, args.shapes, args.per_sm, args.tokens, args.spreads, args.composites,
            args.stream)


if __name__ == "__main__":
    main()
