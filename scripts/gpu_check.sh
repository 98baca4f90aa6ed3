#!/usr/bin/env bash
# `make gpu-check`: on the GPU machine as it is (its own python3; no network, no pip): the GPU tests, then
# the kernel benchmarks. Full logs and JSON go under $OUT when set (else benchmarks/results/latest).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/latest}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
$PY -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" || status=1
$PY benchmarks/kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels.log" || status=1
echo
echo "== summary =="
tail -n 1 "$OUT/gpu_tests.log"
sed -n '/^|/p' "$OUT/kernels.log"
exit $status
