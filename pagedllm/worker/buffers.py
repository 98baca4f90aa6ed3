"""Byte buffers for the small copies between host and device that every step makes: several tensors packed into
one buffer (one copy instead of one per tensor), and host buffers reused from step to step."""
from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from types import ModuleType

import numpy as np
import torch

ALIGN = 16  # bytes: every packed tensor starts where any dtype's view may start

Spec = tuple[torch.dtype, Sequence[int]]  # a packed tensor's dtype and shape
ZERO_COPY_ENV_VAR = "PAGEDLLM_ZERO_COPY"  # 0: every transfer a DMA copy (the A/B switch)


@functools.lru_cache(maxsize=None)
def zero_copy(device: torch.device) -> ModuleType | None:
    """The zero-copy transfer kernels (pagedllm.ops.triton.transfer) for a CUDA device, or None where transfers
    stay copies: other devices, no Triton, or switched off."""
    off = os.environ.get(ZERO_COPY_ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no")
    if device.type != "cuda" or torch.version.hip is not None or off:
        return None
    try:
        from pagedllm.ops.triton import transfer
    except ImportError as e:
        warnings.warn(f"zero-copy transfers unavailable ({e}); they stay copies", RuntimeWarning, stacklevel=2)
        return None
    return transfer


def packed_size(specs: Collection[Spec]) -> int:
    return _offsets(specs)[1]


def packed_views(buffer: torch.Tensor, specs: Collection[Spec]) -> list[torch.Tensor]:
    """Tensors of the given dtypes and shapes one after the other (each aligned) in a uint8 buffer."""
    return [buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for offset, (dtype, shape) in zip(_offsets(specs)[0], specs)]


def _offsets(specs: Collection[Spec]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for dtype, shape in specs:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return offsets, total


def write_packed(host: torch.Tensor, buffer: torch.Tensor, views: Iterable[torch.Tensor],
                 arrays: Iterable[np.ndarray]) -> tuple[int, int]:
    """Writes each array into the leading corner of its view's place in host, a uint8 host tensor laid out as
    buffer, the device buffer (uint8) the views lie in, each with the array's dtype. Returns the byte range
    [start, end) written (start >= end where nothing was)."""
    host_bytes, base, start, end = host.numpy(), buffer.data_ptr(), buffer.numel(), 0
    for view, a in zip(views, arrays):
        if a.size:
            offset, strides = view.data_ptr() - base, [s * a.itemsize for s in view.stride()]
            np.ndarray(a.shape, a.dtype, host_bytes, offset, strides)[...] = a
            start = min(start, offset)
            end = max(end, offset + sum((n - 1) * s for n, s in zip(a.shape, strides)) + a.itemsize)
    return start, end


class HostBuffers:
    """A few uint8 host buffers handed out round-robin, pinned on CUDA so that copies to and from them run
    asynchronously, each with an event (CUDA only) that the taker records once it has queued its copy: a step's
    small copies then cost no pinned allocation and no new event each.

    A buffer is handed out again only once its previous use is over: its event has completed (the copy ran)
    and the release given with it, if any, has returned (e.g. the copy's reader has read it)."""

    def __init__(self, device: torch.device, num_buffers: int) -> None:
        self.cuda = device.type == "cuda"
        self.slots: list[tuple[torch.Tensor, torch.cuda.Event | None] | None] = [None] * num_buffers
        self.releases: list[Callable[[], object] | None] = [None] * num_buffers
        self.next = 0

    def take(self, nbytes: int, release: Callable[[], object] | None = None
             ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        i, self.next = self.next, (self.next + 1) % len(self.slots)
        slot, previous = self.slots[i], self.releases[i]
        self.releases[i] = release
        if previous is not None:
            previous()
        if slot is not None and slot[1] is not None:
            slot[1].synchronize()
        if slot is None or slot[0].numel() < nbytes:
            size = max(nbytes, 2 * slot[0].numel()) if slot is not None else max(nbytes, 1 << 16)
            slot = self.slots[i] = (torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda),
                                    torch.cuda.Event() if self.cuda else None)
        return slot


class HostRing:
    """The rows of one pinned int64 tensor, handed out round-robin, each with an event: kernels write a row chosen
    at run time (a decode graph's argmax writes each replay's sampled ids into the slot its step uploaded), so
    the host reads them without a copy of its own. A slot is handed out again only once the reader of what was
    last written there has returned (HostBuffers' release)."""

    def __init__(self, slots: int, width: int) -> None:
        self.rows = torch.zeros(slots, width, dtype=torch.int64, pin_memory=True)
        self.events = [torch.cuda.Event() for _ in range(slots)]
        self.readers: list[Callable[[], object] | None] = [None] * slots
        self.next = 0

    def take(self) -> int:
        i, self.next = self.next, (self.next + 1) % len(self.readers)
        reader, self.readers[i] = self.readers[i], None
        if reader is not None:
            reader()
        return i


class UploadRing:
    """Pinned host slots for uploads captured in CUDA graphs (transfer.upload_from_ring). A graph replays its kernel
    with the same pointers each time, so the kernel reads the slot a device-side counter names and moves the counter
    on, while the host fills the slots in the same round-robin order: they stay in step as long as each filled slot
    is committed once the run that uploads it is queued, and nothing else runs the kernel. A slot is filled again
    only once that run has ended (its event; on the CPU, where the interpreter runs the kernel, it has)."""

    def __init__(self, device: torch.device, num_slots: int, nbytes: int) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(num_slots, -(-nbytes // ALIGN) * ALIGN, dtype=torch.uint8, pin_memory=cuda)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(num_slots)]
        self.next = 0

    def slot(self) -> torch.Tensor:
        """The slot the next run uploads; filling it again before commit() is fine (nothing ran)."""
        if self.events[self.next] is not None:
            self.events[self.next].synchronize()
        return self.host[self.next]

    def commit(self) -> None:
        """After queueing the run that uploads the slot last filled."""
        if self.events[self.next] is not None:
            self.events[self.next].record()
        self.next = (self.next + 1) % len(self.events)
