"""ModelRunner.prepare: the vectorized step inputs equal a per-token construction, through chunked prefills,
prefix-cache hits and preemptions (tiny random-weight model, CPU)."""
import math
import random

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.shapes import model_dir_for


def reference_inputs(items, block_ids_of, bs):
    """The plain way: one Python iteration per token."""
    ids, pos, slots, logits_indices, tables, seq_lens, query_start = [], [], [], [], [], [], [0]
    for it in items:
        start, end = it.num_computed_tokens, it.num_computed_tokens + it.num_new_tokens
        block_ids = block_ids_of(it.request)
        for p in range(start, end):
            # A token still on its way from the previous step: the device fills it in (see check_step).
            ids.append(it.request.all_token_ids[p] if p < it.request.num_tokens else 0)
            pos.append(p)
            slots.append(block_ids[p // bs] * bs + p % bs)
        if it.sample:
            logits_indices.append(len(ids) - 1)
        tables.append(block_ids[:math.ceil(end / bs)])
        seq_lens.append(end)
        if it.num_new_tokens != 1:
            query_start.append(query_start[-1] + it.num_new_tokens)
    return ids, pos, slots, logits_indices, tables, seq_lens, query_start


def check_step(step, items, block_ids_of, bs, num_rows, sampled_rows):
    ids, pos, slots, logits_indices, tables, seq_lens, query_start = reference_inputs(items, block_ids_of, bs)
    nd = step.num_decodes
    waiting = [[i, sampled_rows[it.request.request_id]] for i, it in enumerate(items)
               if it.num_computed_tokens == it.request.num_tokens]
    assert step.placeholders.T.tolist() == waiting and all(i < nd for i, _ in waiting)
    pad = max(num_rows - nd, 0)
    assert nd == sum(it.num_new_tokens == 1 for it in items)
    # A padded decode-only step: extra rows write nowhere and attend to nothing.
    assert step.input_ids.tolist() == ids[:nd] + [0] * pad + ids[nd:]
    assert step.positions.tolist() == pos[:nd] + [0] * pad + pos[nd:]
    assert step.slot_mapping.tolist() == slots[:nd] + [-1] * pad + slots[nd:]
    assert step.decode_seq_lens.tolist() == seq_lens[:nd] + [0] * pad
    assert step.prefill_seq_lens.tolist() == seq_lens[nd:]
    assert step.prefill_query_start_loc.tolist() == query_start
    assert step.logits_indices.tolist() == logits_indices
    for table, rows in ((step.decode_block_tables, tables[:nd]), (step.prefill_block_tables, tables[nd:])):
        assert table.dtype == np.int32 and table.shape[1] == max(map(len, rows), default=0)
        # Kernels read a row only up to its own blocks; what lies past them does not matter.
        for got, want in zip(table, rows):
            assert got[:len(want)].tolist() == want
        assert not table[len(rows):].any()


@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=30, max_num_batched_tokens=48, max_num_seqs=8),  # chunking and preemption
    dict(block_size=8, max_num_batched_tokens=512),  # prefix hits
])
def test_prepare_matches_a_per_token_reference(options):
    llm = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=256, **options)
    engine = llm.engine
    runner, kv, bs = engine.runner, engine.kv_cache_manager, engine.config.block_size
    prepare = runner.prepare
    checked = {"steps": 0, "padded": 0, "placeholders": 0}

    def checked_prepare(items, blocks_of, num_rows=0):
        step = prepare(items, blocks_of, num_rows)
        check_step(step, items, kv.get_block_ids, bs, num_rows, runner._sampled_rows)
        if step.num_decodes == len(items):
            # What a CUDA graph of the next captured size gets.
            check_step(prepare(items, blocks_of, len(items) + 3), items, kv.get_block_ids, bs, len(items) + 3,
                       runner._sampled_rows)
            checked["padded"] += 1
        checked["steps"] += 1
        checked["placeholders"] += step.placeholders.shape[1]
        return step

    runner.prepare = checked_prepare
    rng = random.Random(0)
    shared = [rng.randrange(512) for _ in range(40)]
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 70))] for _ in range(10)]
    prompts += [shared + [i] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert checked["steps"] > 10 and checked["padded"] > 0 and checked["placeholders"] > 0
    if "num_kv_blocks" in options:
        assert engine.stats()["num_preemptions"] > 0
    else:
        assert engine.stats()["prefix_cache_hits"] > 0
