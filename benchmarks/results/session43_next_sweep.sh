#!/bin/bash
# The next device call for issue 4 (written in the forty-third session, not yet run): the LM head's greedy kernels
# against main in the engine's batch-1 step, one 600 s call. Variants (a sed of main, or a patch):
#   pick16 - PICK_TILES 16: 149 pick programs, one wave at 80 KB of shared memory (594 now: ~2.25 waves), and an
#            argmax of 149 parts, not 594
#   tma    - session43_tma_screen.patch: the screen reads its codes as head_linear reads the head (64-row tiles through
#            the TMA, several in flight; 2374 programs instead of 18992 that each load 8 KB into registers once)
#   nopdl  - the screen launched plainly: it starts after the final norm, not beside the last down_proj phase. The
#            screen takes ~66 us in the step (session37 log) against 56 us alone: is its early start the cause?
# Setup, from a checkout of main (adhoc/ is untracked, so it travels with the call):
#   mkdir -p adhoc && for v in base pick16 tma nopdl; do mkdir adhoc/$v; git archive HEAD pagedllm benchmarks tests \
#     | tar -x -C adhoc/$v; done
#   sed -i 's/^PICK_TILES = 4 /PICK_TILES = 16 /' adhoc/pick16/pagedllm/ops/triton/greedy_head.py
#   (cd adhoc/tma && patch -p1 < ../../benchmarks/results/session43_tma_screen.patch)
#   sed -i 's/num_warps=SCREEN_WARPS, \*\*pdl.options(x))/num_warps=SCREEN_WARPS, PDL=False)/' \
#     adhoc/nopdl/pagedllm/ops/triton/greedy_head.py
#   cp benchmarks/results/session43_next_sweep.sh adhoc/sweep.sh
# then run `bash adhoc/sweep.sh` (timeout 600). Land a variant only if it is faster in every round and its GPU tests
# pass (those beside the warm-up may be cut by its limit: finish them in the next call).
cd adhoc
# beside the warm-up: tma's greedy-head and engine screened-head tests first, then the others' greedy-head tests
tests='(cd tma && PYTHONPATH=$PWD timeout -k 5 -s KILL 200 python -m pytest -q tests/gpu/test_greedy_head_gpu.py \
  tests/gpu/test_engine_gpu.py::test_screened_lm_head_gives_the_whole_heads_tokens 2>&1 | tail -2 | sed "s/^/tma: /")
  for v in pick16 nopdl; do (cd $v && PYTHONPATH=$PWD timeout -k 5 -s KILL 55 python -m pytest -q \
  tests/gpu/test_greedy_head_gpu.py 2>&1 | tail -2 | sed "s/^/$v: /"); done'
python base/benchmarks/alternate.py --trees base pick16 tma nopdl --pattern 'GPU period ([0-9.]+) ms' \
  --rounds 3 --timeout 45 --warmup-timeout 320 --deadline 500 --warmup-with "$tests" \
  -- python benchmarks/engine_probe.py batch1 --max-num-seqs 2 2>&1 | tee $OUT/sweep.log
for v in base tma; do  # the step's timeline: where the screen starts and ends against the layers and the norm
  [ $SECONDS -lt 530 ] && (cd $v && PYTHONPATH=$PWD timeout -k 5 45 python benchmarks/engine_probe.py \
    batch1-kernels --max-num-seqs 2 2>&1 | grep -v -i warn | tail -8 | tee $OUT/kernels_$v.log)
done
echo "end after $SECONDS s"
