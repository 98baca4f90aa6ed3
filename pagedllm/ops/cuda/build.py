"""Build and load pagedllm's CUDA op library (``csrc/``) with ``torch.utils.cpp_extension`` and ninja.

First use compiles the sources for the GPU's own architecture (``sm_90a`` on Hopper) into
``~/.cache/pagedllm/cuda/<key>/`` (``$PAGEDLLM_CACHE_DIR`` overrides ``~/.cache/pagedllm``), where
``<key>`` hashes the sources, the compiler flags, the torch and CUDA versions and the architecture; later
processes load the cached library with ``torch.ops.load_library`` without compiling. Ahead of time
(e.g. right after ``pip install``, or in a container image)::

    python -m pagedllm.ops.cuda            # every visible GPU's architecture
    python -m pagedllm.ops.cuda --check    # compile-check only (no GPU or CUDA torch needed)

``--check`` (what ``make cuda-check`` runs) compiles every source with nvcc for
``sm_90a`` and ``sm_80`` on any machine with nvcc and torch's headers, one shape per kernel template for speed.

When the library cannot be had (CPU-only torch, no GPU, no nvcc or ninja, a failed compile)
:class:`CudaOpsUnavailable` (an ImportError) says why, so callers can fall back to another backend.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
# compiled; headers only enter the hash
SOURCES = ("decode.cu", "cache.cu", "decode_model.cu", "sparse_attention.cu", "registration.cpp")
NVCC_FLAGS = ("-O3", "-lineinfo")  # torch adds its own -std (C++17 or 20, matching its headers)
CXX_FLAGS = ("-O3",)
# The check compiles for Hopper, what the kernels are written for, and for Ampere, where the library must build
# too (it compiles for the GPU's own architecture): there the Hopper-only kernels are empty and refuse to launch.
CHECK_ARCHS = ("sm_90a", "sm_80")
ENV_CACHE_DIR = "PAGEDLLM_CACHE_DIR"
ENV_VERBOSE = "PAGEDLLM_CUDA_VERBOSE"
# What torch adds to every extension's nvcc command; the check mirrors it (cpp_extension.COMMON_NVCC_FLAGS).
_TORCH_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                     "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                     "--expt-relaxed-constexpr")


class CudaOpsUnavailable(ImportError):
    """The CUDA op library cannot be built or loaded here; the message says why."""


def arch_for_capability(major: int, minor: int) -> str:
    """nvcc's name for a compute capability; the arch-specific 'a' targets from Hopper on."""
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def gencode_flag(arch: str) -> str:
    number = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{number},code={arch}"


def source_files() -> list[Path]:
    """Every file the library is built from: compiled sources and the headers they include."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".cpp", ".h"))


def cache_key(arch: str, torch_version: str | None = None, cuda_version: str | None = None) -> str:
    """Hex digest naming one build: sources, flags, torch and CUDA versions, GPU architecture."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr((NVCC_FLAGS, CXX_FLAGS, arch, torch_version or torch.__version__,
                   cuda_version or torch.version.cuda)).encode())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "pagedllm") / "cuda"


def _library_name(key: str) -> str:
    return f"pagedllm_cuda_{key}"


def device_arch(device: torch.device | int | None = None) -> str:
    """Architecture of a visible GPU; CudaOpsUnavailable without a CUDA torch or a GPU."""
    if torch.version.cuda is None:
        raise CudaOpsUnavailable(f"pagedllm CUDA ops need a CUDA build of PyTorch; this torch "
                                 f"({torch.__version__}) is CPU-only")
    if not torch.cuda.is_available():
        raise CudaOpsUnavailable("pagedllm CUDA ops need an NVIDIA GPU; none is visible")
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"pagedllm CUDA ops take CUDA tensors, got tensors on {device}")
    return arch_for_capability(*torch.cuda.get_device_capability(device))


def _find_nvcc() -> str | None:
    from torch.utils import cpp_extension
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


_loaded: dict[str, str] = {}  # arch -> loaded library path


def load_library(device: torch.device | int | None = None, verbose: bool | None = None) -> str:
    """Load (building first if not cached) the op library for ``device``'s architecture; return its
    path. Safe to call repeatedly and from concurrent processes (cpp_extension locks the build dir)."""
    arch = device_arch(device)
    if arch in _loaded:
        return _loaded[arch]
    key = cache_key(arch)
    build_dir = cache_root() / key
    name = _library_name(key)
    lib = build_dir / f"{name}.so"
    if lib.exists():
        torch.ops.load_library(str(lib))
    else:
        _build(name, arch, build_dir, verbose)
    _loaded[arch] = str(lib)
    return str(lib)


