"""The greedy token of a decode step of one sequence without reading the whole LM head: its argmax is screened on
an int8 copy of the head, and only the 64-row tiles that can hold it are computed exactly.

At batch 1 the head is the largest read of a step (Qwen3-0.6B: 311 MB of 1.19 GB, ~101 us at the H100's 3.07 TB/s)
and head_linear already streams it at that rate. A greedy step needs only the argmax. Each row v of the head W
[V, K] is kept as int8 codes q_v with a float32 scale s_v (s_v = max |W_v| / 127), half the bytes. For a step's
x (the final norm's output) the screen computes A_v = s_v sum_j q_vj x_j, and a bound B_v on how far the
logit head_linear computes can lie from it:

    |W_v . x - A_v| <= ||W_v - s_v q_v|| ||x|| (Cauchy-Schwarz)  + float32 rounding of both sums,

with ||W_v - s_v q_v|| and ||W_v|| computed once, in float64, when the screen is built (ScreenedHead). The
largest A_v - B_v, T, is a lower bound on the largest logit. Only a row whose A_v + B_v reaches T can hold it,
or tie with it once the logits are rounded to the model dtype (head_linear's output): the threshold is T less
two units in the last place of the dtype, any logit that may round to infinity passing (threshold_terms). The pick
kernel recomputes each 64-row tile of the head holding such a row with head_linear's own code (linear.tile_sums:
same tiles, same MMA order, so the same float32 sums bit for bit), rounds the logits as head_linear stores them, and
keeps the first largest: the token head_linear + argmax would give, whatever x is (but for NaN, as argmax). Few tiles
pass: on the H100 (benchmarks/greedy_head.py), with the hidden states of a random-weight Qwen3-0.6B decoding, 7 of
its 2374 on average (15 at most), and the head + argmax took 64 us instead of 105; with random x on Llama 3 8B's head
(K = 4096 widens the bound) 145 of 2004, 217-248 us instead of 345. Many near-equal logits make more tiles pass,
which is slower, never wrong.

The screen's sums are exact integers: x goes to fixed point, X_j = x_j / u rounded, u a power of two such that
|X_j| <= XCAP (fixed_point: 16513 at K = 1024, so that no int32 sum of 127 |X_j| overflows), and dp2a
instructions multiply two 16-bit X_j by two int8 codes and add them to an int32, four a word of 8 codes; the bound
takes in the fixed point's rounding as ||s_v q_v|| ||x - X u|| (Cauchy-Schwarz). Every program computes u and X
from x (2 KB, read from the L2). The earlier screen widened each code to float32 (2^23 + u as a float's bits) for
an FMA, ~920 instructions a thread against ~600 (sm_90a SASS, 8 rows a program of 2 warps), and at the H100's 13
bytes a cycle an SM those were most of the issue slots: on the H100 (benchmarks/greedy_head.py, forty-ninth
session) the screen alone 55.9 -> 53.5 us on Qwen3-0.6B's head (2.82 -> 2.94 TB/s), 219 -> 194 us on Llama 3 8B's
(2.41 -> 2.72 TB/s), and the engine's batch-1 step 1-2.5 us shorter. The screen is a GEMV on the CUDA cores, a
program's rows and warps set by K (HEAD_CONFIGS; persistent programs streaming tiles through shared memory were no
faster). Only steps of one sequence take it: at two rows the screen held twice the registers, fewer programs fit an
SM, and it read at half the rate (108 us against head_linear's 105). It is a dependent launch of the final norm that
waits before it loads anything, so that its first programs are resident when the norm ends: the engine's batch-1
step 0.600 -> 0.598 ms on the H100 against a plain launch (fiftieth session). Programs that requested their codes
before the wait, beside the last layer's down_proj, had made the step 3-4 us slower (forty-fifth and forty-sixth
sessions, benchmarks/results/README.md). The pick's (value, index) per program is one int64 key
(fused.argmax_key), so the argmax after it reads one array: one dependent load fewer at the step's end.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import pdl
from .fused import argmax_key, argmax_of_chunks
from .linear import head_supported, tile_sums

HEAD_TILE = 64  # head_linear's weight tile (rows), the unit the pick kernel recomputes
# Launch configs by the head's columns K, the first that applies: (from K, a screening program's rows and warps, a
# pick program's head tiles and its weight tiles in flight, BK = 128 columns each). The screen: 4 rows a warp, whose
# codes then take 128 registers a thread at K = 4096 (8 rows a warp spilled); on the H100 (benchmarks/results/README.md,
# forty-ninth session) Qwen3-0.6B's head (K = 1024) took 53.5 us at 8 x 2, 53.9 at 16 x 4, Llama 3 8B's (K = 4096)
# 193.8 at 8 x 2 and 168.9 at 16 x 4 (3.12 TB/s). The pick (fiftieth session, greedy with the 8 x 2 screen):
# Qwen3-0.6B 64.3 us at 4 tiles and 4 stages, 63.4 at 16 and 5 (5 stages, 100 KB of shared memory, keep two programs
# an SM; one program's tiles are recomputed one after another, and Llama 3 8B's K widens the bound so that ~146 of its
# 2004 tiles pass: 236.2 us at 16 and 5, 223.0 at 4 and 5, 225.7 at 4 and 4).
HEAD_CONFIGS = ((4096, 16, 4, 4, 5), (0, 8, 2, 16, 5))
# The screen's programs put their largest lower bound into one of this many slots by atomic max (spread, so that
# the atomics do not queue on one address); the argmax kernel after the pick sets them back to -inf.
TOP_SLOTS = 64
# A unit in the last place of a logit rounded to the dtype, relative to it (at most 2^-7 for bfloat16's 8
# significant bits, 2^-10 for float16's 11): two normal logits that round to the same value are at most that far
# apart. Twice that, for the threshold's own float32 rounding. Below the dtype's smallest normal value the units are
# fixed (threshold_terms), and from its largest on everything rounds to infinity.
MARGIN = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}


@triton.jit
def _dot8(w, xa, xb, xc, xd, INTERPRET: tl.constexpr):
    """int32 sums of the 8 signed bytes of each w (int64: the codes of 8 columns) times x's fixed-point values, xa..xd
    holding two of those columns each as 16-bit halves (the first in the low half): four dp2a instructions."""
    if INTERPRET:  # the interpreter runs no PTX: the same integer sums, one byte at a time
        acc = tl.zeros(w.shape, tl.int32)
        for i in tl.static_range(8):
            code = ((w >> (8 * i)) & 0xFF).to(tl.int32)
            code -= (code & 0x80) << 1
            if i < 2:
                pair = xa
            elif i < 4:
                pair = xb
            elif i < 6:
                pair = xc
            else:
                pair = xd
            if i % 2 == 0:
                acc += code * ((pair << 16) >> 16)  # arithmetic shifts: signed halves
            else:
                acc += code * (pair >> 16)
        return acc
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi;
        mov.b64 {lo, hi}, $1;
        mov.b32 $0, 0;
        dp2a.lo.s32.s32 $0, $2, lo, $0;
        dp2a.hi.s32.s32 $0, $3, lo, $0;
        dp2a.lo.s32.s32 $0, $4, hi, $0;
        dp2a.hi.s32.s32 $0, $5, hi, $0;
        }""", "=r,l,r,r,r,r", [w, xa, xb, xc, xd], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _fixed_pair(lo, hi, inv, unit):
    """Two columns of x in fixed point, X = x inv rounded to the nearest integer, as the 16-bit halves of one int32;
    and their squares and squared rounding errors in units of x (||x|| and ||x - X unit|| enter the bound). Adding
    1.5 2^23 rounds x inv (|x inv| < 2^22) to an integer, which the float's low bits then hold."""
    a = lo * inv + 12582912.0
    b = hi * inv + 12582912.0
    da = lo - (a - 12582912.0) * unit
    db = hi - (b - 12582912.0) * unit
    packed = (a.to(tl.int32, bitcast=True) & 0xFFFF) | (b.to(tl.int32, bitcast=True) << 16)
    return packed, lo * lo + hi * hi, da * da + db * db


