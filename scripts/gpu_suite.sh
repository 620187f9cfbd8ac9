#!/usr/bin/env bash
# The GPU test suite as parallel pytest processes, one per heavy file: the kernels' first
# compiles are CPU-bound, so on 16 cores the suite takes ~9 minutes instead of > 15 (test_ops,
# test_mailbox_errors, test_kernels and test_runtime apart too: the rest with test_runtime ran
# past 500 s under the others' load, 275 s alone). Then the multi-process TP groups
# (tests/test_multiprocess.py) alone, under MPS: started here where nvidia-cuda-mps-control
# exists and none runs, stopped at the end (the ranks inherit this shell's environment:
# CuTe DSL must be importable in it, not only in pytest's process).
# Logs and exit codes go to ${OUT:-/tmp/gpu_suite}; each test's name and verdict as it ends (-v), so a
# group cut by its limit still names its failures (the tracebacks come at the end).
# The parallel groups take up to T and the multi-process groups ~2 minutes after them: on a
# device whose calls end at 600 s, run them as two calls (the second finds the first's kernels
# in the machine's cache):
#   bash scripts/gpu_suite.sh                  # every group; per-group limit: T=540 seconds
#   T=480 bash scripts/gpu_suite.sh parallel   # every group but multiprocess; then: bash scripts/gpu_suite.sh multiprocess
#   bash scripts/gpu_suite.sh runtime rest     # only these groups (multiprocess is one)
set -u
OUT=${OUT:-/tmp/gpu_suite}; T=${T:-540}; mkdir -p "$OUT"; : > "$OUT/rc.txt"
heavy=(experts_kernels attn_res_kernels tail_kernels gpu gpu_guard gemm_kernels dsa_kernels ops mailbox_errors kernels runtime)
wanted=" ${*:-${heavy[*]} rest multiprocess} "
[[ $wanted == *" parallel "* ]] && wanted="$wanted ${heavy[*]} rest "
run() {
  name=$1; shift
  timeout "$T" python3 -m pytest -v --tb=short -rf -p no:cacheprovider "$@" --durations=8 > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/rc.txt"
}
ignores=(--ignore=tests/test_multiprocess.py)
for f in "${heavy[@]}"; do
  ignores+=("--ignore=tests/test_$f.py")
  [[ $wanted == *" $f "* ]] && run "$f" "tests/test_$f.py" &
done
[[ $wanted == *" rest "* ]] && run rest tests "${ignores[@]}" &
wait
if [[ $wanted == *" multiprocess "* ]]; then
  started=0
  if command -v nvidia-cuda-mps-control > /dev/null && [ ! -e "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control" ]; then
    nvidia-cuda-mps-control -d && started=1
  fi
  run multiprocess -x tests/test_multiprocess.py  # -x: a failed group's report before the limit can cut it
  [ "$started" = 1 ] && echo quit | nvidia-cuda-mps-control
fi
cat "$OUT/rc.txt"
for f in "$OUT"/*.log; do echo "== $f"; tail -n 2 "$f"; done
! grep -qv "rc=0$" "$OUT/rc.txt"  # the exit status: 0 when every group passed
