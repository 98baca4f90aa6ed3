"""Token sampling for one step: penalties, min_tokens, greedy/temperature, top-k/top-p/min-p, logprobs (and the
logprobs of prompt tokens, prompt_logprobs).

The batch is processed at once on the logits' device. A plain greedy step is one argmax; otherwise the host
sends the step's parameters as one float table and one packed int tensor (a host->device copy each) and
reads back only the sampled ids and any requested logprobs. Top-k ranks only the batch's largest k logits;
the whole vocabulary is sorted only for a row with top-p and no top-k. Random rows sample with the
exponential-race trick (argmax of probs / Exp(1) noise). A seeded request draws its noise from its own
generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.engine.request import Request
from pagedllm.layers.norm import fused_kernels
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.buffers import HostBuffers, HostRing, packed_size, packed_views, zero_copy

# Columns of the per-step parameter table, one row per request.
_TEMPERATURE, _TOP_K, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(7)


class SamplerOutput:
    """One step's sampled ids (and requested logprobs), computed on the device. They are copied into a host
    buffer as soon as the sampler has queued them, so reading token_ids waits for this step's work only, not for
    work queued after it (the next step, when steps overlap). ring_slot (ids only): (ring, slot) where the queued
    work already writes the ids into that row of a HostRing (a decode graph's argmax), so no copy is queued."""

    def __init__(self, buffers: HostBuffers, token_ids: torch.Tensor, logprob_rows: list[int] = (),
                 num_top: list[int] = (), logprob_tensors: tuple[torch.Tensor, ...] = (),
                 ring_slot: tuple[HostRing, int] | None = None) -> None:
        self.device_token_ids = token_ids
        self._logprob_rows, self._num_top = logprob_rows, num_top
        self._lists: tuple[list[int], list[dict[int, float] | None]] | None = None
        if ring_slot is not None:
            ring, slot = ring_slot
            self._host, self._ready = [ring.rows[slot, :token_ids.shape[0]]], ring.events[slot]
            ring.readers[slot] = self._read
            self._ready.record(torch.cuda.current_stream(token_ids.device))
            return
        tensors = (token_ids, *logprob_tensors)
        specs = [(t.dtype, t.shape) for t in tensors]
        # The buffer is taken back only after this output has been read (_read).
        buffer, self._ready = buffers.take(packed_size(specs), release=self._read)
        self._host = packed_views(buffer, specs)
        transfer = zero_copy(token_ids.device)
        for host, t in zip(self._host, tensors):
            if transfer is None:
                host.copy_(t, non_blocking=True)
            else:
                transfer.download(host, t)
        if self._ready is not None:
            self._ready.record(torch.cuda.current_stream(token_ids.device))

    @property
    def token_ids(self) -> list[int]:
        return self._read()[0]

    @property
    def logprobs(self) -> list[dict[int, Logprob] | None]:
        """Per row: {token_id: Logprob} of the sampled token and the top-k tokens (ranked, without their text),
        or None if not requested."""
        return self._read()[1]

    def _read(self) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        if self._lists is None:
            if self._ready is not None:
                self._ready.synchronize()
            token_list, *logprob_lists = [t.tolist() for t in self._host]
            logprobs: list[dict[int, Logprob] | None] = [None] * len(token_list)
            if logprob_lists:
                sampled, sampled_ranks, top_values, top_ids = logprob_lists
                for j, (i, n) in enumerate(zip(self._logprob_rows, self._num_top)):
                    logprobs[i] = _entry(token_list[i], sampled[j], sampled_ranks[j], top_ids[j][:n], top_values[j][:n])
            self._lists = token_list, logprobs
        return self._lists


class PromptLogprobs:
    """The logprobs of the prompt tokens a step computed (SamplingParams.prompt_logprobs), copied to the host as
    soon as they are queued, as the step's samples are. spans: per request (request, index of its first prompt
    token here, how many, top n), in the order of the rows."""

    def __init__(self, spans: list[tuple[Request, int, int, int]], tensors: tuple[torch.Tensor, ...]) -> None:
        self._spans = spans
        self._host = [t.to("cpu", non_blocking=True) for t in tensors]
        self._ready = None
        if tensors[0].is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tensors[0].device))

    def read(self) -> list[tuple[Request, int, list[dict[int, Logprob]]]]:
        """Per request: (request, index of the first prompt token, {token_id: Logprob} per token, ranked, without
        their text)."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, values, ranks, top_values, top_ids = [t.tolist() for t in self._host]
        out, row = [], 0
        for request, first, count, n in self._spans:
            out.append((request, first, [_entry(tokens[j], values[j], ranks[j], top_ids[j][:n], top_values[j][:n])
                                         for j in range(row, row + count)]))
            row += count
        return out


def _entry(token: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float]) -> dict[int, Logprob]:
    """{token_id: Logprob} of one position: the token's own, then the top ones by rank."""
    entry = {token: Logprob(logprob, rank)}
    for r, (tok, lp) in enumerate(zip(top_ids, top_values), 1):
        entry.setdefault(tok, Logprob(lp, r))
    return entry


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Of log-softmax rows [rows, vocab] and a token per row: the tokens' logprobs, their ranks (vLLM's: the tokens
    at least as likely, itself included, so tied tokens share the worse rank) and the top k logprobs and ids."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top = logprobs.topk(k, dim=-1)
    return chosen, (logprobs >= chosen[:, None]).sum(-1), top.values, top.indices


