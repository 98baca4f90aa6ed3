"""ModelRunner on the tiny random-weight model (CPU): the vectorized step inputs equal a per-token construction
through chunked prefills, prefix-cache hits and preemptions; the upload (copies or zero-copy kernels) fills
placeholder input ids from the previous samples; decode steps through the decode graphs' static inputs sample what
eager steps do."""
import json
import math
import random

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.shapes import model_dir_for
from pagedllm.layers.attention import set_forward_context
from pagedllm.worker import cuda_graph
from pagedllm.worker.cuda_graph import DecodeGraphs
from pagedllm.worker.model_runner import StepInputs


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


class EagerGraph:
    """Stands in for one of DecodeGraphs' CUDA graphs on the CPU: a replay runs the model on the static inputs."""

    def __init__(self, graphs: DecodeGraphs, key: tuple[int, int, bool], replays: list) -> None:
        self.graphs, self.key, self.replays = graphs, key, replays

    def replay(self) -> None:
        graphs, (bs, bound, screened) = self.graphs, self.key
        with set_forward_context(graphs._metadata(bs, bound)):
            graphs.outputs[self.key] = graphs._forward(bs, graphs.inputs[bs], screened)
        self.replays.append(self.key)


class ArgmaxScreen:
    """Stands in for the screened LM head (ops.triton.greedy_head, whose kernels tests/test_greedy_head.py checks):
    the argmax of the model's logits."""

    def __init__(self, model) -> None:
        self.model = model

    def greedy(self, hidden, out, *host):
        return torch.argmax(self.model.compute_logits(hidden), dim=-1, out=out)


def decode_graphs_on_cpu(runner, screen=None) -> list:
    """Gives the runner DecodeGraphs whose graphs run eagerly, with screened graphs of one row where screen is
    given; returns the list of (size, bound, screened) replayed."""
    cfg, replays = runner.config, []
    graphs = DecodeGraphs(runner.model, runner.device, cfg.max_num_seqs, cfg.max_model_len, cfg.block_size)
    graphs.screen = screen
    graphs.graphs = {key: EagerGraph(graphs, key, replays) for bs in graphs.sizes for bound in graphs.bounds_of(bs)
                     for key in [(bs, bound, False)] + [(bs, bound, True)] * graphs.has_screen(bs)}
    runner.decode_graphs = graphs
    return replays


def test_small_batches_have_a_decode_graph_per_power_of_two_context_bound():
    """A small decode batch replays the graph of the smallest bound that holds its longest sequence: at most twice
    as long, however long max_model_len is (Qwen3's 40960, Llama 3's 131072). Larger batches plan for
    max_model_len."""
    graphs = DecodeGraphs(torch.nn.Identity(), torch.device("cpu"), 64, 40960, 16)
    assert graphs.bounds_of(1) == graphs.bounds_of(32) == [512, 1024, 2048, 4096, 8192, 16384, 32768, 40960]
    assert graphs.bounds_of(48) == [40960]
    assert DecodeGraphs(torch.nn.Identity(), torch.device("cpu"), 4, 4096, 16).bounds_of(4) == [512, 1024, 2048, 4096]
    assert DecodeGraphs(torch.nn.Identity(), torch.device("cpu"), 4, 128, 16).bounds_of(4) == [16, 32, 64, 128]


