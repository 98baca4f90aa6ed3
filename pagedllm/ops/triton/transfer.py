"""A decode step's small host<->device transfers as kernels that read and write pinned host memory directly
(zero-copy), instead of DMA copies.

Every engine step uploads its few hundred bytes of inputs and reads back its sampled ids. As copies, those put
the copy engines in the stream twice a step, and each hand-over between a copy engine and the SMs costs
microseconds. The pinned buffers are mapped into the device's address space (unified addressing), so a kernel
reaches them through their own pointers. On the H100 (benchmarks/results/README.md, thirty-third session): a
104-us CUDA graph with the samples copied back, a 640-byte upload and the placeholder ids' gather took 118.6 us a
step, with these kernels 110.5; the engine's batch-1 step 0.669-0.671 -> 0.663 ms, batch 2 in `bench latency`
0.850 -> 0.838 ms. Reads cross the bus at its latency, so only small transfers take these kernels (MAX_WORDS):
large ones go faster as copies. A decode graph's greedy ids need no read-back at all: its argmax writes them into a
pinned row itself (DecodeGraphs, fused.argmax). A decode graph whose inputs fit one pass uploads them itself
(upload_from_ring, the first kernel it replays), so its first phase starts beside the upload: the engine's batch-1
step 0.612 -> 0.607 ms on the H100 (forty-seventh session).
"""
import torch
import triton
import triton.language as tl

from pagedllm.ops.triton import pdl

BLOCK = 1024  # 32-bit words a program moves per iteration
MAX_WORDS = 4 * BLOCK  # larger transfers stay DMA copies
GATHER = 256  # placeholder ids gathered per iteration


@triton.jit
def _copy_words(src, dst, num_words, BLOCK: tl.constexpr):
    for start in range(0, num_words, BLOCK):
        i = start + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < num_words), mask=i < num_words)


# The counts vary from step to step: specialised on them (1, multiples of 16), a kernel would compile anew mid-run.
@triton.jit(do_not_specialize=["num_words"])
def _copy_kernel(src, dst, num_words, BLOCK: tl.constexpr):
    _copy_words(src, dst, num_words, BLOCK)


@triton.jit(do_not_specialize=["slot_words", "num_slots", "num_words", "stride_p0", "stride_p1", "n", "stride_s",
                            "stride_i"])
