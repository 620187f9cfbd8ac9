#!/usr/bin/env bash
# The session's benchmarks in one device call (about 6-9 minutes on a cold kernel cache):
# the layer at kimi_k3 TP1 and at one TP8 rank's shapes (JSON + the breakdown PNG data),
# the tail's paths, then the main example (kimi_k3, 3 layers: eager, compiled, CUDA graph). Logs and JSON go to ${OUT:-/tmp/gpu_bench}; each step has its own
# limit, so one that hangs leaves the others' results.
#   bash scripts/gpu_bench.sh            # B = 1 8 64 for the layers
set -u
OUT=${OUT:-/tmp/gpu_bench}; mkdir -p "$OUT"
step() {
  name=$1 limit=$2; shift 2
  timeout "$limit" python3 "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/rc.txt"
}
: > "$OUT/rc.txt"
step layer 180 -m benchmarks.bench_layer --batches 1 8 64 --skip-no-pdl --json "$OUT/layer.json"
step layer_tp8 120 -m benchmarks.bench_layer --tp8-rank --batches 1 8 64 --skip-no-pdl --json "$OUT/layer_tp8.json"
step tail 90 -m benchmarks.bench_tail
step example 180 examples/decode_layer.py
cat "$OUT/rc.txt"
for f in layer layer_tp8; do echo "== $f"; grep -E "^ +B |^ +(1|8|64) |routed|tail:" "$OUT/$f.log"; done
echo "== tail"; tail -n 12 "$OUT/tail.log"
echo "== example"; tail -n 8 "$OUT/example.log"
