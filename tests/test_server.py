"""The OpenAI-compatible server, started for real on loopback and driven with the official openai client."""
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from conftest import MODEL, long_text
from pagedllm import SamplingParams, __version__
from pagedllm.entrypoints.openai.protocol import CompletionRequest

API_KEY = "test-key"
MAX_MODEL_LEN = 256
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colors."}]
TINY_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}A:{% endif %}")
TINY_ORIGIN = "https://app.example"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], env: dict | None = None):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", *args, "--port", str(port)],
                            cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        assert proc.poll() is None, f"server exited: {proc.stderr.read()}"
        assert time.time() < deadline, "server did not start in time"
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)


def stop_server(proc) -> None:
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    # The key comes from the environment variable, which --api-key would override.
    proc, url = start_server([MODEL, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)],
                             env={"PAGEDLLM_API_KEY": API_KEY})
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A two-layer random-weight model (--load-format dummy) with SmolLM2's tokenizer: starts in seconds, and
    a queue limit of 4 waiting requests with one sequence at a time."""
    from pagedllm.models.loader import resolve_model
    tokenizer_dir = resolve_model(MODEL)
    with open(tokenizer_dir / "config.json") as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    model_dir = tmp_path_factory.mktemp("tiny")
    (model_dir / "config.json").write_text(json.dumps(config))
    # vLLM's way of naming the model and flags its users pass; a chat template and CORS origins of its own
    proc, url = start_server(["--model", str(model_dir), "--load-format", "dummy", "--tokenizer", str(tokenizer_dir),
                              "--served-model-name", "tiny", "--max-num-seqs", "1",
                              "--max-waiting-requests", "4", "--chat-template", TINY_TEMPLATE,
                              "--allowed-origins", json.dumps([TINY_ORIGIN]), "--trust-remote-code", "-tp", "1",
                              "--disable-log-stats", "--disable-log-requests"])
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


def get_metrics(url: str) -> dict[str, float]:
    """Samples but histogram buckets, keyed by name and their labels but model_name:
    pagedllm:generation_tokens_total, pagedllm:request_success_total{finished_reason="stop"}."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {re.sub(r'\{model_name="[^"]*",?', "{", line.rsplit(" ", 1)[0]).removesuffix("{}"): float(line.split()[-1])
            for line in text.splitlines() if line.startswith("pagedllm:") and "_bucket" not in line}


def wait_for_metrics(url: str, condition, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while not condition(m := get_metrics(url)):
        assert time.time() < deadline, f"metrics never got there: {m}"
        time.sleep(0.02)
    return m


def post(url: str, path: str, body: bytes | dict, key: str | None = API_KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- results equal the offline engine's -------------------------------------------------------------------
def test_completions_greedy_match_llm_generate(client, llm):
    expected = [o.outputs[0].text for o in
                llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)]
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    assert batch.usage.completion_tokens == 24
    token_ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    by_ids = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected[0]
    assert by_ids.usage.prompt_tokens == len(token_ids)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_greedy_matches_llm_chat(client, llm):
    expected = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert full.choices[0].message.content == expected.text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_n_and_seed_reproduce(client):
    def sample(stream: bool) -> list[str]:
        out = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, seed=1234, temperature=1.0,
                                             max_tokens=8, stream=stream)
        if not stream:
            return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]
        texts = ["", ""]
        for chunk in out:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        return texts

    first = sample(stream=False)
    assert len(first) == 2 and first[0] != first[1]
    assert sample(stream=True) == first


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.tokens) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Greedy: the chosen token is the most likely one.
        assert len(top) == 3 and top[token] == logprob == max(top.values()) and logprob <= 0
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    # The sampled token is always among top_logprobs, beside the k most likely (as OpenAI and vLLM return them).
    for k in (0, 1):
        lp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=3,
                                       logprobs=k).choices[0].logprobs
        assert all(top[token] == logprob and len(top) <= k + 1
                   for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
        assert k or all(len(top) == 1 for top in lp.top_logprobs)

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)


