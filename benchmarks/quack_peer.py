"""quack-kernels' tuned GEMM (Dao-AILab/quack 0.6.5, a CuTe DSL library) as bench_projection's
peer column, in a process of its own: importing quack patches CuTe DSL process-wide, so our
kernels never run beside it.

The call is quack's own linear forward, ``gemm(x, w.t(), tuned=True, split_k=None)`` (the
[N, K] weight as its K-major (K, N) view: no copy), tuned by quack's autotuner before the
timing over its shipped SM90 configs that fit a decode shape plus swap-AB tiles with the
batch as the tile's N (not in quack's list), its split-K variants added by quack itself.
Timed as bench_projection times ours: CUDA-graph replay, each call its own weight copy past
L2. Per case a row {N, K, B, us, config, ok} or {N, K, B, error}; after a sticky CUDA error
the remaining cases are not run (each says so).

    python -m benchmarks.quack_peer --cases 7168x1536x1,7168x1536x8 --json out.json
"""

import argparse
import json

import torch

from .common import L2_BYTES, graph_us, rotating

# quack's shipped SM90 configs that fit a decode GEMM: (tile_m, tile_n, pingpong, (cluster_m, cluster_n), swap_ab)
DECODE_CONFIGS = {
    (128, 192, True, (2, 1), False),  # quack's default on SM90
    (128, 128, True, (1, 2), False),
    (128, 128, True, (2, 1), True),
    (256, 128, False, (2, 1), True),
}


def candidates(batch: int) -> list:
    from quack.gemm_config import GemmConfig, _get_sm90_configs

    picked = [c for c in _get_sm90_configs()
              if (c.tile_m, c.tile_n, c.pingpong, (c.cluster_m, c.cluster_n), c.swap_ab) in DECODE_CONFIGS]
    tile_n = 16 if batch <= 16 else 32 if batch <= 32 else 64  # swap-AB: the batch is the tile's N
    same = dict(tile_n=tile_n, cluster_m=2, cluster_n=1, swap_ab=True, device_capacity=9,
                is_dynamic_persistent=False, use_tma_gather=False)
    return picked + [GemmConfig(tile_m=128, pingpong=True, **same), GemmConfig(tile_m=64, pingpong=False, **same)]


def describe(config) -> str:
    text = f"{config.tile_m}x{config.tile_n} c{config.cluster_m}x{config.cluster_n}"
    return text + " swap" * config.swap_ab + (f" sk{config.split_k}" if config.split_k != 1 else "")


def usable() -> bool:
    """The CUDA context holds no sticky error (after one, every later call fails too)."""
    try:
        return torch.ones(1, device="cuda").add_(1).item() == 2
    except RuntimeError:
        return False


def measure(gemm, tuner, n: int, k: int, batch: int, weights) -> dict:
    from quack.autotuner import AutotuneConfig

    gen = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, k, device="cuda", generator=gen).bfloat16()
    tuner.configs = [AutotuneConfig(config=c) for c in candidates(batch)]
    out = gemm(x, weights[0].t(), tuned=True, split_k=None)  # tunes (outside the timing)
    want = x.float() @ weights[0].float().t()
    ok = bool((out.float() - want).abs().max() <= 1e-2 * want.abs().max() + 1e-3)
    call = rotating(lambda w: gemm(x, w.t(), tuned=True, split_k=None), weights)
    us = graph_us(call, calls=max(20, len(weights)))
    return {"us": us, "config": describe(tuner.best_config.kwargs["config"]), "ok": ok}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", required=True, help="NxKxB, comma separated")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",") if case]
    import quack.gemm_interface as qgi

    tuner = qgi.gemm_tuned
    tuner.cache_results = False  # no winner on disk from an earlier run
    rows, weights, shape = [], [], None
    for n, k, batch in cases:
        row = {"N": n, "K": k, "B": batch}
        if not usable():
            row["error"] = "not run: an earlier case left a sticky CUDA error"
        else:
            if shape != (n, k):
                weights, shape = [], (n, k)  # the previous shape's copies freed first
                gen = torch.Generator(device="cuda").manual_seed(n * k)
                copies = max(2, int(L2_BYTES // (n * k * 2)) + 1)
                weights = [torch.randn(n, k, device="cuda", generator=gen).bfloat16() * k**-0.5 for _ in range(copies)]
            try:
                row.update(measure(qgi.gemm, tuner, n, k, batch, weights))
            except Exception as error:  # a case's failure is its row's, not the run's
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.json, "w") as f:
        json.dump({"quack": __import__("quack").__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
