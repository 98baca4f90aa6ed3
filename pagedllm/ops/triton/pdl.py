"""Programmatic dependent launch (PDL, Hopper on) for the kernels of a decode step.

Inside a CUDA graph a kernel boundary still costs the next kernel's launch, its ramp-up and the previous
kernel's tail (~1-3 us at decode sizes on the H100). A kernel launched with `launch_pdl=True` may start as
soon as every program of the kernel before it has called `gdc_launch_dependents`; it must call `gdc_wait`,
which returns once that kernel has completed and its writes are visible, before it reads or writes anything
an earlier kernel touches. Work before the wait may only read what no kernel of the step writes: the
weights; and, in a decode step whose first kernel is a plain launch (the embedding) or lets the next kernel
start only after its wait (the decoder-layer kernel's first phase), the step's metadata (positions, seq_lens,
slots, block tables: uploaded before that kernel) and the K/V that earlier steps cached. Not the token ids (a
decode's token id can be the previous step's sample). A kernel that waits completes only after the one before
it, so the ordering stays transitive however many kernels start early; kernels launched without the attribute
(cuBLAS, PyTorch) wait for their predecessor in full as always.

`PAGEDLLM_PDL=0` launches everything plainly (the A/B switch of benchmarks/results/README.md).
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV_VAR = "PAGEDLLM_PDL"


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels working on x launch as programmatic dependents: NVIDIA GPUs of compute capability 9+,
    not under the Triton interpreter (which has no grid dependency control), not switched off."""
    if (not x.is_cuda or torch.version.hip is not None or os.environ.get("TRITON_INTERPRET", "0") == "1"
            or os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no")):
        return False
    return _device_supports(x.device.index if x.device.index is not None else torch.cuda.current_device())


def options(x: torch.Tensor) -> dict:
    """Launch keywords of a kernel with a `PDL` constexpr, for tensors like x. `launch_pdl` is passed only
    when set: backends without the option (AMD's) reject the keyword itself."""
    return dict(PDL=True, launch_pdl=True) if enabled(x) else dict(PDL=False)


@triton.jit
def start(PDL: tl.constexpr):
    """At the top of a kernel that needs its predecessor's results from the start: let the next kernel launch,
    then wait for the previous one. Meant for short kernels: the next kernel's programs sit resident and waiting
    beside this one's for its whole run. The paged decode kernel lost 4-20% of its bandwidth that way on the H100,
    so it lets the next kernel launch only after its K/V loop."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


__all__ = ["ENV_VAR", "enabled", "options", "start", "gdc_launch_dependents", "gdc_wait"]
