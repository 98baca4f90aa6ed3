"""End-to-end engine behaviour on the real SmolLM2-135M-Instruct model (CPU, float32)."""
import os
import time

import pytest
import torch

from conftest import MODEL, long_text, smollm2_gguf_path
from pagedllm import LLM, SamplingParams
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def chat_ids(tokenizer, content):
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    raw = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           long_text(3600)]
    ids = [tok(p).input_ids for p in raw]
    ids += [chat_ids(tok, c) for c in ("What is 2+2?", "Name three colors.", "Write a haiku about autumn.",
                                       "Summarize this code:\n" + long_text(3000))]
    assert any(len(p) > 900 for p in ids) and any(len(p) < 20 for p in ids)
    return ids


@pytest.fixture(scope="module")
def hf_greedy(prompts):
    from transformers import AutoModelForCausalLM
    path = smollm2_gguf_path()
    import os
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)
            outs.append(gen[0, len(ids):].tolist())
    return outs


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_batched_and_one_at_a_time(llm, prompts, hf_greedy):
    batched = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    single = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    for ours, theirs in zip(batched, hf_greedy):
        # HF keeps the EOS token in its output; so do we.
        assert ours == theirs
    assert single == batched


def test_prefix_caching_does_not_change_outputs_and_hits(prompts):
    shared = prompts[3][:600]
    workload = [shared + tail for tail in ([11, 12, 13], [21, 22], [31], [41, 42, 43, 44])]
    cached = LLM(MODEL, dtype="float32", enable_prefix_caching=True)
    plain = LLM(MODEL, dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = token_ids(cached.generate(workload, params, use_tqdm=False))
    before = cached.engine.stats()
    second = token_ids(cached.generate(workload, params, use_tqdm=False))
    after = cached.engine.stats()
    expected = token_ids(plain.generate(workload, params, use_tqdm=False))
    assert first == second == expected
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits >= 0.9 * len(shared) * len(workload)
    assert plain.engine.stats()["prefix_cache_hits"] == 0
    assert cached.engine.stats()["kv_cache_usage_perc"] == 0.0


def test_preemption_does_not_change_outputs(prompts):
    workload = [p[:80] for p in prompts[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = LLM(MODEL, dtype="float32")
    tiny = LLM(MODEL, dtype="float32", num_kv_blocks=24, block_size=16)
    expected = token_ids(big.generate(workload, params, use_tqdm=False))
    got = token_ids(tiny.generate(workload, params, use_tqdm=False))
    assert tiny.engine.stats()["num_preemptions"] > 0
    assert got == expected
    assert tiny.engine.kv_cache_manager.num_free_blocks == 24


def test_tiny_token_budget_forces_chunked_prefill(llm, prompts):
    chunked = LLM(MODEL, dtype="float32", max_num_batched_tokens=32)
    workload = [prompts[0], prompts[3][:300], prompts[4]]
    assert token_ids(chunked.generate(workload, GREEDY, use_tqdm=False)) == \
        token_ids(llm.generate(workload, GREEDY, use_tqdm=False))


def test_bad_requests_are_rejected_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * (llm.engine.config.max_model_len + 5)], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], use_tqdm=False)
    # More logprobs than vLLM's max_logprobs (20) is refused up front, not inside a step (where a top-k past
    # the vocabulary would fail).
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate(["Hello"], SamplingParams(logprobs=100000), use_tqdm=False)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(MODEL, no_such_option=1)
    with pytest.raises(ValueError, match="cudagraph_mode"):
        LLM(MODEL, cudagraph_mode="full")
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.stats()["kv_cache_usage_perc"] == 0.0


def test_a_kv_cache_sized_below_max_model_len_is_refused_at_start():
    """As vLLM: where the memory left holds fewer tokens than max_model_len, the engine does not start (a sequence
    of that length could never run), naming what to change; num_kv_blocks set by hand still starts (a request that
    cannot fit the pool is then refused by itself)."""
    from pagedllm.bench.shapes import model_dir_for
    options = dict(load_format="dummy", device="cpu", block_size=16)
    per_block = LLM(model_dir_for("tiny"), max_model_len=64, **options).engine.runner._bytes_per_block()
    space = 3.5 * per_block / 2 ** 30  # three blocks: 48 tokens
    with pytest.raises(ValueError, match="holds 48 tokens, fewer than max_model_len=64"):
        LLM(model_dir_for("tiny"), max_model_len=64, cpu_kv_cache_space_gb=space, **options)
    for sized in (dict(max_model_len=48, cpu_kv_cache_space_gb=space), dict(max_model_len=64, num_kv_blocks=3)):
        assert LLM(model_dir_for("tiny"), **sized, **options).engine.runner.num_blocks == 3


