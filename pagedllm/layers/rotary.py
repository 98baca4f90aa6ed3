"""Rotary position embedding, neox style (HF Llama's rotate_half: the two halves of each head are paired).

cos/sin for every position up to max_position are computed once; a step gathers its rows by position, so
flat batches of unrelated sequences need no per-sequence work.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.layers.norm import RMSNorm, fused_kernels

ROPE_TYPES = ("default", "linear", "llama3")


def rope_config(hf_config) -> tuple[float, dict]:
    """(theta, scaling dict) from a HF config: transformers 5 keeps both in rope_parameters, 4.x in
    rope_theta + rope_scaling; either may be absent."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    return float(theta), params


def _inv_freq(head_size: int, base: float, scaling: dict) -> torch.Tensor:
    # The exponent is computed from int64 then cast, as HF does, so the frequencies match it bit for bit.
    # On the CPU whatever the model's device: the same numbers everywhere, even while building on `meta`.
    exponent = torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size
    inv_freq = 1.0 / (base ** exponent)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 context extension: long wavelengths are slowed by `factor`, short ones kept, and the band
    between the two wavelength limits is blended linearly in 1/wavelength."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, blended, scaled)


def qk_norm_args(qk_norm: tuple[RMSNorm, RMSNorm] | None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The fused kernels' form of Qwen3's q/k norms: (q weight, k weight, eps). One eps serves both: Qwen3
    builds the two norms from the same config value."""
    return None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)


class RotaryEmbedding(nn.Module):
    """One per model, shared by its layers: the cache is max_position x head_size float32 (67 MB for
    Llama 3.1's 128K positions), too big to repeat per layer."""

    def __init__(self, head_size: int, max_position: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        self.inv_freq = _inv_freq(head_size, base, scaling or {})  # validates the scaling type up front
        # float32 whatever the model dtype; rows are cast when gathered. Not persistent: rebuilt, never loaded.
        self.register_buffer("cos_sin_cache", torch.empty(max_position, head_size, dtype=torch.float32),
                             persistent=False)
        self.reset_cache()

    def reset_cache(self) -> None:
        """Fill the cache on its device; the loader calls it again after building the model on `meta`."""
        if self.cos_sin_cache.is_meta:
            return
        positions = torch.arange(self.cos_sin_cache.shape[0], dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, self.inv_freq)
        self.cos_sin_cache.copy_(torch.cat((freqs.cos(), freqs.sin()), dim=-1))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None):
        """positions [T]; q [T, H*D], k [T, Hkv*D] -> rotated (q, k), same shapes. qk_norm: Qwen3's
        RMSNorms of each q and k head, applied before rotating (in the same kernel on the GPU).
        The fused kernels (CUDA) rotate q and k in place: pass tensors whose old values are not needed."""
        kernels = fused_kernels(q)
        if kernels is not None:
            kernels.rotary_embedding(positions, q, k, self.head_size, self.cos_sin_cache, qk_norm_args(qk_norm))
            return q, k
        if qk_norm is not None:
            q = self._per_head(qk_norm[0], q)
            k = self._per_head(qk_norm[1], k)
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(-2).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _per_head(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(x.shape[0], -1, self.head_size)).view(x.shape)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x1, x2 = x.view(shape[0], -1, self.head_size).chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).view(shape)
