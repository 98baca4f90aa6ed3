"""RMSNorm with the residual add fused in, so each decoder layer does one pass over the hidden state.

Also home of the switch between the fused Triton kernels (pagedllm.ops.triton.fused) and the PyTorch code
that every layer here keeps: CUDA tensors take the kernels unless PAGEDLLM_FUSED=0 or `set_fused(False)`;
CPU tensors always take the PyTorch code, so CPU-only machines never import Triton.
"""
from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch
from torch import nn

FUSED_ENV_VAR = "PAGEDLLM_FUSED"

_enabled: bool | None = None  # None: read FUSED_ENV_VAR when first needed
_kernels: ModuleType | None = None


def set_fused(enabled: bool | None) -> None:
    """Use the fused kernels for CUDA tensors (True) or the PyTorch code (False); None: back to the
    environment variable (default on). Takes effect at the next forward; captured CUDA graphs keep
    whatever they captured."""
    global _enabled
    _enabled = enabled


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The fused-kernel module for layers working on `x`, or None where they run their PyTorch code."""
    global _enabled, _kernels
    if not x.is_cuda:
        return None
    if _enabled is None:
        _enabled = os.environ.get(FUSED_ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")
    if _enabled and _kernels is None:
        try:
            from pagedllm.ops.triton import fused
        except ImportError as e:
            warnings.warn(f"fused Triton kernels unavailable ({e}); layers run their PyTorch code",
                          RuntimeWarning, stacklevel=3)
            _enabled = False
            return None
        _kernels = fused
    return _kernels if _enabled else None


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32, result cast back before the weight multiply: the same rounding as HF Llama.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: returns norm(x). With residual: returns (norm(x + residual), x + residual).
        x may be a ResidualLinear's SplitKSums (only on the fused path, always with a residual)."""
        if not isinstance(x, torch.Tensor):
            return x.add_rms_norm(self.weight, self.eps, residual)
        kernels = fused_kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        # The sum is rounded to the model dtype before normalising, as HF does in its unfused residual path.
        x = x + residual
        return self._norm(x), x
