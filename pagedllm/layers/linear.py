"""Projections whose output only goes into the residual stream (o_proj, down_proj).

On the fused path, for steps of up to linear.MAX_ROWS tokens (decode batches, short prefills), their GEMM is
pagedllm's split-K kernel and the output stays as float32 partial sums that the next RMSNorm adds to the
residual (pagedllm.ops.triton.linear says why this beats cuBLAS there). Everywhere else (CPU, float32, longer
prefills, fused kernels off) they are nn.Linear.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.norm import fused_kernels


class SplitKSums(NamedTuple):
    """x W^T as float32 partials [parts, rows, N]; only a residual RMSNorm consumes it (RMSNorm.forward)."""
    partials: torch.Tensor

    def add_rms_norm(self, weight: torch.Tensor, eps: float, residual: torch.Tensor):
        return fused_kernels(self.partials).rms_norm_split_k(self.partials, weight, eps, residual)


class ResidualLinear(nn.Linear):

    def forward(self, x: torch.Tensor, act: SiluAndMul | None = None) -> torch.Tensor | SplitKSums:
        """act: the MLP's SiluAndMul, to apply to x = [gate | up] first; for the fewest rows the split-K GEMM
        applies it as it loads x, so it costs no kernel of its own."""
        kernels = fused_kernels(x)
        if kernels is not None and act is not None and kernels.split_k_supported(x, self.weight, self.bias, True):
            return SplitKSums(kernels.split_k_linear(x, self.weight, gated=True))
        if act is not None:
            x = act(x)
        if kernels is not None and kernels.split_k_supported(x, self.weight, self.bias):
            return SplitKSums(kernels.split_k_linear(x, self.weight))
        return F.linear(x, self.weight, self.bias)
