"""benchmarks/bench_tp.py's composite on the CPU: the NCCL tail a serving engineer writes
(kimi_ops.testing.composite.tail_composite with a group), here over a gloo group of two processes, against the
TP1 composite. Rank 1 holds zero expert weights and zero shared rows, so the all-reduce
and the reduce-scatter give rank 0's values exactly and the TP2 rows must be the TP1 rows
of rank 0's inputs (up to the CPU GEMM's blocking over the row shards: BF16 tolerance); a
wrong reduce-scatter layout or all-gather order moves whole column blocks."""

import pathlib

import torch

from kimi_ops import launch
from kimi_ops.testing.composite import tail_composite

BATCH, LATENT, HIDDEN = 3, 64, 48


def rank_inputs():
    gen = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()  # noqa: E731
    return (rand(BATCH, 16, LATENT), rand(BATCH, 16).abs(), rand(BATCH, HIDDEN), rand(LATENT) * 0.1 + 1,
            rand(HIDDEN, LATENT) * LATENT**-0.5)


WORKER = f"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import test_bench_tp as t
from kimi_ops.testing.composite import tail_composite
dist.init_process_group("gloo")
rank, tp = dist.get_rank(), dist.get_world_size()
expanded, weights, shared, gamma, w_up = t.rank_inputs()
if rank:
    weights, shared = torch.zeros_like(weights), torch.zeros_like(shared)
shard = w_up.shape[0] // tp
out = tail_composite(expanded, weights, shared, gamma, w_up[rank * shard:(rank + 1) * shard], 1e-6, dist.group.WORLD)
torch.save(out, os.path.join(sys.argv[1], f"rank{{rank}}.pt"))
dist.barrier()
os._exit(0)
"""


def test_tp2_composite_equals_tp1_on_one_ranks_inputs(tmp_path):
    codes = launch.spawn(2, ["-c", WORKER, str(tmp_path)], timeout=120, grace=5)
    assert codes == [0, 0]
    want = tail_composite(*rank_inputs(), 1e-6)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == (BATCH, HIDDEN)
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
