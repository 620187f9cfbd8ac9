"""One rank of a multi-process TP group (tests/test_multiprocess.py starts them through
kimi_ops.launch): ``python tests/tp_worker.py SCENARIO OUTDIR``. Writes
OUTDIR/SCENARIO_RANK.json, then ends through kimi_ops.launch.finish.

- ``equal``: 6 layers, B in (1, 5, 64): eager steps and 100 replays of a captured graph
  against the simulated group's outputs (OUTDIR/expected.pt); the boxes end armed.
- ``silent``: the last rank skips its front publish in layer 2: every rank raises
  KimiMailboxError within 2 s; after reset() the next step equals the expected one.
- ``stalled``: the last rank sleeps 5 s on the host before a barrier, alive: the step
  completes on every rank (the barrier waits on a peer whose heartbeat still ticks).
- ``dead``: after a healthy step the last rank exits; the others raise within 2 s.
- ``mismatch``: rank 1 asks for another capacity: every rank gets KimiArgumentError at
  construction.
"""

import json
import pathlib
import sys
import time
import traceback

import torch

from kimi_ops import KimiArgumentError, KimiConfig, KimiDecoder, KimiMailboxError, launch
from kimi_ops.mailbox import SENTINEL, parities

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))  # a rank's process: the repo root, for benchmarks
from benchmarks.common import capture  # noqa: E402  (the side-stream warm-up, then the capture)

CONFIG = KimiConfig.tiny(latent=256, expert_intermediate=16)  # the tail and expert kernels (as test_gpu)
LAYERS, SEED, BATCHES, INPUTS, REPLAYS = 6, 21, (1, 5, 64), 4, 100
STALL = 5.0  # seconds a live rank sleeps on the host (``stalled``)


def inputs(batch: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + batch)
    return [torch.randn(batch, CONFIG.hidden, generator=gen).bfloat16() for _ in range(INPUTS)]


def armed(decoder, batch: int) -> bool:
    """Every box armed but what the step leaves by design: the last MoE layer's rows of
    its parity in the latent, shared and two-shot boxes (the next step that uses a box
    re-arms them in its first layer: BATCHES grow, so a box the step left alone holds at
    most ``batch`` such rows), and the sync box's tickets."""
    boxes, rank = decoder.boxes, decoder.group.rank
    last = parities(LAYERS - 1, LAYERS)[0]
    sentinel = lambda t: bool((t.view(torch.int32) == SENTINEL).all())  # noqa: E731
    whole = all(sentinel(boxes.own(k, rank)) for k in ("attn", "front", "out"))
    kept = [boxes.own(k, rank) for k in ("latent", "rs", "recv", "gathered") if k in boxes.kinds]
    others = [p for p in range(3) if p != last]
    return whole and all(sentinel(box[others]) and sentinel(box[last, :, batch:]) for box in kept)


def equal(group, out: pathlib.Path) -> dict:
    expected = torch.load(out / "expected.pt")
    decoder = KimiDecoder(CONFIG, LAYERS, tp=group, seed=SEED)
    result = {}
    for batch in BATCHES:
        try:
            result[batch] = equal_at(decoder, group, batch, [w.to(group.device) for w in expected[batch]])
        except Exception as error:
            error.add_note(f"rank {group.rank}, batch {batch}")
            raise
    return result


