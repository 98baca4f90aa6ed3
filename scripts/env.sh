# Sourced by the GPU-machine scripts: the repository root as working directory, $OUT for logs and results
# (default benchmarks/results/latest), the checkout on PYTHONPATH, and $PY (the machine's own python3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-benchmarks/results/latest}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
