#!/bin/bash
# The next device calls for issue 4 (written in the forty-seventh session, not yet run), each ~8-9 min on a cold
# machine, timeout 600:
#   1. `bash benchmarks/results/session47_next_sweep.sh tests`, from a checkout of main: every GPU test file
#      (scripts/gpu_check.sh, STAGES=tests). The forty-seventh session landed the decode graphs' own upload (5edffe2)
#      after only 19 GPU tests had passed beside its A/B; this runs the rest (engine, CUDA graphs, decoder layer).
#   2. `bash adhoc/sweep.sh ab` after this setup, from a checkout of main (adhoc/ is untracked, so it travels):
#        mkdir -p adhoc && for v in base chain; do mkdir adhoc/$v; git archive HEAD pagedllm benchmarks tests \
#          | tar -x -C adhoc/$v; done
#        (cd adhoc/chain && git apply ../../benchmarks/results/session47_upload_chain.patch)
#        cp benchmarks/results/session47_next_sweep.sh adhoc/sweep.sh
#      It times session47_upload_chain.patch (the upload's chain of round trips shortened) against main in the
#      engine's batch-1 step, with the uploader and engine graph tests of the patched tree beside the warm-up. Land
#      it only if it is faster in every round and those tests pass.
set -u
case "${1:-}" in
tests)
  STAGES=tests timeout -k 10 575 bash scripts/gpu_check.sh 2>&1 | tail -40
  ;;
ab)
  cd adhoc
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  tests='(cd chain && PYTHONPATH=$PWD timeout -k 5 -s KILL 250 python -m pytest -q -p no:cacheprovider -rf \
    tests/gpu/test_uploader_gpu.py tests/gpu/test_engine_gpu.py -k "uploader or cuda_graphs_equal_eager or async" \
    2>&1 | tail -4 | sed "s/^/chain: /")'
  python base/benchmarks/alternate.py --trees base chain --pattern 'GPU period ([0-9.]+) ms' \
    --rounds 4 --timeout 45 --warmup-timeout 260 --deadline 480 --warmup-with "$tests" \
    -- python benchmarks/engine_probe.py batch1 --max-num-seqs 2 2>&1 | tee $OUT/sweep.log
  for v in chain base; do  # the upload's time and the layers' start after it
    [ $SECONDS -lt 520 ] && (cd $v && PYTHONPATH=$PWD timeout -k 5 35 python benchmarks/engine_probe.py \
      batch1-kernels --max-num-seqs 2 2>&1 | grep -v -i warn | tail -8 | tee $OUT/kernels_$v.log)
  done
  echo "end after $SECONDS s"
  ;;
*)
  echo "usage: $0 tests | ab" >&2; exit 2
  ;;
esac
