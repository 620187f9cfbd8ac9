"""The MoE tail and the whole layer at TP2 / TP8, one process a rank (issues 26, 27):

    python -m kimi_ops.launch --tp 2 --timeout 1800 benchmarks.bench_tp [--batches 1 8 64] [--json tp2.json]

(the first run compiles every kernel variant on every rank: --timeout past the default)

Per batch, µs per call, each column a CUDA graph replayed by every rank; each replay starts
after the group's device barrier (kimi::group_barrier, its own graph), so the ranks start
together, and a row is the slowest rank's median:

- ours: the decoder's tail at this TP over symmetric-memory boxes, as KimiDecoder.forward
  runs it (moe_tail_push, moe_tail_publish, two-shot's moe_latent_reduce where the boxes
  take it, the group barriers between phases, moe_tail_poll), then the next AttnRes's take
  of the output rows (attn_res_take), parities rotating as over MoE layers;
- composite: the same tail as a serving engineer writes it on NCCL (kimi_ops.testing.composite.tail_composite:
  weighted sum, all-reduce, RMSNorm, the up projection shard through cuBLAS,
  reduce-scatter of the shared rows, all-gather of the output rows), then the same
  AttnRes (the decoder's, on the gathered rows) as ours;
- all-reduce alone, of the [B, L] partial latent: NCCL's, and torch symmetric memory's
  one-shot (torch.ops.symm_mem.one_shot_all_reduce);
- layer: KimiDecoder's whole layer at this TP (a step of ``--layers`` layers / layers);
- floor: the rank's up-projection shard at the HBM rate.

Weights rotate past L2 as in bench_tail. NCCL needs a GPU a rank (two ranks on one GPU
hang), so with fewer GPUs than ranks its columns are left out; ranks sharing a GPU need MPS
(kimi_ops.launch). Never multicast: symmetric memory here is peer stores and loads only.
"""

import argparse
import json
import math

import torch
import torch.distributed as dist

from kimi_ops import KimiConfig, KimiDecoder, launch
from kimi_ops.mailbox import parities
from kimi_ops.testing.composite import tail_composite

from .common import L2_BYTES, capture, floor_us, print_table, replay_us

BATCHES = (1, 8, 64)
REPLAYS = 20
COLUMNS = ("ours", "composite", "nccl_all_reduce", "symm_one_shot", "layer", "floor")

kimi = torch.ops.kimi


class Group:
    """This rank's side of the benchmark: the decoder (its boxes, tail weights and AttnRes
    weights), the device barrier that starts every timed replay, the NCCL group where each
    rank has a GPU of its own."""

    def __init__(self, config: KimiConfig, layers: int):
        self.group = launch.group_from_env()
        if self.group is None:
            raise SystemExit("bench_tp.py runs one process a rank: "
                             "python -m kimi_ops.launch --tp N benchmarks.bench_tp")
        self.tp, self.rank, self.device = self.group.tp, self.group.rank, self.group.device
        self.decoder = KimiDecoder(config, layers, tp=self.group, seed=0)
        own_gpus = torch.cuda.device_count() >= self.tp  # the same on every rank: new_group is collective
        self.nccl = dist.new_group(backend="nccl") if own_gpus else None

    def sync(self) -> None:
        """The device barrier, then ~25 µs of sleep: every rank's timed graph is queued
        before its start event fires (else the last rank's launch counts as its time)."""
        boxes, rank = self.decoder.boxes, self.rank
        kimi.group_barrier(boxes.peers("sync", rank), boxes.ticket(rank), boxes.error(rank), rank)
        torch.cuda._sleep(50_000)

    def everyone(self, value) -> list:
        values = [None] * self.tp
        dist.all_gather_object(values, value)
        return values

    def timed_us(self, fn, calls: int) -> float:
        """The slowest rank's median µs per call of ``fn`` (module doc)."""
        self.group.host_barrier()  # the warm-ups' polls find their peers running
        start_graph, _ = capture(self.sync, 1, warmups=1)
        mine = replay_us(capture(fn, calls)[0], calls, REPLAYS, start_graph.replay)
        reports = self.everyone((mine, int(self.decoder.boxes.error(self.rank))))
        if any(error for _, error in reports):  # on every rank: a lone raise would leave the others waiting
            raise RuntimeError(f"bench_tp: a poll found nothing (error words by rank: {[e for _, e in reports]})")
        return max(us for us, _ in reports)


def tail_inputs(config: KimiConfig, batch: int, rank: int, device):
    """This rank's expert rows [B, 16, L], their weights [B, 16], its shared expert's
    partial rows [B, H], and the AttnRes partial [B, H]."""
    gen = torch.Generator().manual_seed(100 * rank + batch)
    rand = lambda *shape: torch.randn(*shape, generator=gen).bfloat16().to(device)  # noqa: E731
    return (rand(batch, config.top_k, config.latent) * 0.3, rand(batch, config.top_k).abs() * 0.2,
            rand(batch, config.hidden), rand(batch, config.hidden))


