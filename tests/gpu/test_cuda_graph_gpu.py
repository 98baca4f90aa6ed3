"""Piecewise CUDA graphs against the eager forward pass, step by step: the same hidden states and K/V, and the
rows that pad a step up to a captured size never write into the cache."""
import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.shapes import SHAPES
from pagedllm.layers.attention import AttentionMetadata, set_forward_context

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16


def prefill_meta(slots, seq_lens, query_lens, tables):
    dev = "cuda"
    loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), num_decode_tokens=0,
        decode_block_tables=None, decode_seq_lens=None, decode_max_seq_len=0,
        prefill_block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        prefill_seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), prefill_query_start_loc=loc,
        prefill_max_query_len=max(query_lens), prefill_max_seq_len=max(seq_lens))


@torch.inference_mode()
def test_piecewise_step_equals_eager_and_padding_writes_nothing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen3-0.6b"]))
    llm = LLM(str(tmp_path), load_format="dummy", device="cuda", dtype="float32", num_kv_blocks=256,
              max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=2048)
    runner = llm.engine.runner
    graphs, model, layers = runner.piecewise_graphs, runner.model, runner.attn_layers
    assert graphs is not None and 1000 not in graphs.sizes
    g = torch.Generator(device="cuda").manual_seed(0)

    def step(n, first_slot, context):
        """n new tokens of one sequence whose blocks start at first_slot and that already holds `context`."""
        pos = torch.arange(context, context + n, device="cuda")
        ids = torch.randint(0, 1000, (n,), device="cuda", generator=g)
        blocks = list(range(first_slot // BLOCK, first_slot // BLOCK + (context + n + BLOCK - 1) // BLOCK))
        meta = prefill_meta([first_slot + p for p in pos.tolist()], [context + n], [n], [blocks])
        return ids, pos, meta

    def snapshot():
        return [(layer.key_cache.clone(), layer.value_cache.clone()) for layer in layers]

    # A long step fills slots 0..999 (padded to the next captured size); a short one follows in other blocks,
    # on an empty cache, so padding rows that reused the long step's slots would show up as non-zero pages.
    for n, first_slot, context in ((1000, 0, 0), (10, 1024, 0), (7, 1024, 10)):
        ids, pos, meta = step(n, first_slot, context)
        if context == 0:
            for layer in layers:
                layer.key_cache.zero_()
                layer.value_cache.zero_()
        before = snapshot()
        hidden = graphs.run(ids, pos, meta).clone()
        after = snapshot()
        for (k0, v0), (k1, v1) in zip(before, after):
            for c0, c1 in ((k0, k1), (v0, v1)):
                changed = (c0 != c1).flatten(2).any(-1)  # [blocks, heads]: "hnd" pages
                written = torch.zeros_like(changed)
                written[first_slot // BLOCK:(first_slot + context + n + BLOCK - 1) // BLOCK] = True
                assert not (changed & ~written).any(), "a padding row wrote into the cache"
        # The same step eagerly, from the state before it: equal hidden states and cache contents.
        for layer, (k, v) in zip(layers, before):
            layer.key_cache.copy_(k)
            layer.value_cache.copy_(v)
        with set_forward_context(meta):
            expected = model(ids, pos)
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
        for layer, (k, v) in zip(layers, after):
            torch.testing.assert_close(layer.key_cache, k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(layer.value_cache, v, rtol=1e-4, atol=1e-4)


def test_decode_graphs_of_each_context_bound_equal_eager(tmp_path, monkeypatch):
    """Small decode batches replay the graph captured for the smallest context bound that holds their
    longest sequence (its attention split planned for that length): the same tokens as eager steps, at every
    bound."""
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen3-0.6b"]))
    options = dict(load_format="dummy", device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=4096,
                   max_num_seqs=2)
    llm, eager = LLM(str(tmp_path), **options), LLM(str(tmp_path), enforce_eager=True, **options)
    graphs = llm.engine.runner.decode_graphs
    assert graphs.context_bounds == [512, 1024, 2048, 4096]
    used = set()
    run = graphs.run

    def recording_run(bs, max_seq_len, screened=False):
        used.add(next(b for b in graphs.bounds_of(bs) if b >= max_seq_len))
        return run(bs, max_seq_len, screened)

    monkeypatch.setattr(graphs, "run", recording_run)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for n in (100, 700, 1500, 3000):  # one request at a time: its length picks the bound
        prompt = torch.randint(0, 1000, (n,), generator=g).tolist()
        tokens = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids]
        assert tokens == [eager.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids]
    assert used == {512, 1024, 2048, 4096}