def equal_at(decoder, group, batch: int, want: list[torch.Tensor]) -> dict:
    xs = [x.to(group.device) for x in inputs(batch)]
    eager = all(torch.equal(decoder(x), w) for x, w in zip(xs, want))
    static_x = xs[0].clone()
    # A first step on a new stream pays one-time host costs (allocator pools, library
    # workspaces) that exceeded the barrier's 1 s bound at TP8 on one GPU: meet first.
    group.host_barrier()
    graph, static_out = capture(lambda: decoder(static_x), warmups=1)
    same, times = 0, []
    for i in range(REPLAYS):
        static_x.copy_(xs[i % INPUTS])
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        same += int(torch.equal(static_out, want[i % INPUTS]))
    decoder.check()
    return {"eager": eager, "replays_equal": same, "ms": sorted(times)[len(times) // 2] * 1e3,
            "armed": armed(decoder, batch)}


def faulted_step(decoder, x) -> dict:
    """One step that should fault: the KimiMailboxError's message ("" if none) and how long
    the step took to raise."""
    start = time.perf_counter()
    try:
        decoder(x)
        raised = ""
    except KimiMailboxError as error:
        raised = str(error)
    return {"raised": raised, "seconds": time.perf_counter() - start}


def silent(group, out: pathlib.Path) -> dict:
    decoder = KimiDecoder(CONFIG, LAYERS, tp=group, seed=SEED)
    x = inputs(5)[0].to(group.device)
    want = torch.load(out / "expected.pt")[5][0].to(group.device)
    healthy = torch.equal(decoder(x), want)
    if group.rank == group.tp - 1:
        decoder.layers[2][0].front_publish = lambda x, boxes: None
    fault = faulted_step(decoder, x)
    if group.rank == group.tp - 1:
        del decoder.layers[2][0].front_publish
    decoder.reset()
    return {"healthy": healthy, **fault, "recovered": torch.equal(decoder(x), want)}


def stalled(group, out: pathlib.Path) -> dict:
    """The last rank sleeps STALL seconds on the host before its third barrier, alive (its
    heartbeat ticks): every rank's step completes, equal to the expected one."""
    decoder = KimiDecoder(CONFIG, LAYERS, tp=group, seed=SEED)
    x = inputs(5)[0].to(group.device)
    want = torch.load(out / "expected.pt")[5][0].to(group.device)
    healthy = torch.equal(decoder(x), want)
    if group.rank == group.tp - 1:
        barrier, calls = decoder.barrier, []

        def slow_barrier():
            calls.append(None)
            if len(calls) == 3:
                time.sleep(STALL)
            barrier()

        decoder.barrier = slow_barrier
    start = time.perf_counter()
    try:
        same, raised = torch.equal(decoder(x), want), ""
    except KimiMailboxError as error:
        same, raised = False, str(error)
    return {"healthy": healthy, "equal": same, "raised": raised, "seconds": time.perf_counter() - start,
            "heartbeat": group.heartbeat is not None}


def dead(group, out: pathlib.Path) -> dict:
    import torch.distributed as dist

    decoder = KimiDecoder(CONFIG, LAYERS, tp=group, seed=SEED)
    x = inputs(5)[0].to(group.device)
    decoder(x)
    torch.cuda.synchronize()
    dist.barrier()
    if group.rank == group.tp - 1:
        launch.finish(0, barrier=False)  # this rank dies between steps
    time.sleep(0.5)  # let it go
    return faulted_step(decoder, x)


def mismatch(group, out: pathlib.Path) -> dict:
    config = KimiConfig.tiny(latent=256, capacity=32 if group.rank == 1 else 64)
    try:
        KimiDecoder(config, LAYERS, tp=group, seed=SEED)
        return {"raised": ""}
    except KimiArgumentError as error:
        return {"raised": str(error)}


def main() -> None:
    scenario, out = sys.argv[1], pathlib.Path(sys.argv[2])
    group = launch.group_from_env()
    try:
        result = {"ok": True, **globals()[scenario](group, out)}
    except Exception:  # with the barrier's bound in force (a timeout's first question)
        bound = "a peer's silence (heartbeat on)" if group.pulses else "fixed (no heartbeat)"
        result = {"ok": False, "error": f"{traceback.format_exc()}group barrier bound: {bound}"}
    (out / f"{scenario}_{group.rank}.json").write_text(json.dumps(result))
    launch.finish(0, barrier=scenario != "dead")


if __name__ == "__main__":
    main()
