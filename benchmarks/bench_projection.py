"""The decode projections on one GPU (kernels/gemm/), at every (N, K) the decoder runs
per rank at TP 1 / 2 / 8 (Kimi-K3), B in BATCHES: µs per call, CUDA-graph replayed, each
call of a graph reading its own weight copy (the copies exceed the H200's L2):

- ours: ``kimi::oproj`` / ``kimi::moe_front`` (the functional op);
- cuBLAS: ``x @ w.T`` (BF16 out);
- autotune: Inductor ``mode="max-autotune-no-cudagraphs"`` of the same matmul (slow to
  build: only with ``--autotune``);
- quack: quack-kernels' tuned GEMM (``--quack``; a bench-only extra, ``pip install -e
  '.[bench]'``), in a process of its own (benchmarks/quack_peer.py);
- ours/peer: ours over the best of cuBLAS and quack;
- floor: the weight bytes at 4.3 TB/s;
- for the publishing shapes, ``publish``: ``kimi::oproj_publish`` / ``kimi::moe_front_publish``
  into TP boxes on this GPU, against ``op+copy``: the functional op and a copy of its rows
  into every box (the reference's way).

    python -m benchmarks.bench_projection [--tp 1 2 8] [--shapes o_proj front ...] [--batches 1 8 64] [--autotune]
        [--quack] [--partitions [--compile-only]]

``--partitions``: instead, every (N, K)'s GEMM (``kimi::oproj``'s kernel) by each partition of
its weight whose grid is resident (tiles a CTA × K split, ``kernels.gemm.plan.partitions``),
the plan's marked; ``--compile-only`` compiles those variants into the kernel cache and
exits (no GPU needed: CUTE_DSL_ARCH=sm_90a; carry the cache to the device).
"""

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch

import kimi_ops  # noqa: F401
from kimi_ops.config import INDEX_DIM, INDEX_HEADS, KimiConfig
from kimi_ops.mailbox import canonical

from .common import HBM_BYTES_PER_US, L2_BYTES, graph_us, print_table, rotating

BATCHES = (1, 2, 4, 8, 16, 32, 64)
kimi = torch.ops.kimi