def test_stop_strings_without_a_tokenizer_are_refused():
    """Stop strings are matched in the detokenized text: a model without a tokenizer refuses them rather than
    ignoring them, naming stop_token_ids, and keeps serving."""
    from pagedllm.bench.shapes import model_dir_for
    tiny = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=64)
    assert tiny.engine.tokenizer is None
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
    out = tiny.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and tiny.engine.kv_cache_manager.usage == 0.0


def test_request_larger_than_the_pool_is_rejected():
    small = LLM(MODEL, dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError):
        small.generate(["Hello " * 10], SamplingParams(max_tokens=200), use_tqdm=False)
    out = small.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_sampling_options_end_to_end(llm):
    p = "Tell me a story about a dragon."
    a = llm.generate([p], SamplingParams(temperature=0.8, seed=42, max_tokens=12), use_tqdm=False)
    b = llm.generate([p, "Other prompt", "More"], SamplingParams(temperature=0.8, seed=42, max_tokens=12),
                     use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids

    n2 = llm.generate([p], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=10), use_tqdm=False)[0]
    assert [c.index for c in n2.outputs] == [0, 1]
    assert n2.outputs[0].token_ids != n2.outputs[1].token_ids

    fixed = llm.generate([p], SamplingParams(ignore_eos=True, max_tokens=7, temperature=0.0), use_tqdm=False)
    assert len(fixed[0].outputs[0].token_ids) == 7 and fixed[0].outputs[0].finish_reason == "length"

    params = SamplingParams(logprobs=3, max_tokens=4, temperature=0.0, ignore_eos=True)
    lp = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
    assert len(lp.logprobs) == 4
    tokenizer = llm.get_tokenizer()
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert tok in entry and len(entry) >= 3 and all(v.logprob <= 0 for v in entry.values())
        # vLLM's Logprob: greedy picks the most likely token, rank 1; every entry carries its token's text
        assert entry[tok].rank == 1 and entry[tok].logprob == max(v.logprob for v in entry.values())
        assert sorted(v.rank for v in entry.values()) == [1, 2, 3]
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in entry.items())
    assert lp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(lp.token_ids, lp.logprobs)))


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    text = base[0].outputs[0].text
    assert " 7" in text, text
    stopped = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0.0, max_tokens=12, stop=[" 7"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.text == text[:text.index(" 7")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 7"
    first = base[0].outputs[0].token_ids[2]
    by_id = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0.0, max_tokens=12,
                                                              stop_token_ids=[first]), use_tqdm=False)[0]
    assert by_id.outputs[0].token_ids == base[0].outputs[0].token_ids[:3]
    assert by_id.outputs[0].stop_reason == first


def test_stop_tokens_stop_strings_and_min_tokens_as_vllm(llm):
    prompt = "1, 2, 3, 4, 5,"

    def run(**kw):
        return llm.generate([prompt], SamplingParams(temperature=0.0, **kw), use_tqdm=False)[0].outputs[0]

    base = run(max_tokens=12)
    # A stop token id ends the sample without its text, unless include_stop_str_in_output.
    stop_id = base.token_ids[2]
    by_id = run(max_tokens=12, stop_token_ids=[stop_id])
    assert by_id.token_ids == base.token_ids[:3] and by_id.text == run(max_tokens=2).text
    assert run(max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=True).text == run(max_tokens=3).text
    # A stop string completed by the last token max_tokens allows still finishes as "stop".
    k = next(k for k in range(1, 12) if " 7" in run(max_tokens=k).text)
    at_limit = run(max_tokens=k, stop=[" 7"])
    assert (at_limit.finish_reason, at_limit.stop_reason) == ("stop", " 7")
    assert at_limit.text == base.text[:base.text.index(" 7")]
    # Stop strings count only after min_tokens tokens.
    first_comma = base.text.index(",")
    assert run(max_tokens=12, stop=[","]).text == base.text[:first_comma]
    late = run(max_tokens=12, stop=[","], min_tokens=len(run(max_tokens=12, stop=[","]).token_ids) + 1)
    assert late.text == base.text[:base.text.index(",", first_comma + 1)] and late.finish_reason == "stop"
    # Each stop string is searched for on its own: a longer one beside it does not bring back one within min_tokens.
    assert run(max_tokens=12, stop=[",", "never-in-the-text"], min_tokens=len(late.token_ids) - 1).text == late.text


