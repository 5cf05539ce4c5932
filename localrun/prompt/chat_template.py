"""Render a conversation with the model's own Jinja chat template.

The template comes from the GGUF key `tokenizer.chat_template` or from
`tokenizer_config.json`. It runs in a sandboxed Jinja environment with the helpers the
Hugging Face templates expect (`raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text), trim_blocks/lstrip_blocks as transformers sets them.

A template is code from a file anyone can publish, so it renders inside a budget
(template_budget: steps, time, sizes, output, call depth), and every way it can fail,
from a syntax error to a Python exception deep in a filter, becomes one BadRequestError
line: the CLI prints it, the server answers 400.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache

import jinja2

from ..errors import BadRequestError
from .template_budget import BudgetedSandbox, BudgetExceeded, RenderBudget, render_bounded, spending

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
# Ends every message about a broken template: the fix is another template.
OVERRIDE_HINT = "pass --chat-template FILE to use another"
MAX_REASON_CHARS = 300  # an exception's text can quote a whole message; one line stays short
MAX_JSON_INDENT = 16  # tojson(indent=n): templates use 2 or 4


class TemplateRefusal(jinja2.exceptions.TemplateError):
    """The template's own `raise_exception(...)`: it refuses these messages on purpose."""


def _raise(message: str):
    # reprlib: a message that is not text (a list repeating a long string) stays short
    raise TemplateRefusal(message if isinstance(message, str) else reprlib.repr(message))


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    width = len(indent) if isinstance(indent, str) else indent or 0
    if width > MAX_JSON_INDENT:  # each line of the JSON repeats it
        raise BudgetExceeded(f"asked tojson for an indent of {width:,} (at most {MAX_JSON_INDENT})")
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, default=_listed)


def _listed(value):
    """Jinja's `map` and `select` give generators (llama.cpp's DeepSeek-R1 template writes
    `tools | map(attribute='function') | tojson`): JSON gets their items as a list."""
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = BudgetedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        filters={"tojson": _tojson},
        globals={"raise_exception": _raise, "strftime_now": lambda fmt: datetime.now().strftime(fmt)},
    )
    # Jinja folds constant expressions while compiling, through the same budgeted hooks.
    with spending(RenderBudget.for_input()):
        return env.from_string(template)


MAX_TEMPLATE_FILE_BYTES = 256 * 1024  # the largest published templates (tools, reasoning) are ~20 KB


def load_template_file(path) -> str:
    """A `--chat-template FILE`: read (at most MAX_TEMPLATE_FILE_BYTES, UTF-8) and compiled
    now, so a broken file fails when the model opens, as one line naming the file."""
    import os

    name = os.fspath(path)
    if os.path.exists(name) and not os.path.isfile(name):  # a folder, FIFO or device: never block on it
        raise BadRequestError(f"--chat-template {name}: not a regular file")
    try:
        with open(name, "rb") as f:
            data = f.read(MAX_TEMPLATE_FILE_BYTES + 1)
    except OSError as exc:
        raise BadRequestError(f"--chat-template {name}: cannot read it ({exc.strerror})") from None
    if len(data) > MAX_TEMPLATE_FILE_BYTES:
        raise BadRequestError(f"--chat-template {name}: over {MAX_TEMPLATE_FILE_BYTES // 1024} KiB; a chat template is a few KB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"--chat-template {name}: not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise BadRequestError(f"--chat-template {name}: the file is empty")
    try:
        _compile(text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise BadRequestError(f"--chat-template {name}: does not parse (line {exc.lineno}): {_one_line(exc.message)}") from None
    except BudgetExceeded as exc:
        raise BadRequestError(f"--chat-template {name}: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise BadRequestError(f"--chat-template {name}: {_one_line(exc)}") from None
    return text


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
    variables = dict(
        messages=messages,
        bos_token=bos_token,
        eos_token=eos_token,
        add_generation_prompt=add_generation_prompt,
        **extra,
    )
    try:
        compiled = _compile(template or CHATML)
        return render_bounded(compiled, RenderBudget.for_input(messages, extra), variables)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise BadRequestError(
            f"the model's chat template does not parse (line {exc.lineno}): {_one_line(exc.message)}; {OVERRIDE_HINT}"
        ) from exc
    except TemplateRefusal as exc:
        raise BadRequestError(f"the model's chat template refused these messages: {_one_line(exc)}") from exc
    except BudgetExceeded as exc:
        raise BadRequestError(f"the model's chat template {exc}; {OVERRIDE_HINT}") from exc
    except jinja2.exceptions.TemplateError as exc:  # undefined names, sandbox refusals, no loader
        raise BadRequestError(f"the model's chat template failed: {_one_line(exc)}; {OVERRIDE_HINT}") from exc
    except Exception as exc:  # noqa: BLE001 - Python errors raised by the template's own code
        # (TypeError, ValueError, KeyError, OverflowError, RecursionError, MemoryError...)
        reason = f"{type(exc).__name__}: {_one_line(exc)}"
        raise BadRequestError(f"the model's chat template failed: {reason}; {OVERRIDE_HINT}") from exc


def _one_line(reason) -> str:
    text = " ".join(str(reason)[: 4 * MAX_REASON_CHARS].split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