@triton.jit
def _screen_kernel(x, codes, scale, bound, hi, top, V, gamma, K: tl.constexpr, COLS_PAD: tl.constexpr,
                   XCAP: tl.constexpr, LOG2_XCAP: tl.constexpr, BN: tl.constexpr, SLOTS: tl.constexpr,
                   INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)  # before any load: see the module's docstring
    tile = tl.program_id(0)
    n = tile * BN + tl.arange(0, BN)
    n_ok = n < V
    cols = tl.arange(0, COLS_PAD)  # words of 8 codes
    c_ok = cols < K // 8
    w = tl.load(codes + n[:, None].to(tl.int64) * (K // 8) + cols[None, :], mask=n_ok[:, None] & c_ok[None, :],
                other=0)
    s = tl.load(scale + n, mask=n_ok, other=0.0)
    err = tl.load(bound + n, mask=n_ok, other=0.0)
    norm = tl.load(bound + V + n, mask=n_ok, other=0.0)
    # x in fixed point, X = x / unit rounded, unit a power of two such that |X| <= XCAP (no int32 sum of 127 |X|
    # overflows): the screen's sums are then exact integers. Each word's 8 columns, in the words' layout.
    xp = x + 8 * cols
    x0 = tl.load(xp, mask=c_ok, other=0.0).to(tl.float32)
    x1 = tl.load(xp + 1, mask=c_ok, other=0.0).to(tl.float32)
    x2 = tl.load(xp + 2, mask=c_ok, other=0.0).to(tl.float32)
    x3 = tl.load(xp + 3, mask=c_ok, other=0.0).to(tl.float32)
    x4 = tl.load(xp + 4, mask=c_ok, other=0.0).to(tl.float32)
    x5 = tl.load(xp + 5, mask=c_ok, other=0.0).to(tl.float32)
    x6 = tl.load(xp + 6, mask=c_ok, other=0.0).to(tl.float32)
    x7 = tl.load(xp + 7, mask=c_ok, other=0.0).to(tl.float32)
    largest = tl.max(tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                                tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7)))),
                     axis=0)
    # inv = 2^(LOG2_XCAP + 127 - b), b the biased exponent of largest, puts largest inv in [2^LOG2_XCAP,
    # 2^(LOG2_XCAP + 1)): halved where that passes XCAP; clamped for x near 0 (and unit's exponent in range)
    b = (largest.to(tl.int32, bitcast=True) >> 23) & 0xFF
    inv_bits = tl.minimum(tl.maximum(LOG2_XCAP + 254 - b, 2), 253)
    inv_bits = tl.where(largest * (inv_bits << 23).to(tl.float32, bitcast=True) > XCAP, inv_bits - 1, inv_bits)
    inv = (inv_bits << 23).to(tl.float32, bitcast=True)
    unit = ((254 - inv_bits) << 23).to(tl.float32, bitcast=True)  # exactly 1 / inv
    xa, sq, off = _fixed_pair(x0, x1, inv, unit)
    xb, sq_b, off_b = _fixed_pair(x2, x3, inv, unit)
    xc, sq_c, off_c = _fixed_pair(x4, x5, inv, unit)
    xd, sq_d, off_d = _fixed_pair(x6, x7, inv, unit)
    dot = tl.sum(_dot8(w, xa[None, :], xb[None, :], xc[None, :], xd[None, :], INTERPRET), axis=1)
    a = dot.to(tl.float32) * s * unit
    nx = tl.sqrt(tl.sum(sq + sq_b + sq_c + sq_d, axis=0))
    r = tl.sqrt(tl.sum(off + off_b + off_c + off_d, axis=0))
    # |W_v x - A_v| <= ||W_v - s_v q_v|| ||x|| + ||s_v q_v|| ||x - X unit|| + float32 rounding (gamma); 1 + 2^-10:
    # the bound's own rounding, the norms' included
    bound_ = (err * nx + norm * (gamma * nx + r)) * 1.0009765625
    tl.store(hi + n, a + bound_, mask=n_ok)
    tl.atomic_max(top + tile % SLOTS, tl.max(tl.where(n_ok, a - bound_, float("-inf")), axis=0), sem="relaxed")