def test_other_eos_ids_are_stop_token_ids_as_in_vllm(llm, monkeypatch):
    """A model whose generation config lists EOS ids beside its tokenizer's (Llama 3's <|eot_id|> and
    <|end_of_text|>): a sample ending on the tokenizer's has no stop reason, one ending on another has that id, as
    vLLM makes the others stop token ids; ignore_eos ignores them all."""
    prompt = "1, 2, 3, 4, 5,"
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    other = base.token_ids[2]
    monkeypatch.setattr(llm.engine, "eos_token_ids", llm.engine.eos_token_ids | {other})
    assert other != llm.engine.eos_token_id
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (base.token_ids[:3], "stop", other)
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == base.token_ids
    monkeypatch.setattr(llm.engine, "eos_token_ids", frozenset({other}))
    monkeypatch.setattr(llm.engine, "eos_token_id", other)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (base.token_ids[:3], "stop", None)


@pytest.mark.parametrize("where,failing_call", [("execute", 3), ("read back", 3), ("schedule", 4)])
def test_a_failed_step_aborts_its_requests_and_the_engine_keeps_serving(llm, monkeypatch, where, failing_call):
    """A step that raises (out of memory, a kernel error, Ctrl-C while tokens are read back) loses its
    requests' tokens: they are aborted, their blocks return to the pool, the prefix cache forgets blocks whose
    K/V may never have been written, and later calls give the outputs they give on a fresh engine."""
    engine = llm.engine
    prompts = [long_text(300), "Tell me about the sea."]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    engine.kv_cache_manager.reset_prefix_cache()
    # schedule: its second allocation of a decode step, after the first request's was made
    target = {"execute": (engine.runner, "execute"), "read back": (engine.scheduler, "update_from_output"),
              "schedule": (engine.kv_cache_manager, "allocate_slots")}[where]
    error = RuntimeError if where == "execute" else KeyboardInterrupt
    original, calls = getattr(*target), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == failing_call:
            raise error("simulated failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(*target, failing)
    if where == "schedule":  # no step in flight, whose requests would be aborted anyway
        monkeypatch.setattr(engine.config, "async_scheduling", False)
    with pytest.raises(error):
        # engine.step directly: LLM.generate would abort whatever the engine left behind
        engine.add_request("a", prompts[0], params)
        engine.add_request("b", prompts[1], params)
        while engine.has_unfinished_requests():
            engine.step()
    monkeypatch.undo()
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.kv_cache_manager.block_pool.cached_blocks
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected


@pytest.mark.parametrize("where", ["after a request finished", "mid-preemption"])
def test_an_interrupt_between_two_updates_of_a_request_leaves_the_engine_serving(monkeypatch, where):
    """Ctrl-C right after the step's read-back marked a request finished (before it leaves running), or after a
    preemption took its victim out of running (before it is queued again): the step's requests are aborted all the
    same, every block returns to the pool and later requests run as on a fresh engine."""
    from pagedllm.bench.shapes import model_dir_for
    from pagedllm.engine.request import Request
    llm = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=256, num_kv_blocks=5,
              block_size=16, async_scheduling=False)
    engine = llm.engine
    prompts = [[1, 2, 3], list(range(4, 40))]
    # the first request done at its prefill, or both needing 2 + 5 of the 5 blocks
    lengths = (1, 40) if where == "after a request finished" else (20, 40)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    if where == "mid-preemption":
        target, original = (engine.scheduler, "_preempt"), engine.scheduler._preempt
        failing = lambda request: (_ for _ in ()).throw(KeyboardInterrupt("simulated Ctrl-C"))
    else:
        target, original, finished = (Request, "check_stop"), Request.check_stop, []

        def failing(request):
            if finished:
                raise KeyboardInterrupt("simulated Ctrl-C")
            done = original(request)
            finished.extend([request] * done)
            return done
    monkeypatch.setattr(*target, failing)
    with pytest.raises(KeyboardInterrupt):
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, p)
        while engine.has_unfinished_requests():
            engine.step()
    monkeypatch.undo()
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_request_ids_in_use_by_a_request_or_a_sample_are_refused():
    """n > 1 names a request's samples request_id-i: an id may be neither a request's nor a sample's. A refused id
    leaves the request that holds it running to the end, in the async engine too."""
    import asyncio
    from pagedllm.bench.shapes import model_dir_for
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_engine import AsyncLLMEngine
    options = dict(load_format="dummy", device="cpu", max_model_len=256)
    engine = LLM(model_dir_for("tiny"), **options).engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("b-1", [1, 2, 3], params)
    for request_id, n in (("a", 1), ("a-0", 1), ("a-1", 3), ("b", 2)):
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(request_id, [4, 5], SamplingParams(n=n, max_tokens=2))
    finished = []
    while engine.has_unfinished_requests():
        finished += [(o.request_id, len(o.outputs), len(o.outputs[-1].token_ids)) for o in engine.step() if o.finished]
    assert sorted(finished) == [("a", 2, 4), ("b-1", 1, 4)]

    async def run():
        aengine = AsyncLLMEngine(EngineConfig.from_kwargs(model_dir_for("tiny"), **options))
        aengine.start()
        try:
            first, second = aengine.open_stream(), aengine.open_stream()
            await aengine.add_request(first, "x", [1, 2, 3], params)
            with pytest.raises(ValueError, match="already in use"):
                await aengine.add_request(second, "x", [4, 5, 6], params)
            outputs = [out async for out in first]
            return outputs[-1].finished, len(outputs[-1].outputs[0].token_ids)
        finally:
            await aengine.shutdown()

    assert asyncio.run(asyncio.wait_for(run(), timeout=60)) == (True, 4)


