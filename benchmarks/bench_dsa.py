"""The DSA indexer front and key insert on one GPU (kernels/dsa.py), B in BATCHES: median µs
per call, CUDA-graph replayed, every call of a graph on its own wq_b copy (the copies
exceed the H200's L2):

- ours: ``kimi::dsa_index_front`` with raw rows (q_norm_w given: the decoder's mode) and
  with normalized rows; ``kimi::dsa_index_key_insert`` on its own;
- eager: the same maths as a plain PyTorch composite (:func:`front_composite`,
  :func:`key_composite`: FP32 / BF16 torch ops, cuBLAS for the projection);
- compiled: ``torch.compile`` of that composite, graph-replayed like ours;
- floor: the bytes each must read (wq_b; the key rows and cache rows) at the measured
  HBM read bandwidth (timing.HBM_READ_BYTES_PER_US).

    python -m benchmarks.bench_dsa [--batches 1 4 8 16 32 64] [--prepare] [--ours-only]

``--ours-only`` skips the composites (their torch.compile takes a minute): for A/B runs of
the kernels.
"""

import argparse

import torch

import kimi_ops  # noqa: F401
from kimi_ops.testing.composite import front_composite, key_composite

from .common import L2_BYTES, floor_us, graph_us, print_table, rotating

BATCHES = (1, 4, 8, 16, 32, 64)
HEADS, DIM, K = 32, 128, 1536
EPS = 1e-6
kimi = torch.ops.kimi


def inputs(batch, device="cuda", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed + batch)
    rows = torch.randn(batch, K, device=device, generator=gen).bfloat16()
    head_in = torch.randn(batch, HEADS, device=device, generator=gen).bfloat16()
    q_norm_w = (1 + 0.1 * torch.randn(K, device=device, generator=gen)).bfloat16()
    k_in = torch.randn(batch, DIM, device=device, generator=gen).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(DIM, device=device, generator=gen)).bfloat16()
    norm_b = (0.1 * torch.randn(DIM, device=device, generator=gen)).bfloat16()
    return rows, head_in, q_norm_w, k_in, norm_w, norm_b


def measure(batches, ours_only=False) -> list[tuple]:
    gen = torch.Generator(device="cuda").manual_seed(23)
    copies = int(L2_BYTES // (HEADS * DIM * K * 2)) + 1
    weights = [(torch.randn(HEADS * DIM, K, device="cuda", generator=gen) * K**-0.5).bfloat16() for _ in range(copies)]
    calls = max(20, copies)
    torch._dynamo.config.cache_size_limit = 64  # a graph per (batch, mode): more than the default 8
    compiled_front = torch.compile(front_composite, dynamic=False)
    compiled_key = torch.compile(key_composite, dynamic=False)
    rows_out = []

    def timed(call, composite=False, **kw):
        return "-" if composite and ours_only else graph_us(call, **kw)

    for batch in batches:
        rows, head_in, q_norm_w, k_in, norm_w, norm_b = inputs(batch)
        slots = torch.randperm(4 * batch, device="cuda")[:batch]
        cache = torch.zeros(4 * batch, DIM + 4, dtype=torch.uint8, device="cuda")
        floor = floor_us(HEADS * DIM * K * 2 + batch * (K * 2 + HEADS * 2))
        for mode, gamma in (("raw", q_norm_w), ("normed", None)):
            rows_out.append((f"front/{mode}", batch,
                             graph_us(rotating(lambda w: kimi.dsa_index_front(rows, w, head_in, gamma, EPS), weights),
                                      calls=calls),
                             timed(rotating(lambda w: front_composite(rows, w, head_in, gamma, EPS), weights), True,
                                   calls=calls),
                             timed(rotating(lambda w: compiled_front(rows, w, head_in, gamma, EPS), weights), True,
                                   calls=calls),
                             floor))
        rows_out.append(("key_insert", batch,
                         graph_us(lambda: kimi.dsa_index_key_insert(k_in, norm_w, norm_b, EPS, cache, slots)),
                         timed(lambda: key_composite(k_in, norm_w, norm_b, EPS, cache, slots), True),
                         timed(lambda: compiled_key(k_in, norm_w, norm_b, EPS, cache, slots), True),
                         floor_us(batch * (DIM * 2 + 8 + 2 * (DIM + 4)))))
        print_table(rows_out[-3:], () if batch != batches[0] else ("op", "B", "ours", "eager", "compiled", "floor"))
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--prepare", action="store_true", help="compile every bucket of both modes first")
    parser.add_argument("--ours-only", action="store_true", help="skip the eager and compiled composites")
    args = parser.parse_args()
    from kimi_ops import backend

    if args.prepare:
        backend.prepare("dsa_index_front", K, args.batches)
        backend.prepare("dsa_index_key_insert")
    print(f"{torch.cuda.get_device_name()}, median µs per call, CUDA-graph replay, L2-cold wq_b")
    measure(args.batches, args.ours_only)


if __name__ == "__main__":
    main()
