"""Token sampling for one step: penalties, min_tokens, greedy/temperature, top-k/top-p/min-p, logprobs.

Random rows sample with the exponential-race trick (argmax of probs / Exp(1) noise). A seeded request draws
its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} of the sampled token and the top-k tokens, or None if not requested.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _request_generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        if request.sampler_state is None:
            g = torch.Generator(device=self.device)
            # Samples of one request must differ, so each index gets its own stream.
            g.manual_seed(seed + request.index)
            request.sampler_state = g
        return request.sampler_state

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        for i, (r, p) in enumerate(zip(requests, params)):
            if p.has_penalties:
                _apply_penalties(logits[i], r, p)
            if r.num_output_tokens < p.min_tokens:
                banned = list(r.eos_token_ids) + p.stop_token_ids
                if banned:
                    logits[i, banned] = float("-inf")

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            sampled = self._sample(logits[random_rows], [requests[i] for i in random_rows])
            tokens[random_rows] = sampled
        token_list = tokens.tolist()

        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        for i, p in enumerate(params):
            if want_logprobs[i]:
                row = raw_logprobs[i]
                entry = {token_list[i]: float(row[token_list[i]])}
                if p.logprobs > 0:
                    top = torch.topk(row, p.logprobs)
                    for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
                        entry.setdefault(tok, lp)
                logprobs[i] = entry
        return SamplerOutput(token_list, logprobs)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
        logits = logits / temperature.unsqueeze(1)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)

        noise = torch.empty_like(probs)
        unseeded = []
        for i, r in enumerate(requests):
            g = self._request_generator(r)
            if g is None:
                unseeded.append(i)
            else:
                noise[i].exponential_(generator=g)
        if unseeded:
            noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_(generator=self.generator)
        return (probs / noise).argmax(dim=-1)


def _apply_penalties(row: torch.Tensor, request: Request, p) -> None:
    """vLLM semantics: repetition over prompt + output tokens; presence/frequency over output tokens only."""
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor(request.all_token_ids, device=row.device)] = True
        penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
    if request.output_token_ids and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
        out = torch.tensor(request.output_token_ids, device=row.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    dev = logits.device
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.tensor([t if t > 0 else vocab for t in top_k], device=dev).clamp(max=vocab)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    mask = ranks >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    # Drop a token once the mass before it already reaches top_p; the first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= torch.tensor(top_p, device=dev).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
