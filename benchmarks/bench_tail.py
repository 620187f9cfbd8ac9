"""kimi::moe_tail at TP1 (L = 3584, H = 7168) on one GPU, CUDA-graph replayed with the
weights L2-cold (each call of the graph reads its own copy of w_up; the copies exceed L2):
the CuTe kernels vs the eager PyTorch composite (BF16 cuBLAS up projection), torch.compile
of it, the library peer (cuBLAS: the up projection GEMM alone, a lower bound for any
cuBLAS-based tail) and the HBM floor (w_up + the expert rows + shared, at 4.26 TB/s).

    python benchmarks/bench_tail.py [B ...]   # default: B in BATCHES
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kimi_ops  # noqa: F401
from kimi_ops.mailbox import parities
from kimi_ops.testing.tail_boxes import TailBoxes

sys.path.insert(0, os.path.dirname(__file__))
from timing import floor_us, graph_us, print_table  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64)
LATENT, HIDDEN, COPIES = 3584, 7168, 5  # 5 × 51.4 MB > the H200's L2


def composite(expanded, weights, shared, gamma, w_up, eps, group=None):
    """What a serving engineer writes in PyTorch: the same rounding points, BF16 GEMM.
    ``group`` (bench_tp.py: an NCCL group of the TP ranks, ``w_up`` this rank's rows): the
    partial latent all-reduced, the shared rows [B, H] reduce-scattered to this rank's
    columns, the output rows all-gathered, as every rank's output box ends."""
    partial = (expanded.float() * weights.float().unsqueeze(-1)).sum(1).bfloat16()
    if group is not None:
        dist.all_reduce(partial, group=group)
    ss = partial.float().square().bfloat16().float().sum(-1, keepdim=True)
    xn = (partial.float() * torch.rsqrt(ss / partial.shape[-1] + eps) * gamma.float()).bfloat16()
    if group is None:
        return (F.linear(xn, w_up).float() + shared.float()).bfloat16()
    tp, (batch, shard) = dist.get_world_size(group), (shared.shape[0], w_up.shape[0])
    # flat buffers, rank-major: gloo checks dim 0 (output × TP = input), NCCL only sizes
    mine = shared.new_empty((batch * shard,))
    dist.reduce_scatter_tensor(mine, shared.view(batch, tp, shard).transpose(0, 1).reshape(-1), group=group)
    out = (F.linear(xn, w_up).float() + mine.view(batch, shard).float()).bfloat16()
    rows = shared.new_empty((tp * batch * shard,))
    dist.all_gather_into_tensor(rows, out.view(-1), group=group)
    return rows.view(tp, batch, shard).permute(1, 0, 2).reshape(batch, tp * shard)


def mailbox_chain(expanded, weights, shared, gamma, w_ups, calls):
    """The serving path (push, then moe_tail_serve: publish and polled tail, the decoder's
    at TP1) over TP1 boxes, ``calls`` MoE layers with rotating parities; returns one call
    per layer."""
    boxes, turn = TailBoxes(64, LATENT, HIDDEN, "cuda"), [0]

    def call():
        parity, rearm = parities(turn[0] % calls, calls)
        boxes.tail(expanded, weights, shared, gamma, w_ups[turn[0] % COPIES], 1e-6, parity, rearm, expanded.shape[0],
                   serve=True)
        turn[0] += 1

    return call


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


def main() -> None:
    compiled = torch.compile(composite, fullgraph=True, dynamic=False)  # one specialized graph per batch
    w_ups, gamma = layer_weights()
    # Every column in the same state, a serving process's: on an H200 the first graphs of a
    # process run ours 0.15-0.3 µs faster at B <= 8 than after other graphs (ours' own
    # included) or a cuBLAS call, whose PDL launches come later (cause not found), so one
    # untimed graph of the composite first.
    expanded, weights, shared = activations(1)
    graph_us(lambda: composite(expanded, weights, shared, gamma, w_ups[0], 1e-6))
    rows = []
    for batch in [int(b) for b in sys.argv[1:]] or BATCHES:
        expanded, weights, shared = activations(batch)
        turn = [0]

        def rotating(fn):
            def call():
                fn(expanded, weights, shared, gamma, w_ups[turn[0] % COPIES], 1e-6)
                turn[0] += 1
            return call

        nbytes = w_ups[0].nbytes + expanded.nbytes + 2 * shared.nbytes
        rows.append((
            batch,
            graph_us(rotating(torch.ops.kimi.moe_tail), calls=COPIES * 4),
            graph_us(mailbox_chain(expanded, weights, shared, gamma, w_ups, COPIES * 4), calls=COPIES * 4),
            graph_us(rotating(composite), calls=COPIES * 4),
            graph_us(rotating(compiled), calls=COPIES * 4),
            graph_us(rotating(lambda e, w, s, g, w_up, eps: F.linear(s[:, : w_up.shape[1]], w_up)), calls=COPIES * 4),
            floor_us(nbytes),
        ))
    print(f"{torch.cuda.get_device_name()}, moe_tail TP1, median µs per call, CUDA-graph replay, L2-cold w_up")
    print("ours: kimi::moe_tail; ours serve: moe_tail_push + moe_tail_serve (publish, then poll; TP1 mailboxes)")
    print_table(rows, ("B", "ours", "ours serve", "eager", "compiled", "cuBLAS", "floor"))


if __name__ == "__main__":
    main()
