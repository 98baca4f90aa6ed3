#!/usr/bin/env bash
# Tuning and profiling visit on the GPU machine: Nsight Compute sections of the Triton decode and prefill
# kernels on both cache layouts, a torch.profiler view of the engine's decode steps
# (benchmarks/step_profile.py) and the launch-config sweep (benchmarks/triton_tuning.py), all under $OUT.
source "$(dirname "$0")/env.sh"
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
          --section LaunchStats --section SchedulerStats"
for kind in decode prefill; do
  for layout in vllm hnd; do
    timeout 150 ncu --clock-control none -k "regex:_${kind}_kernel" -s 3 -c 1 $SECTIONS \
      $PY benchmarks/triton_tuning.py --profile $kind --layout $layout > "$OUT/ncu_${kind}_${layout}.txt" 2>&1
    grep -E "DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Duration" \
      "$OUT/ncu_${kind}_${layout}.txt" | head -8 | sed "s/^/[$kind $layout] /"
  done
done
timeout 240 $PY benchmarks/step_profile.py --out "$OUT/step_profile.json" > "$OUT/step_profile.log" 2>&1
head -n 45 "$OUT/step_profile.log"
$PY benchmarks/triton_tuning.py --out "$OUT/triton_tuning.json" 2>&1 | tee "$OUT/triton_tuning.log"
