"""The timeline of one replayed decode step (issue 37): for each kernel of the chain, when it
started and ended, how long it ran beside its predecessor (with PDL: its pre-wait prologue,
at most), the gaps where no kernel ran, what it adds to the step (its end past every earlier
kernel's: the column sums to the step) and its weight bytes' rate.

Kernel times are CUPTI's (torch.profiler) for the step's CUDA graph, replayed with L2
flushed before each replay; the median replay is shown. A kernel's start is its first
CTA's, its end its last CTA's (CUPTI's kernel record), so "beside" bounds the overlap from
above: CTAs waiting in griddepcontrol.wait count as running. Each kernel is labelled by an
eager step profiled the same way: the ``kimi`` op that launched it (or the aten op), the
layer of its weights, and the op call's weight bytes (routed experts: the distinct experts
routed to). Below each table, the step's parts: the seed systems' kernels, the stand-ins
(the attention core, the routed experts), AttnRes and the rest, each part's Σ adds against
its weights' floor (issue 37's "seed kernels' part of the layer"). Writes a JSON and, where
matplotlib is installed, a Gantt PNG.

``--marks`` (with KIMI_OPS_MARKS=1, compiled in: kernels/launch.py) adds what CUPTI cannot
see: for each marked kernel of the step (AttnResTake), CTA 0's phases, µs after its start
(the median replay of each), and the µs from its last mark to the grid's end (CUPTI's); and
for the fused shared expert's last launch (the last layer's, last replay), every CTA's
phases: how many CTAs stamped each, and the min / median / max µs after its first CTA's
start (where a CTA waited for an SM, for x, for the barrier).

    python -m benchmarks.timeline [--tp8-rank] [--batches 1 8 64] [--out DIR] [--marks]
"""

import argparse
import json
import os
import statistics

import torch

import kimi_ops  # noqa: F401
from kimi_ops import KimiDecoder
from kimi_ops.debug import KimiOpMode, tensors, weight_labels
from kimi_ops.kernels.launch import MARK_COUNT, MARK_FIRST, MARK_RECORD, MARK_RECORDS, MARKS, STAMP_CTAS, STAMP_FIRST

from .bench_layer import (
    LAYERS,
    ab_label,
    ab_settings,
    add_ab_options,
    apply_ab_options,
    apply_chain_options,
    config_for,
    inputs,
)
from .common import HBM_READ_BYTES_PER_US, L2_BYTES, capture, print_table

REPLAYS = 7


STAND_INS = {"oproj.w_core", "front.expert_gate_up", "front.expert_down"}  # the core's and the routed experts'


def part_of(op: str, names) -> str:
    """The step's part a ``kimi`` op call belongs to, by its op and its weights' names."""
    if op.startswith("attn_res"):
        return "AttnRes"
    return "stand-ins" if any(name in STAND_INS for name in names) else "seed kernels"


class OpLabels(KimiOpMode):
    """Wraps every ``kimi`` op call of an eager step in a profiler range named
    ``op|where|part|weight bytes`` (the layer of its weights, as kimi_ops.debug labels
    it; :func:`part_of`)."""

    def __init__(self, decoder):
        super().__init__()
        self.labels, self.where = weight_labels(decoder), "input"

    def kimi_op(self, func, args, kwargs):
        op = func._schema.name.split("::")[1]
        weights = [t for arg in args for t in tensors(arg) if t.data_ptr() in self.labels]
        if weights:
            self.where = self.labels[weights[0].data_ptr()][0]
        if op.startswith("routed_experts"):  # a batch reads the experts it routed to, each once
            _, ids, gate_up, down = args[:4]
            nbytes = int(ids.unique().numel()) * (gate_up[0].nbytes + down[0].nbytes)
        else:
            nbytes = sum(t.nbytes for t in weights)
        part = part_of(op, [self.labels[t.data_ptr()][1] for t in weights])
        with torch.profiler.record_function(f"{op}|{self.where}|{part}|{nbytes}"):
            return func(*args, **kwargs)


def trace_events(prof) -> list[dict]:
    path = f"/tmp/kimi_timeline_{os.getpid()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    return [e for e in events if e.get("ph") == "X"]


