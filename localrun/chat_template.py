"""Render a conversation with the model's own Jinja chat template.

The template comes from the GGUF key `tokenizer.chat_template` or from
`tokenizer_config.json`. It runs in a sandboxed Jinja environment with the helpers the
Hugging Face templates expect (`raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text), trim_blocks/lstrip_blocks as transformers sets them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import BadRequestError

# Used only when a model carries no template at all (some GGUF exports drop it): the
# turn format whose marker tokens the vocabulary has, else ChatML, the most common one.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% set sys = messages[0]['content'] ~ '\n\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ sys if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FALLBACKS = (("<start_of_turn>", GEMMA), ("<|im_start|>", CHATML))


def fallback_template(is_single_token) -> str:
    """Pick a template for a model without one; is_single_token(text) tells whether the
    vocabulary holds `text` as one special token."""
    for marker, template in FALLBACKS:
        if is_single_token(marker):
            return template
    return CHATML

ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise BadRequestError(f"the model's chat template does not parse (line {exc.lineno}): {exc.message}") from exc


def validate_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content", ""), str):
            raise BadRequestError(f"messages[{i}].content must be a string")


def render(
    template: str | None,
    messages: list[dict],
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra,
) -> str:
    validate_messages(messages)
    try:
        return _compile(template or CHATML).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise BadRequestError(f"the model's chat template refused these messages: {exc}") from exc