@pytest.mark.parametrize("graph_step,zero_copy", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("placeholders", [[[0, 1], [2, 0]], [[1, 2], [3, 0]], [[], []]])
def test_upload_sends_the_arrays_and_fills_placeholders(graph_step, placeholders, zero_copy):
    """Into new tensors or a decode graph's static inputs (each array in its buffer's leading corner), and
    placeholder rows, 0..k-1 (one gather into them) or any others, take the previous step's samples: by copies,
    or into the static inputs by the zero-copy kernel the runner takes on CUDA, which gathers them itself (here on
    CPU tensors, under the interpreter)."""
    llm = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=64, max_num_seqs=8)
    runner = llm.engine.runner
    gathered = []
    if zero_copy:
        pytest.importorskip("triton")
        from pagedllm.ops.triton import transfer
        runner.uploader.transfer = transfer
        into = runner.uploader.into
        runner.uploader.into = lambda *a: gathered.append(into(*a)) or gathered[-1]
    decode_graphs_on_cpu(runner)
    runner.decode_graphs.buffer.fill_(0x7F)  # stale bytes that no array holds
    runner._sampled_ids = torch.tensor([10, 11, 12, 13])
    empty = np.zeros(0, dtype=np.int32)
    step = StepInputs(
        input_ids=np.array([5, 0, 0, 7]), sample_slot=np.array([2]),
        placeholders=np.array(placeholders, dtype=np.int64).reshape(2, -1),
        positions=np.array([3, 9, 17, 2]), slot_mapping=np.array([3, 25, 49, -1]), num_decodes=4,
        decode_block_tables=np.array([[0, 0], [1, 0], [2, 3], [4, 5]], dtype=np.int32),
        decode_seq_lens=np.array([4, 10, 18, 0], dtype=np.int32), prefill_block_tables=np.zeros((0, 0), np.int32),
        prefill_seq_lens=empty, prefill_query_start_loc=np.zeros(1, dtype=np.int32),
        logits_indices=np.array([0, 1, 2]))
    expected = step.input_ids.copy()
    expected[step.placeholders[0]] = runner._sampled_ids.numpy()[step.placeholders[1]]
    with torch.inference_mode():
        dev = runner._upload(step, runner.decode_graphs.inputs[4] if graph_step else None)
    for name in ("positions", "slot_mapping", "placeholders", "logits_indices", "decode_seq_lens",
                 "decode_block_tables") + (("sample_slot",) if graph_step else ()):
        want = getattr(step, name)
        assert dev[name][tuple(slice(0, n) for n in want.shape)].tolist() == want.tolist()
    assert dev["input_ids"].tolist() == expected.tolist()
    assert gathered == ([True] if zero_copy else [])


@pytest.mark.parametrize("staged", [False, True])
def test_graph_steps_sample_what_eager_steps_do(monkeypatch, staged):
    """Decode steps through DecodeGraphs' static inputs (its graphs replaced by eager runs: capturing needs a GPU)
    against eager ones: batches padded to several captured sizes whose input layouts overlap in one buffer,
    several context bounds, placeholders whose sources move as requests come and go, preemption, sampling that
    waits for each step (penalties). Staged: each graph uploads its own inputs from the ring the host fills, by
    the zero-copy kernel the graphs take on CUDA (here under the interpreter)."""
    if staged:
        pytest.importorskip("triton")
        from pagedllm.ops.triton import transfer
        monkeypatch.setattr(cuda_graph, "zero_copy", lambda device: transfer)
    options = dict(load_format="dummy", device="cpu", max_model_len=128, num_kv_blocks=24, max_num_seqs=6,
                   max_num_batched_tokens=64, block_size=8)
    graph_llm = LLM(model_dir_for("tiny"), **options)
    eager_llm = LLM(model_dir_for("tiny"), **options)
    replays = decode_graphs_on_cpu(graph_llm.engine.runner)
    graphs = graph_llm.engine.runner.decode_graphs
    assert all(graphs.uploads_inputs(bs) == staged for bs in graphs.sizes)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(2, 40))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 60), ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=40, ignore_eos=True)
    params[7] = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=30, ignore_eos=True)
    outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
               for llm in (graph_llm, eager_llm)]
    assert outputs[0] == outputs[1]
    assert {bs for bs, _, _ in replays} == {1, 2, 4, 6} and len({bound for _, bound, _ in replays}) > 1
    assert graphs.has_head(6)  # the graphs' logits and greedy ids were sampled
    assert graph_llm.engine.stats()["num_preemptions"] > 0
    if staged:  # the device's counter and the host's ring walked in step
        assert graphs.ring.counter.item() == graphs.ring.next == len(replays) % len(graphs.ring.events)


def test_capture_runs_of_staged_graphs_upload_padding(monkeypatch):
    """Capture runs each graph's forward once before capturing it and replays it once after, on padding inputs: where
    the graph uploads its own inputs, that padding is what it uploads (whatever the ring's slots held), and each
    such run moves the device's counter and the host's ring on together."""
    pytest.importorskip("triton")
    from pagedllm.ops.triton import transfer
    monkeypatch.setattr(cuda_graph, "zero_copy", lambda device: transfer)
    llm = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=64, max_num_seqs=4)
    decode_graphs_on_cpu(llm.engine.runner)
    graphs = llm.engine.runner.decode_graphs
    graphs.ring.host.zero_()  # a step writing slot 0 of every row, had the padding not been uploaded
    with torch.inference_mode():
        for bs in graphs.sizes:
            graphs._pad(bs)
            with set_forward_context(graphs._metadata(bs, graphs.bounds_of(bs)[0])):
                graphs._forward(bs, graphs.inputs[bs])
            graphs._ran(bs)
            inputs = graphs.inputs[bs]
            assert inputs["slot_mapping"].tolist() == [-1] * bs and inputs["decode_seq_lens"].tolist() == [0] * bs
            assert inputs["placeholders"].tolist() == [[-1] * bs] * 2 and inputs["input_ids"].tolist() == [0] * bs
    assert graphs.ring.counter.item() == graphs.ring.next == len(graphs.sizes) % len(graphs.ring.events)


