"""``python -m kimi_ops.prepare``: compile every kernel a decoder of these shapes will load
into the on-disk kernel cache, in parallel processes, ahead of serving (a decoder built
later loads them: no compile on the serving path).

    python -m kimi_ops.prepare --config kimi_k3 --tp 8 --batches 1-64 [--layers 61] [--jobs 8]

The work list is what ``KimiDecoder.prepare`` asks for, collected on a 2-layer decoder of
the shapes on the CPU (every layer's kernels are alike; the residuals' by ``--layers``).
Without a GPU it compiles for ``CUTE_DSL_ARCH`` (e.g. sm_90a): the cache then serves a GPU
of that arch with the same CuTe DSL. The cache lives under ``$KIMI_OPS_CACHE_DIR``.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
from dataclasses import replace

import torch

from . import KimiConfig, KimiDecoder, backend
from .progress import Progress
from .runtime.decoder import prepare_residuals


def batch_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"--batches must be B or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def work_list(config: KimiConfig, tp: int, layers: int) -> list[tuple[str, tuple]]:
    """(build name, key) of every kernel a decoder of ``layers`` layers at TP ``tp`` takes."""
    from .kernels import compile as kernel_compile

    # no prepare on the CPU (done below); the forms a CUDA decoder takes (its fused kernels)
    decoder = KimiDecoder(config, 2, tp=tp, device="cpu", target="cuda")
    with kernel_compile.collecting() as needed:
        decoder.prepare_calls()
        prepare_residuals(config, layers, tp, decoder.buckets())
        if tp > 1:  # a process a rank: the phases' barrier (a simulated group has none)
            backend.prepare("group_barrier", tp)
    return sorted(needed, key=repr)


def start_worker(arch: str) -> None:
    os.environ["CUTE_DSL_ARCH"] = arch  # the parent's target: no CUDA context a process
    from . import kernels

    kernels.register()


def build(item: tuple[str, tuple]) -> bool:
    """Compile (or find) one kernel into the cache; True if it was cached already."""
    from .kernels import compile as kernel_compile

    seen = []
    with kernel_compile.reporting(seen.append):
        kernel_compile.BUILDS[item[0]](*item[1])
    return bool(seen and seen[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=["kimi_k3", "tiny"], default="kimi_k3")
    parser.add_argument("--tp", type=int, default=1, help="the group's TP (the kernels of one rank's shards)")
    parser.add_argument("--batches", type=batch_range, default=(1, 64),
                        help="B or LOW-HIGH: the decoder's capacity is HIGH (it prepares every bucket up to it)")
    parser.add_argument("--layers", type=int, default=2, help="the decoder's layers (its residuals' block counts)")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 16), help="compiling processes")
    args = parser.parse_args(argv)
    from . import kernels

    if not kernels.register():
        raise SystemExit("kimi_ops.prepare compiles CuTe kernels: install CuTe DSL (pip install -e '.[cute]')")
    from .kernels import compile as kernel_compile

    if not torch.cuda.is_available() and "CUTE_DSL_ARCH" not in os.environ:
        raise SystemExit("no CUDA device: set CUTE_DSL_ARCH (e.g. sm_90a) to compile for a GPU of that arch")
    config = replace(getattr(KimiConfig, args.config)(), capacity=args.batches[1])
    print(f"{args.config} TP{args.tp}, batches up to {args.batches[1]}, {args.layers} layers, for "
          f"{kernel_compile.arch()}: listing the kernels ...", flush=True)
    items = work_list(config, args.tp, args.layers)
    print(f"{len(items)} kernels into {kernel_compile.cache_dir()} with {args.jobs} processes", flush=True)
    tally = Progress(len(items))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, initializer=start_worker,
                                                initargs=(kernel_compile.arch(),)) as pool:
        for cached in pool.map(build, items):
            tally(cached)
    tally.close()


if __name__ == "__main__":
    main()
