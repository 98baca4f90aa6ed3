#!/usr/bin/env bash
# `make gpu-check`: on the GPU machine as it is (its own python3; no network, no pip): the GPU tests, then
# the kernel benchmarks. Full logs and JSON go under $OUT when set (else benchmarks/results/latest).
# The tests run as parallel processes, one per file (compiling Triton and CUDA kernels is CPU-bound and the
# machine has cores to spare), the long ones spread over pytest-xdist workers where it is installed, else the
# Triton grid in three shards; the benchmarks run after them, alone on the GPU. STAGES picks a subset: tests,
# bench (default both: 6 min on an H100 machine that had run it once, its kernels compiled; on a fresh one the
# engine file alone took 7.6 min, and a device call runs 10 at most).
source "$(dirname "$0")/env.sh"
STAGES=${STAGES:-tests bench}
has() { [[ " $STAGES " == *" $1 "* ]]; }
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
pids=()
run_tests() {  # log name, then pytest arguments
  local name=$1; shift
  $PY -m pytest -q -p no:cacheprovider --durations=5 "$@" > "$OUT/$name.log" 2>&1 &
  pids+=($!)
}
workers() {  # pytest-xdist arguments for N > 1 workers, or nothing without xdist
  [ "$1" -gt 1 ] && $PY -c "import xdist" 2>/dev/null && echo "-n $1"
}
if has tests; then
  # Compile time dominates the kernel tests (Triton decode took 9 min in one process), which need little GPU
  # memory; the engine's models do (with three engine workers as well, the GPU's 80 GB ran out).
  declare -A spread=([test_decode_layer_gpu]=2)
  for f in tests/gpu/test_*.py; do
    name=$(basename "$f" .py)
    [ "$name" = test_triton_gpu ] && continue
    run_tests "$name" $(workers "${spread[$name]:-1}") "$f"
  done
  if [ -n "$(workers 6)" ]; then
    run_tests test_triton_gpu $(workers 6) tests/gpu/test_triton_gpu.py
  else
    for shard in decode prefill reshape; do
      run_tests "test_triton_gpu_$shard" tests/gpu/test_triton_gpu.py -k "$shard"
    done
  fi
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
fi
if has bench; then
  $PY benchmarks/kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels.log" || status=1
fi
echo
echo "== summary =="
for log in "$OUT"/test_*.log; do [ -f "$log" ] && echo "$(basename "$log" .log): $(tail -n 1 "$log")"; done
[ -f "$OUT/kernels.log" ] && sed -n '/^|/p' "$OUT/kernels.log"
exit $status
