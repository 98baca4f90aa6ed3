"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are strict about types: a wrong JSON type is a 400 rather than being coerced (an integral float such as
3.0 still counts as an int). As in vLLM, unknown fields are ignored with a warning, so requests written for vLLM
or OpenAI keep working, and JSON null means "use the default", as many non-Python clients send it for unset
fields (but for completions' max_tokens, where it means no limit, as in vLLM). Fields beyond OpenAI's are vLLM's
sampling and chat template extras; what the server cannot honour (structured output, tool calls) is refused.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm.server")



def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _integral_float_to_int(value: Any) -> Any:
    # Clients in languages without an integer type send 3.0 for 3; 3.5 stays a float and fails strict int checks.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral_float_to_int)]


class Strict(BaseModel):
    """Base of the request bodies."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    # Fields whose null is a value of its own rather than "the default" (as vLLM reads them).
    _keeps_null: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_and_unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None or k in cls._keeps_null}
        unknown = data.keys() - cls.model_fields.keys()
        if unknown:
            logger.warning("%s: ignoring unsupported fields %s", cls.__name__, ", ".join(sorted(unknown)))
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries the usage so far
    continuous_usage_stats: bool = False


# The request fields a model's generation config may give defaults for (as vLLM reads it)
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class _SamplingRequest(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: Int = Field(1, ge=1, le=128)
    best_of: Int | None = None
    # unset: the model's default (LLMEngine.default_sampling), else SamplingParams'
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    # SamplingParams checks the range.
    seed: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extras (top_k 0 or -1: disabled).
    top_k: Int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's: token ids as JSON object keys (strings)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int] | None = None
    # only the prompt's last k tokens (-1: max_model_len); SamplingParams refuses 0
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)
    bad_words: list[str] | None = None
    # Structured output (OpenAI's response_format, vLLM's guided decoding) is not implemented: a request for it is
    # refused rather than answered with unconstrained text.
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, response_format: dict[str, Any]) -> dict[str, Any]:
        if response_format.get("type") != "text":
            raise ValueError(f"response_format of type {response_format.get('type')!r} is not supported: this "
                             "server has no structured output (only {'type': 'text'})")
        return response_format

    @field_validator("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
    @classmethod
    def _refuse_guided_decoding(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(f"{info.field_name} is not supported: this server has no guided decoding")

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        # Drawing best_of samples and keeping the n most likely is not implemented; best_of == n is plain sampling.
        n = info.data.get("n")
        if best_of is not None and n is not None and best_of != n:
            raise ValueError(f"best_of must be equal to n ({n}): keeping the best n of best_of samples is not "
                             f"supported")
        return best_of

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """defaults: the model's sampling defaults (LLMEngine.default_sampling), for the fields of
        _MODEL_DEFAULTS the request leaves unset. Raises ValueError naming the field for combinations that
        single-field checks cannot catch."""
        chosen = {**{k: v for k, v in (defaults or {}).items() if k in _MODEL_DEFAULTS},
                  **{k: getattr(self, k) for k in _MODEL_DEFAULTS if getattr(self, k) is not None}}
        return SamplingParams(
            n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens, bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA, **chosen)

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)!r}") from None


# ---- /v1/completions ------------------------------------------------------------------------------------
class CompletionRequest(_SamplingRequest):
    _keeps_null = frozenset({"max_tokens"})
    prompt: str | list[str] | list[Int] | list[list[Int]]
    echo: bool = False  # before max_tokens, whose check reads it
    # 0 with echo: the prompt alone (and with logprobs its logprobs), as vLLM answers it; null: up to the context
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0)

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, max_tokens: int | None, info: ValidationInfo) -> int | None:
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (0 only with echo, for the prompt alone)")
        return max_tokens

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    @property
    def echo_only(self) -> bool:
        """The prompt alone: one token is generated (the engine samples at least one), not returned."""
        return self.echo and self.max_tokens == 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a string or a token-id list is a batch of one."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's extra: the stop string or token id that ended the choice.
    stop_reason: int | str | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions -------------------------------------------------------------------------------
class TextContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Assistant turns that only called tools come back with null content.
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Before the union's own checks, whose error for an image part names neither the part nor the reason.
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this server takes text only")
        return content

    @property
    def text(self) -> str:
        # Text parts are joined with newlines, as vLLM joins them.
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])

    def as_template_input(self) -> dict[str, Any]:
        message = {"role": self.role, "content": self.text}
        # Templates that render tool calls and their results or speaker names read these keys.
        message.update((k, v) for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id),
                                           ("tool_calls", self.tool_calls)) if v is not None)
        return message


class ChatTemplateFields(Strict):
    """vLLM's chat template options of a request (chat_utils.render_chat)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def template_options(self, default_template: str | None) -> dict[str, Any]:
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message,
                    chat_template=self.chat_template or default_template,
                    chat_template_kwargs=self.chat_template_kwargs, tools=self.tools)


class ChatCompletionRequest(_SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's: the reply starts with the last message's text where that message has the reply's role (with
    # continue_final_message, the assistant turn being continued comes back whole)
    echo: bool = False
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self):
        # With tools, OpenAI's default is "auto": the model may answer with tool calls, which this server would
        # return as plain text. Only "none" is honoured: the tools then reach the chat template and nothing else.
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice != "none":
            raise ValueError(f"tool_choice {choice!r} is not supported: this server does not parse tool calls "
                             "(with tool_choice 'none' the tools are only shown to the chat template)")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def echoed(self) -> str:
        """What echo puts in front of each reply: as vLLM, the reply's role is the assistant's where a generation
        prompt opens its turn, else the last message's."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        return last.text if self.echo and last.role == role else ""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _role_only_when_set(self, handler) -> dict[str, Any]:
        # As OpenAI's and vLLM's chunks: the role comes in the first delta, and is absent (not null) after it.
        data = handler(self)
        if data.get("role") is None:
            data.pop("role", None)
        return data


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer, errors ---------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
