"""Sampler and SamplingParams behaviour on synthetic logits (no model needed)."""
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.request import Request
from pagedllm.layers.sampler import Sampler, _param_table, _Rows, _sampling_probs

VOCAB = 50


def make_request(rid="r", prompt=(1, 2, 3), index=0, eos=frozenset({0}), **params):
    sp = SamplingParams(**params)
    request = Request(rid, list(prompt), sp, max_tokens=sp.max_tokens or 16, index=index, eos_token_ids=eos)
    # As the scheduler leaves a request it scheduled to sample: one token on its way.
    request.num_placeholders = 1
    return request


def sample(requests, logits, seed=0):
    return Sampler(torch.device("cpu"), seed)(logits, requests)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("n", 0), ("top_k", -2),
    ("top_k", 1.5), ("min_p", 1.5), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", float("nan")), ("min_p", float("nan")), ("repetition_penalty", float("inf")),
    ("presence_penalty", float("nan")), ("frequency_penalty", float("nan")), ("logprobs", -1), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("min_tokens", -1), ("seed", -2**63 - 1), ("seed", 2**63), ("stop", [""]),
    ("stop_token_ids", [-1]), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 150.0}), ("temperature", 1e39), ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("repetition_penalty", 1e39),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", True),
    ("truncate_prompt_tokens", 2.0), ("truncate_prompt_tokens", "8"), ("bad_words", "word"), ("bad_words", [" "]),
    ("bad_words", [3]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_truncate_prompt_tokens_takes_a_size_or_minus_one_as_in_vllm():
    assert [SamplingParams(truncate_prompt_tokens=k).truncate_prompt_tokens for k in (None, 1, 4096, -1)] == \
        [None, 1, 4096, -1]


def test_top_k_zero_means_every_token_as_in_vllm():
    assert SamplingParams(top_k=0).top_k == SamplingParams().top_k == -1


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token():
    logits = torch.randn(3, VOCAB)
    reqs = [make_request(str(i), temperature=1.0, top_p=1e-300, seed=i) for i in range(3)]
    assert sample(reqs, logits.clone()).token_ids == logits.argmax(-1).tolist()


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


def test_greedy_takes_argmax():
    logits = torch.randn(3, VOCAB)
    reqs = [make_request(str(i), temperature=0.0) for i in range(3)]
    assert sample(reqs, logits.clone()).token_ids == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_when_hot():
    logits = torch.randn(4, VOCAB)
    reqs = [make_request(str(i), temperature=5.0, top_k=1) for i in range(4)]
    assert sample(reqs, logits.clone()).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 7], logits[0, 9] = 5.0, 4.9  # together nearly all of the mass
    seen = set()
    for seed in range(40):
        seen.update(sample([make_request(temperature=1.0, top_p=0.5, seed=seed)], logits.clone()).token_ids)
    assert seen == {7}
    for seed in range(40):
        seen.update(sample([make_request(temperature=1.0, top_p=0.99, seed=seed)], logits.clone()).token_ids)
    assert seen == {7, 9}


def test_min_p_filters_unlikely_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 3.0  # p(3) ~ 0.29, every other ~ 0.014
    for seed in range(30):
        out = sample([make_request(temperature=1.0, min_p=0.1, seed=seed)], logits.clone())
        assert out.token_ids == [3]


def test_seed_makes_sampling_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB)
    alone = []
    for _ in range(3):
        alone.append(sample([make_request("a", temperature=1.0, seed=123)], logits[2:3].clone()).token_ids[0])
    batch_reqs = [make_request(str(i), temperature=1.0, seed=123 if i == 2 else None) for i in range(5)]
    together = []
    sampler = Sampler(torch.device("cpu"), 7)
    for _ in range(3):
        together.append(sampler(logits.clone(), batch_reqs).token_ids[2])
    # The seeded request keeps its generator across steps, so compare step by step with one generator too.
    single = make_request("a", temperature=1.0, seed=123)
    single_sampler = Sampler(torch.device("cpu"), 99)
    expected = [single_sampler(logits[2:3].clone(), [single]).token_ids[0] for _ in range(3)]
    assert together == expected
    assert alone[0] == expected[0]


def test_samples_of_one_request_differ():
    logits = torch.zeros(1, VOCAB)
    ra, rb = make_request(index=0, temperature=1.0, seed=5), make_request(index=1, temperature=1.0, seed=5)
    s = Sampler(torch.device("cpu"), 0)
    seq_a = [s(logits.clone(), [ra]).token_ids[0] for _ in range(10)]
    seq_b = [s(logits.clone(), [rb]).token_ids[0] for _ in range(10)]
    assert seq_a != seq_b


