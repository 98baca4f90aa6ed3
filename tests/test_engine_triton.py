"""The engine on the Triton backend (kernels under the interpreter on CPU, the "hnd" cache layout) against
the same engine on the reference ops: greedy tokens agree through plain, chunked and prefix-cached
prefill and decode. The GPU suite repeats this at scale against transformers."""
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.shapes import model_dir_for

pytest.importorskip("triton")


def _tokens(backend, prompts, **kwargs):
    llm = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", dtype="float32", seed=5,
              attention_backend=backend, num_kv_blocks=64, block_size=16, **kwargs)
    cache_rank = {"triton": 4, "reference": 5}[backend]  # "hnd" pages vs vLLM's key layout
    assert llm.engine.runner.attn_layers[0].key_cache.dim() == cache_rank
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_triton_engine_matches_reference_engine():
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 400, (40,), generator=gen).tolist()
    prompts = [shared + [7, 8, 9], shared + [10], torch.randint(0, 400, (3,), generator=gen).tolist(),
               torch.randint(0, 400, (57,), generator=gen).tolist()]
    # A 32-token step budget splits the long prompts into chunks; the shared 40-token prefix hits the cache.
    kwargs = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    assert _tokens("triton", prompts, **kwargs) == _tokens("reference", prompts, **kwargs)
