"""A request's state as the scheduler, the KV cache manager and the engine see it."""
from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from pagedllm.outputs import Logprob, RequestStateStats
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

_arrival_counter = itertools.count()


class Request:
    """One sequence to generate. A user request with n > 1 becomes n of these (one per sample)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        prompt: str | None = None,
        parent_id: str | None = None,
        index: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        eos_token_id: int | None = None,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # already capped by max_model_len
        # Every EOS id of the model (its generation config's, its config's, its tokenizer's), and the tokenizer's:
        # a sample that ends on another has that id as its stop reason, a stop token id to vLLM.
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_id
        # SamplingParams.bad_words as token ids (LLMEngine.bad_words_token_ids)
        self.bad_words_token_ids = bad_words_token_ids
        self.arrival = next(_arrival_counter)
        self.stats = RequestStateStats(arrival_time=time.time())

        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose ids the host does not know yet: with asynchronous scheduling
        # a step is scheduled while the previous one still runs on the device, so a running request can be
        # one token ahead of all_token_ids (counting the step being scheduled, briefly two).
        self.num_placeholders = 0
        # Prompt tokens served from the prefix cache at first scheduling (-1: not yet scheduled).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Hashes of the full blocks of all_token_ids, maintained by the KV cache manager.
        self.block_hashes: list[Any] = []
        self.stop_reason: int | str | None = None
        # Per-token logprobs: list of {token_id: Logprob} (only when sampling_params.logprobs is set).
        self.logprobs: list[dict[int, Logprob]] | None = [] if sampling_params.logprobs is not None else None
        # The prompt's logprobs so far (SamplingParams.prompt_logprobs, on a request's first sample only): None for
        # its first token, then one {token_id: Logprob} a token.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None and index == 0 else None)
        # Sum of the sampled tokens' logprobs (meaningful only with logprobs).
        self.cumulative_logprob = 0.0
        # Sampling state owned by the sampler (seeded generator, token ids for penalties).
        self.sampler_state: Any = None
        # The model runner's copy of this request's block ids, so a step need not walk all its blocks.
        self.block_row: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus placeholders: the length the scheduler plans with."""
        return len(self._all_token_ids) + self.num_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def banned_token_ids(self) -> list[int]:
        """The last token of each bad word whose other tokens end the output (all of a one-token word's)."""
        out = self.output_token_ids
        return [word[-1] for word in self.bad_words_token_ids
                if len(word) == 1 or out[len(out) - len(word) + 1:] == list(word[:-1])]

    @property
    def samples_after_its_tokens(self) -> bool:
        """Whether sampling its next token reads the tokens before it (penalties, bad words of several tokens): the
        step must then wait for the previous one's."""
        return self.sampling_params.has_penalties or any(len(word) > 1 for word in self.bad_words_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some of its prompt logprobs are still to be computed (every prompt position must then run)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Token-level stop checks after a token was appended; sets status and returns True if finished.

        Stop strings need the detokenized text and are checked by the engine.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        num_output = len(self.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = None if last == self.eos_token_id else last
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_output >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
