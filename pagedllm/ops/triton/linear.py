"""x W^T as split-K partial sums, for the projections of steps of up to MAX_ROWS tokens (decode batches, short
prefills) whose output only feeds the residual stream (o_proj, down_proj): the residual RMSNorm that consumes
them sums the partials (fused.rms_norm_split_k).

These projections have narrow outputs and long inputs (Qwen3-0.6B: N = 1024, K = 2048 / 3072), so cuBLAS
covers the H100 with 16 output tiles and reads their 4-6 MB of weights at 0.7-0.9 TB/s (with the residual
norm after them 6.9 / 8.3 us at one row, benchmarks/gemm_probe.py). Here K is split so that every SM
streams a share of the weight, the weight tile is the MMA's M operand (swap-AB: a tile of 1-64 rows of x is
its N, so a batch of 1 wastes no MMA rows) and arrives by TMA. Each program stores its float32 partial;
summing them in the norm kernel, in a fixed order, keeps the result deterministic without a reduce kernel
or a semaphore (a last-program reduce inside this kernel cost ~1.5 us of tail, most of the gain). For
down_proj the MLP's SiLU-and-mul is applied as x is loaded (`gated`), so that kernel goes too.

The LM head of decode steps of up to MAX_HEAD_ROWS sequences runs the same kernel unsplit (`head_linear`).
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import pdl

# Where it wins on the H100 (benchmarks/gemm_probe.py, each projection with its residual norm): on outputs of at
# most 32 weight tiles (2048 features), which cuBLAS spreads over too few SMs, from 1 to 256 rows;
# Qwen3-0.6B's o + down went from 6.9 + 8.3 to 5.5 + 6.8 us at one row, 7.7 + 8.8 to 7.2 + 7.8 at 64, 7.5 + 9.6 to
# 5.9 + 7.9 at 128 and 7.9 + 11.4 to 6.9 + 10.3 at 256. Llama 3 8B's 4096-wide outputs already cover the GPU
# (within +-5% of cuBLAS up to 64 rows, 12-72% slower at 96-256), so they keep it.
MAX_ROWS = 256
MAX_OUTPUT_TILES = 32
# SiLU-and-mul in the loads (`gated`) is recomputed by every program of a row tile: up to 16 rows that costs less
# than the SiLU kernel (down_proj + norm 9.6 -> 8.3 us at one row); at 32 rows it breaks even and at 64 it loses
# (10.2 -> 12.5 us), so more rows take the SiLU kernel and the plain split-K GEMM.
MAX_GATED_ROWS = 16
# The LM head (N the vocabulary, K the hidden size) runs the same kernel unsplit, writing logits in the model dtype:
# its thousands of 64-row weight tiles fill the GPU, and it streams the weight at ~3.05 TB/s where cuBLAS reads it
# at ~2.8 (H100, twenty-fifth session, benchmarks/results/README.md: Qwen3-0.6B's 151936 x 1024 head at one row
# 101.8 against 111.0 us, at 32 rows 112.2 against 118.1; Llama 3 8B's 128256 x 4096 341.8 / 359.3 against 371.8 /
# 381.1). From 64 rows on each 64-row tile of x re-reads the weight and cuBLAS wins (Qwen3's head at 128 rows:
# 244 against 129 us).
MAX_HEAD_ROWS = 32


@triton.jit
def _split_k_kernel(x, w_desc, partials, M, N, K, k_per, stride_xm, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    acc = tile_sums(x, w_desc, pid_n * BN, offs_m, m_ok, pid_k * k_per, k_per, stride_xm, K, BM, BN, BK, STAGES,
                    GATED)
    tl.store(partials + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], tl.trans(acc), mask=m_ok[:, None])


@triton.jit
def tile_sums(x, w_desc, n0, offs_m, m_ok, k0, k_per, stride_xm, K, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr):
    """float32 [BN, BM] sums of weight rows n0 ... n0 + BN - 1 times rows offs_m [BM] of x over columns k0 ... k0 +
    k_per - 1. greedy_head recomputes the LM head's logits with it, bit for bit as head_linear computed them."""
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BN, BM), tl.float32)
    for k in tl.range(k0, k0 + k_per, BK, num_stages=STAGES):
        w = w_desc.load([n0, k])
        x_ptr = x + offs_m[None, :] * stride_xm + (k + offs_k)[:, None]
        if GATED:  # x = [gate | up]; rounded as fused.silu_and_mul rounds
            gate = tl.load(x_ptr, mask=m_ok[None, :], other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K, mask=m_ok[None, :], other=0.0)
            xt = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up
        else:
            xt = tl.load(x_ptr, mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    return acc


def _config(m: int, n: int, k: int):
    """(BM, BN, BK, SPLIT, num_stages, num_warps), from gemm_probe's sweeps on the H100: row tiles of at most 64
    rows (128-row tiles lost at 96-256 rows), and K split as far as the programs stay within one wave of 128
    (one per SM), 64 for 17-64 rows (split 4 beat 8 at 32 and 64 rows; 96 and 128 rows take 128 programs, 160-256
    rows 96-128: split 2 beat 4 at 192)."""
    bm = min(max(16, triton.next_power_of_2(m)), 64)
    bn, bk = 64, 128
    tiles = n // bn * triton.cdiv(m, bm)
    programs = 64 if 16 < m <= 64 else 128
    split = 1
    while split < 8 and tiles * split * 2 <= programs and k % (bk * split * 2) == 0:
        split *= 2
    return bm, bn, bk, split, 4, 4


def _tileable(x: torch.Tensor, weight: torch.Tensor, k_x: int, max_rows: int) -> bool:
    """16-bit x [..., k_x] of 1 to max_rows rows and a weight of its dtype that the 64 x 128 tiles cover and a
    TMA descriptor can read (unit inner stride, 16-byte rows and base)."""
    n, k = weight.shape
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.shape[-1] == k_x
            and 0 < x.numel() // k_x <= max_rows and x.stride(-1) == 1 and n % 64 == 0 and k % 128 == 0
            and weight.stride(1) == 1 and weight.stride(0) % 8 == 0 and weight.data_ptr() % 16 == 0)


