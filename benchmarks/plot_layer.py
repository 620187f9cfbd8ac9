"""bench_layer's breakdown as a PNG: per op of the layer, our time against its weight floor,
one panel per batch (matplotlib; without it a clear message and exit status 1). Several
JSON files (say one run per batch) of one config make one figure.

    python -m benchmarks.plot_layer layer.json [more.json ...] [--out layer.png]
"""

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="bench_layer.py --json outputs (one config)")
    parser.add_argument("--out", help="the PNG (default: the first JSON's path with .png)")
    args = parser.parse_args(argv)
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    if len({(run["config"], run["device"]) for run in runs}) > 1:
        print("plot_layer: the JSON files are of different configs or devices", file=sys.stderr)
        return 2
    result = {**runs[0], "breakdown": {b: ops for run in runs for b, ops in run["breakdown"].items()}}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_layer needs matplotlib (pip install matplotlib); the breakdown is in the JSON and "
              "in bench_layer's printed tables", file=sys.stderr)
        return 1
    batches = list(result["breakdown"])
    fig, axes = plt.subplots(len(batches), 1, figsize=(12, 3.2 * len(batches)), squeeze=False)
    for ax, batch in zip(axes[:, 0], batches):
        ops = result["breakdown"][batch]
        names = [op["op"] + ("" if op.get("in_layer", True) else " *") for op in ops]  # *: inside a '+' row
        where = range(len(ops))
        ours = [op["us"] or 0.0 for op in ops]  # None: not timed (smoke)
        ax.bar([i - 0.2 for i in where], ours, 0.4, label="ours")
        ax.bar([i + 0.2 for i in where], [op["floor_us"] for op in ops], 0.4, label="HBM floor (weights)")
        ax.set_xticks(list(where), names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("µs per call (* not in the layer)")
        ax.set_title(f"{result['config']}, B = {batch}, {result['device']}" + (" (smoke: not timed)" if result["smoke"] else ""))
        ax.legend()
    fig.tight_layout()
    out = args.out or args.json[0].rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
