"""``python -m pagedllm.ops.cuda [--check]``: build the CUDA op library ahead of time (see build.py)."""
import sys

from pagedllm.ops.cuda.build import main

sys.exit(main())
