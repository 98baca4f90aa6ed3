#!/bin/bash
# The next device call for issue 4 (written in the forty-sixth session, not yet run): session46_l2_prefetch.patch (a
# side kernel pulling the next layer's weights into the L2, paced by the layer the decoder-layer kernel has reached)
# against main in the engine's batch-1 step, one call of ~450 s on a cold machine. Why it might pay: with every layer
# reading weights that sat in the L2 the forward took ~475 us against ~585 (chain-floor entry, twenty-ninth session);
# the prefetches made by the phases' own programs were slower (tenth, thirtieth and thirty-third sessions), as they
# sat on the chain and burst beside attention's loads. Here one warp a program of 16 issues them, a layer at a time.
# Setup, from a checkout of main (adhoc/ is untracked, so it travels with the call):
#   mkdir -p adhoc && for v in base pf; do mkdir adhoc/$v; git archive HEAD pagedllm benchmarks tests \
#     | tar -x -C adhoc/$v; done
#   (cd adhoc/pf && patch -p1 < ../../benchmarks/results/session46_l2_prefetch.patch)
#   cp benchmarks/results/session46_next_sweep.sh adhoc/sweep.sh
# then run `bash adhoc/sweep.sh` (timeout 600). Read "l2 prefetch: [timed out, steps]" in the sweep log: timeouts
# beyond the first steps mean the side kernel did not run beside the layers. Land it only if it is faster in every
# round and the engine's GPU tests pass (those beside the warm-up first; then test_decode_layer_gpu.py).
cd adhoc
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tests='(cd pf && PYTHONPATH=$PWD timeout -k 5 -s KILL 230 python -m pytest -q \
  tests/gpu/test_engine_gpu.py -k "screened_lm_head or half_precision" 2>&1 | tail -4 | sed "s/^/pf: /")'
python base/benchmarks/alternate.py --trees base pf --pattern 'GPU period ([0-9.]+) ms' \
  --rounds 4 --timeout 45 --warmup-timeout 260 --deadline 470 --warmup-with "$tests" \
  -- python benchmarks/engine_probe.py batch1 --max-num-seqs 2 2>&1 | tee $OUT/sweep.log
grep -h "l2 prefetch" $OUT/alternate/*.log | sort | uniq -c | tee -a $OUT/sweep.log
for v in pf base; do  # the step's timeline: the layers' span with and without the side kernel
  [ $SECONDS -lt 520 ] && (cd $v && PYTHONPATH=$PWD timeout -k 5 40 python benchmarks/engine_probe.py \
    batch1-kernels --max-num-seqs 2 2>&1 | grep -v -i warn | tail -9 | tee $OUT/kernels_$v.log)
done
echo "end after $SECONDS s"