def test_stop_strings_are_cut_and_never_streamed_in_part(client):
    base = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, logprobs=0)
    tokens = base.choices[0].logprobs.tokens
    # A stop string that starts inside one token and ends inside the next, so streaming must hold back the
    # end of the first token until the next one shows whether the stop string is complete.
    i = next(i for i in range(3, len(tokens) - 1) if len(tokens[i]) >= 2 and tokens[i + 1].strip())
    start = sum(map(len, tokens[:i])) + 1
    stop = base.choices[0].text[start:start + len(tokens[i])]
    expected = base.choices[0].text[:base.choices[0].text.index(stop)]

    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop])
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stop=["never appears", stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_and_extras(client):
    extras = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                    extra_body=extras)
    assert out.choices[0].text.startswith(PROMPTS[0]) and len(out.choices[0].text) > len(PROMPTS[0])
    assert out.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                            echo=True, stream=True, extra_body=extras))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_bad_words_as_llm_generate(client, llm):
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0).choices[0].text
    words = [plain.split()[0]]  # the greedy text's first word
    expected = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, bad_words=words),
                            use_tqdm=False)[0].outputs[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"bad_words": words})
    assert out.choices[0].text == expected != plain


def test_echo_with_logprobs_scores_the_prompt(client, llm):
    """Completions with echo and logprobs (how lm-eval-harness scores a text): the prompt's tokens come first with
    the engine's prompt logprobs (the first token has none), then the completion's, the text offsets counting from
    the prompt's start; max_tokens 0 returns the prompt alone. Streamed, the same tokens."""
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    expected = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2),
                            use_tqdm=False)[0].prompt_logprobs
    for max_tokens in (0, 3):
        choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0,
                                           echo=True, logprobs=2).choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and "".join(lp.tokens) == choice.text
        assert choice.text.startswith(PROMPTS[0]) and (max_tokens or choice.text == PROMPTS[0])
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(expected[i][ids[i]].logprob, abs=1e-5)
            assert len(lp.top_logprobs[i]) in (2, 3) and lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_logit_bias_steers_sampling(server, client):
    """OpenAI's logit_bias: +100 on one token makes it every greedy pick; -100 keeps the greedy token out."""
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                      logprobs=0).choices[0]
    forced_token = 42
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={str(forced_token): 100}).choices[0]
    _, text = post(server, "/detokenize", {"tokens": [forced_token]})
    assert forced.logprobs.tokens == [text["prompt"]] * 3 != plain.logprobs.tokens
    _, tokenized = post(server, "/tokenize", {"prompt": plain.logprobs.tokens[0], "add_special_tokens": False})
    (first,) = tokenized["tokens"]
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={"0": 0, str(first): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.logprobs.tokens[0]


def test_vllm_request_fields_unknown_fields_and_nulls_are_accepted(server, client):
    """Bodies written for vLLM: its extra fields, fields this server does not implement, and JSON null for unset
    fields (as many non-Python clients send them) all get answers rather than 400s."""
    nulls = dict.fromkeys(["n", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "user",
                           "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
                           "ignore_eos", "min_tokens", "stop_token_ids", "best_of", "skip_special_tokens",
                           "include_stop_str_in_output", "truncate_prompt_tokens"])
    unknown = {"suffix": None, "response_format": {"type": "text"}, "frobnicate": 1}
    status, out = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3.0, "temperature": 2.5,
                                                   "ignore_eos": True, "best_of": 1, "seed": -1, **unknown})
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    # integral floats count as ints wherever ids go too (clients without an integer type send 3.0)
    status, out = post(server, "/v1/completions", {"prompt": [5.0, 6, 7.0], "max_tokens": 2, "stop_token_ids": [1.0]})
    assert status == 200 and out["usage"]["prompt_tokens"] == 3, out
    assert post(server, "/detokenize", {"tokens": [5.0, 6]}) == post(server, "/detokenize", {"tokens": [5, 6]})
    # (max_tokens null means no limit: test_null_max_tokens_completes_up_to_the_context)
    status, out = post(server, "/v1/completions", {"prompt": "hi", **nulls, "logprobs": None, "echo": None})
    assert status == 200 and out["usage"]["completion_tokens"] == 16, out
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert chunks[-1].usage.completion_tokens == 2

    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "1", "name": "weather"},
               {"role": "user", "content": "Thanks."}]
    status, out = post(server, "/v1/chat/completions", {
        "messages": history, **nulls, "max_tokens": 2, "max_completion_tokens": None, "logprobs": None,
        "top_logprobs": None, "tools": [], "parallel_tool_calls": False, "store": False})
    assert status == 200 and out["usage"]["completion_tokens"] <= 2, out