@pytest.mark.parametrize("seed", [-1, -2**63, 2**63 - 1])
def test_any_64_bit_seed_samples_reproducibly(seed):
    """vLLM takes any int64 seed (OpenAI clients send -1 too); each sample of a request adds its index."""
    logits = torch.zeros(1, VOCAB)
    # different engine seeds: the request's seed alone decides
    runs = [[sample([make_request(index=i, temperature=1.0, seed=seed)], logits.clone(), engine_seed).token_ids[0]
             for i in range(3)] for engine_seed in (0, 1)]
    assert runs[0] == runs[1]


def test_logit_bias_is_added_before_sampling_not_to_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB)
    target = int(logits[0].argmin())
    reqs = [make_request("a", temperature=0.0, logprobs=1, logit_bias={target: 100.0}),
            make_request("b", temperature=1.0, seed=3, logit_bias={int(logits[1].argmax()): -100.0}),
            make_request("c", temperature=0.0)]
    out = sample(reqs, logits.clone())
    assert out.token_ids[0] == target and out.token_ids[2] == int(logits[2].argmax())
    assert out.token_ids[1] != int(logits[1].argmax())
    # logprobs are the model's own, as vLLM returns them by default
    assert out.logprobs[0][target].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[target]), abs=1e-5)


def test_allowed_token_ids_are_the_only_ones_sampled():
    """Greedy and random rows with allowed_token_ids pick among them only; the others and the logprobs (the
    model's own) are untouched."""
    torch.manual_seed(6)
    logits = torch.randn(4, VOCAB)
    allowed = [3, 17, 41]
    reqs = [make_request("a", temperature=0.0, logprobs=1, allowed_token_ids=allowed),
            *(make_request(f"r{i}", temperature=5.0, seed=i, allowed_token_ids=allowed) for i in range(2)),
            make_request("c", temperature=0.0)]
    out = sample(reqs, logits.clone())
    assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert set(out.token_ids[1:3]) <= set(allowed) and out.token_ids[3] == int(logits[3].argmax())
    token = out.token_ids[0]
    assert out.logprobs[0][token].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[token]), abs=1e-5)
    hot = [make_request(f"h{i}", temperature=50.0, seed=i, allowed_token_ids=[5, 6]) for i in range(32)]
    assert set(sample(hot, torch.randn(32, VOCAB)).token_ids) == {5, 6}


def test_bad_words_ban_their_last_token_once_the_output_ends_with_the_rest():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 9], logits[0, 3] = 3.0, 2.0, 1.0
    req = make_request(temperature=0.0)
    req.bad_words_token_ids = ((5,), (7, 9))
    assert not Sampler.plain_greedy([req])
    assert sample([req], logits.clone()).token_ids == [9]
    req.append_output_token(7)
    assert sample([req], logits.clone()).token_ids == [3]
    req.append_output_token(8)
    assert sample([req], logits.clone()).token_ids == [9]


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 20] = 2.0, 1.5  # token 1 is in the prompt
    assert sample([make_request(temperature=0.0)], logits.clone()).token_ids == [1]
    assert sample([make_request(temperature=0.0, repetition_penalty=2.0)], logits.clone()).token_ids == [20]


