"""A soak of the multi-process decoder (issue 39): one rank of a TP group under
``kimi_ops.launch``, STEPS graph replays at random batch sizes, a fault injected about every
FAULT_EVERY steps (the last rank skips a front publish in an eager step: every rank raises
KimiMailboxError) and ``reset()`` after it. Every healthy replay is compared with a fresh
decoder's output for its input (eager steps right after construction); the GPU memory is
sampled every 1000 steps. Rank 0 prints the table; ``--json`` writes it.

    nvidia-cuda-mps-control -d
    python -m kimi_ops.launch --tp 4 --timeout 1800 benchmarks.soak [--steps 10000] [--json soak.json]
"""

import argparse
import json
import random
import time

import torch
import torch.distributed as dist

from kimi_ops import KimiConfig, KimiDecoder, KimiMailboxError, launch

from .common import capture, print_table

CONFIG = KimiConfig.tiny(latent=256, expert_intermediate=16)  # the tail and expert kernels serve it
LAYERS, SEED, INPUTS = 6, 21, 4
BATCHES = (1, 2, 5, 8, 13, 17, 32, 64)


def inputs(batch: int, device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + batch)
    return [torch.randn(batch, CONFIG.hidden, generator=gen).bfloat16().to(device) for _ in range(INPUTS)]


def faulted(decoder, group, x) -> bool:
    """An eager step with the last rank's front publish of layer 2 skipped: True if this
    rank raised KimiMailboxError (every rank should)."""
    part = decoder.layers[2][0]
    if group.rank == group.tp - 1:
        part.front_publish = lambda x, boxes: None
    try:
        decoder(x)
        raised = False
    except KimiMailboxError:
        raised = True
    if group.rank == group.tp - 1:
        del part.front_publish
    return raised


def soak(group, steps: int, fault_every: int) -> dict:
    device = group.device
    decoder = KimiDecoder(CONFIG, LAYERS, tp=group, seed=SEED)
    xs = {b: inputs(b, device) for b in BATCHES}
    with torch.no_grad():
        want = {b: [decoder(x).clone() for x in xs[b]] for b in BATCHES}  # a fresh decoder's
    group.host_barrier()
    statics = {b: xs[b][0].clone() for b in BATCHES}
    graphs = {}
    with torch.no_grad():
        for b in BATCHES:
            graphs[b] = capture(lambda b=b: decoder(statics[b]), warmups=1)
    rng = random.Random(SEED)  # every rank draws the same steps and faults
    next_fault = rng.randint(fault_every // 2, 3 * fault_every // 2)
    counts = {"steps": 0, "healthy": 0, "equal": 0, "faults": 0, "raised": 0, "recovered": 0}
    memory, start, after_fault = [], time.perf_counter(), False
    for step in range(steps):
        counts["steps"] += 1
        if step == next_fault:
            counts["faults"] += 1
            counts["raised"] += faulted(decoder, group, xs[BATCHES[0]][0])
            decoder.reset()
            next_fault = step + rng.randint(fault_every // 2, 3 * fault_every // 2)
            after_fault = True
            continue
        batch, i = rng.choice(BATCHES), rng.randrange(INPUTS)
        statics[batch].copy_(xs[batch][i])
        graph, out = graphs[batch]
        graph.replay()
        decoder.check()
        same = torch.equal(out, want[batch][i])
        counts["healthy"] += 1
        counts["equal"] += same
        if after_fault:
            counts["recovered"] += same
            after_fault = False
        if step % 1000 == 0:
            memory.append(torch.cuda.memory_allocated(device))
    return {**counts, "seconds": time.perf_counter() - start, "memory_min": min(memory),
            "memory_max": max(memory), "max_allocated": torch.cuda.max_memory_allocated(device)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--fault-every", type=int, default=500)
    parser.add_argument("--json", help="rank 0 writes the table here")
    args = parser.parse_args(argv)
    group = launch.group_from_env()
    result = soak(group, args.steps, args.fault_every)
    results = [None] * group.tp
    dist.all_gather_object(results, result, group=group.group)
    if group.rank == 0:
        mib = 2**20
        print(f"{torch.cuda.get_device_name()}, TP{group.tp}, {LAYERS} tiny layers, batches {BATCHES}")
        print_table([(r, s["steps"], f"{s['equal']}/{s['healthy']}", f"{s['raised']}/{s['faults']}",
                      f"{s['recovered']}/{s['faults']}", s["memory_min"] / mib, s["memory_max"] / mib,
                      s["max_allocated"] / mib, s["seconds"]) for r, s in enumerate(results)],
                    ("rank", "steps", "= fresh", "raised", "recovered", "MiB min", "MiB max", "MiB peak", "s"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    launch.finish(0)


if __name__ == "__main__":
    main()