def test_truncate_prompt_tokens_serves_the_prompts_last_tokens(server, client, llm):
    """vLLM's truncate_prompt_tokens: a prompt past max_model_len (a 400 without it) runs as its last k tokens, cut
    before the context-length check; usage counts them and echo returns them, and the answer is LLM's for them."""
    tok = llm.get_tokenizer()
    text = long_text(3000)
    ids = tok(text).input_ids
    assert len(ids) > MAX_MODEL_LEN
    kept = ids[-20:]
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([kept], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].text
    for prompt in (text, ids):
        out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, temperature=0,
                                        max_tokens=4, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 20})
        choice = out.choices[0]
        assert out.usage.prompt_tokens == 20 and choice.text == tok.decode(kept) + expected
        lp = choice.logprobs  # the prompt's logprobs are the kept tokens', the first without one
        assert lp.tokens[:20] == [tok.decode([t]) for t in kept] and len(lp.tokens) == 24
        assert lp.token_logprobs[0] is None and None not in lp.token_logprobs[1:]
    status, error = post(server, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 200, "max_tokens": 100})
    assert status == 400 and error["error"]["param"] == "max_tokens", error
    assert "(200 in the prompt" in error["error"]["message"], error

    messages = [{"role": "user", "content": text}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,
                                            extra_body={"truncate_prompt_tokens": 30})
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=30),
                       use_tqdm=False)[0]
    assert answer.usage.prompt_tokens == 30 and answer.choices[0].message.content == offline.outputs[0].text

    for bad in (0, -2, True, "8", 2.5, MAX_MODEL_LEN + 1):
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
            status, error = post(server, path, {**body, "truncate_prompt_tokens": bad})
            assert status == 400 and error["error"]["param"] == "truncate_prompt_tokens", (bad, error)
            assert "truncate_prompt_tokens" in error["error"]["message"], (bad, error)


def test_unset_sampling_fields_take_the_models_defaults():
    """As vLLM: a field the request leaves unset takes the model's generation config default, then SamplingParams'."""
    defaults = {"temperature": 0.25, "top_k": 7, "max_tokens": 5}
    params = CompletionRequest.model_validate({"prompt": "hi", "top_k": 3}).sampling_params(16, None, None, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.25, 3, 1.0, 16)


def test_unknown_fields_are_named_in_one_warning(caplog):
    with caplog.at_level("WARNING", logger="pagedllm.server"):
        req = CompletionRequest.model_validate({"prompt": "hi", "suffix": "x", "frobnicate": {}, "n": None})
    assert req.n == 1
    assert [r.getMessage() for r in caplog.records] == [
        "CompletionRequest: ignoring unsupported fields frobnicate, suffix"]


def test_best_of_other_than_n_names_best_of(server):
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2})[0] == 200
    status, error = post(server, "/v1/chat/completions", {"messages": CHAT, "n": 1, "best_of": 3})
    assert status == 400 and error["error"]["param"] == "best_of" and "best_of" in error["error"]["message"]