def test_a_bad_prompt_queued_behind_a_failing_step_gets_its_own_error():
    """A step fails while a request with an empty prompt waits to be added: the add still says what is wrong with
    the prompt (the server's 400), and the running request's stream says the engine died."""
    import asyncio
    import threading
    from pagedllm.bench.shapes import model_dir_for
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDead
    entered, release = threading.Event(), threading.Event()

    def failing_step():
        entered.set()
        release.wait(timeout=30)
        raise RuntimeError("simulated device error")

    async def run():
        aengine = AsyncLLMEngine(EngineConfig.from_kwargs(model_dir_for("tiny"), load_format="dummy", device="cpu",
                                                          max_model_len=64))
        aengine.engine.step = failing_step
        aengine.start()
        try:
            running = aengine.open_stream()
            await aengine.add_request(running, "a", [1, 2, 3], SamplingParams(max_tokens=5))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            bad = asyncio.create_task(aengine.add_request(aengine.open_stream(), "b", [], SamplingParams()))
            await asyncio.sleep(0.05)  # queued on the engine thread behind the step
            release.set()
            with pytest.raises(ValueError, match="prompt"):
                await bad
            with pytest.raises(EngineDead):
                async for _ in running:
                    pass
            with pytest.raises(EngineDead):
                await aengine.add_request(aengine.open_stream(), "c", [1], SamplingParams())
        finally:
            await aengine.shutdown()

    asyncio.run(asyncio.wait_for(run(), timeout=60))


def test_the_models_generation_config_sets_the_sampling_defaults(tmp_path):
    """As vLLM's --generation-config: 'auto' takes the model's generation_config.json sampling keys (a request
    without SamplingParams samples with them), 'vllm' SamplingParams' own, a folder that folder's; a bad value
    fails at start naming the file."""
    import json
    from pagedllm.bench.shapes import model_dir_for
    model = model_dir_for("tiny")
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "top_k": 7, "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2}, f)
    options = dict(load_format="dummy", device="cpu", max_model_len=64)
    llm = LLM(model, **options)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 5)
    greedy = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[:len(out.token_ids)] and (out.finish_reason == "length") == (len(greedy) == 5)
    assert LLM(model, generation_config="vllm", **options).get_default_sampling_params() == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert LLM(model, generation_config=str(tmp_path), **options).get_default_sampling_params().top_p == 0.5
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        LLM(model, generation_config=str(tmp_path), **options)
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(model, generation_config=str(tmp_path / "missing"), **options)


