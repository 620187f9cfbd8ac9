#!/usr/bin/env bash
# An A/B of a benchmark between the working tree and a commit, arms alternating on one device.
# The device's copy of the tree has no git history, so the baseline is archived here first
# (kimi_ops and benchmarks into the git-ignored .gpu/base: carry it), then run there:
#   bash scripts/ab.sh base 8d1af04                  # here: .gpu/base holds that commit's tree
#   bash scripts/ab.sh run 2 -m benchmarks.bench_dsa --ours-only --batches 1 8 64   # device
# Each arm runs from its own tree with a kernel cache of its own (KIMI_OPS_CACHE_DIR plus
# /head or /base: the two trees' sources differ), N times each, head first; logs to
# ${OUT:-/tmp/ab}/{head,base}_I.txt, each arm's last lines printed. Per-run limit: T=300 s.
set -u
case "${1:-}" in
  base)
    rev=${2:?a commit}
    rm -rf .gpu/base && mkdir -p .gpu/base
    git archive "$rev" kimi_ops benchmarks | tar -x -C .gpu/base
    rm -rf .gpu/base/benchmarks/results  # plots and JSON: not needed to run, and they count against carry
    echo "$(git rev-parse --short "$rev") in .gpu/base"
    ;;
  run)
    runs=${2:?how many runs an arm}; shift 2
    [ -d .gpu/base/kimi_ops ] || { echo "no .gpu/base: run 'scripts/ab.sh base REV' here and carry .gpu/base"; exit 2; }
    OUT=${OUT:-/tmp/ab}; T=${T:-300}; cache=${KIMI_OPS_CACHE_DIR:-/tmp/kimi_ops_ab}; mkdir -p "$OUT"
    for i in $(seq "$runs"); do
      KIMI_OPS_CACHE_DIR=$cache/head timeout "$T" python3 "$@" > "$OUT/head_$i.txt" 2>&1
      (cd .gpu/base && KIMI_OPS_CACHE_DIR=$cache/base timeout "$T" python3 "$@") > "$OUT/base_$i.txt" 2>&1
    done
    tail -n "${LINES_SHOWN:-8}" "$OUT"/head_*.txt "$OUT"/base_*.txt
    ;;
  *)
    echo "usage: scripts/ab.sh base REV | scripts/ab.sh run N PYTHON_ARGS..."; exit 2
    ;;
esac