# Prompt logprobs are computed in slices of rows holding at most this many logits (256 MB in float32).
PROMPT_LOGPROBS_SLICE = 2 ** 26


def prompt_logprobs_bytes(vocab: int) -> int:
    """The most memory prompt_logprobs takes at once: a slice's float32 logits and their log-softmax."""
    return 2 * max(vocab, PROMPT_LOGPROBS_SLICE) * 4


def prompt_logprobs(compute_logits, hidden: torch.Tensor, targets: torch.Tensor,
                    spans: list[tuple[Request, int, int, int]], vocab: int) -> PromptLogprobs:
    """The logprobs of targets, the next prompt token of each row of hidden, under compute_logits (vocab logits a
    row): in slices of rows holding PROMPT_LOGPROBS_SLICE logits at most (one row where a row holds more)."""
    k = max(n for *_, n in spans)
    step = max(1, PROMPT_LOGPROBS_SLICE // vocab)
    parts = [token_logprobs(torch.log_softmax(compute_logits(hidden[i:i + step]).float(), dim=-1),
                            targets[i:i + step], k) for i in range(0, len(targets), step)]
    return PromptLogprobs(spans, (targets, *(torch.cat(p) for p in zip(*parts))))


@dataclass
class _Rows:
    """A subset of a batch's rows as a device index; a subset holding every row skips the indexing."""
    index: torch.Tensor
    every: bool

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.every else t[self.index]

    def put(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """t with the subset's rows replaced by rows (in place unless every row is replaced)."""
        if self.every:
            return rows
        t[self.index] = rows
        return t


class _RequestState:
    """What the sampler keeps on a request (request.sampler_state) from step to step."""

    def __init__(self, device: torch.device, request: Request) -> None:
        self.generator = None
        seed = request.sampling_params.seed
        if seed is not None:
            self.generator = torch.Generator(device=device)
            # Samples of one request must differ, so each index gets its own stream.
            self.generator.manual_seed(seed + request.index)
        self._token_ids = np.empty(0, dtype=np.int64)
        self._num_tokens = 0

    def all_token_ids(self, request: Request) -> np.ndarray:
        """request.all_token_ids as an array, converting only the tokens appended since the last call (a
        request's tokens only ever grow)."""
        n, old = request.num_tokens, self._num_tokens
        if n > len(self._token_ids):
            grown = np.empty(max(n, 2 * len(self._token_ids)), dtype=np.int64)
            grown[:old] = self._token_ids[:old]
            self._token_ids = grown
        self._token_ids[old:n] = request.all_token_ids[old:n]
        self._num_tokens = n
        return self._token_ids[:n]


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # The engine reads a step's samples one step later, so two buffers would do; a third is a margin.
        self.host_buffers = HostBuffers(device, 3)

    def _state(self, request: Request) -> _RequestState:
        if request.sampler_state is None:
            request.sampler_state = _RequestState(self.device, request)
        return request.sampler_state

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t
        # Pinned, so the copy neither blocks the host nor waits for the GPU to drain the model's kernels.
        return t.pin_memory().to(self.device, non_blocking=True)

    def upload_ints(self, *parts: list[int] | np.ndarray) -> list[torch.Tensor]:
        """Several int sequences as int64 tensors on the device, in one copy."""
        flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in parts])
        return list(self._to_device(torch.from_numpy(flat)).split([len(x) for x in parts]))

    @staticmethod
    def plain_greedy(requests: list[Request]) -> bool:
        """Whether a step of these requests takes each row's largest logit as it is: no random sampling,
        penalties, logprobs, logit bias, allowed or bad words or min_tokens ban (so only the argmax of the logits is
        needed)."""
        # The token sampled now is output number num_output_tokens + num_placeholders (counting from 1): the
        # placeholders include it and any earlier token still on its way.
        return all(p.greedy and not p.has_penalties and p.logprobs is None and not p.logit_bias
                   and p.allowed_token_ids is None and not r.bad_words_token_ids
                   and r.num_output_tokens + r.num_placeholders > p.min_tokens
                   for r in requests for p in (r.sampling_params,))

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor | None, requests: list[Request], greedy: torch.Tensor | None = None,
                 greedy_host: tuple[HostRing, int] | None = None) -> SamplerOutput:
        """Samples one token per row of logits [len(requests), vocab]; may modify logits in place. greedy: the
        rows' argmax where a decode graph has computed it (DecodeGraphs.run), taken for a plain greedy step
        (which needs no logits then); greedy_host: the HostRing slot the graph also writes it into
        (SamplerOutput's ring_slot)."""
        if self.plain_greedy(requests):
            # argmax is exact in the logits' own dtype: no float32 copy of the whole batch's logits.
            if greedy is None:
                return SamplerOutput(self.host_buffers, greedy_tokens(logits))
            return SamplerOutput(self.host_buffers, greedy, ring_slot=greedy_host)
        params = [r.sampling_params for r in requests]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        penalty_rows = [i for i, p in enumerate(params) if p.has_penalties]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        biased = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
        allowed = [(i, t) for i, p in enumerate(params) if p.allowed_token_ids for t in p.allowed_token_ids]
        min_tokens_rows = [i for i, r in enumerate(requests)
                           if r.num_output_tokens + r.num_placeholders <= r.sampling_params.min_tokens]

        logits = logits.float()
        batch, vocab = logits.shape
        table = self._to_device(_param_table(params))
        # Positions among the random rows of those with top-k or top-p.
        filtered_rows = [j for j, i in enumerate(random_rows) if params[i].top_k > 0 or params[i].top_p < 1.0]
        penalised = [requests[i] for i in penalty_rows]
        penalised_tokens = [self._state(r).all_token_ids(r) for r in penalised]
        # min_tokens bans EOS and stop tokens, bad words their last tokens; ids outside the vocabulary could never
        # be sampled anyway.
        banned = [(i, t) for i in min_tokens_rows
                  for t in (*requests[i].eos_token_ids, *params[i].stop_token_ids) if t < vocab]
        banned += [(i, t) for i, r in enumerate(requests) if r.bad_words_token_ids for t in r.banned_token_ids
                   if t < vocab]
        (random_idx, filtered_idx, penalty_idx, logprob_idx, ban_rows, ban_tokens, bias_rows, bias_tokens,
         allowed_rows, allowed_tokens, penalty_tokens, penalty_num_tokens, penalty_num_prompt) = self.upload_ints(
            random_rows, filtered_rows, penalty_rows, logprob_rows, [i for i, _ in banned], [t for _, t in banned],
            [i for i, _, _ in biased], [t for _, t, _ in biased], [i for i, _ in allowed], [t for _, t in allowed],
            np.concatenate(penalised_tokens) if penalised else [], [r.num_tokens for r in penalised],
            [r.num_prompt_tokens for r in penalised])

        raw_logprobs = torch.log_softmax(logits[logprob_idx], dim=-1) if logprob_rows else None
        if biased:
            # After the logprobs, which are the model's own (vLLM's default); before the penalties, as vLLM's
            # logit-bias processor runs (it matters for the multiplicative repetition penalty).
            biases = self._to_device(torch.tensor([b for _, _, b in biased], dtype=torch.float32))
            logits.index_put_((bias_rows, bias_tokens), biases, accumulate=True)
        if allowed:
            # Every other token of those rows out, as vLLM's allowed-token-ids processor does (before penalties).
            keep = torch.zeros_like(logits, dtype=torch.bool).index_put_((allowed_rows, allowed_tokens),
                                                                          torch.tensor(True, device=logits.device))
            masked = keep.any(dim=1, keepdim=True) & ~keep
            logits = logits.masked_fill(masked, float("-inf"))
        if penalty_rows:
            rows = _Rows(penalty_idx, len(penalty_rows) == batch)
            logits = rows.put(logits, _apply_penalties(rows.take(logits), rows.take(table), penalty_tokens,
                                                       penalty_num_tokens, penalty_num_prompt))
        if banned:
            logits[ban_rows, ban_tokens] = float("-inf")

        random = _Rows(random_idx, len(random_rows) == batch)
        tokens = None if random.every else greedy_tokens(logits)
        if random_rows:
            sampled = self._sample(random.take(logits), random.take(table), [requests[i] for i in random_rows],
                                   _Rows(filtered_idx, len(filtered_rows) == len(random_rows)),
                                   [params[random_rows[j]].top_k for j in filtered_rows])
            tokens = random.put(tokens, sampled)
        if not logprob_rows:
            return SamplerOutput(self.host_buffers, tokens)
        # Logprobs of the sampled token and of each row's top-n tokens, read back with the tokens.
        num_top = [params[i].logprobs for i in logprob_rows]
        return SamplerOutput(self.host_buffers, tokens, logprob_rows, num_top,
                             token_logprobs(raw_logprobs, tokens[logprob_idx], max(num_top)))

    def _sample(self, logits: torch.Tensor, table: torch.Tensor, requests: list[Request], filtered: _Rows,
                filtered_top_k: list[int]) -> torch.Tensor:
        """Random rows: the exponential race over their filtered probabilities."""
        probs = _sampling_probs(logits, table, filtered, filtered_top_k,
                                any(r.sampling_params.min_p > 0.0 for r in requests))
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                noise[i].exponential_(generator=self._state(r).generator)
        return (probs / noise).argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first index of each row's largest logit (into out where given), with the Triton kernel on CUDA."""
    kernels = fused_kernels(logits)
    if kernels is not None:
        return kernels.argmax(logits, out)
    return logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)