def eager_labels(decoder, hidden, slots) -> list[dict]:
    """Per kernel of an eager step, in launch order: its kernel name, its op, layer and bytes."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        with OpLabels(decoder):
            decoder(hidden, slots)
        torch.cuda.synchronize()
    events = trace_events(prof)
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"].count("|") == 3]
    aten = [e for e in events if e.get("cat") == "cpu_op"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime"
                and "correlation" in e.get("args", {})}
    labels = []
    for kernel in sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        launch = launches.get(kernel["args"].get("correlation"))
        at = launch["ts"] if launch else kernel["ts"]
        inside = [r for r in ranges if r["ts"] <= at <= r["ts"] + r["dur"]]
        if inside:
            op, where, part, nbytes = min(inside, key=lambda r: r["dur"])["name"].split("|")
        else:
            around = [e for e in aten if e["ts"] <= at <= e["ts"] + e["dur"]]
            op, where, part, nbytes = (min(around, key=lambda e: e["dur"])["name"] if around else "?"), "", "rest", "0"
        labels.append({"kernel": kernel["name"], "op": op, "where": where, "part": part, "bytes": int(nbytes)})
    return labels


def replayed(decoder, hidden, slots, marks=None) -> list[list[dict]]:
    """The step's graph replayed REPLAYS times, L2 flushed before each: per replay, its
    kernels (name, start, end in µs). ``marks``: the words whose records the replays take
    (their count zeroed first)."""
    with torch.no_grad():
        graph, _ = capture(lambda: decoder(hidden, slots), warmups=1)
    if marks is not None:
        marks[MARK_COUNT] = 0
        marks[STAMP_FIRST:] = 0
    flush = torch.empty(int(2 * L2_BYTES), dtype=torch.uint8, device=hidden.device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            flush.fill_(1)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
    events = trace_events(prof)
    graph_launches = {e["args"]["correlation"] for e in events if e.get("cat") == "cuda_runtime"
                      and "GraphLaunch" in e["name"] and "correlation" in e.get("args", {})}
    runs = {}
    for kernel in (e for e in events if e.get("cat") == "kernel"):
        correlation = kernel["args"].get("correlation")
        if correlation in graph_launches:
            runs.setdefault(correlation, []).append(
                {"kernel": kernel["name"], "start": kernel["ts"], "end": kernel["ts"] + kernel["dur"]})
    return [sorted(run, key=lambda k: k["start"]) for _, run in sorted(runs.items())]


def aligned(labels: list[dict], run: list[dict]) -> list[dict]:
    """The eager labels of a replay's kernels, matched by kernel name in order (an eager
    step launches some kernels a capture does not: the host path's checks)."""
    out, i = [], 0
    for kernel in run:
        j = next((j for j in range(i, len(labels)) if labels[j]["kernel"] == kernel["kernel"]), None)
        if j is None:
            raise RuntimeError(f"the graph's kernel {kernel['kernel'][:60]} is not in the eager step's order")
        out.append(labels[j])
        i = j + 1
    return out


