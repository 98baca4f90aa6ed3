"""CPU-side checks of the CUDA backend: build cache keys, loading from the cache, the fallback error
without a GPU or nvcc, the decode split plan, and (where nvcc exists) the compile check that
`make cuda-check` runs."""
import shutil
import types
from pathlib import Path

import pytest
import torch

from pagedllm import ops
from pagedllm.ops import cuda as cuda_ops
from pagedllm.ops.cuda import build


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """The sources in a scratch folder the test may edit."""
    dst = tmp_path / "csrc"
    shutil.copytree(build.CSRC, dst)
    monkeypatch.setattr(build, "CSRC", dst)
    return dst


def test_arch_names():
    assert build.arch_for_capability(9, 0) == "sm_90a"
    assert build.arch_for_capability(10, 0) == "sm_100a"
    assert build.arch_for_capability(8, 6) == "sm_86"
    assert build.gencode_flag("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"


def test_cache_key_tracks_sources_versions_and_arch(csrc_copy):
    key = build.cache_key("sm_90a", "2.11.0", "13.0")
    assert key == build.cache_key("sm_90a", "2.11.0", "13.0")
    assert key != build.cache_key("sm_80", "2.11.0", "13.0")
    assert key != build.cache_key("sm_90a", "2.12.0", "13.0")
    assert key != build.cache_key("sm_90a", "2.11.0", "12.8")
    header = csrc_copy / "decode_kernel.cuh"  # a header too: it is not a compiled source
    header.write_text(header.read_text() + "\n// changed\n")
    assert key != build.cache_key("sm_90a", "2.11.0", "13.0")


def test_cached_library_is_loaded_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(build, "device_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(build, "_loaded", {})
    key = build.cache_key("sm_90a")
    lib = tmp_path / "cuda" / key / f"pagedllm_cuda_{key}.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(build, "_build", lambda *a: pytest.fail("a cached library must not be rebuilt"))
    assert build.load_library() == str(lib)
    assert build.load_library() == str(lib)  # loaded once per process
    assert loaded == [str(lib)]


def test_missing_library_is_built_into_the_keyed_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(build, "device_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(build, "_loaded", {})
    calls = []
    monkeypatch.setattr(build, "_build", lambda name, arch, folder, verbose: calls.append((name, arch, folder)))
    build.load_library()
    key = build.cache_key("sm_90a")
    assert calls == [(f"pagedllm_cuda_{key}", "sm_90a", tmp_path / "cuda" / key)]


def test_unavailable_without_cuda_torch_or_gpu(monkeypatch):
    assert issubclass(build.CudaOpsUnavailable, ImportError)  # what backend choosers catch
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(build.CudaOpsUnavailable, match="CUDA build of PyTorch"):
        cuda_ops.load()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(build.CudaOpsUnavailable, match="GPU"):
        cuda_ops.load()


def test_unavailable_without_nvcc(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_find_nvcc", lambda: None)
    with pytest.raises(build.CudaOpsUnavailable, match="nvcc"):
        build._build("x", "sm_90a", tmp_path, False)
    with pytest.raises(build.CudaOpsUnavailable, match="nvcc"):
        build.check_compile()


def test_backend_cuda_raises_catchable_error_without_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    ops.set_backend("cuda")
    try:
        out = torch.zeros(1, 4, 64, dtype=torch.float16)
        with pytest.raises(ImportError, match="pagedllm CUDA ops"):
            ops.paged_attention(out, out, None, None, 4, 1.0, None, None, 16, 1, None, "auto", 1.0, 1.0)
    finally:
        ops.set_backend(None)


@pytest.mark.parametrize("num_seqs,num_kv_heads,max_seq_len,expect_split", [
    (1, 8, 32768, True), (1, 32, 32768, True), (3, 8, 100000, True), (16, 8, 4096, False),
    (256, 8, 2048, False), (64, 32, 1024, False), (4, 8, 200, False)])
def test_decode_partition_plan(num_seqs, num_kv_heads, max_seq_len, expect_split):
    """Split only when single-pass thread blocks leave SMs idle, and then fill the SMs about evenly."""
    size = cuda_ops.decode_partition_size(num_seqs, 32, num_kv_heads, max_seq_len, num_sms=132)
    assert (size > 0) == expect_split
    if size:
        assert size % 16 == 0 and cuda_ops.TUNING.min_partition <= size < max_seq_len
        blocks = num_seqs * num_kv_heads * -(-max_seq_len // size)
        assert blocks / (132 * -(-blocks // 132)) > 0.5  # SMs mostly busy in every wave


def test_check_command_mirrors_the_build_flags(tmp_path):
    cmd = build.check_command(Path("decode.cu"), tmp_path / "o", ["-Iinc"], "nvcc")
    assert build.gencode_flag(build.CHECK_ARCHS[0]) in cmd and "-DPAGEDLLM_CHECK_BUILD" in cmd
    assert all(flag in cmd for flag in build.NVCC_FLAGS) and "--expt-relaxed-constexpr" in cmd


nvcc = pytest.mark.skipif(build._find_nvcc() is None, reason="nvcc not installed")


@nvcc
def test_compile_error_is_reported(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k() { this is not cuda; }\n")
    with pytest.raises(RuntimeError, match="bad.cu"):
        build.check_compile([bad])


@nvcc
def test_every_source_compiles_for_hopper_and_ampere():
    build.check_compile()  # what `make cuda-check` runs


def test_whole_model_kernel_refuses_gpus_before_hopper(monkeypatch):
    """On an Ampere GPU the library builds with that kernel empty; the fused decode must not pick it."""
    from pagedllm.ops.cuda.decode_model import DecodeModelKernel
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cache = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    assert "Hopper" in DecodeModelKernel.unsupported(1024, 3072, 16, 8, 128, torch.bfloat16, cache)
