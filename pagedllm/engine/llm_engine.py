"""LLMEngine: the engine's state in one place. Requests in, one scheduled step at a time, outputs out."""
from __future__ import annotations

import gc
import json
import os
import warnings
from dataclasses import dataclass, field

import torch

from pagedllm import ops
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.layers.sampler import PromptLogprobs, SamplerOutput
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput, RequestStateStats
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.worker.model_runner import ModelRunner


@dataclass
class _Parent:
    """A user request: its samples (one Request each) and what the user sees of them."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    # per sample, the tokens and characters of text its outputs have shown (RequestOutputKind.DELTA)
    sent_tokens: list[int] = field(init=False)
    sent_chars: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.sent_tokens, self.sent_chars = [0] * len(self.children), [0] * len(self.children)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


@dataclass
class _Step:
    """A step queued on the device: what was scheduled, who samples in it, and the samples (not yet read)."""
    sched: SchedulerOutput
    sampling: list[Request]
    out: SamplerOutput | None
    prompt: PromptLogprobs | None  # the prompt logprobs it computed (not yet read)


def _parent_stats(children: list[Request]) -> RequestStateStats:
    """RequestOutput.metrics of a request's samples (RequestStateStats)."""
    stats = [c.stats for c in children]
    started = [t for t in (s.scheduled_ts for s in stats) if t] or [0.0]
    first = [t for t in (s.first_token_ts for s in stats) if t] or [0.0]
    return RequestStateStats(stats[0].arrival_time, stats[0].queued_ts, min(started), min(first),
                             max(s.last_token_ts for s in stats), sum(c.num_output_tokens for c in children))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        ops.set_backend(_attention_backend(config))
        torch.manual_seed(config.seed)
        self.dtype = config.torch_dtype(_checkpoint_dtype(resolve_model(config.model)))
        self.model, self.hf_config, model_dir = load_model(config.model, self.dtype, config.device,
                                                           config.load_format, config.seed)
        self.model_dir = str(model_dir)
        config.resolve_lengths(self.hf_config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(config.tokenizer or self.model_dir)
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.hf_config, self.tokenizer)
        self.default_sampling = _default_sampling(config.generation_config, self.model_dir)
        self.eos_token_id = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self._token_texts: dict[int, str] = {}
        self.runner = ModelRunner(config, self.model, self.hf_config, self.dtype)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.block_size, self.runner.num_blocks)
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, _Parent] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # The step queued on the device whose tokens have not been read yet (asynchronous scheduling).
        self._in_flight: _Step | None = None
        # Python's collector makes a full pass once the objects promoted to its oldest generation since the last
        # full pass number a quarter of those that pass kept. Start-up leaves that many (torch, transformers, the
        # model, the KV blocks: ~0.4M objects), so the pass, 0.1-0.2 s in which the device idles, would come early
        # in the run (a batch-1 step is ~1 ms); made here, it also resets the count.
        gc.collect()

    # ---- requests -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prompt_text: str | None = None) -> None:
        """prompt is text to tokenize or token ids; prompt_text is the text reported back for token ids. Without
        params, the model's sampling defaults (get_default_sampling_params)."""
        params = params or self.get_default_sampling_params()
        # A request's samples are named request_id-i (n > 1): neither may be an id a request or a sample holds.
        ids = [request_id] if params.n == 1 else [request_id, *(f"{request_id}-{i}" for i in range(params.n))]
        in_use = [i for i in ids if i in self.parents or i in self.child_to_parent]
        if in_use:
            raise ValueError(f"request id {in_use[0]!r} is already in use")
        vocab = self.hf_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > min(self.config.max_logprobs, vocab):
                raise ValueError(f"requested {n} {name.replace('_', ' ')} per token, more than max_logprobs="
                                 f"{self.config.max_logprobs} or the vocabulary ({vocab})")
        for name in ("logit_bias", "allowed_token_ids"):
            tokens = getattr(params, name)
            if tokens and max(tokens) >= vocab:
                raise ValueError(f"{name} token id {max(tokens)} is outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings are matched in the text, and this model has no tokenizer to produce it: "
                             "use stop_token_ids")
        bad_words = self.bad_words_token_ids(params.bad_words or [])
        text, token_ids = self.process_prompt(prompt, prompt_text, params.truncate_prompt_tokens)
        max_tokens = self.config.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        children = [
            Request(child_id, token_ids, params, max_tokens, prompt=text, parent_id=request_id, index=i,
                    eos_token_ids=self.eos_token_ids, eos_token_id=self.eos_token_id, bad_words_token_ids=bad_words)
            for i, child_id in enumerate(ids[-params.n:])
        ]
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        detoks = [self._detokenizer(token_ids, params) for _ in children]
        self.num_prompt_tokens += len(token_ids)
        parent = _Parent(request_id, text, token_ids, children, detoks)
        self.parents[request_id] = parent
        for child in children:
            self.child_to_parent[child.request_id] = parent

    def process_prompt(self, prompt: str | list[int], prompt_text: str | None = None,
                       truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """A prompt as the engine runs and reports it: (its text or None, its token ids). Text is tokenized; with
        truncate_prompt_tokens only the last tokens are kept (truncation_size), and the text is theirs. Raises
        ValueError naming what is wrong with it."""
        text = prompt if isinstance(prompt, str) else prompt_text
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        keep = self.truncation_size(truncate_prompt_tokens)
        truncated = keep is not None and len(token_ids) > keep
        if truncated:
            token_ids = token_ids[-keep:]
        self.validate_prompt(token_ids)  # before decoding: the tokenizer fails on some bad ids (past 2^32)
        if truncated and text is not None:
            text = None if self.tokenizer is None else self.tokenizer.decode(token_ids)
        return text, token_ids

    def bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """SamplingParams.bad_words as vLLM tokenizes them: each word without its leading spaces, and after one space
        where that gives other ids of as many tokens (a word-initial token of BPE vocabularies)."""
        if words and self.tokenizer is None:
            raise ValueError("bad_words are tokenized, and this model has no tokenizer: ban token ids with logit_bias")
        token_ids = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            token_ids.append(tuple(bare))
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                token_ids.append(tuple(spaced))
        return tuple(token_ids)

    def truncation_size(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of a prompt's last tokens SamplingParams.truncate_prompt_tokens keeps (-1: max_model_len, as in
        vLLM), or None for all of them. Raises ValueError (vLLM's) where it is more than max_model_len."""
        if truncate_prompt_tokens is None:
            return None
        max_len = self.config.max_model_len
        keep = max_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep > max_len:
            raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_len}). "
                             "Please, select a smaller truncation size.")
        return keep

    def token_text(self, token_id: int) -> str | None:
        """One token's text on its own (a logprob entry's decoded_token), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults EngineConfig.generation_config sets (vLLM's, from the model's
        generation_config.json by default)."""
        return SamplingParams(**self.default_sampling)

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Raises ValueError naming what is wrong with a prompt's token ids."""
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={self.config.max_model_len}")

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens, params.stop,
                                      params.include_stop_str_in_output, params.min_tokens)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Aborts user requests (all their samples) and frees their blocks at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            self.scheduler.finish_requests([c.request_id for c in parent.children], RequestStatus.FINISHED_ABORTED)
            for c in parent.children:
                del self.child_to_parent[c.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # ---- stepping -------------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Runs one step; returns an output of every user request that advanced in it, as its
        SamplingParams.output_kind says (final_only: FINAL_ONLY for every request, what LLM.generate needs).

        With async_scheduling the step is scheduled and queued on the device before the previous step's
        tokens are read back, and the outputs returned are the previous step's: the host schedules while
        the device computes. A request that stops at step N has also been scheduled into step N+1; that
        token is dropped.
        """
        previous, self._in_flight, sched = self._in_flight, None, None
        try:
            sched = self.scheduler.schedule()
            current = _Step(sched, *self.runner.execute(sched, self.kv_cache_manager.get_blocks))
            overlaps = self._overlaps(current.sampling)
            advanced = self._process(previous) if previous is not None else {}
            if overlaps:
                self._in_flight = current
            else:
                advanced.update(self._process(current))
        except BaseException:
            self._drop_failed_step(previous, sched)
            raise
        # One output per request per call, as callers expect, also where two steps were read back in it (an
        # overlapped step, then one that had to wait).
        outputs = []
        for parent in advanced.values():
            kind = RequestOutputKind.FINAL_ONLY if final_only else parent.children[0].sampling_params.output_kind
            if kind != RequestOutputKind.FINAL_ONLY or parent.finished:
                outputs.append(self._output(parent, kind))
        return outputs

    def _drop_failed_step(self, previous: _Step | None, sched: SchedulerOutput | None) -> None:
        """After a step raised (a bad input, out of memory, Ctrl-C): its requests are aborted, as their tokens and
        the scheduler's view of them are lost, and the engine stays usable for the others. Where schedule() itself
        raised, it may have advanced any running request, so all of them go. Blocks the step registered in the
        prefix cache may never have received their K/V, so the cache forgets every block."""
        if sched is None:  # a preemption's victim may already be out of running
            children = {r.request_id for r in self.scheduler.requests.values() if r not in self.scheduler.waiting}
        else:
            children = {it.request.request_id for it in sched.scheduled}
        if previous is not None:
            children.update(it.request.request_id for it in previous.sched.scheduled)
        self.abort_request(list({self.child_to_parent[c].request_id for c in children if c in self.child_to_parent}))
        self.kv_cache_manager.reset_prefix_cache()

    def _overlaps(self, sampling: list[Request]) -> bool:
        return self.config.async_scheduling and not any(r.samples_after_its_tokens for r in sampling)

    def _process(self, step: _Step) -> dict[str, _Parent]:
        """Reads a step's tokens back (waiting for the device) into its requests; returns the user requests that
        advanced, by id (those that finished are no longer the engine's)."""
        sampled, logprobs = {}, {}
        if step.out is not None:
            ids = [req.request_id for req in step.sampling]
            sampled, logprobs = dict(zip(ids, step.out.token_ids)), dict(zip(ids, step.out.logprobs))
        if step.prompt is not None:
            for req, first, entries in step.prompt.read():
                for entry in entries:
                    self._name_tokens(entry)
                req.prompt_logprobs[first:first + len(entries)] = entries
        advanced = self.scheduler.update_from_output(step.sched, sampled)
        self.num_generation_tokens += len(advanced)
        touched: dict[str, _Parent] = {}
        for req in advanced:
            lp = logprobs[req.request_id]
            if lp is not None:
                self._name_tokens(lp)
                req.logprobs.append(lp)
                req.cumulative_logprob += lp[req.output_token_ids[-1]].logprob
            parent = self.child_to_parent[req.request_id]
            touched[parent.request_id] = parent
            detok = parent.detokenizers[req.index]
            # The token that ended the sample (EOS or a stop token id) is not part of its text unless asked for,
            # as in vLLM.
            stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
            if detok is not None and not (stopped_by_token and not req.sampling_params.include_stop_str_in_output):
                stop = detok.update(req.output_token_ids[-1])
                if stop is not None and not stopped_by_token:
                    # A stop string in the last token max_tokens allowed still ends the sample as "stop".
                    req.stop_reason = stop
                    if req.is_finished:
                        req.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        for parent in touched.values():
            if parent.finished:
                del self.parents[parent.request_id]
                for c in parent.children:
                    del self.child_to_parent[c.request_id]
        return touched

    def _name_tokens(self, entry: dict[int, Logprob]) -> None:
        for tok, lp in entry.items():
            lp.decoded_token = self.token_text(tok)

    def _output(self, parent: _Parent, kind: RequestOutputKind) -> RequestOutput:
        delta = kind == RequestOutputKind.DELTA
        first_output = not any(parent.sent_tokens)
        completions = []
        for i, (req, detok) in enumerate(zip(parent.children, parent.detokenizers)):
            tokens, start = req.output_token_ids, parent.sent_tokens[i] if delta else 0
            if delta and start == len(tokens):
                continue  # a sample that did not advance since the last output
            text = "" if detok is None else detok.visible_text(req.is_finished)
            chars = parent.sent_chars[i] if delta else 0
            parent.sent_tokens[i], parent.sent_chars[i] = len(tokens), len(text)
            completions.append(CompletionOutput(
                index=req.index, text=text[chars:], token_ids=list(tokens[start:]),
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                logprobs=req.logprobs[start:] if delta and req.logprobs is not None else req.logprobs,
                cumulative_logprob=None if req.logprobs is None else req.cumulative_logprob))
        first = parent.children[0]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             finished=parent.finished, num_cached_tokens=max(first.num_cached_tokens, 0),
                             prompt_logprobs=first.prompt_logprobs if first_output or not delta else None,
                             metrics=_parent_stats(parent.children))

    # ---- stats ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        kv = self.kv_cache_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
        }


