#!/usr/bin/env bash
# Engine speed visit on the GPU machine (issue 4), with its own python3: the engine GPU tests, then the
# throughput workload (with the Hugging Face baseline, and once with async scheduling off), decode latency
# against batch size (JSON + PNG) and torch.profiler step profiles at 256 and 1 running sequences.
# Everything goes under $OUT (else benchmarks/results/latest); a short table ends the output.
# STAGES picks a subset: tests, throughput, latency, profile (default: all).
source "$(dirname "$0")/env.sh"
STAGES=${STAGES:-tests throughput latency profile}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
has() { [[ " $STAGES " == *" $1 "* ]]; }
bench() { $PY -m pagedllm bench "$@" --load-format dummy; }
if has tests; then
  # pytest-xdist, where present, runs the files side by side (model loading and compiling are CPU-bound).
  xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile")
  $PY -m pytest -q -p no:cacheprovider --durations=5 $xdist tests/gpu/test_engine_gpu.py tests/gpu/test_sampler_gpu.py \
    tests/gpu/test_uploader_gpu.py tests/gpu/test_fused_gpu.py tests/gpu/test_cuda_graph_gpu.py \
    > "$OUT/engine_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/engine_tests.log"
fi
if has throughput; then
  bench throughput --disable-tqdm --hf-baseline --output "$OUT/throughput.json" > "$OUT/throughput.log" 2>&1 || status=1
  bench throughput --disable-tqdm --no-async-scheduling --output "$OUT/throughput_sync.json" > "$OUT/throughput_sync.log" 2>&1 \
    || status=1
fi
if has latency; then
  bench latency --output "$OUT/latency.json" > "$OUT/latency.log" 2>&1 || status=1
fi
if has profile; then
  for n in 256 1; do
    timeout 240 $PY benchmarks/step_profile.py --num-requests $n --out "$OUT/step_profile_$n.json" \
      > "$OUT/step_profile_$n.log" 2>&1 || status=1
  done
fi
echo "== summary =="
for f in throughput throughput_sync; do [ -f "$OUT/$f.log" ] && { echo "[$f]"; grep -E "tok/s|fraction|x HF|speed-up" "$OUT/$f.log"; }; done
[ -f "$OUT/latency.log" ] && sed -n '/^|/p' "$OUT/latency.log"
for n in 256 1; do [ -f "$OUT/step_profile_$n.log" ] && head -n 1 "$OUT/step_profile_$n.log"; done
exit $status
