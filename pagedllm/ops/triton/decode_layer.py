"""A Llama-family decoder layer as five kernel phases (or one persistent launch), for decode steps of up to
MAX_ROWS sequences (rows): every phase runs its work for each row, reusing the weight share it holds.

At batch 1 a layer ran as ~9 kernels (norm, qkv, RoPE + cache write, attention, its reduce, o_proj, norm,
gate_up, down), each streaming a few MB of weights and each paying a launch gap, a ramp to full bandwidth and
a tail: Qwen3-0.6B spent ~40 us a layer where reading its 31 MB of weights takes ~10 (benchmarks/results/
README.md, decode step latency). Here num_programs programs (at most one per SM) run the layer as five phases:

  A  residual add + RMSNorm, qkv projection
  B  q/k RMSNorm + RoPE, attention to the cached keys split into partitions (each partition's first K/V tile
     requested before the wait for A); the newest token's K/V into the cache and its scores, on their own
  C  the partitions and the newest token merged, o_proj split over the kv heads (each program merges its kv
     head's query heads)
  D  residual add (of o_proj's output, its per-kv-head partial sums added up by phase C) + RMSNorm, gate_up
     projection, SiLU-and-mul
  E  down_proj, whose output and the residual are the next layer's input

Each projection is a GEMV whose rows are dealt out to the programs in equal contiguous shares; a program
requests its whole share of the weights (for Qwen3-0.6B 32-128 KB, held in registers at 16 warps) at once.
Shares too large for that stream in slices, the next one in flight while one is used. The values are rounded
to the model dtype where the layers' fused path holds them in a tensor of that dtype (normalised input, q/k/v,
attention output, SiLU-and-mul, residual; o_proj's and down_proj's outputs stay float32 as the split-K GEMM's
partials do), so the two paths agree to the accumulation order of the GEMVs.

By default each phase is its own launch (PHASE = 0..4), a programmatic dependent launch on Hopper (pdl.py):
its programs start on the SMs the previous phase frees, request their weights and only then wait for that
phase's results, so the next projection's weights are in flight during the previous phase's tail. The
persistent mode (PHASE = -1) runs all five in one launch with a grid barrier between each two, every program
requesting its share of the next projection's weights before it waits (o_proj's during attention). It needs
every program resident at once (one per SM, nothing else running) and all phases share its 16 warps; on the
H100 it was no faster than five plain launches inside a CUDA graph and is slower than five dependent ones,
so it is opt-in (PAGEDLLM_DECODE_LAYER=persistent). The Triton interpreter runs programs one after another,
where a grid barrier would wait forever: CPU tensors always take the five launches.

Measured on the H100 (benchmarks/results/README.md, benchmarks/decode_layer.py): Qwen3-0.6B's batch-1 forward 1045 ->
908 us with attention at 4 warps, ~25 us a layer (attention 8.5, gate_up 9.5 as launches of their own), 904 -> 748 us
with the phases as dependent launches; the engine's step ~1.0 ms against 1.36 without the kernel; a grid barrier ~1
us. Pulling the attention's K/V into the L2 during phase A (prefetch.global.L2) made the persistent layer slower (31
-> 35 us); in the five launches (thirtieth session), so did prefetching gate_up's and W_o's weights ahead of their
phases (forward at 1024 tokens 585 -> 609-644 us) and waiting on an arrival counter instead of griddepcontrol.wait
(593 -> 669 us; one dependent launch's boundary costs ~1.1 us by itself). A per-program timestamp trace of the forward
(thirteenth session) showed the layer bound by the work after each phase's wait, not by its weights: with every layer
reading one layer's weights from the L2 the forward still took 685 us against 752. Attention's first tile requested
before its wait, the GEMVs' columns laid out so that each thread sums its own and bf16 widened with integer
instructions took the forward at 1024 tokens from 747 to ~700 us, at 1100 from 810 to ~740; gate_up's shares spread
over every program (16 + 8 rows, not 32 on three quarters of them) to ~660 / ~690; the attention partitions merged in
o_proj's programs instead of by the last partition of each kv head to ~620 / ~660 (the sessions' own machines;
alternating on one H100 in the sixteenth session, 662 / 664 us), the newest token's attention on its own to 636 / 648,
the launch configs re-swept (twenty-fourth session) from 637 / 622 to 631 / 606 at 1024 tokens in graphs bounded at
1024 / 2048, the GEMV tiles' warps over their rows (thirtieth session, _weight_slice) 580 / 585 to 551 / 561, gate_up's
input held as bf16 pairs (thirty-first session, gate_up_tile) to 547 / 533, the norms' weights requested beside their
rows and the newest token's loads before its reductions (thirty-second session) to 529 / 515, and at 1100 tokens 551
-> 538 with partitions of whole pages, and at 4000 tokens (graphs bounded at 4096) from 687 to 628 with twice the
partitions (thirty-third session, ATTENTION_SPLIT). Fewer CTA barriers a phase (forty-second session: gate_up's rest
slice over its chunks, _store_held, qkv's input as pairs) took the engine's batch-1 step from 0.618 to 0.615 ms
(alternating on one H100, forty-third session).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _host, pdl
from .fused import head_halves, rms_scale, rotate_halves, rotated_heads, store_token_kv
from .paged_tile import LOG2E, attend_kv, attend_range, load_kv_tile

PHASES = 5
NUM_WARPS = 16
# Attention's tiles (16 query rows x 64 keys) waste 16 warps: as its own launch it takes 4 (benchmarks/
# decode_layer.py on the H100: phase B 13.2 -> 8.5 us, 2 warps 8.3, 8 warps 10.1; the step 1045 -> 924 us).
ATTENTION_WARPS = 4
# Where a partition can hold more than 3 BLOCK_N keys (one 128-key tile and more than half of another), attention takes
# 8: on the H100 (benchmarks/results/README.md, fourteenth session) the forward at 3500 / 4000 tokens (graphs bounded
# at 4096) 917 / 942 -> 868 / 881 us, at 8000 (bound 8192) 1122 -> 1082. It costs ~40 us where a partition holds
# little more than one tile (2100 tokens: 760 -> 800; the crossover is near 2700) and 30-50 us in graphs bounded at
# 2048, which keep 4.
ATTENTION_LONG_WARPS = 8
# Attention's partitions a kv head are phase C's programs a kv head, this many times as many where that keeps every
# partition within 3 BLOCK_N keys and the one-per-program split would not (DecoderLayerKernel.partitions): steps
# bounded at 3073-6144 tokens at Qwen3-0.6B's 16 programs a kv head, whose launches then keep attention at
# ATTENTION_WARPS and gate_up under its register cap. On the H100 (benchmarks/results/README.md, thirty-third session)
# the forward at 2100 / 3000 / 4000 tokens in graphs bounded at 4096 620 / 635 / 687 -> 592 / 610 / 628 us; twice the
# partitions at every bound cost 40-60 us at 64-1500 tokens (bounds 1024 / 2048), four times 150-190.
ATTENTION_SPLIT = 2
# Registers of the attention phase with one tile size (LONG off), whose prefetched tile would take ~200: at 168 the
# forward at 64 / 1024 tokens took 678 / 698 us against 711 / 721 (benchmarks/results/README.md, thirteenth session).
# The phase with both sizes needs its ~250 (at 168: 1100 tokens 740 -> 805 us).
ATTENTION_REGISTERS = 168
# A program's whole share of a projection's weights, requested at once (before the barrier it then waits at):
# up to 64 registers a thread at 16 warps. Qwen3-0.6B's largest share is gate_up's 96 KB.
SLICE_BYTES = 131072
# Registers of the gate_up phase in launches whose attention phase has both tile sizes (LONG) and runs at
# ATTENTION_WARPS, where its weight share takes at most GATE_UP_REGISTERS - 24 of them (Qwen3-0.6B: 48 of its 82;
# no spills at 72). 72 at 16 warps leaves exactly the 56 a thread that down_proj's phase takes, so its programs can
# start beside gate_up's. Measured on the H100 (benchmarks/results/README.md, fourteenth session), forward at 1024
# tokens in a graph bounded at 2048: 690 -> 658 us. Without LONG the cap cost 15 us at 64 tokens and gained nothing
# at 1024; with attention at ATTENTION_LONG_WARPS it cost 10-11% (twenty-fourth session: 3000 / 8000 tokens in
# graphs bounded at 4096 / 8192, 780 / 1066 us against 712 / 950 without it), so it is off there.
GATE_UP_REGISTERS = 72
# Registers of the qkv and o_proj phases where what they hold takes at most PROJECTION_REGISTERS - 24 of them
# (Qwen3-0.6B: 32 and 40). On the H100 (twenty-fourth session, alternating), o_proj at 16 warps in every launch (it
# had run at 8 where attention has two tile sizes) took the forward at 1024 / 1500 tokens in graphs bounded at 2048
# from 623 / 655 to 615 / 642 us; then both phases capped at 64 registers, at 64 / 1024 / 1500 tokens (graphs
# bounded at 1024 / 2048 / 2048), from 628 / 617 / 642 to 619 / 608 / 637 us (at 4000, bound 4096, within 1 us).
# o_proj capped at 56 or 48 was 1-8 us slower than at 64.
PROJECTION_REGISTERS = 64
# Larger shares stream in slices of this size, the next one in flight while the current one is used.
STEP_BYTES = 32768
# o_proj's programs of a kv head split its columns into this many groups, each program merging only its group's
# attention channels (so it reads that share of the partitions' outputs) and adding twice the rows into o_sum, where
# the query group is a power of two and the partitions divide evenly; else each takes all of them. On the H100
# (benchmarks/results/README.md, twenty-seventh session), forward at 64 / 1024 / 1500 / 4000 tokens (graphs bounded
# at 1024 / 2048 / 2048 / 4096): 1 group 611 / 598 / 627 / 748 us, 2 groups 582 / 591 / 616 / 732, 4 583 / 595 /
# 619 / 735, 8 593 / 591 / 614 / 757.
O_COLUMN_GROUPS = 2
MAX_PROGRAMS = 128
_WARPS = tl.constexpr(NUM_WARPS)
# Inline PTX (_store_held) on NVIDIA GPUs only: not under the interpreter (read at import, as triton.jit reads it)
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.version.hip is None)
# Where Triton lays a program's warps in a tile whose last dimension the lanes fill: over the leading dimensions
# first up to 3.6 (the GPU machine's), over the ones nearest the last from 3.7 on (ptxas reports of this file's kernels
# compiled by each; _weight_slice orders its tile's dimensions by it).
_WARPS_LEAD = tl.constexpr(tuple(int(v) for v in triton.__version__.split(".")[:2]) <= (3, 6))
# Decode steps of up to this many sequences take the kernel: each program's weight share, requested once, serves
# every row. Each row's input and sums then stay live beside the held weights, so the projections take 98-128
# registers at 2 rows (no two phases' programs share an SM, so no phase's weights stream during the one before) and
# gate_up spills at 4. On the H100 (benchmarks/results/README.md, twenty-eighth session), forward at 1024 tokens
# (graphs bounded at 2048): 2 rows 919 us against the layers' 1093, 4 rows 1620 against 1182.
MAX_ROWS = 2
BLOCK_N = 64  # keys per attention tile (twice that for partitions longer than one)
# o_proj's per-kv-head partial sums are added into one int64 vector in fixed point (2^-32 steps, |x| < 2^31), so
# the sum is the same whatever order the programs' atomics land in; phase D's programs then each read 8 KB where
# they read and summed the partials' 32 KB. On the H100 (benchmarks/results/README.md, twenty-seventh session) the
# forward at 64 / 1024 / 8000 tokens 617 / 612 / 943 -> 609 / 597 / 933 us.
_FIXED_ONE = tl.constexpr(2.0 ** 32)


@triton.jit
def _grid_sync(barrier, target):
    """Wait until the step's barrier counter reaches target. Every program adds one per barrier and the counter
    only grows within a step, so no program can miss a barrier's release. The CTA barriers order all threads'
    stores before the release and every later load after the acquire (cooperative groups' grid sync)."""
    tl.debug_barrier()
    tl.atomic_add(barrier, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(barrier, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(barrier, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _launch_dependents_after(dep):
    """griddepcontrol.launch_dependents once dep (a tensor) is computed: pdl.gdc_launch_dependents has no
    operands, so the compiler may issue it anywhere after the last barrier before it."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,f", [dep.to(tl.float32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_held(ptr, val, mask, FIRST_WARP: tl.constexpr = False):
    """tl.store(ptr, val, mask=mask) (32- or 16-bit values) by the threads that hold val, in val's layout; with
    FIRST_WARP by the first warp's only (val replicated over every warp). A GEMV's sums end replicated over the lanes
    (or warps) that reduced them; Triton stores those through shared memory into a layout of one value a thread: two
    CTA barriers at the end of a projection phase, on the layer's critical path. Each lane storing the value it holds
    writes the same bytes 32 times in one instruction, one transaction."""
    if _PTX:
        only: tl.constexpr = "mov.u32 t, %tid.x; setp.lt.and.u32 p, t, 32, p;" if FIRST_WARP else ""
        if val.dtype.primitive_bitwidth == 32:
            tl.inline_asm_elementwise("{ .reg .pred p; .reg .u32 t; setp.ne.b32 p, $3, 0; " + only +
                                      " @p st.global.b32 [$1], $2; }\nmov.b32 $0, 0;", "=r,l,r,r",
                                      [ptr, val.to(tl.int32, bitcast=True), mask.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:  # the value and its mask in one register (gate_up's phase is one register short of its cap)
            held = (val.to(tl.int16, bitcast=True).to(tl.int32) & 65535) | (mask.to(tl.int32) << 16)
            tl.inline_asm_elementwise("{ .reg .pred p; .reg .b16 v, m; .reg .u32 t; mov.b32 {v, m}, $2; "
                                      "setp.ne.b16 p, m, 0; " + only + " @p st.global.b16 [$1], v; }\n"
                                      "mov.b32 $0, 0;", "=r,l,r", [ptr, held], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def _globaltimer():
    """The GPU's nanosecond clock (the trace's timestamps)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _at(v, DIM: tl.constexpr):
    """The 1-D v along dimension DIM of a 4-D tile."""
    if DIM == 0:
        t = v[:, None, None, None]
    elif DIM == 1:
        t = v[None, :, None, None]
    elif DIM == 2:
        t = v[None, None, :, None]
    else:
        t = v[None, None, None, :]
    return t


@triton.jit
def _weight_slice(w, row0, n_rows, row_limit, K: tl.constexpr, K_PAD: tl.constexpr, RPP: tl.constexpr,
                  PAIRS: tl.constexpr, ROW: tl.constexpr, OUTER: tl.constexpr = True):
    """Rows row0 ... row0 + RPP - 1 of w [n_rows (x PAIRS), K] (rows ROW elements apart), their columns in chunks of
    one warp's coalesced width (CW), as a tile of [RPP, PAIRS, chunks, CW] (loaded in the order that puts Triton's
    warps where they belong, below). With OUTER, a slice of at least a row (or pair) per warp has them over its rows:
    every thread sums its own chunks, the lanes each row with one shuffle reduction, and gate's and up's rows stay in
    one thread. On the H100 (benchmarks/results/README.md, thirtieth session) that took qkv's
    phase from 488 to 352 instructions a thread, uncapped gate_up's from 1024 to 560, and the forward at 64 / 1024 /
    1500 / 4000 tokens from 580 / 585 / 611 / 731 to 551 / 561 / 589 / 708 us. Each thread then holds its lanes' columns
    of the input for every chunk, so gate_up holds a bf16 input as pairs (gate_up_tile) and down_proj's 8-row
    slices would not leave registers for qkv's programs beside it: those keep the chunks over the warps, which
    reduce through shared memory. Rows from row_limit on are not loaded (0: none). PAIRS 2: gate rows r and
    the up rows n_rows + r beside them. bf16 loads as int32 pairs of columns: _gemv_rows widens each half with one
    integer instruction, where converting the upper half of a pair takes two. The weights are read once a step (a
    step streams ~1 GB through the 50 MB L2), so their lines are the L2's first to go, before the phases' exchanges
    and the K/V: on the H100 (benchmarks/results/README.md, thirty-eighth session) the engine's batch-1 step 0.621-0.627
    -> 0.618-0.625 ms (~3 us), a process each, alternating, on two machines."""
    # Triton fills the warps from a tile's leading dimensions up to 3.6 and from those nearest the last after
    # (_WARPS_LEAD): the rows first where a row (or pair) a warp, then the chunks, the pairs last, so that a slice of
    # fewer rows than warps puts its other warps on its chunks, not between a gate row and its up row; else the
    # chunks first. DR, DP, DC: the rows', pairs' and chunks' dimensions of the tile as loaded; it is returned as
    # [RPP, PAIRS, chunks, CW] (a permutation of the registers' labels, not of the registers).
    OVER_ROWS: tl.constexpr = OUTER and RPP * PAIRS >= _WARPS
    DR: tl.constexpr = (0 if _WARPS_LEAD else 2) if OVER_ROWS else (2 if _WARPS_LEAD else 0)
    DP: tl.constexpr = (2 if _WARPS_LEAD else 0) if OVER_ROWS else 1
    DC: tl.constexpr = 1 if OVER_ROWS else (0 if _WARPS_LEAD else 2)
    rows = _at(row0 + tl.arange(0, RPP), DR)
    r = (_at(tl.arange(0, PAIRS), DP) * n_rows + rows).to(tl.int64)
    row_ok = rows < row_limit
    # one warp's coalesced row segment: 16 bytes a thread
    WARP_COLS: tl.constexpr = 4096 // w.dtype.element_ty.primitive_bitwidth
    if w.dtype.element_ty == tl.bfloat16:
        HALF_PAD: tl.constexpr = K_PAD // 2
        CW: tl.constexpr = WARP_COLS // 2 if WARP_COLS // 2 < HALF_PAD else HALF_PAD
        c = _at(tl.arange(0, HALF_PAD // CW), DC) * CW + _at(tl.arange(0, CW), 3)
        wt = tl.load(w.to(tl.pointer_type(tl.int32), bitcast=True) + r * (ROW // 2) + c, mask=row_ok & (c < K // 2),
                     other=0, eviction_policy="evict_first")
    else:
        CW: tl.constexpr = WARP_COLS if WARP_COLS < K_PAD else K_PAD
        c = _at(tl.arange(0, K_PAD // CW), DC) * CW + _at(tl.arange(0, CW), 3)
        wt = tl.load(w + r * ROW + c, mask=row_ok & (c < K), other=0.0, eviction_policy="evict_first")
    return tl.permute(wt, (DR, DP, DC, 3))


@triton.jit
def _weight_share(w, pid, n_rows, K: tl.constexpr, K_PAD: tl.constexpr, RPP: tl.constexpr, STEPS: tl.constexpr,
                  RPP2: tl.constexpr, PAIRS: tl.constexpr, ROW: tl.constexpr, OUTER: tl.constexpr = True):
    """The program's first slice of its share of w's rows (_gemv_plan), and the RPP2-row rest of a one-slice share
    (the first slice again where there is none): both requested at once."""
    row0 = pid * (RPP * STEPS + RPP2)
    first = _weight_slice(w, row0, n_rows, n_rows, K, K_PAD, RPP, PAIRS, ROW, OUTER)
    if RPP2 > 0:
        rest = _weight_slice(w, row0 + RPP, n_rows, n_rows, K, K_PAD, RPP2, PAIRS, ROW, OUTER)
    else:
        rest = first
    return first, rest


@triton.jit
def _gemv_rows(wt, x, row0, n_rows, out, bias, RPP: tl.constexpr, PAIRS: tl.constexpr, HAS_BIAS: tl.constexpr,
               OUT_STRIDE: tl.constexpr, OUTER: tl.constexpr = True, PACKED: tl.constexpr = False):
    """out[rows of the slice] = wt x (wt as _weight_slice gives it, for the same OUTER; out's rows OUT_STRIDE
    elements apart); PAIRS 2: silu(gate) * up, gate and up rounded as the layers round them."""
    CH: tl.constexpr = wt.shape[2]
    CW: tl.constexpr = wt.shape[3]
    if wt.dtype == tl.int32 and PACKED:  # x (bf16) held as pairs too, each half widened where used (gate_up_tile)
        x_even, x_odd = tl.split(tl.reshape(x.to(tl.int16, bitcast=True).to(tl.int32), [CH * CW, 2]))
        xp = tl.reshape((x_odd << 16) | (x_even & 65535), [CH, CW])[None, None, :, :]
        prod = ((wt << 16).to(tl.float32, bitcast=True) * (xp << 16).to(tl.float32, bitcast=True) +
                (wt & -65536).to(tl.float32, bitcast=True) * (xp & -65536).to(tl.float32, bitcast=True))
    elif wt.dtype == tl.int32:  # bf16 pairs: the low half is the even column
        x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32), [CH * CW, 2]))
        even = (wt << 16).to(tl.float32, bitcast=True)
        odd = (wt & -65536).to(tl.float32, bitcast=True)
        prod = (even * tl.reshape(x_even, [CH, CW])[None, None, :, :] +
                odd * tl.reshape(x_odd, [CH, CW])[None, None, :, :])
    else:
        prod = wt.to(tl.float32) * tl.reshape(x.to(tl.float32), [CH, CW])[None, None, :, :]
    if OUTER and RPP >= _WARPS:  # no warps on the chunks: each thread sums its own first
        acc = tl.sum(tl.sum(prod, axis=2), axis=2)  # [RPP, PAIRS]
    else:  # the lanes first, then the chunks across the warps, on a tile without its columns
        acc = tl.sum(tl.sum(prod, axis=3), axis=2)
    rows = row0 + tl.arange(0, RPP)
    ok = rows < n_rows
    if PAIRS == 2:  # rounded as F.linear's output, then as fused.silu_and_mul rounds
        half = tl.arange(0, PAIRS)[None, :]
        gate = tl.sum(tl.where(half == 0, acc, 0.0), axis=1).to(out.dtype.element_ty).to(tl.float32)
        up = tl.sum(tl.where(half == 1, acc, 0.0), axis=1).to(out.dtype.element_ty)
        val = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up
    else:
        val = tl.sum(acc, axis=1)
        if HAS_BIAS:
            val += tl.load(bias + rows, mask=ok, other=0.0).to(tl.float32)
    if out.dtype.element_ty == tl.int64:  # a split-K partial, added in fixed point (_FIXED_ONE)
        tl.atomic_add(out + rows * OUT_STRIDE, (val * _FIXED_ONE).to(tl.int64), mask=ok, sem="relaxed")
    elif OUTER and RPP * PAIRS >= _WARPS:  # each row held by the lanes of one warp (or two)
        _store_held(out + rows * OUT_STRIDE, val.to(out.dtype.element_ty), ok)
    elif CH >= _WARPS:  # every warp on the chunks: after their reduction each holds every row, so one stores
        _store_held(out + rows * OUT_STRIDE, val.to(out.dtype.element_ty), ok, True)
    else:
        tl.store(out + rows * OUT_STRIDE, val, mask=ok)


@triton.jit
def _gemv(w, share, pid, n_rows, x, out, bias, K: tl.constexpr, K_PAD: tl.constexpr, RPP: tl.constexpr,
          STEPS: tl.constexpr, RPP2: tl.constexpr, PAIRS: tl.constexpr, HAS_BIAS: tl.constexpr, ROW: tl.constexpr,
          OUT_STRIDE: tl.constexpr, OUTER: tl.constexpr = True, PACKED: tl.constexpr = False):
    """out = x W^T on this program's rows, `share` being what _weight_share loaded; with several steps each
    loads the next slice before using the current one."""
    first, rest = share
    row0 = pid * (RPP * STEPS + RPP2)
    if STEPS == 1:
        _gemv_rows(first, x, row0, n_rows, out, bias, RPP, PAIRS, HAS_BIAS, OUT_STRIDE, OUTER, PACKED)
        if RPP2 > 0:
            _gemv_rows(rest, x, row0 + RPP, n_rows, out, bias, RPP2, PAIRS, HAS_BIAS, OUT_STRIDE, OUTER, PACKED)
    else:
        wt = first
        for s in range(STEPS):
            r = row0 + s * RPP
            nxt = _weight_slice(w, r + RPP, n_rows, tl.where(s + 1 < STEPS, n_rows, 0), K, K_PAD, RPP, PAIRS, ROW,
                                OUTER)
            _gemv_rows(wt, x, r, n_rows, out, bias, RPP, PAIRS, HAS_BIAS, OUT_STRIDE, OUTER)
            wt = nxt


@triton.jit
def _gemv_of(w, share, pid, n_rows, src, out, K: tl.constexpr, K_PAD: tl.constexpr, RPP: tl.constexpr,
             STEPS: tl.constexpr, RPP2: tl.constexpr):
    """_gemv of the vector src [K], an earlier phase's output."""
    cols = tl.arange(0, K_PAD)
    _gemv(w, share, pid, n_rows, tl.load(src + cols, mask=cols < K, other=0.0), out, out, K, K_PAD, RPP, STEPS, RPP2,
          1, False, K, 1)


@triton.jit
def _norm_weight(norm_w, D: tl.constexpr, D_PAD: tl.constexpr):
    """The norm's weight, which a phase loads right after its wait, beside its row: loaded in _norm_row, it was
    requested only after the row's sum of squares (ptxas does not move a load across the reduction's CTA barriers),
    one more memory round trip in the chain of phases A and D. Loaded before the wait instead, it made the forward
    faster still at 64 / 1024 / 4000 tokens but the engine's batch-1 step (1054-1354 tokens) 12 us slower
    (benchmarks/results/README.md, thirty-second session)."""
    cols = tl.arange(0, D_PAD)
    return tl.load(norm_w + cols, mask=cols < D, other=0.0)


@triton.jit
def _norm_row(x, res, norm_w, eps, D: tl.constexpr, D_PAD: tl.constexpr, HAS_RES: tl.constexpr = True):
    """(h = x + res, RMSNorm(h)) of the hidden row, x being float or (o_proj's sum) int64 fixed point, rounded as
    fused.rms_norm rounds (x first to res's dtype); without HAS_RES (the first layer's) h = x. norm_w: the
    weight's values (_norm_weight)."""
    cols = tl.arange(0, D_PAD)
    ok = cols < D
    xs = tl.load(x + cols, mask=ok, other=0)
    if x.dtype.element_ty == tl.int64:
        xs = xs.to(tl.float32) * (1.0 / _FIXED_ONE)
    h = xs.to(res.dtype.element_ty)
    if HAS_RES:
        h += tl.load(res + cols, mask=ok, other=0.0)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
    return h, rms_scale(h, norm_w, rstd)


@triton.jit
def _attend_partition(kv_head, part, cached, cos, sin, d, qkv, q_norm_w, eps, scale, block_table, k_cache, v_cache,
                      stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2, attn_max, attn_sum, attn_acc,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
                      NP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, X: tl.constexpr,
                      LAYOUT: tl.constexpr, QK_NORM: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """The kv head's query rows over partition `part` of the `cached` keys before the newest: the partition's max,
    sum and unnormalised output. A partition is a whole number of pages, the last of its tiles masked at its end.
    Rounded up to whole tiles, 1100 tokens took 9 of the 16 partitions, 128 keys each, where now 14 take 80: on the
    H100 (benchmarks/results/README.md, thirty-second session) the forward at 1100 / 1500 / 1800 tokens (graphs
    bounded at 2048) 548 / 554 / 562 -> 538 / 547 / 552 us, at 4000 (bound 4096; the same partitions) 676 -> 683."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    HALF: tl.constexpr = HEAD_SIZE // 2
    part_tokens = tl.cdiv(tl.cdiv(cached, NP), BLOCK_SIZE) * BLOCK_SIZE
    start = part * part_tokens
    end = tl.maximum(tl.minimum(start + part_tokens, cached), start)
    # Every key here was cached by an earlier step (the runner keeps steps in which a row reads a block that another
    # row writes off this kernel: AttentionMetadata.decode_rows_share_blocks), and the step's metadata arrived before
    # the graph's first kernel, so the partition's first tile is requested before the wait for phase A, whose q it
    # then waits for:
    # its block-table and K/V loads leave the chain after that wait (benchmarks/results/README.md, thirteenth
    # session).
    g = tl.arange(0, GROUP_PAD)
    q_pos = tl.where(g < GROUP, cached, -1)
    no_sparse = tl.zeros([GROUP_PAD], tl.int32)
    k0, v0, ok0, keep0 = load_kv_tile(start, end, q_pos, k_cache, v_cache, block_table, kv_head, stride_kb,
                                      stride_kh, stride_k2, stride_vb, stride_vh, stride_v2, no_sparse, 0, 0, 1, 1,
                                      HEAD_SIZE, HEAD_SIZE, BLOCK_SIZE, BLOCK_N, X, LAYOUT, True, False)
    if PDL:
        pdl.gdc_wait()

    hq = g[:, None]
    q1, q2 = rotated_heads(qkv + kv_head * GROUP * HEAD_SIZE, q_norm_w, eps, cos, sin, hq, d, hq < GROUP, HALF,
                           QK_NORM)
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GROUP_PAD, HEAD_SIZE))
    qk_scale = scale * LOG2E
    no_alibi = tl.zeros([GROUP_PAD], tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_SIZE], tl.float32)
    m_i, l_i, acc = attend_kv(q, m_i, l_i, acc, k0, v0, ok0, keep0, start, end, q_pos, no_alibi, qk_scale,
                              BLOCK_N, 0, True, False, False, DOT_PREC)
    rest = start + BLOCK_N
    rest_end = tl.maximum(end, rest)
    m_i, l_i, acc = attend_range(
        q, m_i, l_i, acc, rest, rest + (rest_end - rest) // BLOCK_N * BLOCK_N, rest_end, end, q_pos, no_alibi,
        qk_scale, k_cache, v_cache, block_table, kv_head, stride_kb, stride_kh, stride_k2, stride_vb, stride_vh,
        stride_v2, no_sparse, 0, 0, 1, 1, HEAD_SIZE, HEAD_SIZE, BLOCK_SIZE, BLOCK_N, X, LAYOUT, 0, False, False,
        DOT_PREC)

    dd = tl.arange(0, HEAD_SIZE)
    stat = (kv_head * GROUP + g) * NP + part
    tl.store(attn_max + stat, m_i, mask=g < GROUP)
    tl.store(attn_sum + stat, l_i, mask=g < GROUP)
    # [head, channel, partition]: phase C sums over the partitions within each thread (_merged_heads)
    tl.store(attn_acc + ((kv_head * GROUP + g)[:, None] * HEAD_SIZE + dd[None, :]) * NP + part, acc,
             mask=(g < GROUP)[:, None])


@triton.jit
def _newest_token(kv_head, cos, sin, d, qkv, q_norm_w, k_norm_w, eps, scale, slot_mapping, k_cache, v_cache,
                  stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2, attn_new, HEADS: tl.constexpr,
                  KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  X: tl.constexpr, LAYOUT: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
    """The newest token's k (normed, rotated) and v into the cache, and its scores against the kv head's query
    heads (log2 units, as attend_tile keeps them) for phase C's merge, which reads its v from qkv. Every load is
    issued before the first reduction: behind the norms' CTA barriers, k's and the weights' loads had made three
    memory round trips of this item's chain."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    HALF: tl.constexpr = HEAD_SIZE // 2
    slot = tl.load(slot_mapping)
    one = tl.zeros([1, 1], tl.int32)
    qw1, qw2, kw1, kw2 = cos, cos, cos, cos  # without QK_NORM no weights (the pointers are stand-ins)
    if QK_NORM:
        qw1, qw2 = head_halves(q_norm_w, one, d, d < HALF, HALF)
        kw1, kw2 = head_halves(k_norm_w, one, d, d < HALF, HALF)
    if PDL:
        pdl.gdc_wait()
    g = tl.arange(0, GROUP_P2)
    hq = g[:, None]
    q1, q2 = head_halves(qkv + kv_head * GROUP * HEAD_SIZE, hq, d, hq < GROUP, HALF)
    k_ptr = qkv + (HEADS + kv_head) * HEAD_SIZE
    k1, k2 = head_halves(k_ptr, one, d, d < HALF, HALF)
    v1, v2 = head_halves(k_ptr + KV_HEADS * HEAD_SIZE, one, d, d < HALF, HALF)
    q1, q2 = rotate_halves(q1, q2, qw1, qw2, eps, cos, sin, HALF, QK_NORM)
    k1, k2 = rotate_halves(k1, k2, kw1, kw2, eps, cos, sin, HALF, QK_NORM)
    if slot >= 0:
        store_token_kv(k_cache, v_cache, slot.to(tl.int64), k1, k2, v1, v2, kv_head, d, d < HALF, 1.0, 1.0, stride_kb,
                       stride_kh, stride_k2, stride_vb, stride_vh, stride_v2, HALF, BLOCK_SIZE, X, LAYOUT, 0)
    s = tl.sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1) + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)
    tl.store(attn_new + kv_head * GROUP + g, s * (scale * LOG2E), mask=g < GROUP)


@triton.jit
def _attention(item, qkv, q_norm_w, k_norm_w, eps, scale, cos_sin_cache, stride_cs, positions, slot_mapping,
               seq_lens, block_table, k_cache, v_cache, stride_kb, stride_kh, stride_k2, stride_vb, stride_vh,
               stride_v2, attn_max, attn_sum, attn_acc, attn_new,
               HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
               GROUP_P2: tl.constexpr, NP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               LONG: tl.constexpr, NEWEST_APART: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr,
               QK_NORM: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """Phase B's work item: (kv head, partition) = divmod(item, NP) of the keys cached by earlier steps, and the
    newest token of a kv head: with NEWEST_APART as items of their own past those, else after the last partition
    of each kv head. Loads of earlier steps' data are issued before the wait for phase A (PDL). LONG: the step's
    contexts may need partitions longer than one BLOCK_N tile.

    The newest token used to be a step of the partition holding it, after the tiles; where that partition held as
    many tiles as the others, it was the layer's last by ~1.3 us (benchmarks/results/README.md, sixteenth session;
    computed in every partition beside the tiles, the token's norm, RoPE and scores lengthened all of them by ~1
    us). Apart, its items need KV_HEADS more programs in the same wave: not where a program takes a whole SM
    (attention at ATTENTION_LONG_WARPS), and there the last partition is the one most often empty or short."""
    HALF: tl.constexpr = HEAD_SIZE // 2
    cached = tl.load(seq_lens) - 1
    pos = tl.load(positions).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cs = cos_sin_cache + pos * stride_cs + d
    cos = tl.load(cs).to(qkv.dtype.element_ty)
    sin = tl.load(cs + HALF).to(qkv.dtype.element_ty)
    if item < KV_HEADS * NP:
        # A partition is one tile of BLOCK_N keys while the context allows, else tiles of 2 BLOCK_N: each tile is a
        # chain of dependent loads that costs about the same at either size (benchmarks/results/README.md, twelfth
        # session: Qwen3-0.6B's forward at 1320 tokens 825 us with 64-key tiles, 812 with the wider ones, at 3500
        # 1022 against 960). The wide tiles compiled beside the narrow ones cost those ~0.5 us a layer (746 -> 775
        # us at 1024 tokens), so they are compiled only where the step's bound on its context (LONG) can need them;
        # static_range then unrolls both sizes and the context picks one at run time.
        if LONG:
            wide = tl.cdiv(cached, NP) > BLOCK_N
        else:
            wide = False
        for w in tl.static_range(1 + LONG):
            if wide == (w == 1):
                _attend_partition(item // NP, item % NP, cached, cos, sin, d, qkv, q_norm_w, eps, scale, block_table,
                                  k_cache, v_cache, stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
                                  attn_max, attn_sum, attn_acc, HEADS, KV_HEADS, HEAD_SIZE, GROUP_PAD, NP,
                                  BLOCK_SIZE, BLOCK_N * (w + 1), X, LAYOUT, QK_NORM, DOT_PREC, PDL)
    if NEWEST_APART:
        newest, kv_head = item >= KV_HEADS * NP, item - KV_HEADS * NP
    else:
        newest, kv_head = item % NP == NP - 1, item // NP
    if newest:
        _newest_token(kv_head, cos, sin, d, qkv, q_norm_w, k_norm_w, eps, scale, slot_mapping, k_cache, v_cache,
                      stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2, attn_new, HEADS, KV_HEADS,
                      HEAD_SIZE, GROUP_P2, BLOCK_SIZE, X, LAYOUT, QK_NORM, PDL)


@triton.jit
def _merged_heads(kv_head, c0, attn_max, attn_sum, attn_acc, attn_new, v_new, GROUP: tl.constexpr,
                  NP: tl.constexpr, NP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, CH: tl.constexpr):
    """Channels c0 ... c0 + CH - 1 of the kv head's query heads' attention outputs (padding heads 0), merged from the
    partitions' max, sum and unnormalised output (m in log2 units, as attend_tile keeps it) and the newest token's
    score and value (v_new: its HEAD_SIZE channels). The partitions are the fastest axis in memory and in the tile,
    so each thread sums its channels' partitions itself: summed across the warps of a 16-warp program (partitions
    leading), the merge took phase C from 4 to 9 us on the H100 (benchmarks/results/README.md, fifteenth
    session)."""
    c = c0 + tl.arange(0, CH)[:, None]
    p = tl.arange(0, NP_PAD)[None, :]
    real = c < GROUP * HEAD_SIZE
    ok = (p < NP) & real
    head = kv_head * GROUP + c // HEAD_SIZE
    mp = tl.load(attn_max + head * NP + p, mask=ok, other=float("-inf"))
    m_new = tl.load(attn_new + head, mask=real, other=float("-inf"))  # [channels, 1]
    mx = tl.max(tl.maximum(mp, m_new), axis=1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)[:, None]
    weight = tl.exp2(mp - mx)
    # the newest token's weight added to the first partition's column, not summed on its own: a reduction more
    # (over an axis of one) cost phase C ~0.5 us
    w_new = tl.where(p == 0, tl.exp2(m_new - mx), 0.0)
    v = tl.load(v_new + c % HEAD_SIZE, mask=real, other=0.0).to(tl.float32)
    den = tl.sum(weight * tl.load(attn_sum + head * NP + p, mask=ok, other=0.0) + w_new, axis=1)
    parts = tl.load(attn_acc + (kv_head * GROUP * HEAD_SIZE + c) * NP + p, mask=ok, other=0.0)
    return tl.sum(weight * parts + w_new * v, axis=1) / tl.where(den == 0.0, 1.0, den)


@triton.jit
def _decoder_layer_kernel(
    x_in, x_ids, residual, x_out, res_mid, qkv, attn_max, attn_sum, attn_acc, attn_new, o_sum, act, barrier,
    barrier_base,
    w_ln, w_qkv, b_qkv, q_norm_w, k_norm_w, w_o, w_post, w_gate_up, w_down, eps, post_eps, qk_eps, scale,
    cos_sin_cache, stride_cs, positions, slot_mapping, seq_lens, block_table, stride_bt,
    k_cache, v_cache, stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2, trace,
    ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, INTER: tl.constexpr, INTER_PAD: tl.constexpr,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr, NP: tl.constexpr, NP_PAD: tl.constexpr, OPP: tl.constexpr, O_GROUPS: tl.constexpr,
    A_RPP: tl.constexpr, A_STEPS: tl.constexpr, A_RPP2: tl.constexpr, O_RPP: tl.constexpr, O_STEPS: tl.constexpr,
    O_RPP2: tl.constexpr, U_RPP: tl.constexpr, U_STEPS: tl.constexpr, U_RPP2: tl.constexpr, E_RPP: tl.constexpr,
    E_STEPS: tl.constexpr, E_RPP2: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, LONG: tl.constexpr,
    NEWEST_APART: tl.constexpr, X: tl.constexpr, LAYOUT: tl.constexpr, FIRST: tl.constexpr, EMBED: tl.constexpr,
    QK_NORM: tl.constexpr, QKV_BIAS: tl.constexpr, NPROG: tl.constexpr, PHASE: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr, TRACE: tl.constexpr, U_OUTER: tl.constexpr, U_PACKED: tl.constexpr,
):
    pid = tl.program_id(0)
    if TRACE:
        started = _globaltimer()
    if PDL and PHASE != 3 and not EMBED:
        # Launched as a programmatic dependent of the previous phase: let the next phase's programs start as
        # SMs free up (they can issue their weight loads), and wait for the previous phase before reading
        # anything it wrote. Every program waits, so a phase completes only after the one before it.
        pdl.gdc_launch_dependents()
    N_QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    GROUP: tl.constexpr = HEADS // KV_HEADS
    O_K: tl.constexpr = GROUP * HEAD_SIZE
    cols = tl.arange(0, D_PAD)
    if PHASE < 0 or PHASE == 0:
        share = _weight_share(w_qkv, pid, N_QKV, D, D_PAD, A_RPP, A_STEPS, A_RPP2, 1, D)
        if PDL:
            pdl.gdc_wait()
            if EMBED:
                # The step's first phase may follow the upload of its inputs inside the graph (transfer.py's
                # upload_from_ring), which the later phases read before their waits (pdl.py): they start once
                # it is over.
                pdl.gdc_launch_dependents()
        ln = _norm_weight(w_ln, D, D_PAD)
        for r in tl.static_range(ROWS):  # the rows reuse the weights the program holds
            # the first layer's input: its rows of the embedding, gathered here (an embedding kernel and two
            # zeroing ones before this one cost a batch-1 step 701 -> 696 us on the H100, thirty-first session)
            row = tl.load(x_ids + r) if EMBED else r
            h, x = _norm_row(x_in + row * D, residual + r * D, ln, eps, D, D_PAD, not FIRST)
            if pid == 0:
                tl.store(res_mid + r * D + cols, h, mask=cols < D)
                # read by the previous layer's phase D, which has ended: this layer's phase C adds into it
                tl.store(o_sum + r * D + cols, tl.zeros([D_PAD], tl.int64), mask=cols < D)
            _gemv(w_qkv, share, pid, N_QKV, x, qkv + r * N_QKV, b_qkv, D, D_PAD, A_RPP, A_STEPS, A_RPP2, 1, QKV_BIAS,
                  D, 1, True, True)
    if PHASE < 0:
        _grid_sync(barrier, barrier_base + NPROG)
    # o_proj is split over the kv heads, as attention is (OPP programs a kv head; its NP partitions are OPP or
    # ATTENTION_SPLIT times that): each program merges some of the kv head's query-head channels from their
    # partitions itself and sums a block of W_o's rows over those columns, a split-K partial that it adds into o_sum
    # (_FIXED_ONE). Attention then ends with its partitions' stores, where the last partition of each kv head used to
    # merge after an arrival counter. On the H100 (benchmarks/results/README.md, fifteenth session) phase B alone 8.4
    # -> 6.7 us, C 4.2 -> 4.6, D 7.8 -> 8.2; the forward at 1024 / 2100 / 3500 tokens 632 / 800 / 857 -> 621 / 740 /
    # 834 us.
    o_head = tl.minimum(pid // OPP, KV_HEADS - 1)
    o_rows = tl.where(pid < KV_HEADS * OPP, D, 0)  # programs past the last kv head's load and store nothing
    OKC: tl.constexpr = O_K // O_GROUPS  # a program's columns (O_COLUMN_GROUPS)
    OKC_PAD: tl.constexpr = GROUP_P2 * HEAD_SIZE // O_GROUPS
    o_cols = pid % OPP % O_GROUPS * OKC
    o_block = pid % OPP // O_GROUPS
    if PHASE < 0 or PHASE == 2:  # o_proj's weights stream in while attention runs
        share = _weight_share(w_o + o_head * O_K + o_cols, o_block, o_rows, OKC, OKC_PAD, O_RPP, O_STEPS, O_RPP2, 1,
                              HEADS * HEAD_SIZE)
    ITEMS: tl.constexpr = KV_HEADS * (NP + NEWEST_APART)  # phase B's work items of a row
    STATS: tl.constexpr = HEADS * NP  # a row's partition maxima (and sums)
    if PHASE < 0 or PHASE == 1:
        # five launches: a program per item of each row; one launch: every program takes its item of each row
        for i in tl.static_range(ROWS if PHASE < 0 else 1):
            r = i if PHASE < 0 else pid // ITEMS
            if PHASE == 1 or pid < ITEMS:
                _attention(pid % ITEMS, qkv + r * N_QKV, q_norm_w, k_norm_w, qk_eps, scale, cos_sin_cache,
                           stride_cs, positions + r, slot_mapping + r, seq_lens + r, block_table + r * stride_bt,
                           k_cache, v_cache, stride_kb, stride_kh, stride_k2, stride_vb, stride_vh, stride_v2,
                           attn_max + r * STATS, attn_sum + r * STATS, attn_acc + r * STATS * HEAD_SIZE,
                           attn_new + r * HEADS, HEADS, KV_HEADS, HEAD_SIZE, GROUP_PAD, GROUP_P2, NP, BLOCK_SIZE,
                           BLOCK_N, LONG, NEWEST_APART, X, LAYOUT, QK_NORM, DOT_PREC, PDL)
    if PHASE < 0:
        _grid_sync(barrier, barrier_base + 2 * NPROG)
    if PHASE < 0 or PHASE == 2:
        if PDL:
            pdl.gdc_wait()
        for r in tl.static_range(ROWS):
            o = _merged_heads(o_head, o_cols, attn_max + r * STATS, attn_sum + r * STATS,
                              attn_acc + r * STATS * HEAD_SIZE, attn_new + r * HEADS,
                              qkv + r * N_QKV + (HEADS + KV_HEADS + o_head) * HEAD_SIZE, GROUP, NP, NP_PAD, HEAD_SIZE,
                              OKC_PAD)
            # rounded as the attention output the layers' o_proj reads
            o = o.to(qkv.dtype.element_ty)
            _gemv(w_o + o_head * O_K + o_cols, share, o_block, o_rows, o, o_sum + r * D, o_sum, OKC, OKC_PAD, O_RPP,
                  O_STEPS, O_RPP2, 1, False, HEADS * HEAD_SIZE, 1)
    if PHASE < 0 or PHASE == 3:
        share = _weight_share(w_gate_up, pid, INTER, D, D_PAD, U_RPP, U_STEPS, U_RPP2, 2, D, U_OUTER)
    if PHASE < 0:
        _grid_sync(barrier, barrier_base + 3 * NPROG)
    if PHASE < 0 or PHASE == 3:
        if PDL:
            pdl.gdc_wait()
        post = _norm_weight(w_post, D, D_PAD)
        for r in tl.static_range(ROWS):
            h, x = _norm_row(o_sum + r * D, res_mid + r * D, post, post_eps, D, D_PAD)
            if PDL and r == 0:
                # down_proj's programs start only now: launched with this phase's, their 6 MB of weights streamed
                # beside gate_up's 13 MB, which its programs request only as o_proj's leave the SMs. On the H100
                # (twenty-fifth session, benchmarks/results/README.md) this phase then ended 8.2 us after o_proj
                # instead of 9.0 and down_proj's 0.2 us later; the forward at 1024 / 1500 / 4000 / 8000 tokens 618 /
                # 641 / 762 / 948 -> 610 / 634 / 757 / 945 us (64 tokens: 618 -> 619).
                _launch_dependents_after(x)
            if pid == 0:
                tl.store(residual + r * D + cols, h, mask=cols < D)
            _gemv(w_gate_up, share, pid, INTER, x, act + r * INTER, act, D, D_PAD, U_RPP, U_STEPS, U_RPP2, 2, False,
                  D, 1, U_OUTER, U_PACKED)
    if PHASE < 0 or PHASE == 4:
        share = _weight_share(w_down, pid, D, INTER, INTER_PAD, E_RPP, E_STEPS, E_RPP2, 1, INTER)
    if PHASE < 0:
        _grid_sync(barrier, barrier_base + 4 * NPROG)
    if PHASE < 0 or PHASE == 4:
        if PDL:
            pdl.gdc_wait()
        for r in tl.static_range(ROWS):
            _gemv_of(w_down, share, pid, D, act + r * INTER, x_out + r * D, INTER, INTER_PAD, E_RPP, E_STEPS, E_RPP2)
    if TRACE:  # when the program started and when its last thread issued its last store
        tl.debug_barrier()
        tl.store(trace + 2 * pid, started)
        tl.store(trace + 2 * pid + 1, _globaltimer())


@dataclass
class LayerWeights:
    """One decoder layer's parameters as the kernel reads them (nn.Linear layouts: [out, in])."""
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 Hkv) D, hidden]: q, k, v rows
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's per-head norms (both or neither)
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]: gate rows, then up rows
    down: torch.Tensor
    eps: float  # of the input norm
    post_eps: float
    qk_eps: float


def _gemv_plan(n_rows: int, k: int, pairs: int, num_programs: int, itemsize: int) -> tuple[int, int, int]:
    """(RPP, STEPS, RPP2): each program takes STEPS slices of RPP consecutive rows, then RPP2 more. Where the
    program's share fits SLICE_BYTES, all of it is requested before the barrier that precedes its use: a
    power-of-two slice and a power-of-two rest (tiles are powers of two), so that a share of 24 rows is 16 + 8,
    not 32 (padded to 32 rows, Qwen3-0.6B's gate_up left a quarter of the programs idle and gave the rest a third
    more rows than an even split). Else slices of at most STEP_BYTES, each loaded while the one before is used."""
    row_bytes = pairs * triton.next_power_of_2(k) * itemsize
    need = triton.cdiv(n_rows, num_programs)
    share = triton.next_power_of_2(need)
    if share * row_bytes <= SLICE_BYTES:
        rpp = share if share == need else share // 2
        rest = need - rpp
        return rpp, 1, triton.next_power_of_2(rest) if rest else 0
    rpp = share
    while rpp > 1 and rpp * row_bytes > STEP_BYTES:
        rpp //= 2
    return rpp, share // rpp, 0


def _o_groups(num_heads: int, num_kv_heads: int, num_programs: int) -> int:
    """How many column groups o_proj's programs split a kv head's columns into (O_COLUMN_GROUPS)."""
    group, partitions = num_heads // num_kv_heads, max(1, num_programs // num_kv_heads)
    return O_COLUMN_GROUPS if group & (group - 1) == 0 and partitions % O_COLUMN_GROUPS == 0 else 1


def _plans(hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_size: int,
           itemsize: int, num_programs: int) -> tuple[int, ...]:
    """The _gemv_plan of qkv, o_proj (per kv head and column group, over its partitions' programs), gate_up and
    down, flattened."""
    q_width, kv_width = num_heads * head_size, num_kv_heads * head_size
    partitions = max(1, num_programs // num_kv_heads)
    groups = _o_groups(num_heads, num_kv_heads, num_programs)
    return (*_gemv_plan(q_width + 2 * kv_width, hidden_size, 1, num_programs, itemsize),
            *_gemv_plan(hidden_size, q_width // num_kv_heads // groups, 1, partitions // groups, itemsize),
            *_gemv_plan(intermediate_size, hidden_size, 2, num_programs, itemsize),
            *_gemv_plan(hidden_size, intermediate_size, 1, num_programs, itemsize))


def gate_up_tile(long: bool, many_keys: bool, dtype: torch.dtype) -> tuple[bool, bool]:
    """(OUTER, PACKED) of gate_up's slices (_weight_slice, _gemv_rows) in launches of this kind. Rows outer, each
    thread holds its columns of the input for every chunk: as float32 that takes Qwen3-0.6B's phase to 118 registers
    and spills under the cap of GATE_UP_REGISTERS, as bf16 pairs it fits 72 (597 instructions a thread against the
    chunks-over-warps tile's 1064 under the cap), leaving room for down_proj's programs beside it. On the H100
    (benchmarks/results/README.md, thirty-first session) the forward at 64 / 1024 / 1500 / 4000 tokens (graphs
    bounded at 1024 / 2048 / 2048 / 4096) went from 552 / 559 / 587 / 708 us to 547 / 533 / 557 / 708 with bf16
    pairs where a partition holds at most 3 BLOCK_N keys; they cost 54 us at 4000, beside attention's 8 warps. Other
    dtypes keep the chunks over the warps under the cap. The kind decides, not the row count, so that a row's sums
    stay those of its sequence alone."""
    packed = not many_keys and dtype == torch.bfloat16
    return not (long and not many_keys) or packed, packed


def default_programs(device: torch.device) -> int:
    """One program per SM, a power of two (even shares of power-of-two shapes), at most MAX_PROGRAMS."""
    return min(MAX_PROGRAMS, 1 << (_host.num_sms(device).bit_length() - 1))


class DecoderLayerKernel:
    """The kernel's plan for one model shape, built once: tile sizes, the attention split, and the scratch
    buffers every layer and step reuses (so CUDA graphs can capture it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, dtype: torch.dtype, device: torch.device, num_programs: int | None = None,
                 persistent: bool = False) -> None:
        num_programs = num_programs or default_programs(device)
        reason = self.unsupported(hidden_size, intermediate_size, num_heads, num_kv_heads, head_size, dtype,
                                  num_programs)
        if reason:
            raise ValueError(f"decoder-layer kernel: {reason}")
        self.num_programs = num_programs
        self.persistent = persistent
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.dtype = dtype
        self.o_programs = max(1, num_programs // num_kv_heads)  # phase C's programs a kv head
        self.max_partitions = ATTENTION_SPLIT * self.o_programs
        q_width, kv_width = num_heads * head_size, num_kv_heads * head_size
        itemsize = dtype.itemsize
        self.plans = plans = _plans(hidden_size, intermediate_size, num_heads, num_kv_heads, head_size, itemsize,
                                    num_programs)
        self.o_groups = _o_groups(num_heads, num_kv_heads, num_programs)
        # Which of qkv, o_proj and gate_up may take the register caps above: whole shares that fit them, o_proj's
        # beside the three [channels, NP_PAD] float tiles of its merge (_merged_heads), which grow with the query
        # group and the partitions (at Qwen3-0.6B's shape 24 KB of the 80 KB its cap leaves, with twice the
        # partitions 48: split_capped).
        def fits(plan, k_pad, pairs, held, cap):
            rpp, steps, rpp2 = plan
            return steps == 1 and (rpp + rpp2) * pairs * k_pad * itemsize + held <= (cap - 24) * 4 * NUM_WARPS * 32

        o_pad = triton.next_power_of_2(num_heads // num_kv_heads) * head_size // self.o_groups
        d_pad = triton.next_power_of_2(hidden_size)

        def o_fits(partitions):
            return fits(plans[3:6], o_pad, 1, 3 * o_pad * triton.next_power_of_2(partitions) * 4, PROJECTION_REGISTERS)
        self.capped = [fits(plans[0:3], d_pad, 1, 0, PROJECTION_REGISTERS), o_fits(self.o_programs),
                       fits(plans[6:9], d_pad, 2, 0, GATE_UP_REGISTERS)]
        self.split_capped = o_fits(self.max_partitions)

        def buf(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=device)
        self.max_rows = rows = MAX_ROWS  # the scratch buffers' rows
        self.x = buf(rows, hidden_size)  # a layer's MLP output, float32 as the split-K sums were
        self.residual = buf(rows, hidden_size, dtype=dtype)
        self.res_mid = buf(rows, hidden_size, dtype=dtype)
        self.qkv = buf(rows, q_width + 2 * kv_width, dtype=dtype)
        self.attn_stats = buf(2, rows, num_heads, self.max_partitions)
        self.attn_acc = buf(rows, num_heads, head_size, self.max_partitions)
        self.attn_new = buf(rows, num_heads)  # the newest token's scores
        self.o_sum = buf(rows, hidden_size, dtype=torch.int64)  # o_proj's output, fixed point (_FIXED_ONE)
        self.act = buf(rows, intermediate_size, dtype=dtype)
        self.barrier = buf(1, dtype=torch.int32)  # the persistent mode's
        # int64 [layers, PHASES, programs, 2] to receive each program's start and end (GPU nanoseconds) in each
        # phase's launch (programs: at least the widest launch's, launch_programs), five launches of one row only:
        # benchmarks/decode_layer.py sets it.
        self.trace: torch.Tensor | None = None

    @staticmethod
    def unsupported(hidden_size, intermediate_size, num_heads, num_kv_heads, head_size, dtype,
                    num_programs: int = MAX_PROGRAMS) -> str | None:
        """Why the kernel cannot run this shape on num_programs programs, or None. (float32 is for the CPU
        tests; the engine takes the kernel for 16-bit weights only.)"""
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype}"
        if head_size not in (64, 128, 256):
            return f"head size {head_size} (64, 128 or 256)"
        if num_heads % num_kv_heads:
            return f"{num_heads} heads over {num_kv_heads} kv heads"
        if num_kv_heads > num_programs:
            return f"{num_kv_heads} kv heads on {num_programs} programs (attention needs one per kv head)"
        for name, k in (("hidden size", hidden_size), ("intermediate size", intermediate_size)):
            if k % 16:
                return f"{name} {k} (a multiple of 16)"
        return None

    @staticmethod
    def streams_weights(hidden_size, intermediate_size, num_heads, num_kv_heads, head_size, dtype,
                        num_programs: int = MAX_PROGRAMS) -> bool:
        """Whether some projection's share of a program is too large to request whole before its phase, so that
        it streams in slices: then the layers' own kernels are faster (Llama 3 8B's shape, batch 1 on the H100:
        6.99 ms a step against 6.22; results README), and the engine does not take this kernel."""
        plans = _plans(hidden_size, intermediate_size, num_heads, num_kv_heads, head_size, dtype.itemsize,
                       num_programs)
        return any(steps > 1 for steps in plans[1::3])

    def _launch_configs(self, long: bool, many_keys: bool, nvidia: bool, rows: int = 1,
                        split: bool = False) -> list[tuple[int, dict]]:
        """(warps, register cap) of each phase's launch, the fastest measured on the H100 (the constants say where):
        long: attention has both tile sizes; many_keys: a partition may hold more than 3 BLOCK_N keys; nvidia:
        the backend takes maxnreg; split: attention has max_partitions partitions. The projections' caps are for
        one row: with more, each row's input and sums beside the held weights spill under them (Qwen3-0.6B's qkv
        300 bytes at 2 rows)."""
        attention = (ATTENTION_LONG_WARPS if many_keys else ATTENTION_WARPS,
                     dict(maxnreg=ATTENTION_REGISTERS) if nvidia and not long else {})

        def cap(projection, registers, where=True):
            capped = nvidia and where and self.capped[projection] and rows == 1
            return (NUM_WARPS, dict(maxnreg=registers) if capped else {})
        return [cap(0, PROJECTION_REGISTERS), attention, cap(1, PROJECTION_REGISTERS, not split or self.split_capped),
                cap(2, GATE_UP_REGISTERS, long and not many_keys), (NUM_WARPS, {})]

    def partitions(self, max_seq_len: int, phased: bool = True, block_n: int = BLOCK_N) -> int:
        """Attention's partitions of a kv head's cached keys in a step bounded at max_seq_len: phase C's programs
        a kv head (o_programs), ATTENTION_SPLIT times as many in five launches where that takes a partition from
        more than 3 block_n keys to at most that many (one launch has a program per item)."""
        many = triton.cdiv(max_seq_len, self.o_programs) > 3 * block_n
        if phased and many and triton.cdiv(max_seq_len, self.max_partitions) <= 3 * block_n:
            return self.max_partitions
        return self.o_programs

    def launch_programs(self, rows: int = 1, apart: bool = True, partitions: int | None = None) -> list[int]:
        """The programs of each of the five launches of a step of `rows` rows (phase B: one per row, kv head and
        partition, o_programs partitions unless given, and with the newest token's items apart one per row and kv
        head); the persistent launch has num_programs."""
        programs = [self.num_programs] * PHASES
        programs[1] = rows * self.num_kv_heads * ((partitions or self.o_programs) + apart)
        return programs

    def __call__(self, layer: int, x_in: torch.Tensor, w: LayerWeights, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, scale: float, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, max_seq_len: int,
                 phased: bool | None = None, embedding: torch.Tensor | None = None) -> None:
        """Layer `layer` of a decode step of up to max_rows sequences: x_in [rows, hidden] is its input (layer 0's
        the embedded tokens, the others' self.x's first rows), or where embedding [vocab, hidden] is given, x_in
        holds the rows' token ids and their rows of it are the input; leaves its output in the first rows of
        self.x and self.residual. Layer 0 has no residual to add. Reads the rows' positions / slot_mapping /
        seq_lens entries and block table rows; max_seq_len: a bound on their lengths (a CUDA graph's context
        bound), which sizes the attention tiles. phased: the five phases as five launches (default unless
        self.persistent; always for CPU tensors, which the interpreter runs)."""
        layout, block_size, x = _host.cache_layout(key_cache, value_cache)
        block_n = max(BLOCK_N, block_size) if x_in.is_cuda else max(16, block_size)  # CPU: several tiles
        phased = (not self.persistent or not x_in.is_cuda) if phased is None else phased
        partitions = self.partitions(max_seq_len, phased, block_n)
        long = triton.cdiv(max_seq_len, partitions) > block_n
        many_keys = triton.cdiv(max_seq_len, partitions) > 3 * block_n
        group = self.num_heads // self.num_kv_heads
        qk_norm = w.q_norm is not None
        rows = x_in.shape[0]
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"decoder-layer kernel: {rows} rows (1 to {self.max_rows})")
        consts = dict(
            ROWS=rows, D=self.hidden_size, D_PAD=triton.next_power_of_2(self.hidden_size),
            INTER=self.intermediate_size, INTER_PAD=triton.next_power_of_2(self.intermediate_size),
            HEADS=self.num_heads, KV_HEADS=self.num_kv_heads,
            HEAD_SIZE=self.head_size, GROUP_PAD=_host.pow2_at_least(group, 16),
            GROUP_P2=triton.next_power_of_2(group), OPP=self.o_programs, O_GROUPS=self.o_groups,
            **dict(zip((f"{p}_{c}" for p in "AOUE" for c in ("RPP", "STEPS", "RPP2")), self.plans)),
            BLOCK_SIZE=block_size, X=x, LAYOUT=layout,
            BLOCK_N=block_n,
            QK_NORM=qk_norm, QKV_BIAS=w.qkv_bias is not None, NPROG=self.num_programs,
            DOT_PREC=_host.dot_precision(self.dtype), num_stages=1)
        args = (x_in if embedding is None else embedding, x_in, self.residual, self.x, self.res_mid, self.qkv,
                self.attn_stats[0], self.attn_stats[1], self.attn_acc, self.attn_new, self.o_sum, self.act,
                self.barrier, layer * (PHASES - 1) * self.num_programs,
                w.input_norm, w.qkv, w.qkv if w.qkv_bias is None else w.qkv_bias,
                w.q_norm if qk_norm else w.input_norm, w.k_norm if qk_norm else w.input_norm, w.o, w.post_norm,
                w.gate_up, w.down, w.eps, w.post_eps, w.qk_eps, scale, cos_sin_cache, cos_sin_cache.stride(0),
                positions, slot_mapping, seq_lens, block_table, block_table.stride(0), key_cache, value_cache,
                *key_cache.stride()[:3],
                *value_cache.stride()[:3])
        if not phased and layer == 0:
            self.barrier.zero_()  # the layers' grid barriers count on from each other within a step
        if self.trace is not None and not (phased and x_in.is_cuda and rows == 1):
            raise ValueError("decoder-layer kernel: the trace times the five launches of one row on a GPU")
        # Phases as programmatic dependent launches (pdl.py): each phase's programs start on the SMs the previous
        # phase frees and request their weights before they wait for its results.
        dependent = pdl.options(x_in) if phased else dict(PDL=False)
        configs = self._launch_configs(long, many_keys, x_in.is_cuda and torch.version.hip is None, rows,
                                       partitions > self.o_programs)
        # the newest token's attention items apart, past the partitions' (_attention says where not)
        apart = phased and not many_keys
        u_outer, u_packed = gate_up_tile(long, many_keys, self.dtype)
        programs = self.launch_programs(rows, apart, partitions)
        if self.trace is not None and self.trace.shape[2] < max(programs):
            raise ValueError(f"decoder-layer kernel: a trace of {self.trace.shape[2]} programs a launch, where "
                             f"phase B has {programs[1]}")
        for phase in range(PHASES) if phased else (-1,):
            warps, limits = configs[phase] if phase >= 0 else (NUM_WARPS, {})
            # LONG and NP only where attention runs and is merged (gate_up's register cap follows LONG and
            # many_keys): the other phases' kernels stay one compiled variant. The projection phases contract products
            # and sums into FMAs (they are bound by their instruction issue); attention keeps RoPE's separate
            # roundings, as the layers' RoPE kernel has them (fused.py).
            trace = self.barrier if self.trace is None else self.trace[layer, phase]
            grid = (programs[phase] if phase >= 0 else self.num_programs,)
            np_ = partitions if phase in (-1, 1, 2) else self.o_programs
            _decoder_layer_kernel[grid](*args, trace=trace, TRACE=self.trace is not None, PHASE=phase,
                                        NP=np_, NP_PAD=triton.next_power_of_2(np_),
                                        U_OUTER=u_outer, U_PACKED=u_packed,
                                        LONG=long and phase in (-1, 1), NEWEST_APART=apart and phase == 1,
                                        FIRST=layer == 0 and phase < 1, EMBED=embedding is not None and phase < 1,
                                        num_warps=warps, enable_fp_fusion=phase not in (-1, 1), **limits,
                                        **dependent, **consts)
