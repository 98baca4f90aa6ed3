#!/bin/bash
# The next GPU visit for issue 4: session52_mma.patch (qkv, o_proj and gate_up summed by mma.sync) against main, in one
# call of at most 600 s. Run it before session51_next.sh (the owed full tests/gpu pass, on main or on main + the patch
# if it lands). Set the trees up here first, on this machine (the device has no git):
#   rm -rf adhoc && mkdir -p adhoc/base adhoc/mma
#   git archive HEAD pagedllm benchmarks tests | tar -x -C adhoc/base
#   git archive HEAD pagedllm benchmarks tests | tar -x -C adhoc/mma
#   (cd adhoc/mma && patch -p1 < ../../benchmarks/results/session52_mma.patch)
# then: bash benchmarks/results/session52_next.sh
# Why: after each phase's wait its threads widen and multiply every weight they hold (~2 instructions an element); the
# patch has the tensor cores take the bf16 products whole. SASS (Triton 3.6, sm_90a), instructions a thread after the
# wait: qkv 327 -> 236, o_proj 273 -> 236, gate_up 532 -> 345; CTA barriers 4 / 3 / 9 -> 6 / 6 / 9; registers 56 /
# 44 / 72, no spills. The thirtieth session's ~600 fewer such instructions a layer gave 22-30 us a step; the target
# needs ~9. Beside the warm-up, the decoder-layer GPU tests on the patched tree: the tensor cores' sums have only run
# under the interpreter's emulation (tests/test_decode_layer.py), so a wrong fragment shows there first.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/session52_mma.log") 2>&1
nvidia-smi -L; date; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
test -f adhoc/mma/pagedllm/ops/triton/decode_layer.py && grep -q _mma_slice adhoc/mma/pagedllm/ops/triton/decode_layer.py \
  || { echo "set up adhoc/base and adhoc/mma first (see the top of this script)"; exit 2; }
python benchmarks/alternate.py --trees adhoc/base adhoc/mma --pattern 'GPU period ([0-9.]+) ms' --rounds 3 \
  --deadline 560 --warmup-timeout 330 --timeout 70 --log /tmp/ab \
  --warmup-with "cd adhoc/mma && PYTHONPATH=\$PWD timeout 320 python -m pytest -q -x tests/gpu/test_decode_layer_gpu.py \
    -k 'several_rows_equal or one_launch or batch_one_greedy' 2>&1 | tail -30" \
  -- python benchmarks/engine_probe.py batch1 --max-num-seqs 2 --context 16
grep -h "GPU period" /tmp/ab/*.log
tar -czf "$OUT/session52_ab_logs.tgz" -C /tmp ab
date