def test_frequency_and_presence_penalties_count_output_tokens():
    req = make_request(prompt=(30,), temperature=0.0, frequency_penalty=1.0)
    for t in (5, 5, 5):
        req.append_output_token(t)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 3.0, 1.0
    assert sample([req], logits.clone()).token_ids == [6]  # 3 - 3*1.0 = 0 < 1
    req2 = make_request(prompt=(30,), temperature=0.0, presence_penalty=1.5)
    req2.append_output_token(5)
    assert sample([req2], logits.clone()).token_ids == [5]  # 3 - 1.5 = 1.5 > 1
    req2.sampling_params.presence_penalty = 2.0
    logits[0, 6] = 1.1
    assert sample([req2], logits.clone()).token_ids == [6]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0], logits[0, 4], logits[0, 8] = 9.0, 8.0, 1.0
    req = make_request(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    assert sample([req], logits.clone()).token_ids == [8]
    req.append_output_token(8)
    req.append_output_token(8)
    assert sample([req], logits.clone()).token_ids == [0]


def test_min_tokens_holds_at_the_largest_temperature():
    """The ban's -inf logits stay -inf when divided by the largest temperature accepted (float32's largest)."""
    logits = torch.zeros(8, VOCAB)
    logits[:, 0] = 30.0
    reqs = [make_request(str(i), temperature=3.4e38, min_tokens=2, seed=i) for i in range(8)]
    tokens = sample(reqs, logits.clone()).token_ids
    assert 0 not in tokens and len(set(tokens)) > 1


def test_logprobs_are_raw_log_softmax_with_top_k():
    logits = torch.randn(2, VOCAB)
    reqs = [make_request("a", temperature=0.0, logprobs=3), make_request("b", temperature=0.0)]
    out = sample(reqs, logits.clone())
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    top = torch.topk(ref, 3).indices.tolist()
    assert set(lp) == set(top) | {out.token_ids[0]}
    for tok, val in lp.items():
        assert val.logprob == pytest.approx(float(ref[tok]), abs=1e-5)
    assert [lp[t].rank for t in top] == [1, 2, 3]
    assert out.logprobs[1] is None


def reference_probs(logits_row, p):
    """Per-row filtering the plain way: sort the whole vocabulary, cut at top_k, then at top_p, then min_p."""
    x = logits_row.double() / p.temperature
    order = x.argsort(descending=True)
    k = p.top_k if p.top_k > 0 else x.numel()
    kept = order[:k]
    if p.top_p < 1.0:
        probs = torch.softmax(x[kept], -1)
        mass_before = probs.cumsum(-1) - probs
        kept = kept[mass_before < p.top_p]
    probs = torch.zeros_like(x)
    probs[kept] = torch.softmax(x[kept], -1)
    if p.min_p > 0.0:
        probs[probs < probs.max() * p.min_p] = 0.0
    return probs.float()


@pytest.mark.parametrize("case", ["top_k_everywhere", "top_p_without_top_k", "some_rows_unfiltered"])
def test_filters_match_a_full_sort_reference(case):
    torch.manual_seed(1)
    ks = {"top_k_everywhere": [1, 3, 7, 20, 50, 60], "top_p_without_top_k": [5, -1, 12, -1, 50, 2],
          "some_rows_unfiltered": [-1, 4, -1, 9, -1, 30]}[case]
    top_ps = [1.0, 0.3, 0.8, 0.95, 0.5, 1.0] if case != "some_rows_unfiltered" else [1.0, 0.6, 1.0, 1.0, 1.0, 0.9]
    params = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp) for t, k, tp, mp in
              zip([0.5, 1.0, 1.5, 0.8, 2.0, 1.0], ks, top_ps, [0.0, 0.05, 0.0, 0.2, 0.01, 0.0])]
    logits = torch.randn(len(params), VOCAB) * 3
    filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    rows = _Rows(torch.tensor(filtered), len(filtered) == len(params))
    probs = _sampling_probs(logits.clone(), _param_table(params), rows, [params[i].top_k for i in filtered], True)
    for i, p in enumerate(params):
        ref = reference_probs(logits[i], p)
        assert torch.equal(probs[i] > 0, ref > 0), (i, p)
        torch.testing.assert_close(probs[i], ref)