def timeline(labels: list[dict], runs: list[list[dict]]) -> dict:
    """The median replay (by step time) as rows: start and end from the step's first
    kernel start, busy µs, µs beside the predecessor, the idle gap before it, the µs its end
    lies past every earlier kernel's ("adds": they sum to the step), GB/s."""
    if not runs:
        raise RuntimeError("no kernel of the graph's replays was traced")
    run = sorted(runs, key=lambda r: r[-1]["end"] - r[0]["start"])[len(runs) // 2]
    origin, reach, rows = run[0]["start"], run[0]["start"], []
    for i, (kernel, label) in enumerate(zip(run, aligned(labels, run))):
        busy = kernel["end"] - kernel["start"]
        beside = max(0.0, min(run[i - 1]["end"], kernel["end"]) - kernel["start"]) if i else 0.0
        rows.append({"op": label["op"], "where": label["where"], "part": label["part"], "kernel": kernel["kernel"],
                     "start": kernel["start"] - origin, "end": kernel["end"] - origin, "busy": busy,
                     "beside": beside, "gap": max(0.0, kernel["start"] - reach),
                     "adds": max(0.0, kernel["end"] - reach), "bytes": label["bytes"],
                     "gbs": label["bytes"] / busy / 1e3 if busy > 0 else None})
        reach = max(reach, kernel["end"])
    step = run[-1]["end"] - origin
    steps = [r[-1]["end"] - r[0]["start"] for r in runs]
    return {"rows": rows, "step_us": step, "steps_us": steps, "idle_us": sum(r["gap"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows), "median_step_us": statistics.median(steps), "parts": parts(rows)}


def marks_table(words: torch.Tensor, rows: list[dict], replays: int) -> list[dict]:
    """The replays' Marks records (kernels.values) in ``words``, a step's in launch order,
    labelled by the timeline's rows of their op: per marked launch, the median over the
    replays of each phase's µs after CTA 0's start, and about the µs from the last mark to
    the grid's end (the median replay's busy less that median span: CTA 0 starts with the
    grid, give or take its launch)."""
    from kimi_ops.kernels.values import MARKED

    count = int(words[MARK_COUNT])
    if count > MARK_RECORDS:
        raise RuntimeError(f"{count} marked launches overran the {MARK_RECORDS} records: fewer replays or batches")
    records = words[MARK_FIRST:MARK_FIRST + MARK_RECORD * count].cpu().view(torch.int64).view(count, -1).tolist()
    per_step = count // replays
    marked = [r for r in rows if any(r["op"].startswith(kernel) for kernel, _ in MARKED.values())]
    out = []
    for i in range(per_step):
        runs = records[i::per_step][:replays]
        kernel, phases = MARKED[runs[0][0]]
        times = [[(run[1 + j] - run[1]) / 1e3 for j in range(1, len(phases) + 1)] for run in runs]
        median = [statistics.median(column) for column in zip(*times)]
        row = marked[i] if i < len(marked) else {"op": kernel, "where": "?", "busy": float("nan")}
        out.append({"op": row["op"], "where": row["where"], "phases": dict(zip(phases, median)),
                    "to_grid_end": row["busy"] - median[-1]})
    return out


def stamps_table(words: torch.Tensor, phases: tuple) -> list[dict]:
    """The Stamps (kernels.values) of the last launch that stamped ``phases`` from
    STAMP_FIRST on: per phase, the CTAs that stamped it and the min / median / max µs after
    the first CTA's start (phase 0)."""
    pairs = words[STAMP_FIRST:STAMP_FIRST + STAMP_CTAS * len(phases) * 4].cpu().view(torch.int64)
    times = pairs.view(STAMP_CTAS, len(phases), 2)[:, :, 0].tolist()  # (%globaltimer, %clock64) pairs
    ctas = [row for row in times if row[0]]
    if not ctas:
        return []
    first = min(row[0] for row in ctas)
    out = []
    for k, phase in enumerate(phases):
        values = sorted((row[k] - first) / 1e3 for row in ctas if row[k])
        if values:
            out.append({"phase": phase, "ctas": len(values), "min": values[0], "median": statistics.median(values),
                        "max": values[-1]})
    return out


def print_marks(marks: list[dict]) -> None:
    """A table per kind of marked kernel: its launches' phases and drain (:func:`marks_table`)."""
    for phases in dict.fromkeys(tuple(m["phases"]) for m in marks):
        print_table([(m["op"][:18], m["where"][-10:], *m["phases"].values(), m["to_grid_end"])
                     for m in marks if tuple(m["phases"]) == phases],
                    ("op", "where", *phases, "→ grid end"))


def parts(rows: list[dict]) -> dict:
    """Per part of the step (:func:`part_of`): Σ adds (µs), the floor of its weights' bytes
    at HBM_READ_BYTES_PER_US (the H200's: an H100's ratio reads high), and their ratio
    (None without weights)."""
    out = {}
    for row in rows:
        part = out.setdefault(row["part"], {"adds_us": 0.0, "floor_us": 0.0})
        part["adds_us"] += row["adds"]
        part["floor_us"] += row["bytes"] / HBM_READ_BYTES_PER_US
    for part in out.values():
        part["ratio"] = part["adds_us"] / part["floor_us"] if part["floor_us"] else None
    return out


def short(name: str) -> str:
    """A CuTe kernel's class from its mangled name (``...tailfrontsTailFront_object...``)."""
    head = name.split("_object")[0]
    for prefix in ("kernel_cutlass_kernel_", "kernel_"):
        head = head.removeprefix(prefix)
    return head.rsplit("kernels", 1)[-1][-28:] if "kimi_ops" in head else head[:28]


def gantt(result: dict, title: str, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(12, 0.28 * len(rows) + 1.2))
    for i, row in enumerate(rows):
        ax.barh(i, row["busy"], left=row["start"], color="tab:orange" if row["beside"] > 0 else "tab:blue")
        if row["beside"] > 0:
            ax.barh(i, row["beside"], left=row["start"], color="tab:green")
    ax.set_yticks(range(len(rows)), [f"{r['op']} · {r['where']}" for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("µs from the step's first kernel (green: beside the predecessor)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tp8-rank", action="store_true", help="one TP8 rank's shard shapes (bench_layer's)")
    parser.add_argument("--expert-intermediate", type=int, default=16, help="the routed experts' width (a stand-in)")
    parser.add_argument("--out", default=".", help="where the JSON and PNGs go")
    parser.add_argument("--marks", action="store_true", help="the marked kernels' phases (KIMI_OPS_MARKS=1)")
    add_ab_options(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the timeline profiles CUDA-graph replays: it needs a GPU")
    if args.marks and not MARKS:
        raise SystemExit("--marks needs the kernels built with KIMI_OPS_MARKS=1 (set it before the run)")
    apply_ab_options(args)
    args.smoke = False
    config = config_for(args)
    name = "tp8_rank" if args.tp8_rank else "tp1"
    arm = ab_label(args)  # an A/B arm's files apart from the default's
    suffix = arm.strip().replace(" ", "_")
    decoder = KimiDecoder(config, LAYERS, tp=1, seed=0, device="cuda")
    apply_chain_options(decoder, args)
    results = {}
    for batch in args.batches:
        hidden, slots = inputs(config, batch, "cuda")
        with torch.no_grad():
            decoder(hidden, slots)  # compiles and first-call work out of the profiles
        words = decoder.boxes.marks(decoder.group.ranks[0]) if args.marks else None
        result = timeline(eager_labels(decoder, hidden, slots), replayed(decoder, hidden, slots, words))
        decoder.check()
        results[batch] = result
        title = f"kimi_k3 {name}{arm}, {LAYERS} layers, B = {batch}: step {result['step_us']:.1f} µs"
        print(f"\n{title} (median of {REPLAYS} L2-cold replays; idle {result['idle_us']:.1f} µs; "
              f"weights {result['bytes'] / 1e6:.1f} MB)")
        print_table([(r["op"][:18], r["where"][-10:], short(r["kernel"]), r["start"], r["end"], r["busy"], r["beside"],
                      r["gap"], r["adds"], "-" if r["gbs"] is None or not r["bytes"] else r["gbs"])
                     for r in result["rows"]],
                    ("op", "where", "kernel", "start", "end", "busy", "beside", "gap", "adds", "GB/s"))
        print_table([(part, v["adds_us"], v["floor_us"], "-" if v["ratio"] is None else v["ratio"])
                     for part, v in result["parts"].items()], ("part of the step", "Σ adds", "floor", "adds/floor"))
        if args.marks:
            result["marks"] = marks_table(words, result["rows"], REPLAYS)
            print_marks(result["marks"])
            from kimi_ops.kernels.gemm.shared import SHARED_PHASES  # CuTe DSL: only where the kernels run

            result["shared_stamps"] = stamps_table(words, SHARED_PHASES)
            print_table([(s["phase"], s["ctas"], s["min"], s["median"], s["max"]) for s in result["shared_stamps"]],
                        ("shared expert, last launch", "CTAs", "min", "median", "max"))
        png = os.path.join(args.out, f"timeline_{name}{'_' * bool(suffix)}{suffix}_B{batch}.png")
        if gantt(result, title, png):
            print("wrote", png)
    path = os.path.join(args.out, f"timeline_{name}{'_' * bool(suffix)}{suffix}.json")
    with open(path, "w") as f:
        json.dump({"config": name, "layers": LAYERS, "replays": REPLAYS, "device": torch.cuda.get_device_name(),
                   **ab_settings(args), "shared_last": args.shared_last, "front_apart": args.front_apart,
                   "batches": {str(b): r for b, r in results.items()}}, f, indent=1)
    print("wrote", path)
    return results


if __name__ == "__main__":
    main()
