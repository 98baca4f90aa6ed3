"""The offline API: LLM.generate and LLM.chat, shaped like vLLM's."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import render_chat
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """`LLM(model, **engine_options)`: engine options are named like vLLM's (see EngineConfig)."""

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat sample with when given no SamplingParams: the model's generation config's
        defaults, as in vLLM (EngineConfig.generation_config)."""
        return self.engine.get_default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        return self._run([_prompt_input(p) for p in prompts], params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} messages) or a list of conversations, rendered by the
        chat template with vLLM's options (chat_utils.render_chat)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [render_chat(tokenizer, conv, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, chat_template=chat_template,
                                chat_template_kwargs=chat_template_kwargs, tools=tools)
                    for conv in conversations]
        return self.generate([{"prompt": p, "prompt_token_ids": t} for p, t in rendered], sampling_params, use_tqdm)

    def _run(self, inputs: list[tuple[str | None, str | list[int]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        results: dict[str, RequestOutput] = {}
        try:
            for (text, prompt), p in zip(inputs, params):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p, prompt_text=text)
                ids.append(rid)
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    # Building a partial output per request per step costs host time nobody reads here.
                    for out in engine.step(final_only=True):
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # A bad prompt, a failed step or Ctrl-C: none of this call's requests stays in the engine.
            engine.abort_request(ids)
            raise
        return [results[rid] for rid in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _prompt_input(prompt: Prompt) -> tuple[str | None, str | list[int]]:
    """(text shown in the output, what the engine tokenizes or takes as ids)."""
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
