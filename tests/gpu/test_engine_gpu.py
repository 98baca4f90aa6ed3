"""The engine on the GPU against Hugging Face transformers on random-weight models.

Dtypes and tolerances:
- float32: our Triton kernels use IEEE fp32 dots for fp32 inputs and torch's fp32 matmuls do not use TF32 by
  default, so greedy tokens must equal transformers' exactly, token for token.
- bfloat16 (and bf16 with an fp8 KV cache): bf16 keeps 8 mantissa bits, so two correct implementations that
  round in a different order drift apart and a near-tie between two tokens can flip, after which the texts
  diverge. So each token we pick is checked teacher-forced against transformers' fp32 logits on our own
  sequence: its logit must be within a small fraction of that row's spread of the best one (2% for bf16,
  5% with fp8 K/V). A wrong kernel misses that by far (a random token sits ~50% of the spread below).
"""
import functools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QWEN3_0_6B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True)
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=5632,
             num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
             max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "llama": LLAMA}
PROMPT_LENS = (1, 7, 130, 1000, 2100)
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(SHAPES))
def hf_model_dir(request, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(SHAPES[request.param])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model.to("cuda").eval()


def prompts(vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def ours(path, prompt_ids=None, **options):
    """Our greedy tokens for prompt_ids (default: prompts()) with these engine options."""
    from pagedllm import LLM, SamplingParams
    llm = LLM(str(path), device="cuda", num_kv_blocks=2048, max_model_len=4096, max_num_seqs=8, **options)
    runner = llm.engine.runner
    full, piecewise = llm.engine.config.graph_modes()
    assert (runner.decode_graphs is not None, runner.piecewise_graphs is not None) == (full, piecewise)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    vocab = llm.engine.hf_config.vocab_size
    outs = llm.generate(prompt_ids or prompts(vocab), params, use_tqdm=False)
    assert llm.engine.kv_cache_manager.usage == 0.0
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def hf_greedy(model, prompt):
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_TOKENS, do_sample=False,
                         min_new_tokens=MAX_TOKENS)
    return out[0, len(prompt):].tolist()


def test_float32_greedy_equals_transformers(hf_model_dir):
    path, model = hf_model_dir
    got = ours(path, dtype="float32")
    expected = [hf_greedy(model, p) for p in prompts(model.config.vocab_size)]
    assert got == expected


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise", "full_decode_only"])
@pytest.mark.parametrize("budget", [None, 512], ids=["one-step-prefill", "chunked"])
def test_cuda_graphs_equal_eager(hf_model_dir, mode, budget):
    """Graph replays pad the batch (decode graphs also plan decode for max_model_len; piecewise graphs run
    attention eagerly between them): the same tokens must come out. A 512-token budget chunks the long
    prompts, so steps mix decodes with prefill chunks of cached prefixes."""
    path, _ = hf_model_dir
    assert ours(path, dtype="float32", cudagraph_mode=mode, max_num_batched_tokens=budget) == eager(path, budget)


@functools.lru_cache(maxsize=None)
def eager(path, budget):
    return ours(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=budget)


def test_piecewise_graphs_with_fp8_cache_equal_eager(hf_model_dir):
    """Steps mixing decodes with 512-token prefill chunks of cached prefixes replay the piecewise graphs, whose
    fused RoPE writes K/V into an fp8 cache: the same tokens as eager steps on the same cache."""
    path, _ = hf_model_dir
    options = dict(dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=512)
    assert ours(path, cudagraph_mode="piecewise", **options) == ours(path, enforce_eager=True, **options)


def test_xattention_prefill_between_piecewise_graphs_equals_dense(hf_model_dir, monkeypatch):
    """XAttention's sparse prefill runs eagerly between the piecewise graphs, in 512-token chunks against the
    cached prefix; at threshold 1.0 it keeps every block, so the tokens equal the dense eager engine's."""
    from pagedllm.ops import xattention
    path, _ = hf_model_dir
    calls = []
    real = xattention.xattention_paged_prefill
    monkeypatch.setattr(xattention, "xattention_paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    sparse = ours(path, dtype="float32", max_num_batched_tokens=512, sparse_prefill="xattention",
                  xattn_threshold=1.0, xattn_block_size=64, xattn_min_prompt_len=1000)
    assert calls  # the two long prompts went through XAttention
    assert sparse == eager(path, 512)


def test_async_scheduling_equals_synchronous(hf_model_dir):
    """Overlapped steps take each decode's input token from the previous step's samples on the device."""
    path, _ = hf_model_dir
    assert ours(path, dtype="float32") == ours(path, dtype="float32", async_scheduling=False)


@pytest.mark.parametrize("options,tolerance", [
    pytest.param(dict(dtype="bfloat16"), 0.02, id="bf16"),
    pytest.param(dict(dtype="bfloat16", kv_cache_dtype="fp8"), 0.05, id="bf16-fp8kv"),
    pytest.param(dict(dtype="float16", block_size=32, enable_prefix_caching=False), 0.02, id="fp16-block32"),
    pytest.param(dict(dtype="bfloat16", attention_backend="cuda"), 0.02, id="bf16-cuda"),
])
@torch.inference_mode()
def test_half_precision_tokens_are_near_greedy(hf_model_dir, options, tolerance):
    path, model = hf_model_dir
    got = ours(path, **options)
    for prompt, tokens in zip(prompts(model.config.vocab_size), got):
        logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        spread = logits.max(-1).values - logits.min(-1).values
        gap = logits.max(-1).values - logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        assert bool((gap <= tolerance * spread).all()), (gap / spread).max().item()


def test_screened_lm_head_gives_the_whole_heads_tokens(hf_model_dir, monkeypatch):
    """Decode steps of one sequence whose token is its plain argmax replay the graph of the screened LM head
    (ops.triton.greedy_head, which recomputes only the head tiles that can hold the argmax): prompt by prompt,
    the same bf16 tokens as graphs that compute every logit (PAGEDLLM_GREEDY_SCREEN=0). float16 heads:
    test_greedy_head_gpu.py."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.cuda_graph import SCREEN_ENV_VAR, DecodeGraphs
    path, model = hf_model_dir
    replays, run = [], DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, bs, max_seq_len, screened=False:
                        replays.append(screened) or run(self, bs, max_seq_len, screened))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = {}
    for screen in ("1", "0"):
        monkeypatch.setenv(SCREEN_ENV_VAR, screen)
        llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_model_len=4096, max_num_seqs=8)
        assert (llm.engine.runner.decode_graphs.screen is not None) == (screen == "1")
        tokens[screen] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                          for p in prompts(model.config.vocab_size)]
        del llm
        torch.cuda.empty_cache()
    assert tokens["1"] == tokens["0"]
    assert replays.count(True) >= len(PROMPT_LENS) * (MAX_TOKENS - 2)


def test_allowed_token_ids_leave_the_graphs_argmax_paths(hf_model_dir):
    """Greedy decode steps with allowed_token_ids take the sampler, not the graph's argmax or the screened head:
    at batch 1 (the screened head's size) and batch 5, in bf16 graphs, only the allowed ids come out."""
    from pagedllm import LLM, SamplingParams
    path, model = hf_model_dir
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_model_len=4096, max_num_seqs=8)
    allowed = [11, 222, 3333]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    batch = prompts(model.config.vocab_size)
    outs = [*llm.generate(batch[:1], params, use_tqdm=False), *llm.generate(batch, params, use_tqdm=False)]
    assert all(set(o.outputs[0].token_ids) <= set(allowed) and len(o.outputs[0].token_ids) == MAX_TOKENS
               for o in outs)


@torch.inference_mode()
def test_bad_words_leave_the_graphs_argmax_paths(hf_model_dir, monkeypatch):
    """Greedy decode steps with bad words take the sampler's bans, not the graph's argmax or the screened head: at
    batch 1 and batch 5, in bf16 graphs, the first tokens of a plain greedy run never come once banned. The random
    model has no tokenizer, so the words' token ids are given directly."""
    from pagedllm import LLM, SamplingParams
    path, model = hf_model_dir
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_model_len=4096, max_num_seqs=8)
    batch = prompts(model.config.vocab_size)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    banned = set(llm.generate(batch[:1], plain, use_tqdm=False)[0].outputs[0].token_ids[:3])
    monkeypatch.setattr(llm.engine, "bad_words_token_ids", lambda words: tuple((t,) for t in sorted(banned)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=["unused"])
    outs = [*llm.generate(batch[:1], params, use_tqdm=False), *llm.generate(batch, params, use_tqdm=False)]
    assert all(not banned & set(o.outputs[0].token_ids) and len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


@torch.inference_mode()
def test_cuda_backend_greedy_equals_triton(hf_model_dir):
    """Same decode math in another kernel; in bf16 only the summation order differs, so the two runs agree
    token for token until, possibly, a near-tie: where they first differ, both choices must be within 2% of
    the logit spread of transformers' fp32 best (the texts may then go separate, equally valid ways)."""
    path, model = hf_model_dir
    cuda = ours(path, dtype="bfloat16", attention_backend="cuda")
    triton = ours(path, dtype="bfloat16", attention_backend="triton")
    for prompt, a, b in zip(prompts(model.config.vocab_size), cuda, triton):
        if a == b:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        row = model(torch.tensor([prompt + a[:i]], device="cuda")).logits[0, -1].float()
        spread = row.max() - row.min()
        assert row.max() - row[a[i]] <= 0.02 * spread and row.max() - row[b[i]] <= 0.02 * spread


@torch.inference_mode()
def test_decode_rows_sharing_a_written_block_take_the_layers(hf_model_dir, monkeypatch):
    """A's decode token completes its first block, which B takes from the prefix cache in the same step with one
    token left to compute (test_model_runner.py has the CPU side): the step in which B reads the slot A writes runs
    eagerly on the layers' path, which writes both rows' K/V before attending (the decoder-layer kernel and the
    graphs attend to keys cached before the step). Eager steps, so that every step's forward says which path it took;
    on the GPU in bf16 both requests' tokens stay near greedy."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.models import llama
    path, model = hf_model_dir
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=256, block_size=16,
              async_scheduling=False, enforce_eager=True)
    engine, steps = llm.engine, []
    metadata, fused = engine.runner._metadata, llama.fused_decode
    monkeypatch.setattr(engine.runner, "_metadata", lambda step, dev, shared=False: steps.append(
        [step.num_decodes, shared, None]) or metadata(step, dev, shared))

    def spied(*args):
        plan = fused(*args)
        steps[-1][2] = plan is not None
        return plan
    monkeypatch.setattr(llama, "fused_decode", spied)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = torch.randint(0, model.config.vocab_size, (15,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.add_request("A", prompt, params)
    (first,) = engine.step()
    prompts = {"A": prompt, "B": prompt + first.outputs[0].token_ids + [7]}
    engine.add_request("B", prompts["B"], params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    # the marked step (eager, no decoder-layer kernel); the next takes the kernel where it covers the model (the
    # Llama test shape's weight shares would stream in slices, where the layers are faster: fused_decode)
    assert steps[1] == [2, True, False] and steps[2] == [2, False, model.config.model_type == "qwen3"]
    assert engine.kv_cache_manager.usage == 0.0
    for rid, prompt in prompts.items():
        logits = model(torch.tensor([prompt + tokens[rid]], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        spread = logits.max(-1).values - logits.min(-1).values
        gap = logits.max(-1).values - logits.gather(1, torch.tensor(tokens[rid], device="cuda")[:, None])[:, 0]
        assert bool((gap <= 0.02 * spread).all()), (rid, (gap / spread).max().item())


@torch.inference_mode()
def test_prompt_logprobs_equal_transformers(hf_model_dir):
    """SamplingParams.prompt_logprobs in float32 on the GPU, the prompts prefilled through the piecewise graphs in
    512-token chunks: every prompt token's logprob within 1e-3 of transformers' log-softmax, the first None."""
    from pagedllm import LLM, SamplingParams
    path, model = hf_model_dir
    llm = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=2048, max_model_len=4096, max_num_seqs=8,
              max_num_batched_tokens=512)
    assert llm.engine.runner.piecewise_graphs is not None
    vocab = model.config.vocab_size
    outs = llm.generate(prompts(vocab), SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(prompts(vocab), outs):
        ids = torch.tensor(prompt, device="cuda")
        want = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
        got = torch.tensor([e[t].logprob for t, e in zip(prompt[1:], out.prompt_logprobs[1:])], device="cuda")
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert torch.allclose(got, want, atol=1e-3, rtol=0), (got - want).abs().max().item()
    assert llm.engine.kv_cache_manager.usage == 0.0
