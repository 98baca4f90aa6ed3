"""The batched sampler on CUDA tensors: the rows that involve no randomness equal the CPU sampler's, a seeded
request keeps its tokens whatever else is in the batch, and bfloat16 logits take the greedy fast path."""
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.request import Request
from pagedllm.layers.sampler import Sampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 151936


def make_requests(kinds, prompt_len=40, num_output=6):
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i, kw in enumerate(kinds):
        sp = SamplingParams(max_tokens=64, **kw)
        req = Request(str(i), torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist(), sp, 64,
                      eos_token_ids=frozenset({2}))
        for t in torch.randint(0, VOCAB, (num_output,), generator=g).tolist():
            req.append_output_token(t)
        # As the scheduler leaves a request it scheduled to sample: one token on its way.
        req.num_placeholders = 1
        reqs.append(req)
    return reqs


DETERMINISTIC = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.5),
    dict(temperature=0.0, min_tokens=20, stop_token_ids=[5, VOCAB + 9]),
    dict(temperature=0.0, logprobs=4),
    dict(temperature=0.7, top_k=1, logprobs=0),  # random row, but top_k=1 leaves one token
    dict(temperature=1.0, top_k=1, top_p=0.5, repetition_penalty=0.8),
    dict(temperature=0.0, logit_bias={7: 100.0, 11: -100.0}, logprobs=2),  # forces token 7
    dict(temperature=0.0, logit_bias={3: 2.5}, repetition_penalty=1.5, logprobs=1),
]


def test_deterministic_rows_equal_the_cpu_sampler():
    logits = torch.randn(len(DETERMINISTIC), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    cpu = Sampler(torch.device("cpu"), 0)(logits.clone(), make_requests(DETERMINISTIC))
    gpu = Sampler(torch.device("cuda"), 0)(logits.cuda(), make_requests(DETERMINISTIC))
    assert gpu.token_ids == cpu.token_ids
    for a, b in zip(gpu.logprobs, cpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 and a[t].rank == b[t].rank for t in a)
    assert gpu.token_ids[-2] == 7


def test_min_tokens_with_nothing_to_ban():
    # The only special row bans nothing (no EOS, no stop ids): the step uploads an empty index list.
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0.0, min_tokens=3), 16)
    logits = torch.randn(1, VOCAB, device="cuda")
    assert Sampler(torch.device("cuda"), 0)(logits.clone(), [req]).token_ids == logits.argmax(-1).tolist()


def test_seeded_request_ignores_the_rest_of_the_batch():
    seeded = dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1, seed=7)
    batches = {
        "alone": [seeded],
        "mixed": [dict(temperature=0.0), seeded, dict(temperature=1.0, top_p=0.8), dict(temperature=1.0)],
        "top_k": [dict(temperature=1.0, top_k=5, logprobs=2), seeded],
    }
    steps = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(s)).cuda() * 3 for s in range(5)]
    results = {}
    for name, kinds in batches.items():
        reqs = make_requests(kinds)
        row = kinds.index(seeded)
        sampler = Sampler(torch.device("cuda"), len(name))
        tokens = []
        for logits in steps:
            batch = torch.randn(len(reqs), VOCAB, device="cuda")
            batch[row] = logits
            tokens.append(sampler(batch, reqs).token_ids[row])
        results[name] = tokens
    assert results["mixed"] == results["alone"] and results["top_k"] == results["alone"]


def test_bfloat16_greedy_fast_path():
    logits = torch.randn(64, VOCAB, device="cuda", dtype=torch.bfloat16)
    reqs = make_requests([dict(temperature=0.0)] * 64, num_output=0)
    assert Sampler(torch.device("cuda"), 0)(logits, reqs).token_ids == logits.float().argmax(-1).tolist()
