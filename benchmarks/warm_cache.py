"""Compile, without a GPU, every kernel bench_layer's decoder loads into $KIMI_OPS_CACHE_DIR,
so that a device run of the same tree loads them instead of compiling (60 kernels, 3.5 MB,
~50 s on 16 CPU cores at the TP8 rank; on the device each arm of an A/B spent as long):

    CUTE_DSL_ARCH=sm_90a KIMI_OPS_CACHE_DIR=.gpu/cache/head python benchmarks/warm_cache.py [--tp8-rank | --projection]

``--projection``: bench_projection's variants instead (every shape, every bucket: ~4 MB).

Run as a file with the tree to warm first on PYTHONPATH (``scripts/ab.sh warm`` does it for
the working tree and each baseline): it takes only that tree's ``kimi_ops.prepare`` work
list and ``benchmarks.bench_layer.config_for``, which older trees have too.
"""

import argparse
import concurrent.futures
import multiprocessing
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--tp8-rank", action="store_true", help="bench_layer's TP8-rank shapes")
    shapes.add_argument("--projection", action="store_true", help="bench_projection's variants instead")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 16))
    args = parser.parse_args()
    from kimi_ops import kernels
    from kimi_ops.prepare import build, start_worker, work_list

    from benchmarks.bench_layer import config_for

    if not kernels.register() or "CUTE_DSL_ARCH" not in os.environ:
        raise SystemExit("warm_cache compiles CuTe kernels for CUTE_DSL_ARCH (e.g. sm_90a): set it, install CuTe DSL")
    if args.projection:
        from benchmarks.bench_projection import prepare

        prepare(args.jobs)
        print(f"bench_projection's variants in {os.environ.get('KIMI_OPS_CACHE_DIR', 'the default cache')}")
        return
    layer = argparse.Namespace(tp8_rank=args.tp8_rank, smoke=False, expert_intermediate=16)
    items = work_list(config_for(layer), 1, 2)  # bench_layer's decoder: 2 layers, TP1 mailboxes
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, initializer=start_worker,
                                                initargs=(os.environ["CUTE_DSL_ARCH"],)) as pool:
        cached = sum(pool.map(build, items))
    print(f"{len(items)} kernels in {os.environ.get('KIMI_OPS_CACHE_DIR', 'the default cache')}: {cached} were there")


if __name__ == "__main__":
    main()
