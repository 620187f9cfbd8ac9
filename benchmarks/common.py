"""CUDA-graph timing shared by the benchmarks (DESIGN §7)."""

import torch

HBM_READ_BYTES_PER_US = 4.26e6  # 4.26 TB/s, measured on the H200
L2_BYTES = 60e6  # rotate weight copies past the H200's L2 (50 MB), with margin
# The bandwidth of the floors the issues' acceptance lines are written against (issues 21, 25,
# 38: bench_layer, bench_projection, bench_stream), kept apart from the measured read above
# (floor_us, the timeline) so that those lines' floors stay the ones they were set at (1 %)
HBM_BYTES_PER_US = 4.3e6


def capture(fn, calls: int = 1, warmups: int = 3):
    """``fn`` warmed up on a side stream (first-call work stays out of the graph), then
    ``calls`` back-to-back calls captured: (the graph, the last call's result)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_us(fn, calls: int = 20, replays: int = 30) -> float:
    """Median µs per call of ``fn`` replayed from a CUDA graph of ``calls`` back-to-back
    calls (launch gaps included, host cost excluded)."""
    return replay_us(capture(fn, calls)[0], calls, replays)


def replay_us(graph, calls: int, replays: int, before=None) -> float:
    """Median µs per call of ``replays`` replays of ``graph`` (``calls`` calls); ``before()``
    runs ahead of each, untimed (bench_tp.py: the group's device barrier)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        if before is not None:
            before()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def rotating(fn, items):
    """A call of ``fn(item)`` on the next of ``items`` (weight copies past L2, routings):
    the graph captures the rotation."""
    turn = [0]

    def call():
        fn(items[turn[0] % len(items)])
        turn[0] += 1

    return call


def floor_us(nbytes: int) -> float:
    return nbytes / HBM_READ_BYTES_PER_US


def print_table(rows, columns) -> None:
    print(" ".join(f"{c:>10s}" for c in columns))
    for row in rows:
        print(" ".join(f"{v:>10.2f}" if isinstance(v, float) else f"{v!s:>10s}" for v in row))


# The tail benchmarks' shapes and inputs (bench_tail, profile_tail, tail_parts).
LATENT, HIDDEN, COPIES = 3584, 7168, 5  # 5 × 51.4 MB > the H200's L2


def layer_weights():
    """COPIES up projections (each call of a graph reads its own: L2-cold) and gamma."""
    w_ups = [torch.randn(HIDDEN, LATENT, device="cuda").bfloat16() * LATENT**-0.5 for _ in range(COPIES)]
    return w_ups, torch.ones(LATENT, device="cuda").bfloat16()


def activations(batch: int):
    """A batch's expert rows, their weights and the shared expert's rows."""
    return (
        torch.randn(batch, 16, LATENT, device="cuda").bfloat16(),
        torch.rand(batch, 16, device="cuda").bfloat16(),
        torch.randn(batch, HIDDEN, device="cuda").bfloat16(),
    )