def test_allowed_token_ids_bound_every_sampled_token():
    """End to end, greedy (which otherwise takes the plain argmax path) and random: only the allowed ids come out."""
    from pagedllm.bench.shapes import model_dir_for
    llm = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=64)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, allowed_token_ids=[7, 9, 11])
        tokens = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
        assert all(set(o.outputs[0].token_ids) <= {7, 9, 11} and len(o.outputs[0].token_ids) == 6 for o in tokens)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_are_never_generated(async_scheduling):
    """vLLM's bad_words: " Paris" (one token, either spelling) never comes, and "answer is" (two) has its second
    token banned only after its first: the greedy text keeps " answer" and goes another way from there. The same
    with steps overlapped, which a word of several tokens switches off (its ban reads the token before)."""
    llm = LLM(MODEL, dtype="float32", seed=0, async_scheduling=async_scheduling)
    prompt = ["The capital of France is"]
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    paris = {tok.encode(w, add_special_tokens=False)[0] for w in ("Paris", " Paris")}
    answer, is_ = tok.encode(" answer is", add_special_tokens=False)
    assert paris & set(plain) and (answer, is_) in zip(plain, plain[1:])  # what the bans must change
    banned = SamplingParams(temperature=0.0, max_tokens=24, bad_words=["Paris", "answer is"])
    tokens = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids
    assert not paris & set(tokens) and (answer, is_) not in zip(tokens, tokens[1:])
    words = SamplingParams(temperature=0.0, max_tokens=24, bad_words=["answer is"])
    tokens = llm.generate(prompt, words, use_tqdm=False)[0].outputs[0].token_ids
    cut = plain.index(answer) + 1
    assert tokens[:cut] == plain[:cut] and tokens[cut] != is_


