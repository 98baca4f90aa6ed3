"""`make cuda-check`: compile every CUDA source of pagedllm with nvcc for sm_90a, no GPU needed.

Exits 0 when all compile, 1 with the compiler output on any error, 2 when nvcc is missing (CI runs this
only where nvcc is present). One head size per kernel template is compiled, so it takes a few minutes
at most on two cores.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, uninstalled
from pagedllm.ops.cuda.build import CHECK_ARCH, SOURCES, CudaOpsUnavailable, check_compile  # noqa: E402


def main() -> int:
    start = time.perf_counter()
    try:
        check_compile()
    except CudaOpsUnavailable as e:
        print(f"cuda-check: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"cuda-check: {e}", file=sys.stderr)
        return 1
    print(f"cuda-check: {len(SOURCES)} sources compile for {CHECK_ARCH} "
          f"({time.perf_counter() - start:.0f} s): {', '.join(SOURCES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