def test_special_tokens_and_stop_strings_in_output(client):
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0)
    assert answer.choices[0].finish_reason == "stop"

    def past_eos(**extras) -> str:
        # Past its end-of-turn token the model writes more special tokens, which only show when not skipped.
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=answer.usage.completion_tokens + 3,
                                             temperature=0, extra_body={"ignore_eos": True, **extras})
        return out.choices[0].message.content

    assert "<|im_end|>" in past_eos(skip_special_tokens=False) and "<|im_end|>" not in past_eos()

    base = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    stop = base.split()[1]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop,
                                        stream=stream, extra_body={"include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == base[:base.index(stop) + len(stop)]


def test_chat_text_parts_are_joined_with_newlines(server):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    by_parts = post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    joined = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hello\nworld"}]})
    assert by_parts == joined and by_parts[0] == 200


def test_stream_chunks_share_one_created_time(tiny_server):
    """Chunks made more than a second apart still carry the request's one creation time, as does the answer."""
    tiny = OpenAI(base_url=tiny_server + "/v1", api_key="unused", max_retries=0)
    long = {"model": "tiny", "max_tokens": 3000, "stream": True, "extra_body": {"ignore_eos": True}}
    for open_stream in (lambda: tiny.completions.create(prompt=[5, 6, 7], **long),
                        lambda: tiny.chat.completions.create(messages=CHAT, **long)):
        start, created = time.time(), set()
        stream = open_stream()
        for chunk in stream:
            created.add(chunk.created)
            if time.time() - start > 1.5:
                break
        stream.close()
        assert time.time() - start > 1.5, "the stream ended too early to span a second"
        assert len(created) == 1 and abs(created.pop() - start) < 2
    before = time.time()
    out = tiny.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
    assert int(before) <= out.created <= time.time()


def test_stream_chunks_as_vllm_writes_them(tiny_server):
    """The role only in the first chat delta (absent after it, not null), and with continuous_usage_stats every
    chunk carrying the usage so far."""
    body = {"messages": CHAT, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    request = urllib.request.Request(tiny_server + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts[-2:] == [4, 4] and counts == sorted(counts) and len(set(counts)) > 2
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0 for c in chunks)


# ---- the other endpoints ----------------------------------------------------------------------------------
def test_models_health_tokenize_detokenize(server, client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert urllib.request.urlopen(server + "/health").status == 200
    status, body = post(server, "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200 and body["tokens"] == llm.get_tokenizer()(PROMPTS[0]).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": PROMPTS[0]})
    status, chat = post(server, "/tokenize", {"messages": CHAT})
    assert status == 200 and chat["count"] > body["count"]


def test_chat_template_options_shape_the_prompt(server, client, llm):
    """vLLM's template fields: the generation prompt off, the last message continued (left open), a template of
    the request's own with its variables (chat_template_kwargs) and tools shown to it; chat completions render
    the same prompt as /tokenize."""
    tok = llm.get_tokenizer()
    answer = [*CHAT, {"role": "assistant", "content": "Red, green and"}]

    def rendered(**fields) -> str:
        status, body = post(server, "/tokenize", {"messages": answer, **fields})
        assert status == 200, body
        return tok.decode(body["tokens"])

    assert rendered().endswith("Red, green and<|im_end|>\n<|im_start|>assistant\n")
    assert rendered(add_generation_prompt=False).endswith("Red, green and<|im_end|>\n")
    assert rendered(add_generation_prompt=False, continue_final_message=True).endswith("Red, green and")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    own = {"chat_template": "{% for m in messages %}{{ m.content }}|{% endfor %}{{ greeting }}|"
                            "{% for t in tools %}{{ t.function.name }}{% endfor %}",
           "chat_template_kwargs": {"greeting": "hey"}, "tools": tools}
    assert rendered(**own) == "Name three colors.|Red, green and|hey|get_weather"
    out = client.chat.completions.create(model=MODEL, messages=answer, max_tokens=1, tool_choice="none",
                                         tools=tools, extra_body={k: own[k] for k in ("chat_template",
                                                                                      "chat_template_kwargs")})
    assert out.usage.prompt_tokens == len(tok("Name three colors.|Red, green and|hey|get_weather").input_ids)


def test_chat_echo_returns_the_continued_turn(client):
    """vLLM's chat echo: continuing an assistant turn (continue_final_message), the reply starts with that turn's
    text, streamed or not; where the last message is the user's, there is nothing to echo."""
    answer = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    options = dict(model=MODEL, max_tokens=6, temperature=0)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(messages=answer, extra_body=cont, **options).choices[0].message.content
    echoed = client.chat.completions.create(messages=answer, extra_body={**cont, "echo": True},
                                            **options).choices[0].message.content
    assert echoed == "Red, green and" + plain and plain
    chunks = list(client.chat.completions.create(messages=answer, stream=True, extra_body={**cont, "echo": True},
                                                 **options))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    user_last = client.chat.completions.create(messages=CHAT, extra_body={"echo": True}, **options)
    assert user_last.choices[0].message.content == client.chat.completions.create(
        messages=CHAT, **options).choices[0].message.content


def test_the_servers_own_template_version_and_cors(tiny_server):
    """--chat-template replaces the tokenizer's; /version answers; CORS lets the configured origin in."""
    status, body = post(tiny_server, "/tokenize", {"messages": CHAT})
    status, text = post(tiny_server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and text["prompt"] == "user: Name three colors.\nA:"
    with urllib.request.urlopen(tiny_server + "/version") as r:
        assert json.loads(r.read())["version"] == __version__
    for origin, allowed in ((TINY_ORIGIN, True), ("https://elsewhere.example", False)):
        preflight = urllib.request.Request(tiny_server + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        try:
            with urllib.request.urlopen(preflight) as r:
                status, header = r.status, r.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as e:
            status, header = e.code, e.headers.get("access-control-allow-origin")
        assert (status, header) == ((200, origin) if allowed else (400, None))


def test_null_max_tokens_completes_up_to_the_context(tiny_server):
    """As in vLLM, an explicit null max_tokens on /v1/completions is the rest of the context (the default is 16,
    which this prompt would not even fit)."""
    status, out = post(tiny_server, "/v1/completions", {"prompt": [5] * 4090, "max_tokens": None,
                                                        "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 6, out
    assert out["choices"][0]["finish_reason"] == "length"


# ---- bad input --------------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400),  # malformed JSON
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400),  # wrong type
    ("/v1/completions", {"prompt": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400),
    ("/v1/completions", {"max_tokens": 4}, 400),  # no prompt
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400),  # out of range
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3.5}, 400),  # not integral
    ("/v1/completions", {"prompt": [5, 6.5]}, 400),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1.5]}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2}, 400),  # best_of > n is not implemented
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400),  # not a token id
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400),  # out of [-100, 100]
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(10**9): 1}}, 400),  # outside the vocabulary
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": -3}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 8}, 400),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("/v1/completions", {"prompt": ""}, 400),  # no tokens
    ("/v1/completions", {"prompt": [-1, 5]}, 400),  # bad token ids
    ("/v1/completions", {"prompt": [10**9]}, 400),
    ("/v1/completions", {"prompt": "hello " * MAX_MODEL_LEN}, 400),  # beyond max_model_len
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400),  # prompt + max_tokens too long
    ("/v1/completions", {"prompt": "hi", "model": "gpt-nonexistent"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-nonexistent"}, 404),
    ("/v1/no-such-endpoint", {}, 404),
    # refused rather than answered with text that ignores them (no structured output, no tool-call parsing)
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status):
    got, error = post(server, path, body)
    assert got == status, error
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello " * MAX_MODEL_LEN}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}, "messages"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(10**9): 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {str(10**9): 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 10**9]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "bad_words": [" "]}, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    # what SamplingParams checks, named as it names them
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, "messages"),
    # ids the tokenizer cannot even decode for the echo
    ("/v1/completions", {"prompt": [-1], "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 2**40]], "echo": True}, "prompt"),
])
def test_bad_requests_name_the_field_at_fault(server, path, body, param):
    status, error = post(server, path, body)
    assert status == 400 and error["error"]["param"] == param, error