def test_truncate_prompt_tokens_runs_and_reports_the_prompts_last_tokens(llm):
    """As vLLM's truncate_prompt_tokens: a text, token-id or chat prompt runs as its last k tokens, and is reported
    as them (prompt_token_ids, prompt text, prompt logprobs), just as a request for those tokens alone."""
    tok = llm.get_tokenizer()
    text = long_text(600)
    ids = tok(text).input_ids
    assert len(ids) > 100
    plain = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1)
    cut = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, truncate_prompt_tokens=40)
    by_text, by_ids, manual = llm.generate([text, ids, ids[-40:]], [cut, cut, plain], use_tqdm=False)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == manual.prompt_token_ids == ids[-40:]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == manual.outputs[0].token_ids
    assert by_text.prompt == tok.decode(ids[-40:]) and by_ids.prompt is None

    def scores(out):
        return [entry[t].logprob for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    assert len(by_text.prompt_logprobs) == 40 and scores(by_text) == pytest.approx(scores(manual), abs=1e-5)

    whole = llm.generate([text], SamplingParams(max_tokens=1, truncate_prompt_tokens=len(ids)), use_tqdm=False)[0]
    assert whole.prompt == text and whole.prompt_token_ids == ids
    chat = llm.chat([{"role": "user", "content": "Name three colors."}],
                    SamplingParams(max_tokens=1, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert chat.prompt_token_ids == chat_ids(tok, "Name three colors.")[-5:]
    assert chat.prompt == tok.decode(chat.prompt_token_ids)


def test_truncate_prompt_tokens_comes_before_the_max_model_len_check():
    """A prompt past max_model_len that truncation makes fit is served; -1 keeps max_model_len tokens, as in vLLM
    (which then leave no room to generate); a size past max_model_len is vLLM's error, and the engine keeps serving."""
    from pagedllm.bench.shapes import model_dir_for
    tiny = LLM(model_dir_for("tiny"), load_format="dummy", device="cpu", max_model_len=64)
    prompt = list(range(1, 101))
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    cut, manual = tiny.generate([prompt, prompt[-32:]], [SamplingParams(**greedy, truncate_prompt_tokens=32),
                                                         SamplingParams(**greedy)], use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-32:] and len(cut.outputs[0].token_ids) == 4
    assert cut.outputs[0].token_ids == manual.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt has 64 tokens"):
        tiny.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=-1), use_tqdm=False)
    short = tiny.generate([prompt[:10]], SamplingParams(**greedy, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert short.prompt_token_ids == prompt[:10] and len(short.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens value \(65\) is greater than max_model_len "
                                         r"\(64\)\. Please, select a smaller truncation size\.$"):
        tiny.generate([prompt[:10]], SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests() and tiny.engine.kv_cache_manager.usage == 0.0


def test_chat_answers_sensibly(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_chat_continues_the_final_message_as_asked(llm):
    """LLM.chat takes vLLM's template options: the assistant's last message left open for the model to go on."""
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("The capital of France is") and "Paris" in out.outputs[0].text
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conversation, continue_final_message=True)


def test_incremental_detokenization_handles_multibyte(llm):
    tok = llm.get_tokenizer()
    from pagedllm.engine.detokenizer import IncrementalDetokenizer
    text = "Grüße aus Köln! 日本語のテキスト 🐉🔥 done."
    ids = tok(text).input_ids
    d = IncrementalDetokenizer(tok, [1, 2], skip_special_tokens=True, stop=[], include_stop_str_in_output=False)
    for t in ids:
        d.update(t)
        assert "\ufffd" not in d.text
    assert d.text == tok.decode(ids)


def test_cli_generate(capsys):
    from pagedllm.entrypoints.cli import main
    main(["generate", "--prompt", "The capital of France is", "--max-tokens", "5", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "### The capital of France is" in out and "Paris" in out


def test_every_engine_option_is_a_flag_of_its_type():
    import dataclasses
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.cli import build_parser, engine_kwargs
    values = {"str": "xattention", "int": "7", "float": "0.5"}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" or f.type == "bool":
            continue
        kind = next(k for k in ("int", "float", "str") if k in f.type.split(" | "))
        args = build_parser().parse_args(["serve", "--" + f.name.replace("_", "-"), values[kind]])
        assert engine_kwargs(args)[f.name] == {"str": str, "int": int, "float": float}[kind](values[kind]), f.name


def test_integer_flags_take_vllms_suffixes(capsys):
    """--max-model-len 32k / 4K as vLLM's launch lines write them: lower case decimal, upper case binary."""
    from pagedllm.entrypoints.cli import build_parser
    for text, value in (("4096", 4096), ("32k", 32000), ("25.6k", 25600), ("4K", 4096), ("1M", 2**20)):
        assert build_parser().parse_args(["serve", "--max-model-len", text]).max_model_len == value, text
    for text in ("4.5K", "4kb", "four"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-num-batched-tokens", text])
        assert f"--max-num-batched-tokens: not an integer: '{text}'" in capsys.readouterr().err


def test_xattention_prefill_at_threshold_one_equals_dense(llm, prompts, monkeypatch):
    from pagedllm.ops import xattention
    calls = []
    real = xattention.xattention_paged_prefill
    monkeypatch.setattr(xattention, "xattention_paged_prefill",
                        lambda *a, **k: calls.append((k["share_kv_heads"], k["fp8_estimate"])) or real(*a, **k))
    sparse = LLM(MODEL, dtype="float32", sparse_prefill="xattention", xattn_threshold=1.0, xattn_stride=8,
                 xattn_block_size=64, xattn_min_prompt_len=256, xattn_share_kv_heads=True, xattn_fp8_estimate=True,
                 max_num_batched_tokens=512)
    # A long prompt prefilled in chunks against its cached prefix, next to a short one, then a prefix hit.
    workload = [prompts[3], prompts[0], prompts[3][:700] + [11, 12, 13]]
    assert token_ids(sparse.generate(workload, GREEDY, use_tqdm=False)) == \
        token_ids(llm.generate(workload, GREEDY, use_tqdm=False))
    assert calls and all(all(c) for c in calls)  # the long prefills went through XAttention, with the options


def test_final_only_steps_return_each_request_once_when_finished(llm):
    engine = llm.engine
    for rid, n in (("short", 1), ("long", 4)):
        engine.add_request(rid, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        outs = engine.step(final_only=True)
        assert all(o.finished for o in outs)
        seen += [(o.request_id, len(o.outputs[0].token_ids)) for o in outs]
    assert sorted(seen) == [("long", 4), ("short", 1)]


def test_prompt_logprobs_match_transformers(tmp_path):
    """SamplingParams.prompt_logprobs, as vLLM's: None for the first prompt token, then each token's log-softmax
    under transformers' logits of the tokens before it, with its rank and the top n. The same with overlapped
    steps, with the prompts chunked (a 16-token budget) and with preemptions (an 8-block pool); a request asking
    for them runs its prompt although the prefix cache holds it, the first of its samples only."""
    from test_models import random_hf_model
    from transformers import LlamaConfig
    hf = random_hf_model(LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (45, 1, 30)]
    with torch.inference_mode():
        refs = [torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1) for p in prompts]
    params = [SamplingParams(prompt_logprobs=3, n=2, temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(prompt_logprobs=0, max_tokens=4), SamplingParams(max_tokens=4)]
    for options in ({}, dict(max_num_batched_tokens=16, async_scheduling=False), dict(num_kv_blocks=8)):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=128, block_size=16, **options)
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # the prompts into the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[2].prompt_logprobs is None
        for out, ref, p in zip(outs, refs, params[:2]):
            assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
            for row, token, entry in zip(ref, out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
                assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
                assert entry[token].rank == int((row > row[token]).sum()) + 1
                top = row.topk(p.prompt_logprobs).indices.tolist()
                assert sorted((e.rank, t) for t, e in entry.items())[:len(top)] == [(r, t) for r, t in
                                                                                    enumerate(top, 1)]
        if "num_kv_blocks" in options:
            assert llm.engine.scheduler.num_preemptions > 0
        if not options:  # the prefix cache's queries: every prompt, then all but those with prompt logprobs to compute
            assert llm.engine.kv_cache_manager.prefix_cache_queries == sum(map(len, prompts)) + 45 + 1 + 30
        assert llm.engine.kv_cache_manager.usage == 0.0


def test_async_scheduling_equals_synchronous(llm):
    """Overlapped steps feed each decode its token from the device and learn of stops one step late: outputs,
    stop handling, min_tokens, seeded sampling, logprobs and penalties (which fall back to waiting) must be
    exactly what synchronous steps give, with every block back in the pool."""
    prompt = "1, 2, 3, 4, 5,"
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    stop_id = first[0].outputs[0].token_ids[0]  # recurs every few tokens: " 6, 7, 8"
    cases = [
        (prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=[" 7"])),
        (prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])),
        (prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=3)),
        ("Tell me a story.", SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=1)),
        ("Tell me a story.", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=9, logprobs=2)),
        ("Tell me a story.", SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.5)),
        ("Hello", SamplingParams(temperature=0.0, max_tokens=30)),
    ]
    sync = LLM(MODEL, dtype="float32", seed=0, async_scheduling=False)
    # Alone, and together: one request with penalties makes its whole batch wait.
    for batch in (cases, *([case] for case in cases)):
        prompts, params = [c[0] for c in batch], [c[1] for c in batch]
        got = llm.generate(prompts, params, use_tqdm=False)
        want = sync.generate(prompts, params, use_tqdm=False)
        for g, w in zip(got, want):
            for a, b in zip(g.outputs, w.outputs):
                assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                    (b.token_ids, b.text, b.finish_reason, b.stop_reason)
                assert (a.logprobs is None) == (b.logprobs is None)
                for x, y in zip(a.logprobs or [], b.logprobs or []):
                    assert x.keys() == y.keys() and all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
        if batch[0] is cases[0]:
            assert got[0].outputs[0].stop_reason == " 7"
    assert llm.engine.kv_cache_manager.usage == 0.0 and llm.engine.stats()["num_requests_running"] == 0


def test_one_output_per_request_when_a_waiting_step_follows_an_overlapped_one(llm):
    """A request with penalties makes its step wait; the overlapped step before it is read back in the same
    call. Each request still gets one (cumulative) output per call."""
    engine = llm.engine
    engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("penalised", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                               repetition_penalty=1.2))
    lengths = {"plain": []}
    while engine.has_unfinished_requests():
        outs = engine.step()
        ids = [o.request_id for o in outs]
        assert len(ids) == len(set(ids))
        lengths["plain"] += [len(o.outputs[0].token_ids) for o in outs if o.request_id == "plain"]
    assert lengths["plain"][-1] == 8 and lengths["plain"] == sorted(lengths["plain"])
    assert engine.kv_cache_manager.usage == 0.0


