"""How a model writes tool calls, detected once from its chat template.

A template that never reads the `tools` variable cannot show tools to the model: it has
no tool support (`detect_format` returns None). Otherwise the markers it prints for past
calls say which format the model was trained to write (each module's docstring shows
its format):

    json_calls.py    hermes, mistral (array), granite, llama3, generic: JSON call objects
    xml_calls.py     qwen3-coder, seed-oss, glm: one tag per parameter, typed by the schema
    tagged_calls.py  kimi, deepseek-v3.1, deepseek-r1, mistral-args: name, then JSON arguments
    harmony.py       gpt-oss: channels; a call is a message to functions.NAME

Every format object has `name`, `trigger` (the text that starts calls after free text),
`markers` (texts a vocabulary may hold as single control tokens) and what the grammar
(constraint.py) and the parsers (reply.py) need of it.
"""

from __future__ import annotations

import dataclasses
import re

from .harmony import HARMONY, HarmonyFormat
from .json_calls import BARE_FENCE, BARE_FENCE_END, BARE_SEPARATOR, GENERIC, GRANITE, HERMES, LLAMA3, MISTRAL, ToolFormat
from .tagged_calls import DEEPSEEK_R1, DEEPSEEK_V31, KIMI, MISTRAL_ARGS, TaggedFormat
from .xml_calls import GLM, GLM_COMPACT, QWEN3_CODER, SEED_OSS, XmlFormat

CallFormat = ToolFormat | XmlFormat | TaggedFormat | HarmonyFormat

__all__ = [
    "BARE_FENCE", "BARE_FENCE_END", "BARE_SEPARATOR", "CallFormat", "DEEPSEEK_R1", "DEEPSEEK_V31", "GENERIC",
    "GLM", "GLM_COMPACT", "GRANITE", "HARMONY", "HERMES", "KIMI", "LLAMA3", "MISTRAL", "MISTRAL_ARGS",
    "QWEN3_CODER", "SEED_OSS", "HarmonyFormat", "TaggedFormat", "ToolFormat", "XmlFormat", "detect_call_format",
    "detect_format", "supports_tools",
]

_READS_TOOLS = re.compile(r"\btools\b")


def supports_tools(template: str | None) -> bool:
    """The template reads the `tools` variable, so tools given to it reach the model."""
    return bool(template) and _READS_TOOLS.search(template) is not None


def detect_format(template: str | None) -> CallFormat | None:
    """The call format the template's model writes; None when the template has no tools."""
    if not supports_tools(template):
        return None
    return detect_call_format(template)


def detect_call_format(template: str) -> CallFormat:
    """The call format the template's markers name, whether or not it reads `tools`
    (DeepSeek-V3.1's template prints past calls but never the tools)."""
    if "<|channel|>" in template and "<|call|>" in template:  # past calls end with <|call|>
        return HARMONY
    if "<|tool_calls_section_begin|>" in template:
        return KIMI
    if "<｜tool▁calls▁begin｜>" in template:
        return DEEPSEEK_R1 if "```json" in template else DEEPSEEK_V31
    if "<arg_key>" in template:
        return GLM_COMPACT if "</arg_key><arg_value>" in template else GLM
    if "<seed:tool_call>" in template and "<function=" in template:
        return SEED_OSS
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if "[TOOL_CALLS]" in template:
        return MISTRAL_ARGS if "[ARGS]" in template else MISTRAL
    if "<|tool_call|>" in template:
        return GRANITE
    think = "<think>" in template
    if "<tool_call>" in template:
        fmt = HERMES
    elif "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        fmt = LLAMA3
    else:
        fmt = GENERIC
    return dataclasses.replace(fmt, think=True) if think else fmt