def projections(tp: int, config: KimiConfig | None = None) -> list[tuple[str, str, int, int, int]]:
    """(name, op, N, K, n_logits) of every projection the decoder runs on one rank
    (runtime/prepared.py): the DSA helpers (replicated: wq_a, w_head and wk as one GEMM), the
    stand-in core, o-proj, the MoE front, the shared expert's gate/up and down."""
    c = config or KimiConfig.kimi_k3()
    return [
        ("index_in", "oproj", c.q_lora + INDEX_HEADS + INDEX_DIM, c.hidden, 0),
        ("core", "oproj", c.attn_out // tp, c.q_lora, 0),
        ("o_proj", "oproj_publish", c.hidden, c.attn_out // tp, 0),
        ("front", "moe_front_publish", (c.experts + c.latent) // tp, c.hidden, c.experts // tp),
        ("gate_up", "oproj", 2 * c.shared_intermediate // tp, c.hidden, 0),
        ("down", "oproj", c.hidden, c.shared_intermediate // tp, 0),
    ]


def variants(tps=(1, 2, 8)) -> list[tuple[str, int, int, int, int]]:
    """Every distinct (op, N, K, n_logits, TP) of the decoder's projections at ``tps`` (the
    publishing ops also as their functional op; TP 0 for the functional ones)."""
    seen = []
    for tp in tps:
        for _, op, n, k, n_logits in projections(tp):
            keys = [("oproj", n, k, 0, 0)] if op == "oproj" else [
                ("oproj", n, k, 0, 0) if op == "oproj_publish" else ("moe_front", n, k, n_logits, 0),
                (op, n, k, n_logits, tp),
            ]
            seen += [key for key in keys if key not in seen]
    return seen


def compile_key(op: str, n: int, k: int, n_logits: int, tp: int, tokens: int) -> tuple:
    """kernels.gemm.host.compile_gemm's key of a variant at ``tokens``."""
    return n, k, tokens, op in ("moe_front", "moe_front_publish"), n_logits, tp


def compile_one(key: tuple) -> None:
    from kimi_ops.kernels.gemm import host

    host.compile_gemm(*key)


def prepare(jobs: int, keys=None) -> None:
    """Compile ``keys`` (compile_gemm's; by default every variant at every bucket) into the
    disk cache, ``jobs`` processes at once (one process compiles one at a time: about 1.5 s each)."""
    import concurrent.futures
    import multiprocessing

    from kimi_ops.kernels.gemm.plan import TOKEN_TILES

    keys = keys or [compile_key(*v, t) for v in variants() for t in TOKEN_TILES]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(compile_one, keys))


def resident_partitions(n: int, k: int, batch: int) -> dict[tuple[int, int], int]:
    """(tiles, split) → CTAs of every partition of an (N, K) weight whose grid is resident at
    once at ``batch``'s bucket (the plan picks among them) and whose ring fits."""
    from kimi_ops.kernels.gemm.plan import RESIDENT, GemmPlan, partitions, token_tile

    tokens, found = token_tile(batch), {}
    for (split, tiles), (ctas, _) in sorted(partitions(n, k, tokens).items()):
        try:
            GemmPlan(n, k, tokens, (tiles, split))
        except ValueError:
            continue
        if ctas <= RESIDENT[split]:
            found[tiles, split] = ctas
    return found


def partition_keys(shapes, batches) -> list[tuple]:
    """compile_gemm's keys of :func:`partition_rows`' variants."""
    from kimi_ops.kernels.gemm.plan import token_tile

    return sorted({(n, k, token_tile(b), False, 0, 0, False, None, parts)
                   for _, n, k, _ in shapes for b in batches for parts in resident_partitions(n, k, b)})


def partition_rows(name: str, n: int, k: int, tp: int, batches) -> list[tuple]:
    """``kimi::oproj``'s kernel at (N, K) by each of :func:`resident_partitions`, µs a call
    timed as :func:`measure` times it; the plan's partition marked."""
    from kimi_ops.kernels.gemm import host
    from kimi_ops.kernels.gemm.plan import partition, token_tile

    weights, calls = weight_copies(n, k)
    rows = []
    for batch in batches:
        x = torch.randn(batch, k, device="cuda").bfloat16()
        chosen = partition(n, k, token_tile(batch))
        for parts, ctas in resident_partitions(n, k, batch).items():
            variant = host.forced_variant(n, k, batch, parts)
            us = graph_us(rotating(lambda w, variant=variant: host.OprojKernel.rows(variant, x, w), weights), calls=calls)
            rows.append((f"{name}/TP{tp}", batch, "{}×{}".format(*parts), ctas, us, "*" if parts == chosen else "",
                         n * k * 2 / HBM_BYTES_PER_US))
    return rows


def weight_copies(n: int, k: int) -> tuple[list[torch.Tensor], int]:
    """Copies of an (N, K) weight that together exceed L2 (each call of a graph reads its
    own), and the calls a timing takes."""
    gen = torch.Generator(device="cuda").manual_seed(n * k)
    copies = max(2, int(L2_BYTES // (n * k * 2)) + 1)
    return [torch.randn(n, k, device="cuda", generator=gen).bfloat16() * k**-0.5 for _ in range(copies)], max(20, copies)


def boxes_for(op: str, n: int, n_logits: int, tp: int, capacity: int = 64) -> list[torch.Tensor]:
    """TP armed boxes on this GPU, as the decoder's box set shapes them."""
    if op == "oproj_publish":
        shape = (1, tp, capacity, n)
    else:
        shape = (3, 1, capacity, tp * (n - n_logits + 2 * n_logits))
    boxes = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]
    for box in boxes:
        kimi.mailbox_arm(box)
    return boxes


def functional(op: str, n_logits: int):
    """The functional op of a projection: (x, w) -> its outputs."""
    if op == "moe_front_publish":
        return lambda x, w: kimi.moe_front(x, w, n_logits)
    return kimi.oproj


def publisher(op: str, n_logits: int, boxes, rank: int = 0):
    if op == "oproj_publish":
        return lambda x, w: kimi.oproj_publish(x, w, boxes, rank)
    return lambda x, w: kimi.moe_front_publish(x, w, n_logits, boxes, 0, rank)


def copier(op: str, n_logits: int, boxes, rank: int = 0):
    """The functional op, then its rows copied into every box (what the reference does)."""
    if op == "oproj_publish":
        def call(x, w):
            rows = canonical(kimi.oproj(x, w))
            for box in boxes:
                box[0, rank, : x.shape[0]].copy_(rows)
        return call

    def call(x, w):
        logits, latent = kimi.moe_front(x, w, n_logits)
        shard = latent.shape[1]
        words = canonical(logits).view(torch.bfloat16)
        at = len(boxes) * shard + 2 * rank * n_logits
        for box in boxes:
            box[0, 0, : x.shape[0], rank * shard : (rank + 1) * shard].copy_(canonical(latent))
            box[0, 0, : x.shape[0], at : at + 2 * n_logits].copy_(words)
    return call


def measure(name, op, n, k, n_logits, tp, batches, autotune) -> list[tuple]:
    gen = torch.Generator(device="cuda").manual_seed(n * k + 1)
    weights, calls = weight_copies(n, k)
    matmul = lambda x, w: x @ w.T  # noqa: E731
    compiled = torch.compile(matmul, mode="max-autotune-no-cudagraphs", dynamic=False) if autotune else None
    rows = []
    for batch in batches:
        x = torch.randn(batch, k, device="cuda", generator=gen).bfloat16()
        row = [f"{name}/TP{tp}", batch,
               graph_us(rotating(functools.partial(functional(op, n_logits), x), weights), calls=calls),
               graph_us(rotating(functools.partial(matmul, x), weights), calls=calls),
               graph_us(rotating(functools.partial(compiled, x), weights), calls=calls) if autotune else "-",
               n * k * 2 / HBM_BYTES_PER_US]
        if op != "oproj":
            boxes = boxes_for(op, n, n_logits, tp)
            row += [graph_us(rotating(functools.partial(publisher(op, n_logits, boxes), x), weights), calls=calls),
                    graph_us(rotating(functools.partial(copier(op, n_logits, boxes), x), weights), calls=calls)]
        else:
            row += ["-", "-"]
        rows.append(tuple(row))
    return rows


def quack_column(shapes, timeout: float = 1800) -> dict:
    """{(N, K, B): quack's row (µs, its tuned config, whether its output checked) or its
    error} for the GEMM of every measured row (its shape's N, K), from
    benchmarks/quack_peer.py in a child process."""
    cases = sorted({(n, k, row[1]) for (n, k), rows in shapes for row in rows})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "quack.json")
        command = [sys.executable, "-m", "benchmarks.quack_peer", "--json", path,
                   "--cases", ",".join(f"{n}x{k}x{b}" for n, k, b in cases)]
        try:
            done = subprocess.run(command, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {case: f"no result in {timeout:.0f} s" for case in cases}
        if not os.path.exists(path):
            return {case: f"quack_peer failed: {done.stderr[-300:]}" for case in cases}
        with open(path) as f:
            found = {(r["N"], r["K"], r["B"]): r.get("error") or {key: r[key] for key in ("us", "config", "ok")}
                     for r in json.load(f)["rows"]}
    return {case: found.get(case, "no result") for case in cases}


def with_peers(shape, row, quack) -> tuple:
    """measure()'s row with quack's µs (or "error", "-" when not asked) and ours over the best
    peer after cuBLAS's; quack's tuned config last (what won: issue 38's B = 64 path)."""
    name, batch, ours, cublas, *rest = row
    peer = quack.get((*shape, batch), "-")
    if isinstance(peer, dict):
        return (name, batch, ours, cublas, peer["us"], ours / min(cublas, peer["us"]), *rest,
                peer["config"] + ("" if peer["ok"] else " (output off)"))
    return name, batch, ours, cublas, "error" if peer != "-" else "-", ours / cublas, *rest, "-"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--shapes", nargs="+", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument("--quack", action="store_true", help="quack-kernels' tuned GEMM column (pip install -e '.[bench]')")
    parser.add_argument("--prepare", type=int, default=0, help="first compile every variant in this many processes")
    parser.add_argument("--partitions", action="store_true", help="each (N, K) by every resident partition instead")
    parser.add_argument("--compile-only", action="store_true", help="--partitions: compile its variants, then exit")
    args = parser.parse_args(argv)
    if args.quack and importlib.util.find_spec("quack") is None:
        raise SystemExit("--quack needs quack-kernels: pip install -e '.[bench]'")
    if args.partitions:
        shapes = []  # each (N, K) once
        for tp in args.tp:
            for name, _, n, k, _ in projections(tp):
                if (not args.shapes or name in args.shapes) and (n, k) not in [s[1:3] for s in shapes]:
                    shapes.append((name, n, k, tp))
        if args.compile_only:
            prepare(args.prepare or os.cpu_count() or 1, partition_keys(shapes, args.batches))
            return
        print(f"{torch.cuda.get_device_name()}, median µs per call, CUDA-graph replay, L2-cold weights")
        print_table([row for name, n, k, tp in shapes for row in partition_rows(name, n, k, tp, args.batches)],
                    ("shape", "B", "tiles×split", "CTAs", "µs", "plan", "floor"))
        return
    if args.prepare:
        prepare(args.prepare)
    print(f"{torch.cuda.get_device_name()}, median µs per call, CUDA-graph replay, L2-cold weights")
    seen, shapes = set(), []
    for tp in args.tp:
        for name, op, n, k, n_logits in projections(tp):
            if args.shapes and name not in args.shapes:
                continue
            if (op, n, k, n_logits) in seen and op == "oproj":  # replicated helpers: once
                continue
            shapes.append(((n, k), measure(name, op, n, k, n_logits, tp, args.batches, args.autotune)))
            seen.add((op, n, k, n_logits))
    quack = quack_column(shapes) if args.quack else {}
    for case, result in quack.items():
        if isinstance(result, str):
            print(f"quack N×K×B = {'×'.join(map(str, case))}: {result}")
    columns = ("shape", "B", "ours", "cuBLAS", "quack", "ours/peer", "autotune", "floor", "publish", "op+copy",
               "quack's config")
    for i, (shape, rows) in enumerate(shapes):
        print_table([with_peers(shape, row, quack) for row in rows], () if i else columns)  # a blank line between


if __name__ == "__main__":
    main()
