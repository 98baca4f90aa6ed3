"""The model runner's one-copy uploader: arrays of mixed dtypes and shapes (empty ones included) arrive intact,
and reusing its pinned buffers never lets a later step overwrite an earlier step's data in flight."""
import numpy as np
import pytest
import torch

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
