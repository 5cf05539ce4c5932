"""Tool calling (issue 15): declared tools, the model's call format, the call grammar,
the model's reasoning format, and the stream parser that splits generated text into
reasoning, content and call deltas (reply.py).

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

from .calls import ToolCall, ToolCallDelta, collect_calls, new_call_id
from .constraint import call_grammar, call_grammar_text
from .formats import (
    DEEPSEEK_R1, DEEPSEEK_V31, GENERIC, GLM, GLM_COMPACT, GRANITE, HARMONY, HERMES, KIMI, LLAMA3, MISTRAL,
    MISTRAL_ARGS, QWEN3_CODER, SEED_OSS, CallFormat, ToolFormat, detect_call_format, detect_format, supports_tools,
)
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
from .reasoning import HARMONY_REASONING, MISTRAL_THINK, SEED_THINK, THINK, ReasoningFormat, detect_reasoning
from .reply import ReplyParser, ReplyPiece
from .stream import CallStream

__all__ = [
    "DEEPSEEK_R1", "DEEPSEEK_V31", "GENERIC", "GLM", "GLM_COMPACT", "GRANITE", "HARMONY", "HARMONY_REASONING",
    "HERMES", "KIMI", "LLAMA3", "MISTRAL", "MISTRAL_ARGS", "MISTRAL_THINK", "QWEN3_CODER", "SEED_OSS", "SEED_THINK", "THINK",
    "MAX_DESCRIPTION_CHARS", "MAX_TOOL_SCHEMA_BYTES", "MAX_TOOL_SCHEMAS_BYTES", "MAX_TOOLS", "CallFormat",
    "CallStream", "ReasoningFormat", "ReplyParser", "ReplyPiece", "Tool", "ToolCall", "ToolCallDelta",
    "ToolChoice", "ToolFormat", "ToolsUnsupportedError", "call_grammar", "call_grammar_text", "collect_calls",
    "detect_call_format", "detect_format", "detect_reasoning", "history_messages", "new_call_id",
    "parse_tool_choice", "parse_tools", "supports_tools",
]
