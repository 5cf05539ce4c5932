"""Tool calling (issue 15): declared tools, the model's call format, the call grammar,
and the stream parser that turns generated text into content and call deltas.

    tools = parse_tools(body["tools"], "tools")
    choice = parse_tool_choice(body.get("tool_choice"), tools, "tool_choice")
    req = GenerationRequest(tools=tools, tool_choice=choice, parallel_tool_calls=True)
    for ev in engine.chat(history_messages(messages), req):
        ev.text         # content; never call markup
        ev.tool_calls   # ToolCallDelta list or None; collect_calls(...) joins them

The engine renders the tools with the model's own template (Hugging Face's `tools`
variable), holds every call to a declared tool and its JSON schema with one llguidance
grammar (constraint.py), and parses calls out of the text as it streams (stream.py).
"""

from .constraint import call_grammar, call_grammar_text
from .formats import GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormat, detect_format, supports_tools
from .history import history_messages
from .spec import (
    MAX_DESCRIPTION_CHARS,
    MAX_TOOL_SCHEMA_BYTES,
    MAX_TOOL_SCHEMAS_BYTES,
    MAX_TOOLS,
    Tool,
    ToolChoice,
    ToolsUnsupportedError,
    parse_tool_choice,
    parse_tools,
)
from .stream import CallStream, ToolCall, ToolCallDelta, collect_calls, new_call_id

__all__ = [
    "GENERIC", "HERMES", "LLAMA3", "MISTRAL", "MAX_DESCRIPTION_CHARS", "MAX_TOOL_SCHEMA_BYTES",
    "MAX_TOOL_SCHEMAS_BYTES", "MAX_TOOLS", "CallStream", "Tool", "ToolCall", "ToolCallDelta", "ToolChoice",
    "ToolFormat", "ToolsUnsupportedError", "call_grammar", "call_grammar_text", "collect_calls",
    "detect_format", "history_messages", "new_call_id", "parse_tool_choice", "parse_tools", "supports_tools",
]
