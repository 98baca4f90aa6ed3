"""Random paged-attention inputs shared by the Triton kernel tests (CPU interpreter and GPU).

Caches are poisoned (NaN for float caches, NaN bit patterns for fp8) and then filled only at the slots
the sequences own, through the reference reshape_and_cache, so a kernel that reads a slot it should not
see (past a sequence's end, an unused block-table entry) produces NaN instead of a silently wrong number.
Block tables point at random physical blocks; their unused tail holds valid but foreign block ids.
"""
import math

import torch

from pagedllm.ops import reference

FP8_NAN_BITS = 0x7F  # a NaN in both e4m3fn and e5m2


def make_caches(seq_lens, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype, device, gen,
                k_scale=1.0, v_scale=1.0, spare_blocks=3, layout="vllm"):
    """Return (key_cache, value_cache, block_tables int32, seq_lens int32, keys, values), where keys/values
    [sum(seq_lens), kv_heads, head_size] are the cached tokens in sequence order; caches in ``layout``."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(max(blocks_per_seq), 1) + 2
    kshape, vshape, cdtype = reference.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_size, dtype,
                                                       kv_cache_dtype, layout)
    key_cache = torch.empty(kshape, dtype=cdtype, device=device)
    value_cache = torch.empty(vshape, dtype=cdtype, device=device)
    poison = FP8_NAN_BITS if cdtype == torch.uint8 else float("nan")
    key_cache.fill_(poison)
    value_cache.fill_(poison)

    perm = torch.randperm(num_blocks, generator=gen, device="cpu")
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, device="cpu")
    slots, used = [], 0
    for i, n in enumerate(seq_lens):
        own = perm[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        tables[i, :len(own)] = own
        t = torch.arange(n)
        slots.append(own[t // block_size] * block_size + t % block_size)
    slots = torch.cat(slots).to(device)
    total = int(slots.numel())
    keys = torch.randn(total, num_kv_heads, head_size, generator=gen, device="cpu").to(device, dtype)
    values = torch.randn(total, num_kv_heads, head_size, generator=gen, device="cpu").to(device, dtype)
    reference.reshape_and_cache(keys, values, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale)
    return (key_cache, value_cache, tables.to(device, torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), keys, values)


def alibi(num_heads, device):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], device=device)


def nan_like(t):
    return torch.full_like(t, float("nan"))


def assert_close(out, ref, dtype):
    """Elementwise tolerance by dtype (fp16/bf16 P and V round to 8-11 mantissa bits) and no NaN."""
    assert not torch.isnan(out).any(), "kernel left NaN (unwritten output or garbage read)"
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