def test_seeded_request_ignores_batch_composition():
    torch.manual_seed(2)
    steps = [torch.randn(6, VOCAB) for _ in range(4)]
    seeded = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=42)
    others = {
        "alone": [],
        "greedy": [dict(temperature=0.0), dict(temperature=0.0, presence_penalty=1.0)],
        "full_sort": [dict(temperature=1.0, top_p=0.5), dict(temperature=0.7)],
        "unfiltered": [dict(temperature=1.2), dict(temperature=1.0, seed=3, logprobs=2)],
        "top_k": [dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_k=45, min_tokens=3)],
    }
    results = {}
    for name, extra in others.items():
        reqs = [make_request(str(i), **kw) for i, kw in enumerate(extra)]
        mine = make_request("seeded", **seeded)
        reqs.insert(len(reqs) // 2, mine)
        row = reqs.index(mine)
        sampler = Sampler(torch.device("cpu"), len(name))
        tokens = []
        for logits in steps:
            # The seeded request sees the same logits wherever it sits in the batch.
            batch = torch.randn(len(reqs), VOCAB)
            batch[row] = logits[0]
            tok = sampler(batch, reqs).token_ids
            tokens.append(tok[row])
            for r, t in zip(reqs, tok):
                r.append_output_token(t)
        results[name] = tokens
    assert all(v == results["alone"] for v in results.values()), results


def reference_penalties(row, request, p):
    """The per-row definition: repetition over prompt + output, presence/frequency over output only."""
    row = row.clone()
    seen = torch.zeros(row.shape[0], dtype=torch.bool)
    seen[torch.tensor(request.all_token_ids)] = True
    row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
    counts = torch.zeros(row.shape[0])
    for t in request.output_token_ids:
        counts[t] += 1
    return row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_batched_penalties_match_a_per_row_reference():
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        reqs = []
        for i in range(5):
            rp, fp, pp = [(1.0, 0.0, 0.0), (1.5, 0.0, 0.0), (0.7, 0.5, 0.0), (1.0, 1.2, -1.0), (1.3, -0.4, 0.8)][i]
            prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
            req = make_request(str(i), prompt=prompt.tolist(), temperature=0.0, repetition_penalty=rp,
                               frequency_penalty=fp, presence_penalty=pp)
            num_output = int(torch.randint(0, 12, (1,), generator=g))
            for t in torch.randint(0, VOCAB, (num_output,), generator=g).tolist():
                req.append_output_token(t)
            reqs.append(req)
        logits = torch.randn(len(reqs), VOCAB) * 2
        expected = [int(reference_penalties(logits[i], r, r.sampling_params).argmax()) for i, r in enumerate(reqs)]
        assert sample(reqs, logits.clone()).token_ids == expected


def test_min_tokens_bans_only_rows_below_their_minimum():
    logits = torch.zeros(3, VOCAB)
    logits[:, 0], logits[:, 4], logits[:, 8] = 9.0, 8.0, 1.0
    reqs = [make_request("a", temperature=0.0, min_tokens=2, stop_token_ids=[4, VOCAB + 5]),
            make_request("b", temperature=0.0),
            make_request("c", temperature=0.0, min_tokens=1, stop_token_ids=[4])]
    reqs[2].append_output_token(8)
    assert sample(reqs, logits.clone()).token_ids == [8, 0, 0]


def test_logprobs_in_a_mixed_batch():
    torch.manual_seed(4)
    logits = torch.randn(4, VOCAB)
    reqs = [make_request("a", temperature=1.0, seed=1, logprobs=0), make_request("b", temperature=0.0),
            make_request("c", temperature=0.0, logprobs=5, repetition_penalty=3.0),
            make_request("d", temperature=0.5, logprobs=2)]
    out = sample(reqs, logits.clone())
    assert out.logprobs[1] is None
    for i, n in ((0, 0), (2, 5), (3, 2)):
        ref = torch.log_softmax(logits[i], -1)  # raw: before penalties and temperature
        lp = out.logprobs[i]
        assert list(lp)[0] == out.token_ids[i]
        assert set(lp) == set(torch.topk(ref, n).indices.tolist()) | {out.token_ids[i]}
        for tok, val in lp.items():
            assert val.logprob == pytest.approx(float(ref[tok]), abs=1e-5)
            # the rank among the whole vocabulary, for the sampled token too (vLLM's)
            if tok == out.token_ids[i]:
                assert val.rank == int((ref >= ref[tok]).sum())


def test_tied_logprobs_share_the_worse_rank_as_in_vllm():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = logits[0, 7] = 5.0
    out = sample([make_request(temperature=0.0, logprobs=2)], logits)
    assert out.token_ids[0] in (3, 7) and out.logprobs[0][out.token_ids[0]].rank == 2


def test_reused_host_buffers_keep_every_output():
    """The sampler copies each step's samples into one of a few reused host buffers; one comes round again
    while its output is still unread (more steps queued than buffers), so it is read first: no output loses its
    tokens or logprobs to a later step's."""
    sampler = Sampler(torch.device("cpu"), 0)
    num_steps = 3 * len(sampler.host_buffers.slots) + 1
    steps = [torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(i)) for i in range(num_steps)]
    kinds = [dict(temperature=0.0), dict(temperature=0.0, logprobs=2)]
    outputs = [sampler(logits.clone(), [make_request(str(i), **kw) for i, kw in enumerate(kinds)])
               for logits in steps]
    for logits, out in zip(steps, outputs):
        assert out.token_ids == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits[1], -1)
        assert out.logprobs[0] is None
        got = {t: e.logprob for t, e in out.logprobs[1].items()}
        assert got == pytest.approx({t: expected[t].item() for t in expected.topk(2).indices.tolist()})


@pytest.mark.parametrize("vocab", [10, 100])
def test_prompt_logprobs_slices_stay_within_what_the_runner_reserves(monkeypatch, vocab):
    """Prompt logprobs run in slices of rows whose logits and log-softmax take at most prompt_logprobs_bytes (the
    runner keeps that much free beside the KV cache); a row wider than a slice is a slice of its own. The slices give
    what the whole log-softmax gives."""
    from pagedllm.layers import sampler
    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_SLICE", 64)
    gen = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(23, 8, generator=gen), torch.randn(vocab, 8, generator=gen)
    targets = torch.randint(0, vocab, (23,), generator=gen)
    widths = []

    def logits(h):
        widths.append(h.shape[0])
        return h @ head.T
    out = sampler.prompt_logprobs(logits, hidden, targets, [(None, 1, 23, 2)], vocab)
    assert sum(widths) == 23 and max(widths) == max(1, 64 // vocab)
    assert all(2 * w * vocab * 4 <= sampler.prompt_logprobs_bytes(vocab) for w in widths)
    whole = torch.log_softmax(hidden @ head.T, dim=-1)
    _, chosen, _, top, _ = out._host
    torch.testing.assert_close(chosen, whole.gather(1, targets[:, None]).squeeze(1))
    torch.testing.assert_close(top, whole.topk(2, dim=-1).values)