def _upload_kernel(host, slot_words, counter, num_slots, dev, num_words, placeholders, stride_p0, stride_p1, n,
                   sampled, stride_s, input_ids, stride_i, RING: tl.constexpr, PDL: tl.constexpr,
                   BLOCK: tl.constexpr, GATHER: tl.constexpr):
    if RING:
        # Captured in a CUDA graph, which replays it with the same host pointer each step: it reads the slot the
        # device's counter names, the one the host filled for this replay (UploadRing), and moves the counter on.
        if PDL:
            # the graph's first phase may start and request its weights; it waits for this kernel before
            # letting anything else start (decode_layer.py's EMBED)
            pdl.gdc_launch_dependents()
        slot = tl.load(counter)
        host += slot * slot_words
    _copy_words(host, dev, num_words, BLOCK)
    # The placeholder rows' ids, just written as zeros, are the previous step's samples: gathered once every
    # thread's copy is visible (the placeholders themselves are among the words copied). Columns whose source is
    # negative pad a captured graph's placeholders to its rows.
    tl.debug_barrier()
    if RING:
        # past the barrier, so that no warp can read the counter after it has moved on
        tl.store(counter, (slot + 1) % num_slots)
    for start in range(0, n, GATHER):
        j = start + tl.arange(0, GATHER)
        rows = tl.load(placeholders + j * stride_p1, mask=j < n, other=0)
        sources = tl.load(placeholders + stride_p0 + j * stride_p1, mask=j < n, other=-1)
        ok = sources >= 0
        tl.store(input_ids + rows * stride_i, tl.load(sampled + sources * stride_s, mask=ok), mask=ok)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """t's bytes as int32 words, or None where t is not contiguous or not a whole number of words."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4:
        return None
    return t.reshape(-1).view(torch.uint8).view(torch.int32)


def fits(nbytes: int) -> bool:
    """Whether a transfer of nbytes goes through these kernels rather than a copy."""
    return nbytes % 4 == 0 and nbytes <= 4 * MAX_WORDS


def upload(host: torch.Tensor, dev: torch.Tensor, placeholders: torch.Tensor | None = None, k: int = 0,
           sampled: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> None:
    """dev[:] = host[:] (uint8 of equal size that fits(); host pinned, or both on the CPU under the interpreter),
    then input_ids[placeholders[0, i]] = sampled[placeholders[1, i]] for i < k: placeholders [2, n] (int64,
    rows of input_ids) and input_ids [rows] lie in dev, the placeholders read after the copy; sampled [n]."""
    if dev.shape != host.shape or not fits(dev.numel()):
        raise ValueError(f"upload: {host.numel()} bytes into {dev.numel()} (equal, at most {4 * MAX_WORDS}, whole "
                         "32-bit words)")
    src, dst = host.view(torch.int32), dev.view(torch.int32)
    if not k:
        _copy_kernel[(1,)](src, dst, dst.numel(), BLOCK=BLOCK, num_warps=4)
        return
    if (sampled is None or placeholders is None or input_ids is None or placeholders.dim() != 2
            or not 0 < k <= placeholders.shape[1] or sampled.dim() != 1 or input_ids.dim() != 1):
        raise ValueError(f"upload: {k} placeholder ids need their samples [n], rows [2, >= {k}] and input ids [rows]")
    _upload_kernel[(1,)](src, 0, src, 1, dst, dst.numel(), placeholders, *placeholders.stride(), k, sampled,
                         sampled.stride(0), input_ids, input_ids.stride(0), RING=False, PDL=False, BLOCK=BLOCK,
                         GATHER=GATHER, num_warps=4)


def upload_from_ring(ring_slots: torch.Tensor, counter: torch.Tensor, dev: torch.Tensor, placeholders: torch.Tensor,
                     sampled: torch.Tensor, input_ids: torch.Tensor) -> None:
    """A CUDA graph's upload: dev[:] = ring_slots[counter][:dev.numel()], counter advanced round the ring, then
    input_ids[placeholders[0, i]] = sampled[placeholders[1, i]] wherever placeholders[1, i] >= 0 (i < its
    columns): ring_slots uint8 [slots, bytes] pinned (or on the CPU under the interpreter); counter int32 [1]; dev
    uint8 of at most a slot's bytes that fits() in one pass; the rest as upload() takes them."""
    words = ring_slots.shape[1] // 4
    if ring_slots.dim() != 2 or ring_slots.shape[1] % 4 or not fits(dev.numel()) or dev.numel() > 4 * words:
        raise ValueError(f"upload_from_ring: {dev.numel()} bytes from slots of {list(ring_slots.shape)} (whole "
                         f"32-bit words, at most a slot and {4 * MAX_WORDS} bytes)")
    _upload_kernel[(1,)](ring_slots.view(torch.int32), words, counter, ring_slots.shape[0], dev.view(torch.int32),
                         dev.numel() // 4, placeholders, *placeholders.stride(), placeholders.shape[1], sampled,
                         sampled.stride(0), input_ids, input_ids.stride(0), RING=True, PDL=pdl.enabled(dev),
                         BLOCK=MAX_WORDS, GATHER=GATHER, num_warps=4)


def download(host: torch.Tensor, dev: torch.Tensor) -> None:
    """host.copy_(dev, non_blocking=True), host pinned (or, under the interpreter, on the CPU): by the kernel
    where both are contiguous alike and fit(), else as that copy."""
    src, dst = _words(dev), _words(host)
    if src is None or dst is None or host.shape != dev.shape or host.dtype != dev.dtype or not fits(4 * src.numel()):
        host.copy_(dev, non_blocking=True)
        return
    _copy_kernel[(1,)](src, dst, src.numel(), BLOCK=BLOCK, num_warps=4)