def test_plain_greedy_steps_of_one_sequence_take_the_screened_graph():
    """A decode step of one sequence whose token is its plain argmax replays the graph of the screened LM head (no
    logits); one that samples, asks for logprobs or is still within min_tokens replays the graph with the logits,
    and the tokens are those of eager steps."""
    options = dict(load_format="dummy", device="cpu", max_model_len=128, max_num_seqs=4)
    graph_llm = LLM(model_dir_for("tiny"), **options)
    eager_llm = LLM(model_dir_for("tiny"), **options)
    runner = graph_llm.engine.runner
    replays = decode_graphs_on_cpu(runner, ArgmaxScreen(runner.model))
    prompt = [[5, 9, 2, 7]]
    cases = [(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), {True}),
             (SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True), {False}),
             (SamplingParams(temperature=0.0, logprobs=2, max_tokens=8, ignore_eos=True), {False}),
             (SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8), {False, True})]
    for params, screened in cases:
        replays.clear()
        outputs = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0] for llm in (graph_llm, eager_llm)]
        assert outputs[0].token_ids == outputs[1].token_ids and len(outputs[0].token_ids) == 8
        assert {s for bs, _, s in replays} == screened and {bs for bs, _, _ in replays} == {1}


@pytest.mark.parametrize("hidden,dtype,env,screened", [(128, torch.float16, "1", True), (128, torch.float16, "0", False),
                                                       (128, torch.float32, "1", False), (64, torch.float16, "1", False)])
def test_kv_budget_holds_room_for_the_screen_only_where_one_is_built(monkeypatch, tmp_path, hidden, dtype, env,
                                                                      screened):
    """The decode graphs' LM head screen (V x K + 12 V bytes) is taken from the KV cache's budget exactly where
    capture builds one: 16-bit heads of head_linear's tiles on the fused path, the screen not switched off."""
    from pagedllm.bench.shapes import TINY
    from pagedllm.ops.triton import fused
    monkeypatch.setattr(cuda_graph, "fused_kernels", lambda x: fused)  # as on a GPU
    monkeypatch.setenv(cuda_graph.SCREEN_ENV_VAR, env)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY, "hidden_size": hidden, "head_dim": hidden // 4}))
    model = LLM(model_dir_for(str(config)), load_format="dummy", device="cpu", dtype=dtype, max_model_len=128).engine.runner.model
    vocab, k = model.head_weight().shape
    assert cuda_graph.screen_bytes(model) == screened * (vocab * k + 12 * vocab)
    assert (cuda_graph._screened_head(model) is not None) == screened


def test_a_decode_row_reading_the_block_another_row_completes_is_marked(monkeypatch):
    """Synchronous steps: A's decode token completes its first block, which the prefix cache already offers to B,
    admitted in the same step with one token left to compute: a decode-only step in which B reads the slot A writes.
    The runner marks it (AttentionMetadata.decode_rows_share_blocks), which keeps it off the fused decoder-layer
    kernel and the decode graphs; the steps after it share no written block."""
    llm = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=256, block_size=16,
              async_scheduling=False)
    engine, marks = llm.engine, []
    metadata = engine.runner._metadata
    monkeypatch.setattr(engine.runner, "_metadata", lambda step, dev, shared=False: marks.append(
        (step.num_decodes, len(step.prefill_seq_lens), shared)) or metadata(step, dev, shared))
    prompt = list(range(1, 16))
    engine.add_request("A", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    (first,) = engine.step()
    engine.add_request("B", prompt + first.outputs[0].token_ids + [7],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    a, b = (engine.kv_cache_manager.get_block_ids(r) for r in engine.scheduler.running)
    assert a[0] == b[0]  # B took A's first block from the prefix cache
    engine.step()
    assert marks == [(0, 1, False), (2, 0, True), (2, 0, False)]
