"""Declared tools and the tool choice, parsed from a request and bounded.

    tools = parse_tools(body["tools"], "tools")          # OpenAI's (and Ollama's) form
    choice = parse_tool_choice(body.get("tool_choice"), tools, "tool_choice")

A tool's `parameters` schema is compiled by llguidance when it is parsed (the same
compile the call grammar makes later), so a schema the constraint could not enforce is
a 400 naming `tools[i].function.parameters`, before any model work. Compiles are cached
by the schema's text: agents send the same tools with every request.

Bounds, each a `BadRequestError` naming the field:

- at most `MAX_TOOLS` = 128 tools (OpenAI's limit); names match `^[A-Za-z0-9_-]{1,64}$`
  (OpenAI's rule; they are also spliced into the call grammar, so nothing else may pass)
  and do not repeat;
- a tool's `parameters` schema: at most `MAX_TOOL_SCHEMA_BYTES` = 64 KiB of JSON, and all
  of them together at most `MAX_TOOL_SCHEMAS_BYTES` = 256 KiB (the call grammar compiles
  them all; 256 KiB is also the cap on one `response_format` schema, MAX_SCHEMA_BYTES);
- a description: at most `MAX_DESCRIPTION_CHARS` = 32,768 characters (agents' longest
  tool descriptions are ~10 KB; it only costs prompt tokens and the template's budget).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ..errors import BadRequestError
from ..grammar.core import Grammar, json_schema_layout

MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 64 * 1024
MAX_TOOL_SCHEMAS_BYTES = 256 * 1024
MAX_DESCRIPTION_CHARS = 32_768
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICE_MODES = ("auto", "none", "required")

# Arguments are held to the separators Python's json.dumps writes, which is what a
# template's `tojson` shows the model for earlier calls: in distribution, and no room
# for runs of whitespace between tokens under sampling.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS = {"type": "object", "properties": {}}


class ToolsUnsupportedError(BadRequestError):
    """Tools were sent to a model whose chat template cannot show them to it. `str()` is
    the CLI's line; `for_model(name)` is Ollama's text, which clients match."""

    reason = "does not support tools"

    def __init__(self) -> None:
        super().__init__(
            "this model's chat template does not support tools; pass --chat-template FILE with one that does"
        )

    def for_model(self, name: str) -> str:
        return f"{name} {self.reason}"


@dataclass(frozen=True)
class Tool:
    """One declared function. `parameters` is its JSON schema (an object schema); equal
    tools compare and hash equal through `schema_json`, the schema's canonical text."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: dict(NO_ARGUMENTS), compare=False, hash=False)
    schema_json: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_name(self.name, "tool name")  # spliced into the call grammar: nothing else may pass
        if not isinstance(self.parameters, dict):
            raise BadRequestError(f"a tool's parameters must be a JSON schema object, got {_show(self.parameters)}")
        object.__setattr__(self, "schema_json", json.dumps(self.parameters, sort_keys=True, ensure_ascii=False))

    def template_dict(self) -> dict:
        """The tool as Hugging Face templates read it (the `tools` variable)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def constrained_schema(self) -> dict:
        """The schema the call grammar enforces: the tool's, laid out as json.dumps writes,
        and, where the schema lists `properties` and says nothing of others, without
        others (llama.cpp's default too: a model invents no arguments the tool never
        declared; every call still validates against the tool's own schema)."""
        schema = json_schema_layout(self.parameters, JSON_LAYOUT)
        if "properties" in schema and not {"additionalProperties", "patternProperties"} & schema.keys():
            schema["additionalProperties"] = False
        return schema


@dataclass(frozen=True)
class ToolChoice:
    """mode: "auto" (text or calls), "none" (no call), "required" (at least one call),
    "named" (a call of `name`)."""

    mode: str = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in CHOICE_MODES + ("named",):
            raise BadRequestError(f"tool choice mode must be one of auto, none, required, named; got {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise BadRequestError("a named tool choice needs a name, and only it takes one")


def _show(v) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = type(v).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def parse_tools(raw, where: str = "tools") -> tuple[Tool, ...]:
    """Tools from OpenAI's form `[{"type": "function", "function": {name, description,
    parameters}}]` (Ollama sends the same); Tool objects pass through. None -> ()."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise BadRequestError(f"'{where}' must be a list of tools, got {_show(raw)}")
    if len(raw) > MAX_TOOLS:
        raise BadRequestError(f"'{where}' may hold at most {MAX_TOOLS} tools, got {len(raw)}")
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    total = 0
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        tool = item if isinstance(item, Tool) else _parse_one(item, at)
        if isinstance(item, Tool):  # its name was checked when it was made
            _check_schema(tool, f"{at}.parameters")
        if tool.name in seen:
            raise BadRequestError(f"'{at}.function.name' {tool.name!r} repeats {where}[{seen[tool.name]}]")
        seen[tool.name] = i
        total += len(tool.schema_json.encode())
        if total > MAX_TOOL_SCHEMAS_BYTES:
            raise BadRequestError(
                f"'{where}': the tools' parameter schemas add up to over {MAX_TOOL_SCHEMAS_BYTES:,} bytes"
                f" (MAX_TOOL_SCHEMAS_BYTES) by {at}; send fewer or smaller tools"
            )
        tools.append(tool)
    return tuple(tools)


def _parse_one(item, at: str) -> Tool:
    if not isinstance(item, dict):
        raise BadRequestError(f"'{at}' must be an object {{\"type\": \"function\", \"function\": {{...}}}}, got {_show(item)}")
    kind = item.get("type", "function")
    if kind != "function":
        raise BadRequestError(f"'{at}.type' must be \"function\", got {_show(kind)}")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise BadRequestError(f"'{at}.function' must be an object with name, description and parameters, got {_show(fn)}")
    name = fn.get("name")
    _check_name(name, f"{at}.function.name")
    description = fn.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise BadRequestError(f"'{at}.function.description' must be a string, got {_show(description)}")
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise BadRequestError(
            f"'{at}.function.description' may hold at most {MAX_DESCRIPTION_CHARS:,} characters, got {len(description):,}"
        )
    params = fn.get("parameters")
    if params is None or params == {}:
        params = dict(NO_ARGUMENTS)
    if not isinstance(params, dict):
        raise BadRequestError(f"'{at}.function.parameters' must be a JSON schema object, got {_show(params)}")
    tool = Tool(name, description, params)
    _check_schema(tool, f"{at}.function.parameters")
    return tool


def _check_name(name, at: str) -> None:
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise BadRequestError(f"'{at}' must match ^[A-Za-z0-9_-]{{1,64}}$, got {_show(name)}")


def _check_schema(tool: Tool, at: str) -> None:
    size = len(tool.schema_json.encode())
    if size > MAX_TOOL_SCHEMA_BYTES:
        raise BadRequestError(f"'{at}' is {size:,} bytes of JSON; the limit is {MAX_TOOL_SCHEMA_BYTES:,} (MAX_TOOL_SCHEMA_BYTES)")
    kind = tool.parameters.get("type")
    if kind is not None and kind != "object":
        raise BadRequestError(f"'{at}' must describe an object (\"type\": \"object\"): arguments are a JSON object")
    try:
        _compile_once(tool)
    except BadRequestError as exc:
        raise BadRequestError(f"'{at}' cannot be enforced: {exc}") from None


_SCHEMA_CACHE: "OrderedDict[str, bool]" = OrderedDict()
_SCHEMA_CACHE_SIZE = 1024  # schemas known to compile (their text as keys: <= 64 MiB worst case)
_schema_lock = threading.Lock()


def _compile_once(tool: Tool) -> None:
    """Compile the constrained schema once per distinct schema (llguidance, within
    grammar.py's limits); a schema that compiled before is a dictionary hit."""
    key = tool.schema_json
    with _schema_lock:
        if key in _SCHEMA_CACHE:
            _SCHEMA_CACHE.move_to_end(key)
            return
    # BadRequestError with llguidance's reason; the call grammar's layout, not the default
    Grammar.from_json_schema(tool.constrained_schema(), layout=JSON_LAYOUT)
    with _schema_lock:
        _SCHEMA_CACHE[key] = True
        while len(_SCHEMA_CACHE) > _SCHEMA_CACHE_SIZE:
            _SCHEMA_CACHE.popitem(last=False)


def parse_tool_choice(raw, tools: tuple[Tool, ...], where: str = "tool_choice") -> ToolChoice | None:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name": ...}};
    a ToolChoice passes through (checked against `tools`). None -> "auto" with tools,
    else None."""
    if raw is None:
        return ToolChoice("auto") if tools else None
    if isinstance(raw, ToolChoice):
        choice = raw
    elif isinstance(raw, str):
        if raw not in CHOICE_MODES:
            raise BadRequestError(f"'{where}' must be \"auto\", \"none\", \"required\" or a function object, got {_show(raw)}")
        choice = ToolChoice(raw)
    elif isinstance(raw, dict):
        if raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
            raise BadRequestError(
                f"'{where}' as an object must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_show(raw)}"
            )
        name = raw["function"].get("name")
        if not isinstance(name, str):
            raise BadRequestError(f"'{where}.function.name' must be a string, got {_show(name)}")
        choice = ToolChoice("named", name)
    else:
        raise BadRequestError(f"'{where}' must be a string or an object, got {_show(raw)}")
    if choice.mode in ("required", "named") and not tools:
        raise BadRequestError(f"'{where}' {_show(choice.name or choice.mode)} needs 'tools' to choose from")
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        raise BadRequestError(f"'{where}' names {choice.name!r}, which is not among the tools")
    return choice
