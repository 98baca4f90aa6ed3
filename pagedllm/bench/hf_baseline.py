"""Hugging Face transformers baseline: the same prompts through its `generate` (static batches, left padding)
and through its continuous batching (`generate_batch`), greedy, every request producing exactly output_len
tokens. The model is built from the same config.json with its own random weights: they differ from ours,
which does not matter for speed. Uses only APIs present in transformers 5.17 and later."""
from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from pagedllm.bench.roofline import synchronize

PAD_ID = 0


def load_hf_model(model_dir: str, dtype: torch.dtype, device: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    # Built on the device directly: initialising an 8B model on the CPU first would take minutes.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], output_len: int, batch_size: int, use_tqdm: bool) -> dict:
    from transformers import GenerationConfig
    # min_new_tokens = max_new_tokens is HF's ignore_eos: no row stops early, so every row is real work.
    gen = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                           pad_token_id=PAD_ID)
    device = model.device
    elapsed = 0.0
    generated = 0
    for start in tqdm(range(0, len(prompts), batch_size), desc="HF generate batches", disable=not use_tqdm):
        batch = prompts[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        synchronize(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        synchronize(device)
        elapsed += time.perf_counter() - t0
        generated += (out.shape[1] - width) * len(batch)
    return _rates(prompts, generated, elapsed) | {"batch_size": batch_size}


def hf_continuous_batching(model, prompts: list[list[int]], output_len: int, use_tqdm: bool) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    # eos_token_id=-1 turns EOS off in its continuous batching.
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID)
    # Its paged cache (blocks of 256 tokens) holds every request at full length, and its token budget per step
    # is its own default (8192, as ours). Left to size itself from free memory, a CPU run spends minutes
    # filling a static attention mask of that size.
    num_blocks = sum(math.ceil((len(p) + output_len) / 256) for p in prompts) + len(prompts)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=min(8192, sum(map(len, prompts))))
    synchronize(model.device)
    t0 = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=use_tqdm)
    synchronize(model.device)
    elapsed = time.perf_counter() - t0
    errors = [r.error for r in results.values() if r.error is not None]
    if len(results) != len(prompts) or errors:
        raise RuntimeError(f"transformers generate_batch finished {len(results)} of {len(prompts)} requests; "
                           f"errors: {errors[:3]}")
    generated = sum(len(r.generated_tokens) for r in results.values())
    return _rates(prompts, generated, elapsed)


def _rates(prompts: list[list[int]], generated: int, elapsed: float) -> dict:
    return {"elapsed_s": elapsed, "output_tokens": generated, "output_tok_s": generated / elapsed,
            "total_tok_s": (sum(map(len, prompts)) + generated) / elapsed}