def ours_chain(bench: Group, batch: int, inputs, w_ups, calls: int):
    """The decoder's tail (module doc) over rotating parities and w_up copies."""
    decoder, rank = bench.decoder, bench.rank
    boxes, config, error = decoder.boxes, decoder.config, decoder.boxes.error(rank)
    expanded, weights, shared, partial = inputs
    tail, moe_res = decoder.layers[0][0].tail, decoder.attn_res[0][1]
    blocks = partial.new_empty((0, batch, config.hidden))
    two_shot, turn = boxes.two_shot(batch), [0]

    def call():
        parity, rearm = parities(turn[0] % calls, calls)
        w_up = w_ups[turn[0] % len(w_ups)]
        kimi.moe_tail_push(shared, boxes.peers("rs", rank), parity, rank)
        kimi.moe_tail_publish(expanded, weights, boxes.peers("recv" if two_shot else "latent", rank), parity, rank)
        decoder.barrier()
        if two_shot:
            kimi.moe_latent_reduce(boxes.own("recv", rank), boxes.peers("gathered", rank), error, parity, rearm, batch,
                                   rank, batch)
            decoder.barrier()
        kimi.moe_tail_poll(boxes.own("gathered" if two_shot else "latent", rank), boxes.own("rs", rank), tail.gamma,
                           w_up, config.eps, boxes.peers("out", rank), error, parity, rearm, batch, rank, batch)
        decoder.barrier()
        decoder.residual_take(moe_res, boxes.own("out", rank), blocks, partial, batch, error)
        turn[0] += 1

    return call


def symm_one_shot(bench: Group, batch: int, latent: int):
    """torch symmetric memory's one-shot all-reduce of a [B, L] buffer (None where this
    torch or this placement does not run it)."""
    import torch.distributed._symmetric_memory as symm_mem

    name, why = dist.group.WORLD.group_name, None
    try:
        buffer = symm_mem.empty((batch, latent), dtype=torch.bfloat16, device=bench.device)
        symm_mem.rendezvous(buffer, name)
        buffer.zero_()
    except Exception as error:  # noqa: BLE001 (any failure: the column is left out on every rank)
        why = error
    if any(bench.everyone(why is not None)):  # agreed before any rank enters the op's barrier
        return None
    call = lambda: torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", name)  # noqa: E731
    call()
    torch.cuda.synchronize()
    return call


def measure(bench: Group, batch: int) -> dict:
    decoder, config = bench.decoder, bench.decoder.config
    decoder.reset()  # the last step's rows (another batch's, another parity sequence) re-armed
    tail, moe_res = decoder.layers[0][0].tail, decoder.attn_res[0][1]
    copies = max(2, math.ceil(L2_BYTES / tail.w_up.nbytes) + 1)
    w_ups = [tail.w_up] + [tail.w_up.clone() for _ in range(copies - 1)]
    # whole rotations (each replay reads every copy once in turn), a count of MoE layers
    # whose parities do not collide (≡ 1 mod 3)
    calls = next(k * copies for k in range(4, 8) if k * copies % 3 != 1)
    inputs = tail_inputs(config, batch, bench.rank, bench.device)
    row = dict.fromkeys(COLUMNS)
    row["B"], row["floor"] = batch, floor_us(tail.w_up.nbytes)
    row["ours"] = bench.timed_us(ours_chain(bench, batch, inputs, w_ups, calls), calls)
    if bench.nccl is not None:
        expanded, weights, shared, partial = inputs
        blocks, turn = partial.new_empty((0, batch, config.hidden)), [0]

        def composite_call():
            w_up = w_ups[turn[0] % copies]
            rows = tail_composite(expanded, weights, shared, tail.gamma, w_up, config.eps, bench.nccl)
            decoder.residual(moe_res, blocks, partial, rows[None])
            turn[0] += 1

        row["composite"] = bench.timed_us(composite_call, calls)
        zeros = torch.zeros(batch, config.latent, device=bench.device).bfloat16()  # in place: stays finite
        row["nccl_all_reduce"] = bench.timed_us(lambda: dist.all_reduce(zeros, group=bench.nccl), 20)
    one_shot = symm_one_shot(bench, batch, config.latent)
    if one_shot is not None:
        row["symm_one_shot"] = bench.timed_us(one_shot, 20)
    hidden = torch.randn(batch, config.hidden, generator=torch.Generator().manual_seed(batch)).bfloat16()
    hidden, slots = hidden.to(bench.device), torch.arange(batch, device=bench.device)
    with torch.no_grad():
        row["layer"] = bench.timed_us(lambda: decoder(hidden, slots), 5) / decoder.num_layers
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (the layer column: a step / layers)")
    parser.add_argument("--expert-intermediate", type=int, default=16)
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args(argv)
    config = KimiConfig.kimi_k3(expert_intermediate=args.expert_intermediate, capacity=max(64, *args.batches))
    bench = Group(config, args.layers)
    rows = [measure(bench, batch) for batch in args.batches]
    if bench.rank == 0:
        print(f"{torch.cuda.get_device_name()}, TP{bench.tp} ({torch.cuda.device_count()} GPUs), kimi_k3, "
              "µs per call, CUDA-graph replay, the slowest rank's median")
        print_table([[row["B"], *(row[c] if row[c] is not None else "-" for c in COLUMNS)] for row in rows],
                    ("B", *COLUMNS))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tp": bench.tp, "gpus": torch.cuda.device_count(), "rows": rows}, f, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    main()
    launch.finish()
