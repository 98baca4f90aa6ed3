"""The zero-copy transfer kernels (pagedllm.ops.triton.transfer) on CPU tensors under the interpreter: what they
move arrives bit for bit, and what they cannot move (strided, not whole 32-bit words, too large) falls back to a
copy or is refused by name. The runner's uploads through them are in test_model_runner.py; on the GPU, against
pinned memory, in tests/gpu/test_uploader_gpu.py."""
import pytest
import torch

pytest.importorskip("triton")
from pagedllm.ops.triton import transfer  # noqa: E402


@pytest.mark.parametrize("src,kernel", [
    (torch.arange(7, dtype=torch.int64) * (1 << 40), True),  # sampled ids
    (torch.randn(3, 5), True),
    (torch.arange(2 * transfer.BLOCK + 6, dtype=torch.int16), True),  # two of the kernel's iterations
    (torch.arange(12, dtype=torch.int64).view(3, 4)[:, ::2], False),  # strided
    (torch.arange(3, dtype=torch.bfloat16), False),  # 6 bytes
    (torch.arange(transfer.MAX_WORDS + 2, dtype=torch.int32), False),  # too large
])
def test_download_delivers_every_tensor(monkeypatch, src, kernel):
    launches = []

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    real = transfer._copy_kernel
    monkeypatch.setattr(transfer, "_copy_kernel", Counted())
    host = torch.full(src.shape, -1, dtype=src.dtype)
    transfer.download(host, src)
    assert torch.equal(host, src) and len(launches) == kernel


def test_upload_copies_then_gathers_past_one_iteration():
    """k placeholders beyond one gather iteration; rows in any order, the ids past them untouched."""
    n = transfer.GATHER + 44
    rows, sources = torch.randperm(n + 8)[:n], torch.randint(0, 50, (n,))
    dev = torch.zeros(8 * (3 * n + 8), dtype=torch.uint8)
    ids, placeholders = dev[:8 * (n + 8)].view(torch.int64), dev[8 * (n + 8):].view(torch.int64).view(2, n)
    host = torch.empty_like(dev)
    host[:8 * (n + 8)].view(torch.int64).copy_(torch.arange(n + 8) + 1000)  # placeholder rows arrive as their ids
    host[8 * (n + 8):].view(torch.int64).view(2, n).copy_(torch.stack([rows, sources]))
    sampled = (torch.arange(100) * 7)[::2]  # strided, as any view of the samples may be
    transfer.upload(host, dev, placeholders, n, sampled, ids)
    expected = torch.arange(n + 8) + 1000
    expected[rows] = sampled[sources]
    assert torch.equal(ids, expected) and torch.equal(placeholders, torch.stack([rows, sources]))


def test_ring_upload_takes_the_slot_its_counter_names_and_skips_padding_columns():
    """A graph's upload replays with the same arguments: each run copies the next slot round the ring, then gathers
    only the placeholder columns with a source (-1 pads them to the graph's rows)."""
    rows, slots = 4, 3
    dev = torch.zeros(8 * 3 * rows, dtype=torch.uint8)
    ids, placeholders = dev[:8 * rows].view(torch.int64), dev[8 * rows:].view(torch.int64).view(2, rows)
    ring = torch.zeros(slots, dev.numel() + 16, dtype=torch.uint8)
    for s in range(slots):
        ring[s, :8 * rows].view(torch.int64).copy_(torch.arange(rows) + 100 * s)
        ring[s, 8 * rows:dev.numel()].view(torch.int64).view(2, rows).copy_(
            torch.tensor([[s, -1, -1, -1], [s + 1, -1, -1, -1]]))
    counter = torch.zeros(1, dtype=torch.int32)
    sampled = torch.arange(10) * -1 - 1
    for run in range(slots + 2):
        transfer.upload_from_ring(ring, counter, dev, placeholders, sampled, ids)
        s = run % slots
        expected = torch.arange(rows) + 100 * s
        expected[s] = sampled[s + 1]
        assert torch.equal(ids, expected) and counter.item() == (run + 1) % slots
    with pytest.raises(ValueError, match="from slots of"):
        transfer.upload_from_ring(ring[:, :16], counter, dev, placeholders, sampled, ids)


def test_upload_refuses_what_it_cannot_move():
    with pytest.raises(ValueError, match="bytes into"):
        transfer.upload(torch.zeros(8, dtype=torch.uint8), torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes into"):
        big = torch.zeros(4 * transfer.MAX_WORDS + 4, dtype=torch.uint8)
        transfer.upload(big, big.clone())
    with pytest.raises(ValueError, match="placeholder ids"):
        dev = torch.zeros(32, dtype=torch.uint8)
        transfer.upload(dev.clone(), dev, dev[:16].view(torch.int64).view(2, 1), 2, torch.zeros(4, dtype=torch.int64),
                        dev[16:].view(torch.int64))
