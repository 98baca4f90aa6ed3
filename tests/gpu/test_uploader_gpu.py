"""The model runner's one-copy uploader: arrays of mixed dtypes and shapes (empty ones included) arrive intact,
and reusing its pinned buffers never lets a later step overwrite an earlier step's data in flight; the same for
the zero-copy kernels that carry small transfers both ways."""
import numpy as np
import pytest
import torch

from pagedllm.layers.sampler import SamplerOutput
from pagedllm.worker.buffers import HostBuffers, HostRing, UploadRing, packed_size, packed_views, write_packed
from pagedllm.worker.model_runner import Uploader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_arrays_arrive_intact_through_reused_buffers():
    uploader = Uploader(torch.device("cuda"), num_buffers=2)
    rng = np.random.default_rng(0)
    sent, received = [], []
    # Keep the GPU busy so copies queue behind it while the host packs the next steps.
    busy = torch.randn(4096, 4096, device="cuda")
    for step in range(12):
        for _ in range(3):
            busy = busy @ busy / 64
        arrays = [rng.integers(-2**40, 2**40, size=rng.integers(0, 300), dtype=np.int64),
                  rng.integers(-2**30, 2**30, size=(rng.integers(0, 9), 33), dtype=np.int32),
                  np.empty((0, 5), dtype=np.int32), np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)[:, ::2],
                  rng.integers(0, 9, size=70000 * (step == 7), dtype=np.int64)]  # grows a buffer mid-run
        sent.append([a.copy() for a in arrays])
        received.append(uploader(*arrays))
        for a in arrays:
            a.fill(-1)  # the host's arrays are free to change once uploaded
    torch.cuda.synchronize()
    for want, got in zip(sent, received):
        for a, t in zip(want, got):
            assert t.device.type == "cuda" and tuple(t.shape) == a.shape
            assert t.dtype == {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}[a.dtype]
            assert np.array_equal(t.cpu().numpy(), a)


def test_zero_copy_steps_fill_placeholders_and_read_back_samples():
    """A decode graph's static inputs written by the zero-copy kernel with the placeholder ids gathered from the
    previous samples, and those samples read back into pinned buffers by the other kernel, steps queued behind a
    busy GPU while the host reuses its buffers: every step's inputs and samples arrive as they were."""
    device = torch.device("cuda")
    uploader = Uploader(device, num_buffers=2)
    assert uploader.transfer is not None
    buffers = HostBuffers(device, 2)
    rows = 4
    specs = [(torch.int64, (rows,)), (torch.int64, (2, rows)), (torch.int32, (rows, 16))]
    static = torch.zeros(packed_size(specs), dtype=torch.uint8, device=device)
    ids, placeholders, table = packed_views(static, specs)
    rng = np.random.default_rng(0)
    sampled = torch.tensor([100, 101, 102, 103], device=device)
    sampled_host = sampled.cpu().numpy()
    busy = torch.randn(4096, 4096, device=device)
    got, want, outs = [], [], []
    for step in range(10):
        busy = busy @ busy / 64
        k = int(rng.integers(0, rows + 1))
        arrays = [rng.integers(0, 1000, size=rows), np.stack([rng.permutation(rows)[:k], rng.integers(0, 4, k)]),
                  rng.integers(0, 10**6, size=(rows, 16), dtype=np.int32)]
        expected_ids = arrays[0].copy()
        expected_ids[arrays[1][0]] = sampled_host[arrays[1][1]]
        want.append((expected_ids, arrays[2].copy()))
        assert uploader.into(static, [ids, placeholders, table], arrays, (placeholders, k, sampled, ids))
        got.append((ids.clone(), table.clone()))
        sampled = sampled * 2 + ids  # the step's "samples", computed on the device from its inputs
        sampled_host = sampled_host * 2 + expected_ids
        outs.append((SamplerOutput(buffers, sampled.clone()), sampled.clone()))
    torch.cuda.synchronize()
    for (ids_want, table_want), (ids_got, table_got) in zip(want, got):
        assert ids_got.tolist() == ids_want.tolist() and np.array_equal(table_got.cpu().numpy(), table_want)
    for out, dev_ids in outs:
        assert out.token_ids == dev_ids.tolist()


def test_samples_read_from_the_ring_their_argmax_wrote():
    """A decode graph's argmax also writes the ids into the HostRing row its step uploaded (SamplerOutput's ring
    slot, no copy after the graph): steps queued behind a busy GPU, the host taking a slot again before it has
    read the output last written there, read back every step's ids as they were."""
    from pagedllm.ops.triton import fused
    device = torch.device("cuda")
    ring = HostRing(2, 4)
    buffers = HostBuffers(device, 2)
    slot_dev = torch.zeros(1, dtype=torch.int64, device=device)
    busy = torch.randn(4096, 4096, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    outs = []
    for step in range(8):
        busy = busy @ busy / 64
        slot = ring.take()  # from the third step on, reads the output two steps back first
        slot_dev.fill_(slot)
        logits = torch.randn(3, 50000, device=device, generator=gen) + busy[0, 0] * 0
        ids = torch.empty(3, dtype=torch.int64, device=device)
        fused.argmax(logits, ids, ring.rows, slot_dev)
        outs.append((SamplerOutput(buffers, ids, ring_slot=(ring, slot)), logits.argmax(-1)))
    for out, want in outs:
        assert out.token_ids == want.tolist()


def test_graph_uploads_each_step_from_the_slot_the_host_filled():
    """A CUDA graph that uploads its own inputs (DecodeGraphs.uploads_inputs): the host fills the ring's slots ahead
    of a busy GPU, each replay takes the next one with its placeholder ids gathered, and no slot is refilled before
    the replay that reads it has run."""
    from pagedllm.ops.triton import transfer
    device = torch.device("cuda")
    rows = 4
    specs = [(torch.int64, (rows,)), (torch.int64, (2, rows)), (torch.int32, (rows, 16))]
    static = torch.zeros(packed_size(specs), dtype=torch.uint8, device=device)
    ids, placeholders, table = packed_views(static, specs)
    ring = UploadRing(device, 3, static.numel())
    sampled = torch.arange(rows, dtype=torch.int64, device=device) + 100

    def step():
        transfer.upload_from_ring(ring.host, ring.counter, static, placeholders, sampled, ids)
        return (ids * 2).sum() + table.sum()

    ring.slot().zero_()
    step()  # compiles the kernel outside the capture
    ring.commit()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    rng = np.random.default_rng(0)
    busy = torch.randn(4096, 4096, device=device)
    got, want = [], []
    for _ in range(10):
        busy = busy @ busy / 64
        k = int(rng.integers(0, rows + 1))
        arrays = [rng.integers(0, 1000, size=rows), np.full((2, rows), -1),
                  rng.integers(0, 10**6, size=(rows, 16), dtype=np.int32)]
        arrays[1][:, :k] = [rng.permutation(rows)[:k], rng.integers(0, rows, k)]
        expected = arrays[0].copy()
        expected[arrays[1][0, :k]] = arrays[1][1, :k] + 100
        want.append(int(2 * expected.sum() + arrays[2].sum()))
        write_packed(ring.slot(), static, [ids, placeholders, table], arrays)
        graph.replay()
        ring.commit()
        got.append(out.clone())
    torch.cuda.synchronize()
    assert [int(t) for t in got] == want