def test_a_model_without_a_tokenizer_takes_token_ids_and_refuses_what_needs_text():
    """Served without a tokenizer, token-id prompts with stop_token_ids generate; a text prompt, chat and stop
    strings (matched in text the server cannot make) are 400s naming what needs the tokenizer."""
    from pagedllm.bench.shapes import model_dir_for
    proc, url = start_server([model_dir_for("tiny"), "--load-format", "dummy", "--max-model-len", "64"])
    try:
        status, out = post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "stop_token_ids": [1]})
        assert status == 200 and out["usage"]["prompt_tokens"] == 3, out
        for path, body, param in (("/v1/completions", {"prompt": [5, 6], "stop": ["x"]}, "stop"),
                                  ("/v1/completions", {"prompt": "hello"}, None),
                                  ("/v1/chat/completions", {"messages": CHAT}, None)):
            status, error = post(url, path, body)
            assert status == 400 and "no tokenizer" in error["error"]["message"], error
            assert error["error"]["param"] == param, error
    finally:
        stop_server(proc)


def test_api_key_is_required_and_server_keeps_serving(server, client):
    for key in (None, "wrong-key"):
        status, error = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server + "/v1", api_key="wrong-key", max_retries=0).models.list()
    # as in vLLM, the key guards the /v1 API only
    assert post(server, "/tokenize", {"prompt": "hi"}, key=None)[0] == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nonexistent", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason
    assert get_metrics(server)["pagedllm:num_requests_running"] == 0


# ---- per-request metrics ----------------------------------------------------------------------------------
def success(reason: str) -> str:
    return f'pagedllm:request_success_total{{finished_reason="{reason}"}}'