def _attention_backend(config: EngineConfig) -> str | None:
    """The CUDA C++ ops are built on first use; when that cannot work here, say why and use Triton."""
    if config.attention_backend != "cuda":
        return config.attention_backend
    from pagedllm.ops import cuda
    try:
        cuda.load(torch.device(config.device))
    except ImportError as e:
        warnings.warn(f"attention_backend='cuda' unavailable, using Triton instead: {e}", RuntimeWarning)
        return "triton"
    return "cuda"


def _checkpoint_dtype(model_dir) -> torch.dtype | None:
    from transformers import AutoConfig
    hf_config = AutoConfig.from_pretrained(model_dir)
    # transformers 5 names it dtype (reading torch_dtype warns); 4.x only has torch_dtype.
    dtype = hf_config.dtype if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _load_tokenizer(path: str):
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                 "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _generation_config(folder: str) -> dict:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


# generation_config.json's keys that set requests' sampling defaults (vLLM reads the same), as SamplingParams names them
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _default_sampling(source: str, model_dir: str) -> dict:
    """SamplingParams' keyword arguments that EngineConfig.generation_config sets, checked once here."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else source
    if source != "auto" and not os.path.isfile(os.path.join(folder, "generation_config.json")):
        raise ValueError(f"generation_config={source!r}: no generation_config.json there (or 'auto', 'vllm')")
    config = _generation_config(folder)
    defaults = {name: config[key] for key, name in _SAMPLING_KEYS.items() if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"the sampling defaults of {folder}/generation_config.json: {e}") from None
    return defaults


def _eos_token_ids(model_dir: str, hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(_generation_config(model_dir).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)
