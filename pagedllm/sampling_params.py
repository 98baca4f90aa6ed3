"""Sampling parameters with vLLM's names and meanings, validated once at construction."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

_FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.Enum):
    """vLLM's: what each of a request's outputs (LLMEngine.step) holds. CUMULATIVE: all of it so far, at every step
    it advances. DELTA: only what is new since its last output, its completions only those that advanced (prompt
    logprobs in its first). FINAL_ONLY: one output, once every sample has finished. Until a sample finishes, text
    that may be the start of one of its stop strings is held back, in CUMULATIVE and DELTA alike."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 (vLLM's two ways of saying it): every token
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # Per prompt token after the first: its logprob given the tokens before it, and the top-n (vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # {token id: value added to its logit before sampling} (OpenAI's and vLLM's logit_bias, values in [-100, 100])
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (the others' logits are -inf after the logprobs are taken)
    allowed_token_ids: list[int] | None = None
    # vLLM's: only the prompt's last k tokens are kept (-1: max_model_len), before the engine checks or caches it
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never generated. Each is tokenized as it is and after a space; where that takes several tokens,
    # the last is banned wherever the output ends with the others.
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0 and isinstance(self.top_k, int):
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            # the sampler computes in float32, where a larger value is infinite (-inf logits / inf are NaN)
            if not isinstance(value, numbers.Real) or not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                raise bad(name, f"must be a finite number (of at most {_FLOAT32_MAX:.4g} in magnitude)")
        if self.temperature < 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be an integer >= 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            # vLLM's range. A generator takes seeds in [-2**63, 2**64), so the sample index added to it still fits.
            raise bad("seed", "must be a 64-bit signed integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None and any(
                not isinstance(t, int) or t < 0 or not isinstance(b, (int, float)) or not -100 <= b <= 100
                for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "must map non-negative token ids to values in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of words (strings with something besides spaces)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k == 0 or k < -1):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 for max_model_len")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
