#!/usr/bin/env bash
# An A/B of a benchmark between the working tree and one or more commits, arms alternating on
# one device. The device's copy of the tree has no git history, so each baseline is archived
# here first (kimi_ops and benchmarks into the git-ignored .gpu/base/REV: carry .gpu/base),
# then run there:
#   bash scripts/ab.sh base 8d1af04 [7d38e3c …]      # here: .gpu/base holds those commits' trees
#   bash scripts/ab.sh run 2 -m benchmarks.bench_dsa --ours-only --batches 1 8 64   # device
# Each arm runs from its own tree with a kernel cache of its own (KIMI_OPS_CACHE_DIR plus
# /head or /REV: the trees' sources differ), N times each, head first, then each baseline in
# turn; logs to ${OUT:-/tmp/ab}/{head,REV}_I.txt, each arm's last lines printed. Per-run
# limit: T=300 s. bench_layer's caches can be compiled here first, without a GPU, and
# carried (.gpu/cache: the device then loads instead of compiling, ~50 s an arm; 3.4 MB an
# arm, and what travels is at most 64 MiB with .gpu/b's 47.7 MB: carry the arms that fit):
#   bash scripts/ab.sh warm --tp8-rank     # here: .gpu/cache/{head,REV} (benchmarks/warm_cache.py)
#   bash scripts/ab.sh warm --projection   # bench_projection's variants instead (~4 MB an arm)
#   KIMI_OPS_CACHE_DIR=$PWD/.gpu/cache bash scripts/ab.sh run 2 -m benchmarks.bench_layer --tp8-rank ...
set -u
case "${1:-}" in
  base)
    shift
    [ $# -ge 1 ] || { echo "usage: scripts/ab.sh base REV [REV …]"; exit 2; }
    rm -rf .gpu/base && mkdir -p .gpu/base
    for rev in "$@"; do
      short=$(git rev-parse --short "$rev") || exit 2
      mkdir -p ".gpu/base/$short"
      git archive "$rev" kimi_ops benchmarks | tar -x -C ".gpu/base/$short"
      rm -rf ".gpu/base/$short/benchmarks/results"  # plots and JSON: not needed to run, and they count against carry
      echo "$short in .gpu/base/$short"
    done
    ;;
  warm)
    shift
    root=$PWD; bases=$(cd .gpu/base 2> /dev/null && ls -d */ 2> /dev/null | tr -d /)
    for arm in head $bases; do
      tree=$root; [ "$arm" = head ] || tree=$root/.gpu/base/$arm
      (cd "$tree" && PYTHONPATH=$tree CUTE_DSL_ARCH=sm_90a KIMI_OPS_CACHE_DIR=$root/.gpu/cache/$arm \
        python3 "$root/benchmarks/warm_cache.py" "$@") || exit 1
    done
    du -sh .gpu/cache
    ;;
  run)
    runs=${2:?how many runs an arm}; shift 2
    bases=$(cd .gpu/base 2> /dev/null && ls -d */ 2> /dev/null | tr -d /)
    [ -n "$bases" ] || { echo "no .gpu/base/REV: run 'scripts/ab.sh base REV' here and carry .gpu/base"; exit 2; }
    OUT=${OUT:-/tmp/ab}; T=${T:-300}; cache=${KIMI_OPS_CACHE_DIR:-/tmp/kimi_ops_ab}; mkdir -p "$OUT"
    for i in $(seq "$runs"); do
      KIMI_OPS_CACHE_DIR=$cache/head timeout "$T" python3 "$@" > "$OUT/head_$i.txt" 2>&1
      for rev in $bases; do
        (cd ".gpu/base/$rev" && KIMI_OPS_CACHE_DIR=$cache/$rev timeout "$T" python3 "$@") > "$OUT/${rev}_$i.txt" 2>&1
      done
    done
    tail -n "${LINES_SHOWN:-8}" "$OUT"/head_*.txt $(for rev in $bases; do echo "$OUT/${rev}_"*.txt; done)
    ;;
  *)
    echo "usage: scripts/ab.sh base REV [REV …] | scripts/ab.sh warm [--tp8-rank] | scripts/ab.sh run N PYTHON_ARGS..."; exit 2
    ;;
esac