def split_k_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      gated: bool = False) -> bool:
    """Whether the layers should take `split_k_linear` for F.linear(x, weight, bias) (gated: of
    silu_and_mul(x)): no bias, and a shape where it beats cuBLAS (MAX_ROWS, MAX_OUTPUT_TILES, MAX_GATED_ROWS)."""
    n, k = weight.shape
    return (bias is None and n // 64 <= MAX_OUTPUT_TILES
            and _tileable(x, weight, 2 * k if gated else k, MAX_GATED_ROWS if gated else MAX_ROWS))


def head_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the LM head F.linear(x, weight) should take `head_linear` (MAX_HEAD_ROWS)."""
    return _tileable(x, weight, weight.shape[1], MAX_HEAD_ROWS)


def head_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ weight [N, K]^T as [rows, N] in x's dtype (into out where given, contiguous): the kernel
    unsplit, its float32 sums rounded as they are stored."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if out is None:
        out = torch.empty(m, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(rows, weight, out, (max(16, triton.next_power_of_2(m)), 64, 128, 1, 4, 4), False)  # one row tile
    return out


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, config=None, gated: bool = False) -> torch.Tensor:
    """x [..., K] (rows may be strided), weight [N, K] -> float32 partials [SPLIT, rows, N] whose sum over
    dim 0 is x W^T. gated: x is [..., 2K] = [gate | up] and the product is of silu(gate) * up.
    config: (BM, BN, BK, SPLIT, num_stages, num_warps) instead of `_config`'s (the probe's sweep)."""
    n, k = weight.shape
    if x.shape[-1] != (2 * k if gated else k):
        raise ValueError(f"split_k_linear: x has {x.shape[-1]} features for a weight of {k} inputs (gated={gated})")
    rows = x.reshape(-1, x.shape[-1])
    config = config or _config(rows.shape[0], n, k)
    partials = torch.empty(config[3], rows.shape[0], n, dtype=torch.float32, device=x.device)
    _launch(rows, weight, partials, config, gated)
    return partials


def _launch(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config, gated: bool) -> None:
    """The kernel on rows [M, K or 2K] into out [SPLIT, M, N] (or [M, N] unsplit), stored in out's dtype."""
    n, k = weight.shape
    m = rows.shape[0]
    bm, bn, bk, split, stages, warps = config
    if n % bn or k % (bk * split):
        raise ValueError(f"split-K kernel: config {(bm, bn, bk, split)} does not tile N={n}, K={k}")
    w_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [bn, bk])
    _split_k_kernel[(n // bn, triton.cdiv(m, bm), split)](rows, w_desc, out, m, n, k, k // split, rows.stride(0),
                                                          BM=bm, BN=bn, BK=bk, STAGES=stages, GATED=gated,
                                                          num_warps=warps, enable_fp_fusion=False,
                                                          **pdl.options(rows))
