"""A conversation rendered through the tokenizer's chat template, with vLLM's options: LLM.chat, the server's
/v1/chat/completions and its /tokenize share it."""
from __future__ import annotations

import inspect
import os
from typing import Any


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None,
                tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """The template's text and its token ids. continue_final_message leaves the last message open, for the model
    to go on with it; chat_template_kwargs are the template's own variables (Qwen3's enable_thinking, ...).
    Raises ValueError for options that contradict each other, or a tokenizer without a template; jinja2's
    TemplateError where the template rejects the messages."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true (set "
                         "add_generation_prompt to false to continue the last message)")
    extra = dict(chat_template_kwargs or {})
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    if extra.keys() & own:
        raise ValueError(f"chat_template_kwargs cannot set {sorted(extra.keys() & own)}: they are the template "
                         "call's own arguments")
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **extra)
    # The template already holds any BOS token, so the text is not tokenized with special tokens again.
    return text, tokenizer(text, add_special_tokens=False).input_ids


def load_chat_template(template: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's path, or the Jinja template itself."""
    if template is None:
        return None
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{" not in template:  # neither a file nor a template: most likely a path with a typo
        raise ValueError(f"--chat-template {template!r} is not a file, nor a Jinja template")
    return template