def test_outputs_carry_when_requests_were_queued_scheduled_and_sampled(llm, monkeypatch):
    """RequestOutput.metrics, as vLLM v1's RequestStateStats: the arrival by the wall clock, then queued <= scheduled
    <= first token <= last token by the monotonic clock, every sample's tokens counted; a request that waits for a
    sequence slot is scheduled only once the one before it has finished (the server's queue time)."""
    engine = llm.engine
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 2)
    params = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    wall, mono = time.time(), time.monotonic()
    runs = _run(engine, [("pair", [1, 2, 3], SamplingParams(n=2, **params)),
                         ("next", [4, 5], SamplingParams(**params))])
    pair, after = runs["pair"][-1].metrics, runs["next"][-1].metrics
    for stats in (pair, after):
        assert wall <= stats.arrival_time <= time.time()
        assert mono <= stats.queued_ts <= stats.scheduled_ts <= stats.first_token_ts <= stats.last_token_ts
        assert stats.last_token_ts <= time.monotonic()
    assert pair.num_generation_tokens == 10 and after.num_generation_tokens == 5
    assert after.scheduled_ts >= pair.last_token_ts > pair.first_token_ts
    counts = [o.metrics.num_generation_tokens for o in runs["next"]]
    assert counts == sorted(set(counts)) and counts[-1] == 5