def test_per_request_metrics_count_each_finished_sequence(tiny_server):
    """vLLM's per-request series take each finished sequence once (n=2 twice), completions and chat, streamed or
    not, under its finish reason."""
    tiny = OpenAI(base_url=tiny_server + "/v1", api_key="unused", max_retries=0)
    max_len = json.loads(urllib.request.urlopen(tiny_server + "/v1/models").read())["data"][0]["max_model_len"]
    length = {"ignore_eos": True}
    stop = {"allowed_token_ids": [42], "stop_token_ids": [42]}  # the first token ends the sequence
    usage = {"include_usage": True}
    before = get_metrics(tiny_server)
    plain = tiny.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, extra_body=length)
    *_, streamed = tiny.completions.create(model="tiny", prompt=[5, 6], max_tokens=4, n=2, stream=True,
                                           stream_options=usage, extra_body=length)
    chat_stop = tiny.chat.completions.create(model="tiny", messages=CHAT, extra_body=stop)  # max_tokens unset
    *_, chat_streamed = tiny.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, stream=True,
                                                     stream_options=usage, extra_body=length)
    assert chat_stop.choices[0].finish_reason == "stop"
    after = get_metrics(tiny_server)
    delta = {key: after[key] - before[key] for key in after}

    assert delta[success("length")] == 1 + 2 + 1 and delta[success("stop")] == 1 and delta[success("abort")] == 0
    usages = [plain.usage, streamed.usage, chat_stop.usage, chat_streamed.usage]
    sequences = [1, 2, 1, 1]
    for name in ("e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens"):
        assert delta[f"pagedllm:{name}_count"] == 5, name
    # each of the n prompt's sequences counts the prompt
    assert delta["pagedllm:request_prompt_tokens_sum"] == sum(u.prompt_tokens * n for u, n in zip(usages, sequences))
    generated = sum(u.completion_tokens for u in usages)
    assert delta["pagedllm:request_generation_tokens_sum"] == generated == delta["pagedllm:generation_tokens_total"]
    chat_limit = max_len - chat_stop.usage.prompt_tokens
    assert delta["pagedllm:request_params_max_tokens_sum"] == 4 + 2 * 4 + chat_limit + 3
    assert delta["pagedllm:request_params_n_count"] == 4 and delta["pagedllm:request_params_n_sum"] == 5
    # each sequence's phases, from the engine's timestamps as vLLM v1 splits them
    for phase in ("queue", "inference", "prefill", "decode"):
        assert delta[f"pagedllm:request_{phase}_time_seconds_count"] == 5, phase
    assert delta["pagedllm:request_time_per_output_token_seconds_count"] == 5
    prefill, decode, inference = (delta[f"pagedllm:request_{p}_time_seconds_sum"] for p in ("prefill", "decode",
                                                                                           "inference"))
    assert prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode)
    assert delta["pagedllm:e2e_request_latency_seconds_sum"] >= inference + delta[
        "pagedllm:request_queue_time_seconds_sum"]
    # one TTFT per prompt, each before its sequences' ends
    assert delta["pagedllm:time_to_first_token_seconds_count"] == 4
    assert delta["pagedllm:e2e_request_latency_seconds_sum"] >= delta["pagedllm:time_to_first_token_seconds_sum"] > 0
    # vLLM's buckets: token counts 1, 2, 5, 10, ... up to max_model_len; TTFT up to 2560 s, ITL up to 80 s
    text = urllib.request.urlopen(tiny_server + "/metrics").read().decode()

    def bounds(name):
        return re.findall(rf'pagedllm:{name}_bucket\{{model_name="tiny",le="([^"]+)"\}}', text)
    assert bounds("request_prompt_tokens") == [
        repr(float(m * 10 ** e)) for e in range(10) for m in (1, 2, 5) if m * 10 ** e <= max_len] + ["+Inf"]
    ttft, itl = bounds("time_to_first_token_seconds"), bounds("inter_token_latency_seconds")
    assert len(ttft) == 23 and ttft[:2] == ["0.001", "0.005"]
    assert ttft[-5:] == ["80.0", "160.0", "640.0", "2560.0", "+Inf"]
    assert len(itl) == 20 and itl[:2] == ["0.01", "0.025"] and itl[-4:] == ["20.0", "40.0", "80.0", "+Inf"]