@triton.jit
def _pick_kernel(x, w_desc, hi, top, keys, V, margin, tiny, cap, K: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, TILES: tl.constexpr, SLOTS: tl.constexpr,
                 PDL: tl.constexpr):
    pdl.start(PDL)
    part = tl.program_id(0)
    t = tl.max(tl.load(top + tl.arange(0, SLOTS)), axis=0)
    # logits within a rounding of T (relative, or absolute among the subnormals), and any that may round to infinity
    threshold = tl.minimum(t - tl.abs(t) * margin - tiny, cap)
    n = part * TILES * BN + tl.arange(0, TILES * BN)
    passed = (tl.load(hi + n, mask=n < V, other=float("-inf")) >= threshold).to(tl.int32)
    tiles = tl.max(tl.reshape(passed, [TILES, BN]), axis=1)
    tile_ids = tl.arange(0, TILES)
    offs_m = tl.arange(0, BM)  # head_linear's row tile: x's one row, and padding
    best = tl.full([], float("-inf"), tl.float32)
    best_n = tl.full([], 0, tl.int32)
    while tl.max(tiles, axis=0) > 0:  # the passing tiles in column order: on a tie the earlier one stays
        i = tl.argmax(tiles, axis=0, tie_break_left=True)
        tiles = tl.where(tile_ids == i, 0, tiles)
        n0 = (part * TILES + i) * BN
        acc = tile_sums(x, w_desc, n0, offs_m, offs_m < 1, 0, K, 0, K, BM, BN, BK, STAGES, False)
        logits = tl.sum(tl.where(offs_m[None, :] == 0, acc, 0.0), axis=1)
        logits = logits.to(x.dtype.element_ty).to(tl.float32)  # as head_linear stores them
        largest = tl.max(logits, axis=0)
        if largest > best:
            best = largest
            best_n = n0 + tl.argmax(logits, axis=0, tie_break_left=True)
    tl.store(keys + part, argmax_key(best, best_n))


