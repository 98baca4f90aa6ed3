"""The generation endpoints: /v1/completions and /v1/chat/completions on top of AsyncLLMEngine.

Both run the same way: prompts become engine requests feeding one OutputStream, whose outputs (of kind DELTA:
what is new since the last) become per-choice deltas (_Generation.deltas), and the deltas are formatted as SSE
chunks or gathered into one response. Non-streaming responses are the concatenation of the deltas, so both paths
return the same text.
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from jinja2 import TemplateError

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDead, EngineOverloaded
from pagedllm.entrypoints.chat_utils import render_chat
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs,
    ChatMessage, ChatResponseMessage, ChatStreamChoice, ChatTemplateFields, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionRequest, CompletionResponse, TopLogprob, UsageInfo, random_id)
from pagedllm.outputs import CompletionOutput, Logprob
from pagedllm.sampling_params import SamplingParams

# One line per API call; `serve --disable-log-requests` quiets it.
REQUEST_LOGGER = "pagedllm.server.requests"
request_logger = logging.getLogger(REQUEST_LOGGER)


class APIError(Exception):
    """An error the client sees in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Delta:
    """What one choice gained since it last reported: new text, new tokens, and how it ended."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    # the prompt's logprobs (SamplingParams.prompt_logprobs), with a choice's first delta only
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class _Choice:
    num_tokens: int = 0
    finished: bool = False

    def advance(self, index: int, out: CompletionOutput,
                prompt_logprobs: list[dict[int, Logprob] | None] | None) -> Delta:
        """out: the choice's engine output of kind DELTA (what is new, text that may begin a stop string held
        back)."""
        self.finished = out.finish_reason is not None
        delta = Delta(index, out.text, out.token_ids, out.logprobs, out.finish_reason, out.stop_reason,
                      prompt_logprobs if self.num_tokens == 0 else None)
        self.num_tokens += len(out.token_ids)
        return delta


@dataclass
class _Generation:
    """One API call in flight: its engine requests (one per prompt) and the state of its choices."""
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    request_id: str
    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    prompt_param: str  # the request field the prompts came from, named in errors about them
    start: float = field(default_factory=time.perf_counter)
    # Every chunk of a stream and the final response carry this one timestamp, as OpenAI's do.
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.stream = self.engine.open_stream()
        self.choices = [_Choice() for _ in range(len(self.prompts) * self.params.n)]
        self.prompt_index = {f"{self.request_id}-{i}": i for i in range(len(self.prompts))}

    async def add_requests(self) -> None:
        max_len = self.engine.config.max_model_len
        for _, ids in self.prompts:  # (a prompt that alone fills the context was refused by process_prompt)
            if self.params.max_tokens is not None and len(ids) < max_len < len(ids) + self.params.max_tokens:
                raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                                    f"requested {len(ids) + self.params.max_tokens} tokens ({len(ids)} in the "
                                    f"prompt, {self.params.max_tokens} for the completion).", param="max_tokens")
        try:
            for rid, (text, ids) in zip(self.prompt_index, self.prompts):
                await self.engine.add_request(self.stream, rid, ids, self.params, text)
        except BaseException as e:
            self.stream.abort()
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param=self.prompt_param) from e
            if isinstance(e, EngineOverloaded):
                raise APIError(503, f"The server is overloaded: {e}. Retry later.", type="server_error",
                               code="overloaded") from e
            if isinstance(e, EngineDead):
                raise APIError(500, str(e), type="server_error") from e
            raise

    async def deltas(self) -> AsyncIterator[Delta]:
        """Per-choice deltas until every choice finished; aborts the engine requests if the caller stops early
        (client gone). Records TTFT / inter-token latency, each finished choice's per-request metrics, and logs one
        line per call."""
        n = self.params.n
        max_len = self.engine.config.max_model_len
        last_token_time = [None] * len(self.prompts)
        num_tokens = [0] * len(self.prompts)
        prompt_logprobs = [None] * len(self.prompts)  # each prompt's, in its first output only
        try:
            async for out in self.stream:
                now = time.perf_counter()
                p = self.prompt_index[out.request_id]
                choices = self.choices[p * n:(p + 1) * n]
                generated = max(choices[c.index].num_tokens + len(c.token_ids) for c in out.outputs)
                if generated > num_tokens[p]:
                    if last_token_time[p] is None:
                        self.metrics.time_to_first_token.observe(now - self.start)
                    else:
                        new = generated - num_tokens[p]
                        self.metrics.inter_token_latency.observe((now - last_token_time[p]) / new, new)
                    last_token_time[p], num_tokens[p] = now, generated
                if out.finished:  # all n samples, as vLLM observes n once its child requests all finished
                    self.metrics.request_params_n.observe(n)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[p] = out.prompt_logprobs
                prompt_len = len(self.prompts[p][1])
                for c in out.outputs:
                    choice = choices[c.index]
                    delta = choice.advance(p * n + c.index, c, prompt_logprobs[p])
                    if delta.finish_reason is not None:  # before the yield, which a client gone never returns from
                        self.metrics.request_finished(delta.finish_reason, now - self.start, prompt_len,
                                                      choice.num_tokens, self.params.max_tokens or max_len - prompt_len,
                                                      out.metrics)
                    yield delta
        except EngineDead as e:
            raise APIError(500, str(e), type="server_error") from e
        finally:
            self.stream.abort()
            done = all(c.finished for c in self.choices)
            request_logger.info("%s: %d prompt tokens, %d completion tokens, %.3f s%s", self.request_id,
                                self.usage().prompt_tokens, self.usage().completion_tokens,
                                time.perf_counter() - self.start, "" if done else ", aborted")

    def usage(self) -> UsageInfo:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def sse(payload) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.chat_template = chat_template  # --chat-template: instead of the tokenizer's own
        # for the sampling fields a request leaves unset (--generation-config)
        self.default_sampling = engine.engine.default_sampling

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def need_tokenizer(self, what: str, param: str | None = None) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"this model has no tokenizer, so {what} is not possible; pass token ids",
                           param=param)

    # ---- /v1/completions ---------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.echo or any(isinstance(p, str) for p in req.prompts):
            self.need_tokenizer("echo or a text prompt")
        echo_logprobs = req.echo and req.logprobs is not None
        gen = await self._start("cmpl", [(None, p) for p in req.prompts], req, 1 if req.echo_only else req.max_tokens,
                                req.logprobs, req.logprobs if echo_logprobs else None, echo=req.echo)
        # Echoed prompts (as the engine runs them: truncated by truncate_prompt_tokens) go in front of each choice's
        # first piece of text, and with logprobs their tokens in front of its first tokens, the text offsets counting
        # from the prompt's start.
        prefixes = [text if req.echo else "" for text, _ in gen.prompts for _ in range(req.n)]
        offsets = [0 if echo_logprobs else len(p) for p in prefixes]

        def choice(d: Delta) -> CompletionChoice:
            if req.echo_only:
                d = replace(d, text="", token_ids=[], logprobs=None if d.logprobs is None else [])
            text, prefixes[d.index] = prefixes[d.index] + d.text, ""
            prompt_ids = None if d.prompt_logprobs is None else gen.prompts[d.index // req.n][1]
            return CompletionChoice(index=d.index, text=text, finish_reason=d.finish_reason,
                                    stop_reason=d.stop_reason,
                                    logprobs=self._completion_logprobs(d, gen, offsets, prompt_ids))

        def response(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
            return CompletionResponse(id=gen.request_id, created=gen.created, model=self.model_name,
                                      choices=choices, usage=usage)

        if req.stream:
            return self._sse(gen, [], lambda d: response([choice(d)]),
                             lambda: response([], gen.usage()) if req.include_usage else None, req.continuous_usage)
        choices = [CompletionChoice(index=i, text="") for i in range(len(gen.choices))]
        async for d in gen.deltas():
            part, total = choice(d), choices[d.index]
            total.text += part.text
            total.finish_reason, total.stop_reason = part.finish_reason, part.stop_reason
            if part.logprobs is not None:
                total.logprobs = total.logprobs or CompletionLogprobs()
                for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(total.logprobs, key).extend(getattr(part.logprobs, key))
        return response(choices, gen.usage())

    # ---- /v1/chat/completions ----------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        self.need_tokenizer("chat")
        prompt = await self.chat_prompt(req.messages, req)
        max_tokens = req.max_new_tokens if req.max_new_tokens is not None else self.default_sampling.get("max_tokens")
        gen = await self._start("chatcmpl", [prompt], req, max_tokens, req.num_logprobs)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=gen.request_id, created=gen.created, model=self.model_name,
                                       choices=choices, usage=usage)

        echoed = req.echoed
        if req.stream:
            head = [chunk([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                           for i in range(req.n)])]
            if echoed:
                head += [chunk([ChatStreamChoice(index=i, delta=ChatDelta(content=echoed))]) for i in range(req.n)]
            return self._sse(gen, head, lambda d: chunk([ChatStreamChoice(
                index=d.index, delta=ChatDelta(content=d.text), logprobs=self._chat_logprobs(d, gen),
                finish_reason=d.finish_reason, stop_reason=d.stop_reason)]),
                lambda: chunk([], gen.usage()) if req.include_usage else None, req.continuous_usage)
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=echoed)) for i in range(req.n)]
        async for d in gen.deltas():
            total = choices[d.index]
            total.message.content += d.text
            total.finish_reason, total.stop_reason = d.finish_reason, d.stop_reason
            logprobs = self._chat_logprobs(d, gen)
            if logprobs is not None:
                total.logprobs = total.logprobs or ChatLogprobs(content=[])
                total.logprobs.content += logprobs.content
        return ChatCompletionResponse(id=gen.request_id, created=gen.created, model=self.model_name,
                                      choices=choices, usage=gen.usage())

    async def chat_prompt(self, messages: list[ChatMessage], options: ChatTemplateFields) -> tuple[str, list[int]]:
        """The chat template's text and token ids for a request's messages, rendered on the engine thread."""
        try:
            return await self.engine.call(lambda: render_chat(
                self.tokenizer, [m.as_template_input() for m in messages],
                **options.template_options(self.chat_template)))
        except TemplateError as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
        except ValueError as e:  # the template options, or a tokenizer without a template
            raise APIError(400, str(e)) from e

    # ---- shared ------------------------------------------------------------------------------------------
    async def _start(self, prefix: str, inputs: list[tuple[str | None, str | list[int]]], req, max_tokens: int | None,
                     logprobs: int | None, prompt_logprobs: int | None = None, echo: bool = False) -> _Generation:
        """inputs: (prompt_text, prompt) per prompt, as LLMEngine.process_prompt takes them: text or token ids, and
        the text reported for token ids (or None)."""
        try:
            params = req.sampling_params(max_tokens, logprobs, prompt_logprobs, self.default_sampling)
        except ValueError as e:
            # SamplingParams names its field first, and the request fields it checks carry the same names
            named = re.match(r"SamplingParams\.(\w+)", str(e))
            raise APIError(400, str(e), param=named and named.group(1)) from e
        if params.stop:
            self.need_tokenizer("matching stop strings (stop_token_ids can)", param="stop")
        chat = prefix == "chatcmpl"
        # What the engine also rejects, checked here to name the field.
        limit = self.engine.config.max_logprobs
        if logprobs is not None and logprobs > limit:
            raise APIError(400, f"{logprobs} logprobs requested, more than max_logprobs={limit}",
                           param="top_logprobs" if chat else "logprobs")
        vocab = self.engine.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            tokens = getattr(params, name)
            if tokens and max(tokens) >= vocab:
                raise APIError(400, f"{name} token id {max(tokens)} is outside the vocabulary [0, {vocab})",
                               param=name)
        try:  # what process_prompt also refuses, checked first to name the field
            self.engine.engine.truncation_size(params.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from e
        prompt_param = "messages" if chat else "prompt"
        prompts = await self.engine.call(self._process_prompts, inputs, params.truncate_prompt_tokens, echo,
                                         prompt_param)
        gen = _Generation(self.engine, self.metrics, random_id(prefix), prompts, params, prompt_param)
        await gen.add_requests()
        return gen

    def _process_prompts(self, inputs: list[tuple[str | None, str | list[int]]], truncate_prompt_tokens: int | None,
                         echo: bool, param: str) -> list[tuple[str | None, list[int]]]:
        """On the engine thread: (text, token ids) per prompt as the engine will run it (tokenized, truncated,
        checked: LLMEngine.process_prompt), before the context-length check reads it; token-id prompts get text
        only for echo."""
        prompts = []
        for text, prompt in inputs:
            try:
                text, ids = self.engine.engine.process_prompt(prompt, text, truncate_prompt_tokens)
            except ValueError as e:
                raise APIError(400, str(e), param=param) from e
            prompts.append((self.tokenizer.decode(ids) if echo and text is None else text, ids))
        return prompts

    @staticmethod
    async def _sse(gen: _Generation, head: list, chunk_of, usage_chunk, continuous_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: head chunks, one chunk per delta (each with the usage so far if continuous_usage),
        the usage chunk if asked for, [DONE]. The response is already 200 when generation fails, so a failure
        becomes an error event."""
        def event(chunk) -> str:
            if continuous_usage:
                chunk.usage = gen.usage()
            return sse(chunk)

        try:
            for h in head:
                yield event(h)
            async for d in gen.deltas():
                yield event(chunk_of(d))
            usage = usage_chunk()
            if usage is not None:
                yield sse(usage)
        except APIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    @staticmethod
    def _text(token_id: int, lp: Logprob) -> str:
        # The engine decodes each logprob's token; a model without a tokenizer has only the id.
        return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"

    @staticmethod
    def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        # The entry holds the sampled token plus the top k; by rank, a sampled token outside them comes last.
        return sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]

    def _completion_logprobs(self, d: Delta, gen: _Generation, offsets: list[int],
                             prompt_ids: list[int] | None = None) -> CompletionLogprobs | None:
        """The delta's tokens with their logprobs, after prompt_ids (an echoed prompt) with the delta's prompt
        logprobs: the prompt's first token has none (null logprob and top_logprobs, as vLLM gives it)."""
        if d.logprobs is None:
            return None
        token_ids, entries = d.token_ids, d.logprobs
        if prompt_ids is not None:
            token_ids, entries = [*prompt_ids, *token_ids], [*d.prompt_logprobs, *entries]
        out = CompletionLogprobs()
        for tid, entry in zip(token_ids, entries):
            text = self.tokenizer.decode([tid]) if entry is None else self._text(tid, entry[tid])
            out.tokens.append(text)
            out.token_logprobs.append(None if entry is None else entry[tid].logprob)
            if entry is None:
                out.top_logprobs.append(None)
            else:
                # As OpenAI and vLLM: the token's own logprob is always there, beside the top ones (up to k + 1).
                top = dict(self._top(entry, gen.params.logprobs))
                top.setdefault(tid, entry[tid])
                out.top_logprobs.append({self._text(t, lp): lp.logprob for t, lp in top.items()})
            out.text_offset.append(offsets[d.index])
            offsets[d.index] += len(text)
        return out

    def _chat_logprobs(self, d: Delta, gen: _Generation) -> ChatLogprobs | None:
        if d.logprobs is None:
            return None

        def top(t: int, lp: Logprob) -> TopLogprob:
            text = self._text(t, lp)
            return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(tid, entry[tid]).model_dump(),
                             top_logprobs=[top(t, lp) for t, lp in self._top(entry, gen.params.logprobs)])
            for tid, entry in zip(d.token_ids, d.logprobs)])
