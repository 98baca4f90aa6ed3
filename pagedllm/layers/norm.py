"""RMSNorm with the residual add fused in, so each decoder layer does one pass over the hidden state."""
from __future__ import annotations

import torch
from torch import nn


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
        """Without residual: returns norm(x). With residual: returns (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        # The sum is rounded to the model dtype before normalising, as HF does in its unfused residual path.
        x = x + residual
        return self._norm(x), x
