"""Output shapes vLLM users know: RequestOutput holding one CompletionOutput per sample."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's per-token logprob entry: the log-probability, the token's rank in the vocabulary (1 = most likely)
    and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sample (None for the tokenizer's EOS or length; another EOS
    # id of the model's generation config is a stop token id, as in vLLM).
    stop_reason: int | str | None = None
    # Per generated token: {token_id: Logprob} for the sampled token and the top-k ones.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """When a request reached each state, as vLLM v1's RequestOutput.metrics: arrival_time by the wall clock
    (time.time()), the rest by time.monotonic() (0.0: not yet). Over a request's n samples: the earliest scheduling
    and first token, the latest token, and every sample's tokens."""
    arrival_time: float = 0.0
    queued_ts: float = 0.0  # added to the scheduler's queue
    scheduled_ts: float = 0.0  # first scheduled (a preemption does not move it)
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Prompt tokens served from the prefix cache (first sample).
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs, per prompt token: None for the first, then {token_id: Logprob} of the
    # prompt's token and the top-n given the tokens before it.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestStateStats | None = None