def _build(name: str, arch: str, build_dir: Path, verbose: bool | None) -> None:
    from torch.utils import cpp_extension
    if _find_nvcc() is None or cpp_extension.CUDA_HOME is None:
        raise CudaOpsUnavailable("pagedllm CUDA ops are compiled on first use, but nvcc (the CUDA "
                                 "toolkit) was not found: set CUDA_HOME or put nvcc on PATH")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as e:
        raise CudaOpsUnavailable(f"pagedllm CUDA ops need ninja to build: pip install ninja ({e})") from e
    build_dir.mkdir(parents=True, exist_ok=True)
    if verbose is None:
        verbose = os.environ.get(ENV_VERBOSE, "") not in ("", "0")
    try:
        cpp_extension.load(
            name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=[*NVCC_FLAGS, gencode_flag(arch)], build_directory=str(build_dir),
            is_python_module=False, verbose=verbose)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        raise CudaOpsUnavailable(f"building pagedllm CUDA ops for {arch} in {build_dir} failed "
                                 f"(set {ENV_VERBOSE}=1 for the compiler output): {e}") from e


# ----------------------------------------------------------------------------------------------------
# Compile check (no GPU needed): what `make cuda-check` runs
# ----------------------------------------------------------------------------------------------------
def _torch_includes(tmp: Path) -> list[str]:
    """torch's header folders. CPU wheels ship the CUDA headers but not the one generated at CUDA
    build time (c10/cuda/impl/cuda_cmake_macros.h), so a stand-in goes to ``tmp`` when it is missing."""
    from torch.utils import cpp_extension
    dirs = cpp_extension.include_paths()
    if not any((Path(d) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for d in dirs):
        shim = tmp / "shim" / "c10" / "cuda" / "impl"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        dirs = [str(tmp / "shim"), *dirs]
    return [f"-I{d}" for d in dirs]


def check_command(source: Path, obj: Path, includes: list[str], nvcc: str, arch: str = CHECK_ARCHS[0]) -> list[str]:
    """The nvcc command compile-checking one source (the same flags as the real build, one shape per
    kernel template)."""
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    host = ["-Xcompiler", "-fPIC", abi]
    flags = [*NVCC_FLAGS, *_TORCH_NVCC_FLAGS, gencode_flag(arch)] if source.suffix == ".cu" else list(CXX_FLAGS)
    # C++17 keeps the sources buildable with every torch the project supports; newer torch headers
    # only warn about C++20 extensions there.
    return [nvcc, "-c", str(source), "-o", str(obj), "-std=c++17", *flags, *host, *includes,
            "-DPAGEDLLM_CHECK_BUILD", "-diag-suppress=3306", "-Xcompiler", "-Wno-c++20-extensions"]


def check_compile(sources: list[Path] | None = None, archs: tuple[str, ...] = CHECK_ARCHS,
                  jobs: int | None = None) -> None:
    """Compile every source (default: the library's) for each arch to an object file in a temporary folder;
    raise CudaOpsUnavailable without nvcc and RuntimeError with the compiler output on any error."""
    nvcc = _find_nvcc()
    if nvcc is None:
        raise CudaOpsUnavailable("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    sources = [CSRC / s for s in SOURCES] if sources is None else [Path(s) for s in sources]
    jobs_list = [(src, arch) for arch in archs for src in sources]
    with tempfile.TemporaryDirectory(prefix="pagedllm-cuda-check-") as tmp:
        includes = _torch_includes(Path(tmp))

        def run(job):
            src, arch = job
            cmd = check_command(src, Path(tmp) / f"{src.name}.{arch}.o", includes, nvcc, arch)
            return src, arch, subprocess.run(cmd, capture_output=True, text=True)

        workers = jobs or max(1, min(len(jobs_list), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(run, jobs_list))
    failed = [(src, arch, r) for src, arch, r in results if r.returncode != 0]
    if failed:
        report = "\n".join(f"--- {src.name} for {arch} (exit {r.returncode})\n{r.stdout}{r.stderr}"
                           for src, arch, r in failed)
        raise RuntimeError(f"nvcc failed on {len(failed)} of {len(jobs_list)} compiles:\n{report}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"compile-check every source for {', '.join(CHECK_ARCHS)} (no GPU needed), build nothing")
    parser.add_argument("--verbose", action="store_true", help="show the compiler output")
    args = parser.parse_args(argv)
    try:
        if args.check:
            check_compile()
            print(f"pagedllm CUDA sources compile for {', '.join(CHECK_ARCHS)}: {', '.join(SOURCES)}")
        else:
            for index in range(max(torch.cuda.device_count(), 1)):
                print(load_library(index, verbose=args.verbose))
    except (CudaOpsUnavailable, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
