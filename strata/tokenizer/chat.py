"""Rendering chat templates: messages in, prompt text out, exactly as transformers renders them.

Chat templates are Jinja2 programs shipped with a model (tokenizer_config.json, chat_template.jinja
or the GGUF key tokenizer.chat_template). Templates are untrusted code, so they run in Jinja's
immutable sandbox, with the environment transformers gives them: trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, and a `tojson` filter that does not escape HTML.
Each template string is compiled once.

This module only renders text; it does not tokenize and knows nothing about any model.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import StrataError


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # NOTE: Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template for this source text (cached: a model's template is compiled once)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        problem = f"line {exc.lineno}: {exc.message}"
        message = f"the model's chat template does not compile ({problem}); fix the template or use --raw"
        raise StrataError(message) from exc


def render_chat(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables,
) -> str:
    """Render `messages` with the chat template `source`.

    `variables` reach the template as globals (bos_token, eos_token, enable_thinking, ...). As in
    transformers, message keys whose value is None are dropped first, since templates test for a
    key's presence (`content=None` from an OpenAI client would otherwise render as "None").
    """
    if not messages:
        raise StrataError("cannot apply the chat template to an empty conversation; send at least one message")
    cleaned = []
    for message in messages:
        if not isinstance(message, dict):
            raise StrataError(f"chat messages must be objects with 'role' and 'content', got {type(message).__name__}")
        cleaned.append({key: value for key, value in message.items() if value is not None})
    template = compile_template(source)
    try:
        return template.render(
            messages=cleaned,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise StrataError(f"the chat template rejected the conversation: {exc}; fix the messages or use --raw") from exc