# ---- load, disconnects, overload --------------------------------------------------------------------------
def test_load_with_disconnecting_clients_frees_everything(server):
    """64 concurrent streams; every fourth client hangs up after two chunks of a long request. The others
    finish; the hung-up ones are aborted (not run to their 200 tokens) and all blocks come back."""
    async def run() -> list[str | None]:
        aclient = AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i: int) -> str | None:
            leaves = i % 4 == 0
            stream = await aclient.completions.create(
                model=MODEL, prompt=f"Request {i}: once upon a time", temperature=0, stream=True,
                max_tokens=200 if leaves else 6, extra_body={"ignore_eos": leaves})
            finish = None
            async for n, chunk in _aenumerate(stream):
                finish = chunk.choices[0].finish_reason or finish
                if leaves and n == 1:
                    await stream.close()
                    return "left"
            return finish

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=150)
        await aclient.close()
        return results

    before = get_metrics(server)
    results = asyncio.run(run())
    assert results.count("left") == 16
    assert all(r in ("length", "stop") for r in results if r != "left")
    after = wait_for_metrics(server, lambda m: m["pagedllm:num_requests_running"] == 0
                             and m["pagedllm:num_requests_waiting"] == 0)
    assert after["pagedllm:kv_cache_usage_perc"] == 0.0
    generated = after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"]
    assert generated < 48 * 6 + 16 * 40, "disconnected clients' requests kept generating"
    assert after["pagedllm:time_to_first_token_seconds_count"] >= before[
        "pagedllm:time_to_first_token_seconds_count"] + 64
    assert after["pagedllm:inter_token_latency_seconds_count"] > before["pagedllm:inter_token_latency_seconds_count"]
    # as in vLLM, only the finished requests are in the per-request metrics
    for name in (success("length"), success("stop"), success("abort"), "pagedllm:e2e_request_latency_seconds_count"):
        after[name] -= before[name]
    assert after[success("length")] + after[success("stop")] == 48 and after[success("abort")] == 0
    assert after["pagedllm:e2e_request_latency_seconds_count"] == 48


async def _aenumerate(aiterable):
    n = 0
    async for item in aiterable:
        yield n, item
        n += 1


def test_non_streaming_client_disconnect_aborts(tiny_server):
    before = get_metrics(tiny_server)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", int(tiny_server.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for_metrics(tiny_server, lambda m: m["pagedllm:num_requests_running"] == 1)
    m = wait_for_metrics(tiny_server, lambda m: m["pagedllm:num_requests_running"] == 0, timeout=5)
    assert m["pagedllm:kv_cache_usage_perc"] == 0.0 and m["pagedllm:generation_tokens_total"] < 3000
    # in none of the per-request metrics, as a stream's disconnect
    for name in (success("abort"), "pagedllm:e2e_request_latency_seconds_count", "pagedllm:request_params_n_count"):
        assert m[name] == before[name], name


def test_full_waiting_queue_gets_503_then_recovers(tiny_server):
    tiny = OpenAI(base_url=tiny_server + "/v1", api_key="unused", max_retries=0)
    blocker = tiny.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3000, stream=True,
                                      extra_body={"ignore_eos": True})
    next(iter(blocker))  # running now: the only sequence slot is taken
    with ThreadPoolExecutor(4) as pool:
        waiting = [pool.submit(tiny.completions.create, model="tiny", prompt=[5, 6], max_tokens=2)
                   for _ in range(4)]
        wait_for_metrics(tiny_server, lambda m: m["pagedllm:num_requests_waiting"] == 4)
        status, error = post(tiny_server, "/v1/completions", {"prompt": [5], "max_tokens": 2}, key=None)
        assert status == 503 and error["error"]["code"] == "overloaded"
        blocker.close()
        assert all(f.result(timeout=60).choices[0].finish_reason == "length" for f in waiting)
    assert tiny.completions.create(model="tiny", prompt=[5], max_tokens=2).usage.completion_tokens == 2


def test_serving_benchmark_runs_against_a_dummy_model(tiny_server, tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import serving
    finally:
        sys.path.pop(0)
    out = tmp_path / "serving.json"
    report = serving.main(["--base-url", tiny_server, "--num-prompts", "4", "--request-rates", "20,inf",
                           "--input-len", "8", "--output-len", "4", "--output", str(out)])
    assert json.loads(out.read_text()) == report
    for row in report["results"]:
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["ttft_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"] > 0
        assert row["output_throughput"] > 0