def fixed_point(k: int) -> dict[str, int]:
    """The screen kernel's fixed-point constants for x of k columns: XCAP, the largest |X_j| (a 16-bit half of dp2a's
    operand, and 127 k of it within int32), and LOG2_XCAP, the largest power of two within it."""
    cap = min(2 ** 15 - 1, (2 ** 31 - 1) // (127 * k))
    return dict(XCAP=cap, LOG2_XCAP=cap.bit_length() - 1)


def head_config(k: int) -> tuple[int, int, int, int]:
    """(screen rows, screen warps, pick tiles, pick stages) for a head of k columns (HEAD_CONFIGS)."""
    return next(config[1:] for config in HEAD_CONFIGS if k >= config[0])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def threshold_terms(dtype: torch.dtype) -> tuple[float, float, float]:
    """(relative margin, absolute margin, cap) of the pick's threshold for logits of dtype: T - |T| margin - tiny,
    at most the dtype's largest finite value (a logit from there on may round to infinity, a tie)."""
    info = torch.finfo(dtype)
    return MARGIN[dtype], info.tiny, info.max


def threshold(t: float, dtype: torch.dtype) -> float:
    """The pick kernel's threshold for T = t (benchmarks and tests: which rows pass)."""
    margin, tiny, cap = threshold_terms(dtype)
    return min(t - abs(t) * margin - tiny, cap)


class ScreenedHead:
    """The int8 screen of an LM head weight [V, K] (16-bit, V a multiple of 64, K of 128: head_linear's tiles),
    built once: codes (int64 [V, K / 8], eight int8 q each), scale (float32 [V]) and bound (float32 [2, V]:
    ||W_v - s_v q_v|| and ||W_v|| + that, rounded up), and top, the slots of a step's T: V K + 12 V bytes of
    device memory (cuda_graph.screen_bytes)."""

    def __init__(self, weight: torch.Tensor) -> None:
        v, k = weight.shape
        if not head_supported(weight[:1], weight):
            raise ValueError(f"screened LM head: a {tuple(weight.shape)} {weight.dtype} weight is not one "
                             "head_linear tiles (16-bit, rows a multiple of 64, columns of 128)")
        self.weight = weight
        self.codes = torch.empty(v, k, dtype=torch.int8, device=weight.device)
        self.scale = torch.empty(v, dtype=torch.float32, device=weight.device)
        self.bound = torch.empty(2, v, dtype=torch.float32, device=weight.device)
        step = max(1, 2 ** 23 // k)  # rows a slice: its float64 temporaries take ~4 x 64 MB
        for r in range(0, v, step):
            w = weight[r:r + step].double()
            s = (w.abs().amax(dim=1) / 127).float()
            q = torch.where(s[:, None] > 0, w / s.double()[:, None], 0.0).round().clamp(-127, 127)
            err = (w - q * s.double()[:, None]).norm(dim=1)
            self.codes[r:r + step] = q.to(torch.int8)
            self.scale[r:r + step] = s
            # the float32 copies of float64 norms rounded up (2^-20 exceeds their rounding)
            self.bound[0, r:r + step] = err * (1 + 2.0 ** -20)
            self.bound[1, r:r + step] = (w.norm(dim=1) + err) * (1 + 2.0 ** -20)
        self.codes = self.codes.view(torch.int64)
        # -inf between calls: the screen's atomics raise it, the argmax after the pick resets it (so the kernels of
        # one ScreenedHead must not run on two streams at once)
        self.top = torch.full((TOP_SLOTS,), float("-inf"), device=weight.device)

    @staticmethod
    def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether greedy() takes x [rows, K] on this head weight: one row of head_linear's shapes."""
        return x.shape[0] == 1 and head_supported(x, weight)

    def _screen(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [V]: upper bounds A_v + B_v on x's logits; the largest lower bound A_v - B_v into self.top."""
        v, k = self.weight.shape
        hi = torch.empty(v, dtype=torch.float32, device=x.device)
        # Each logit head_linear or the screen sums is within 2 K 2^-24 ||W_v|| ||x|| of its exact value (float32
        # rounding of K products); twice that, and 2^-20 for the bound's own terms.
        gamma = 4 * k * 2.0 ** -24 + 2.0 ** -20
        rows, warps, _, _ = head_config(k)
        _screen_kernel[(triton.cdiv(v, rows),)](
            x, self.codes, self.scale, self.bound, hi, self.top, v, gamma, K=k, COLS_PAD=triton.next_power_of_2(k // 8),
            BN=rows, SLOTS=TOP_SLOTS, INTERPRET=_interpreted(), num_warps=warps, **fixed_point(k), **pdl.options(x))
        return hi

    def bounds(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The screen of x [1, K] on its own (benchmarks and tests): float32 [V] upper bounds A_v + B_v on the
        logits, and T, the largest lower bound A_v - B_v. Synchronises."""
        hi = self._screen(x)
        t = self.top.max().item()
        self.top.fill_(float("-inf"))
        return hi, t

    def greedy(self, x: torch.Tensor, out: torch.Tensor | None = None, host: torch.Tensor | None = None,
               host_slot: torch.Tensor | None = None) -> torch.Tensor:
        """The first index of x's largest logit, as fused.argmax(linear.head_linear(x, weight)) gives it (int64
        [1]), into out, and host's row host_slot[0], as fused.argmax writes them."""
        if not self.supported(x, self.weight):
            raise ValueError(f"screened LM head: x {tuple(x.shape)} {x.dtype} (one row of the head's "
                             f"{self.weight.shape[1]} columns, its dtype, unit stride)")
        v, k = self.weight.shape
        hi = self._screen(x)
        _, _, tiles, stages = head_config(k)
        parts = triton.cdiv(v, tiles * HEAD_TILE)
        keys = torch.empty(1, parts, dtype=torch.int64, device=x.device)
        w_desc = TensorDescriptor(self.weight, [v, k], [self.weight.stride(0), 1], [HEAD_TILE, 128])
        _pick_kernel[(parts,)](x, w_desc, hi, self.top, keys, v, *threshold_terms(x.dtype), K=k, BM=16,
                               BN=HEAD_TILE, BK=128, STAGES=stages, TILES=tiles, SLOTS=TOP_SLOTS, num_warps=4,
                               enable_fp_fusion=False, **pdl.options(x))  # head_linear's tiles
        return argmax_of_chunks(keys, out, host, host_slot, reset=self.top)