def _param_table(params: list[SamplingParams]) -> torch.Tensor:
    return torch.tensor([(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                          p.presence_penalty) for p in params], dtype=torch.float32)


def _sampling_probs(logits: torch.Tensor, table: torch.Tensor, filtered: _Rows, filtered_top_k: list[int],
                    min_p: bool) -> torch.Tensor:
    """Probabilities of random rows after temperature, top-k/top-p (on the filtered rows: their top_k values
    are filtered_top_k) and min-p (when min_p is set)."""
    logits = logits / table[:, _TEMPERATURE:_TEMPERATURE + 1]
    if filtered_top_k:
        # Ranking the whole vocabulary is needed only for a row that has top-p without top-k.
        max_k = None if min(filtered_top_k) < 0 else max(filtered_top_k)
        logits = filtered.put(logits, _top_k_top_p(filtered.take(logits), filtered.take(table), max_k))
    probs = torch.softmax(logits, dim=-1)
    if min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * table[:, _MIN_P:_MIN_P + 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _apply_penalties(logits: torch.Tensor, table: torch.Tensor, tokens: torch.Tensor, num_tokens: torch.Tensor,
                     num_prompt: torch.Tensor) -> torch.Tensor:
    """vLLM semantics: repetition over prompt + output tokens; presence/frequency over output tokens only.

    tokens holds each row's prompt + output ids back to back (num_tokens per row, num_prompt of them prompt).
    """
    rows, vocab = logits.shape
    dev = logits.device
    row_of = torch.repeat_interleave(torch.arange(rows, device=dev), num_tokens, output_size=tokens.shape[0])
    start = torch.cumsum(num_tokens, 0) - num_tokens
    is_output = torch.arange(tokens.shape[0], device=dev) - start[row_of] >= num_prompt[row_of]
    flat = row_of * vocab + tokens
    seen = torch.zeros(rows * vocab, dtype=torch.bool, device=dev).index_fill_(0, flat, True).view(rows, vocab)
    # Adding 0 for prompt tokens instead of selecting the output ones keeps the host out of it (no nonzero).
    counts = torch.zeros(rows * vocab, device=dev).index_add_(0, flat, is_output.float()).view(rows, vocab)

    repetition = table[:, _REPETITION:_REPETITION + 1]
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - (table[:, _FREQUENCY:_FREQUENCY + 1] * counts
                     + table[:, _PRESENCE:_PRESENCE + 1] * (counts > 0).float())


def _top_k_top_p(logits: torch.Tensor, table: torch.Tensor, max_k: int | None) -> torch.Tensor:
    """Keeps each row's top_k tokens (top_k < 0: all), then the smallest prefix of them holding top_p of
    their mass; the rest become -inf. With max_k (>= every row's top_k) only the max_k largest logits are
    ranked, with torch.topk; max_k None sorts the whole vocabulary."""
    vocab = logits.shape[-1]
    top_k, top_p = table[:, _TOP_K], table[:, _TOP_P]
    if max_k is None:
        ranked, ranked_idx = logits.sort(dim=-1, descending=True)
    else:
        ranked, ranked_idx = logits.topk(min(max_k, vocab), dim=-1)
    k = torch.where(top_k > 0, top_k, vocab)
    ranks = torch.arange(ranked.shape[-1], device=logits.device)
    mask = ranks >= k.unsqueeze(1)
    probs = torch.softmax(ranked.masked_fill(mask, float("-inf")), dim=-1)
    # Drop a token once the mass before it already reaches top_p; the first token always stays. top_p = 1
    # keeps everything, even where float rounding lets the running mass reach 1 before the last token.
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= torch.where(top_p < 1.0, top_p, float("inf")).unsqueeze(1)
    mask[:, 0] = False  # also where top_p underflowed to 0 in the float32 table (a top_p of 1e-300)
    return torch.full_like(logits, float("-inf")).scatter_(1, ranked_idx, ranked.masked_fill(mask, float("-inf")))