def _run(engine, requests):
    """Adds (request id, prompt, params) and steps until all finished; the outputs of each request, in order."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outputs = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_output_kinds_delta_and_final_only_add_up_to_cumulative(llm):
    """vLLM's output kinds: DELTA outputs concatenate to the CUMULATIVE one, FINAL_ONLY is that one alone, and no
    output shows text that a stop string spanning two tokens later cuts (it is held back until they decide)."""
    engine, prompt = llm.engine, llm.get_tokenizer()("The capital of France is").input_ids
    plain = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in _run(engine, [("probe", prompt, SamplingParams(**plain))])["probe"]]
    # a stop string across the boundary of two tokens, two characters on each side, after 8 tokens
    cut = next(len(t) for t in texts[8:] if len(t) > 2)
    end = next(len(t) for t in texts if len(t) > cut + 1)
    stop = texts[-1][cut - 2:cut + 2]
    assert texts[-1].find(stop) == cut - 2 and end - cut >= 2
    kinds = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
    params = dict(plain, n=2, stop=[stop], logprobs=1, prompt_logprobs=1)
    runs = _run(engine, [(k.name, prompt, SamplingParams(**params, output_kind=k)) for k in kinds])
    cumulative, delta, final = runs["CUMULATIVE"], runs["DELTA"], runs["FINAL_ONLY"]
    last = cumulative[-1]
    assert last.finished and [c.text for c in last.outputs] == [texts[-1][:cut - 2]] * 2
    for out in cumulative:  # never a text that a later output takes back
        assert all(last.outputs[c.index].text.startswith(c.text) for c in out.outputs)
    def same(a, b):  # the requests' logprobs differ by their rows' float rounding in the batch
        return ((a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason,
                                                                           b.stop_reason)
                and [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
                and [e[t].logprob for e, t in zip(a.logprobs, a.token_ids)]
                == pytest.approx([e[t].logprob for e, t in zip(b.logprobs, b.token_ids)], abs=1e-4))

    assert len(final) == 1 and final[0].finished and all(map(same, final[0].outputs, last.outputs))
    assert len(delta[0].prompt_logprobs) == len(prompt) and all(d.prompt_logprobs is None for d in delta[1:])
    assert delta[-1].finished and not any(d.finished for d in delta[:-1])
    for i in range(2):
        parts = [c for d in delta for c in d.outputs if c.index == i]
        assert all(c.token_ids for c in parts) and [c.finish_reason for c in parts][-1] == "stop"
        joined = CompletionOutput(i, "".join(c.text for c in parts), sum((c.token_ids for c in parts), []),
                                  parts[-1].finish_reason, parts[-1].stop_reason, sum((c.logprobs for c in parts), []))
        assert same(joined, last.outputs[i])
    assert engine.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
