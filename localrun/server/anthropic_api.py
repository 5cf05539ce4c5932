"""The Anthropic dialect: POST /v1/messages (the Messages API, whole or streamed) and
POST /v1/messages/count_tokens, so the official `anthropic` SDKs and Claude Code can use
a local model. Errors use Anthropic's {"type": "error", "error": {type, message}} body
(http.error_response picks it by path).

A request is read into the OpenAI-shaped messages and tools every other dialect feeds the
engine (the reply is rendered by anthropic_stream.py):

    system (string or text blocks)          -> a "system" message first
    user text blocks                        -> one "user" message (blocks joined by a blank line)
    user tool_result blocks                 -> one "tool" message each (tool_call_id), before
                                               the user text of the same message
    assistant text + tool_use blocks        -> "assistant" content + tool_calls (input = arguments)
    assistant thinking blocks               -> the assistant message's reasoning_content (the
                                               template decides whether earlier thinking shows);
                                               redacted_thinking blocks are dropped (sealed text)
    image / document / other blocks         -> 400 naming the block
    tools [{name, description, input_schema}] -> Tool objects; Anthropic's server tools
                                               (a `type` such as web_search_20250305) are left out,
                                               and a schema llguidance cannot enforce is relaxed
                                               (UNIMPLEMENTED_KEYWORDS), not refused
    tool_choice auto|any|tool|none          -> auto|required|named|none, and
                                               disable_parallel_tool_use -> parallel_tool_calls
    thinking {type: enabled, budget_tokens} -> a reasoning budget; {type: disabled} ->
                                               enable_thinking false; output_config.effort ->
                                               reasoning_effort (reasoning.py)
    thinking.display summarized|omitted     -> the thinking as written (a local model has no
                                               summarizer) | empty thinking blocks whose
                                               signature carries the text (anthropic_stream)

Every field is checked when the body is read, with an error that names it; fields this
server has no use for (metadata, context_management, service_tier, cache_control, and any
unknown field) are accepted and logged at debug
level, never refused: Claude Code sends all of them."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from starlette.requests import Request
from starlette.routing import Route
from starlette.responses import JSONResponse

from ..errors import BadRequestError, ContextExceededError
from ..request import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT, GenerationRequest
from ..tools import (
    MAX_DESCRIPTION_CHARS, MAX_TOOL_SCHEMA_BYTES, MAX_TOOL_SCHEMAS_BYTES, MAX_TOOLS, Tool, history_messages,
    parse_tool_choice, parse_tools,
)
from .anthropic_stream import carried_thinking, message_body, message_events, prompt_too_long
from .fields import SAMPLING_FIELDS, Body, generation_request, objects, sampling_params
from .reasoning import NO_REASONING, Reasoning, anthropic
from .http import stream
from .openai_api import chat_tokens
from .runner import collect, submit
from .state import endpoint, state

log = logging.getLogger("localrun.server")

# Fields this dialect reads. Anything else is logged and ignored (Anthropic adds fields
# often; a client must not break on the next one).
KNOWN_FIELDS = frozenset({
    "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "tools", "tool_choice",
    "thinking", "metadata", "service_tier", "context_management", "output_config", "cache_control",
    "container", "mcp_servers", "stop", "lookup", "keep_alive", *SAMPLING_FIELDS,
})
# Fields accepted for compatibility that change nothing here, with why (logged at debug level)
IGNORED_FIELDS = {
    "metadata": "no per-user accounting here",
    "service_tier": "one tier",
    "context_management": "history edits are the client's",
    "output_config": "only its effort is read (as the template's reasoning_effort)",
    "cache_control": "the prompt cache is automatic",
    "container": "no code-execution containers here",
    "mcp_servers": "no remote MCP connector here",
}
# A tool_use block's `input` is arbitrary JSON; the chat template renders it with tojson,
# which recurses: bound its depth (agents' arguments nest a handful of levels).
MAX_INPUT_DEPTH = 64
TOOL_RESULT_ERROR = "Error: "  # what a tool_result with is_error: true starts with (no field for it in templates)
CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


@dataclass
class Parsed:
    """A Messages request read and checked: the engine's messages, tools and request."""

    messages: list[dict]
    tools: tuple[Tool, ...]
    request: GenerationRequest | None  # None for count_tokens (nothing is generated)
    reasoning: Reasoning = NO_REASONING  # the thinking controls (their template variables shape the prompt)
    omit_thinking: bool = False  # thinking.display "omitted"


def _show(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def read_request(b: Body, generate: bool = True, defaults: Reasoning = NO_REASONING) -> Parsed:
    """The body as Parsed; compiles the tools' schemas (llguidance), so call it off the
    event loop. `generate` False reads a count_tokens body (no max_tokens, no sampling).
    `defaults`: the server's reasoning controls."""
    unknown = sorted(set(b.data) - KNOWN_FIELDS)
    if unknown:
        log.debug("anthropic: ignoring unknown field(s) %s", ", ".join(k[:64] for k in unknown[:20]))
    for key, why in IGNORED_FIELDS.items():
        if b.has(key):
            log.debug("anthropic: accepted %r without effect (%s)", key, why)
    _check_ignored_shapes(b)
    reasoning = anthropic(b).over(defaults)
    omit = _omit_thinking(b)
    tools = read_tools(b)
    msgs = history_messages(read_messages(b))  # checks the calls it was given, naming them
    if not generate:
        parse_tool_choice(_tool_choice(b, tools)[0], tools, "tool_choice")  # the same 400s as a create
        GenerationRequest(template_kwargs=reasoning.template_kwargs)  # the same checks as a create
        return Parsed(msgs, tools, None, reasoning)
    max_tokens = b.int("max_tokens", lo=1, hi=MAX_TOKENS_LIMIT)
    if max_tokens is None:
        raise BadRequestError("'max_tokens' is required")
    choice, parallel = _tool_choice(b, tools)
    extra = {}
    if tools:
        extra = {"tools": tools, "tool_choice": parse_tool_choice(choice, tools, "tool_choice"),
                 "parallel_tool_calls": parallel}
    elif choice is not None:
        parse_tool_choice(choice, tools, "tool_choice")  # "any" or a named tool without tools: a 400
    stops = Body({"stop": _stop_sequences(b), "lookup": b.get("lookup")})
    # temperature, top_p, top_k and every llama-server sampler field, under their own names
    request = generation_request(stops, sampling_params(b), max_tokens, None, **extra, **reasoning.request_fields())
    return Parsed(msgs, tools, request, reasoning, omit)


THINKING_DISPLAYS = ("summarized", "omitted")


def _omit_thinking(b: Body) -> bool:
    """thinking.display: "omitted" hides the text of thinking blocks (it rides in their
    signatures); "summarized", Anthropic's default, shows it."""
    display = b.obj("thinking").str("display") if b.has("thinking") else None
    if display is not None and display not in THINKING_DISPLAYS:
        raise BadRequestError(f"'thinking.display' must be \"summarized\" or \"omitted\"; got {_show(display)}")
    return display == "omitted"


def _check_ignored_shapes(b: Body) -> None:
    """The ignored fields still have a documented shape; a wrong one is a client bug
    worth a 400 (Anthropic's API refuses it too)."""
    for key in ("metadata", "context_management", "output_config"):
        b.obj(key)
    b.str("service_tier")
    b.bool("stream", False)


def _stop_sequences(b: Body) -> list[str]:
    """`stop_sequences`, checked here so the error names it (llama-server's `stop` is read too)."""
    raw = b.list("stop_sequences", most=MAX_STOP_STRINGS) or []
    for i, s in enumerate(raw):
        if not isinstance(s, str):
            raise BadRequestError(f"'stop_sequences[{i}]' must be a string, got {_show(s)}")
        if len(s) > MAX_STOP_CHARS:
            raise BadRequestError(f"'stop_sequences[{i}]' may be at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return [*raw, *(b.strings("stop") or [])]


# -- tools ---------------------------------------------------------------------------


# Real-world input schemas (Claude Code's, MCP servers') use JSON Schema keywords that
# llguidance does not implement (zod 4 writes `propertyNames` for every record; MCP tools
# use `uniqueItems`, `not`, formats such as "uri-reference" or "int64", look-around
# patterns). A schema that fails to compile is relaxed instead of failing the request:
# the keywords llguidance names (with the rest of this set), formats it does not know,
# and, after a regex error, every `pattern` are dropped; each of them only narrows what
# is valid, so a call of the relaxed schema is still the object the tool describes. The
# model is shown the relaxed schema too (one schema serves the template and the grammar).
UNIMPLEMENTED_KEYWORDS = frozenset({
    "propertyNames", "if", "then", "else", "not", "contains", "minContains", "maxContains", "uniqueItems",
    "unevaluatedProperties", "unevaluatedItems", "dependentRequired", "dependentSchemas", "dependencies",
})
KNOWN_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
MAX_RELAX_ROUNDS = 4
# keys whose value maps names to subschemas (the names are data, never keywords)
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# keys whose value is a subschema or a list of them
_SUBSCHEMAS = frozenset({
    "items", "additionalProperties", "additionalItems", "anyOf", "oneOf", "allOf", "prefixItems",
    "not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
})
# `$schema` only names a dialect, and an unknown URI there makes llguidance try to fetch it
_ANNOTATIONS = ("$schema", "$comment")


def _relax(schema: dict, keywords: frozenset, formats: bool, patterns: bool) -> dict:
    """A copy of `schema` without `keywords`, unknown formats (`formats`) and patterns
    (`patterns`) in any of its schema nodes; enum, const and default values are data and
    are copied untouched. Iterative: a schema may nest as deep as the body parser allows."""
    root: dict = {}
    todo = [(schema, root)]
    while todo:
        src, dst = todo.pop()
        for key, value in src.items():
            if key in keywords or (patterns and key == "pattern") or (
                formats and key == "format" and value not in KNOWN_FORMATS
            ):
                continue
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                dst[key] = named = {}
                for name, sub in value.items():
                    named[name] = _node(sub, todo)
            elif key in _SUBSCHEMAS and isinstance(value, list):
                dst[key] = [_node(sub, todo) for sub in value]
            elif key in _SUBSCHEMAS:
                dst[key] = _node(value, todo)
            else:
                dst[key] = value
    return root


def _node(sub, todo: list):
    if not isinstance(sub, dict):
        return sub
    copy: dict = {}
    todo.append((sub, copy))
    return copy


# relaxed schemas by the original's text: agents send the same tools with every request,
# and a compile that fails is not cached by localrun.tools (the relaxed one is)
_RELAXED: "OrderedDict[str, dict]" = OrderedDict()
_RELAXED_SIZE = 256
_relaxed_lock = threading.Lock()


def _compiled_tool(name: str, description: str, schema: dict, key: str, at: str) -> Tool:
    """The Tool, its schema compiled once (cached by its text), relaxed where llguidance
    cannot enforce it (see UNIMPLEMENTED_KEYWORDS). `key` is the schema's text."""
    with _relaxed_lock:
        known = _RELAXED.get(key)
        if known is not None:
            _RELAXED.move_to_end(key)
            return Tool(name, description, known)
    keywords, formats, patterns = frozenset(_ANNOTATIONS), False, False
    current = _relax(schema, keywords, formats, patterns)
    for _ in range(MAX_RELAX_ROUNDS):
        tool = Tool(name, description, current)
        try:
            parse_tools((tool,), "t")
            with _relaxed_lock:
                _RELAXED[key] = current
                while len(_RELAXED) > _RELAXED_SIZE:
                    _RELAXED.popitem(last=False)
            return tool
        except BadRequestError as exc:
            reason = str(exc).removeprefix("'t[0].parameters' ")
        named = set(re.findall(r'"([^"]+)"', reason.partition("Unimplemented keys:")[2]))
        learned = (keywords | UNIMPLEMENTED_KEYWORDS | named if named else keywords,
                   formats or "Unknown format" in reason, patterns or "regex parse error" in reason)
        if learned == (keywords, formats, patterns):
            break  # nothing left to relax: the schema is refused for what it is
        keywords, formats, patterns = learned
        log.debug("anthropic: relaxing %s.input_schema (llguidance: %s)", at, reason[:200])
        current = _relax(schema, keywords, formats, patterns)
    raise BadRequestError(f"'{at}.input_schema' {reason}")


def read_tools(b: Body) -> tuple[Tool, ...]:
    """Anthropic's tools as Tool objects, each schema compiled once (cached by its text);
    the count is checked before any is read, so 10,000 tools are a quick 400."""
    raw = b.list("tools", most=MAX_TOOLS) or []
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    total = 0
    for i, item in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(item, dict):
            raise BadRequestError(f"'{at}' must be an object with name, description and input_schema, got {_show(item)}")
        t = Body(item, f"{at}.")
        kind = t.str("type", "custom")
        if kind != "custom":  # a server tool (web_search_20250305, bash_20250124, ...): Anthropic runs those
            log.debug("anthropic: leaving out %s, a server tool of type %r this server does not run", at, kind[:64])
            continue
        name = t.str("name", required=True)
        description = t.str("description", "")
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise BadRequestError(
                f"'{at}.description' may hold at most {MAX_DESCRIPTION_CHARS:,} characters, got {len(description):,}")
        schema = item.get("input_schema")
        if not isinstance(schema, dict):
            raise BadRequestError(f"'{at}.input_schema' must be a JSON schema object, got {_show(schema)}")
        if not schema:
            schema = {"type": "object", "properties": {}}
        try:
            tool = Tool(name, description, schema)
        except BadRequestError:
            raise BadRequestError(f"'{at}.name' must match ^[A-Za-z0-9_-]{{1,64}}$, got {_show(name)}") from None
        if name in seen:
            raise BadRequestError(f"'{at}.name' {name!r} repeats tools[{seen[name]}]")
        seen[name] = i
        size = len(tool.schema_json.encode())
        if size > MAX_TOOL_SCHEMA_BYTES:
            raise BadRequestError(f"'{at}.input_schema' is {size:,} bytes of JSON; the limit is {MAX_TOOL_SCHEMA_BYTES:,}")
        total += size
        if total > MAX_TOOL_SCHEMAS_BYTES:
            raise BadRequestError(f"'tools': the input schemas add up to over {MAX_TOOL_SCHEMAS_BYTES:,} bytes"
                                  f" by {at}; send fewer or smaller tools")
        tools.append(_compiled_tool(name, description, schema, tool.schema_json, at))
    return tuple(tools)


def _tool_choice(b: Body, tools) -> tuple[str | dict | None, bool]:
    """Anthropic's tool_choice as the OpenAI-shaped choice parse_tool_choice reads, and
    whether several calls may be made."""
    if not b.has("tool_choice"):
        return None, True
    c = b.obj("tool_choice")
    kind = c.str("type", required=True)
    if kind not in CHOICES:
        raise BadRequestError(f"'tool_choice.type' must be one of auto, any, tool, none; got {_show(kind)}")
    parallel = not c.bool("disable_parallel_tool_use", False)
    if kind in ("any", "tool") and not tools:
        raise BadRequestError(f"'tool_choice' of type {kind!r} needs 'tools' to choose from")
    if kind == "tool":
        name = c.str("name", required=True)
        if name not in {t.name for t in tools}:
            raise BadRequestError(f"'tool_choice.name' {_show(name)} is not among the tools")
        return {"type": "function", "function": {"name": name}}, parallel
    return CHOICES[kind], parallel


# -- messages ------------------------------------------------------------------------


def read_messages(b: Body) -> list[dict]:
    """`system` and `messages` as OpenAI-shaped messages (see the module docstring)."""
    out: list[dict] = []
    system = _system(b)
    if system:
        out.append({"role": "system", "content": system})
    raw = b.list("messages", required=True, most=MAX_MESSAGES)
    if not raw:
        raise BadRequestError("'messages' must hold at least one message")
    for where, m in objects(raw, "messages", "an object with role and content"):
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadRequestError(f"'{where}.role' must be \"user\" or \"assistant\", got {_show(role)}")
        content = m.get("content")
        if role == "system":  # Claude Code 2.1 sends some instructions as a system message in `messages`
            _system_in_messages(out, content, where)
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            if len(content) > MAX_CONTENT_PARTS:
                raise BadRequestError(f"'{where}.content' may hold at most {MAX_CONTENT_PARTS} blocks, got {len(content)}")
            out.extend(_assistant(content, where) if role == "assistant" else _user(content, where))
        else:
            raise BadRequestError(f"'{where}.content' must be a string or a list of content blocks, got {_show(content)}")
        if len(out) > MAX_MESSAGES:  # tool results become messages of their own
            raise BadRequestError(f"'messages' make more than {MAX_MESSAGES} messages (tool results count one each)")
    return out


def _system_in_messages(out: list[dict], content, where: str) -> None:
    """A system message inside `messages` joins the user message just before it (so a
    template that allows one system message, first, still renders the conversation, and
    the next turn's prompt still begins with this one's); with no user message before it,
    it stands as a system message where it is."""
    if isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise BadRequestError(f"'{where}.content' may hold at most {MAX_CONTENT_PARTS} blocks, got {len(content)}")
        content = "\n\n".join(_text(block, f"{where}.content[{j}]") for j, block in enumerate(content))
    if not isinstance(content, str):
        raise BadRequestError(f"'{where}.content' must be a string or a list of text blocks, got {_show(content)}")
    if out and out[-1]["role"] == "user":
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{content}"}
    else:
        out.append({"role": "system", "content": content})


def _system(b: Body) -> str:
    raw = b.get("system")
    if raw is None or isinstance(raw, str):
        return raw or ""
    if not isinstance(raw, list):
        raise BadRequestError(f"'system' must be a string or a list of text blocks, got {_show(raw)}")
    if len(raw) > MAX_CONTENT_PARTS:
        raise BadRequestError(f"'system' may hold at most {MAX_CONTENT_PARTS} blocks, got {len(raw)}")
    return "\n\n".join(_text(block, f"system[{j}]") for j, block in enumerate(raw))


def _kind(block, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise BadRequestError(f"'{at}' must be a content block object with a 'type', got {_show(block)}")
    kind = block["type"]
    if kind in ("image", "document"):
        raise BadRequestError(f"'{at}': {kind} blocks are not supported: this server reads text only")
    return kind


def _text(block, at: str) -> str:
    kind = _kind(block, at)
    if kind != "text":
        raise BadRequestError(f"'{at}' must be a text block, got a {_show(kind)} block")
    text = block.get("text")
    if not isinstance(text, str):
        raise BadRequestError(f"'{at}.text' must be a string, got {_show(text)}")
    return text


def _blocks(blocks: list, where: str):
    """A message's content blocks, each with where it stands (for errors) and its type."""
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        yield block, at, _kind(block, at)


def _user(blocks: list, where: str) -> list[dict]:
    """A user turn's blocks: a tool message per tool_result, then the text as one message."""
    results, texts = [], []
    for block, at, kind in _blocks(blocks, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            results.append(_tool_result(block, at))
        else:
            raise BadRequestError(f"'{at}': a user message holds text and tool_result blocks, not {_show(kind)}")
    return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts or not results else [])


def _tool_result(block: dict, at: str) -> dict:
    b = Body(block, f"{at}.")
    call_id = b.str("tool_use_id", required=True)
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise BadRequestError(f"'{at}.content' may hold at most {MAX_CONTENT_PARTS} blocks, got {len(content)}")
        text = "\n".join(_result_text(part, f"{at}.content[{k}]") for k, part in enumerate(content))
    else:
        raise BadRequestError(f"'{at}.content' must be a string or a list of text blocks, got {_show(content)}")
    if b.bool("is_error", False):
        text = TOOL_RESULT_ERROR + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _result_text(block, at: str) -> str:
    """A tool result's block: text, or for an image or document (Claude Code's Read of a
    picture) a line saying it was left out, so the agent's session goes on."""
    if isinstance(block, dict) and block.get("type") in ("image", "document"):
        return f"[{block['type']} left out: this server reads text only]"
    return _text(block, at)


def _assistant(blocks: list, where: str) -> list[dict]:
    """An assistant turn's blocks: its text, its tool calls and its thinking, as one message."""
    texts, calls, thoughts = [], [], []
    for block, at, kind in _blocks(blocks, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            b = Body(block, f"{at}.")
            call_id, name = b.str("id", required=True), b.str("name", required=True)
            arguments = block.get("input")
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, dict):
                raise BadRequestError(f"'{at}.input' must be a JSON object, got {_show(arguments)}")
            _check_depth(arguments, f"{at}.input")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise BadRequestError(f"'{at}.thinking' must be a string, got {_show(thought)}")
            # an omitted block (empty thinking) of ours carries its text in its signature;
            # any other signature is ours or another model's: nothing to check
            sig = block.get("signature")
            carried = carried_thinking(sig) if not thought and isinstance(sig, str) else None
            thoughts.append(carried if carried is not None else thought)
        elif kind == "redacted_thinking":
            continue  # sealed for the model that wrote it: no text to give this one
        else:
            raise BadRequestError(
                f"'{at}': an assistant message holds text, tool_use and thinking blocks, not {_show(kind)}")
    msg = {"role": "assistant", "content": "\n\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if any(thoughts):
        msg["reasoning_content"] = "\n\n".join(t for t in thoughts if t)
    return [msg]


def _check_depth(value, at: str) -> None:
    """Refuse JSON nested deeper than MAX_INPUT_DEPTH (iteratively: no recursion to exhaust)."""
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_INPUT_DEPTH:
            raise BadRequestError(f"'{at}' nests deeper than {MAX_INPUT_DEPTH} levels")
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


# -- routes --------------------------------------------------------------------------


async def _prompt(st, request: Request, b: Body, generate: bool):
    parsed = await asyncio.to_thread(read_request, b, generate, st.reasoning)
    model = await st.manager.get(b.str("model"), b.get("keep_alive"))
    asked_for = b.str("model") or model.name
    tokens = await asyncio.to_thread(chat_tokens, model.engine, parsed.messages, parsed.tools, asked_for,
                                     parsed.reasoning.template_kwargs)
    return parsed, model, asked_for, tokens


async def create_message(request: Request):
    st = state(request)
    b = await st.body(request)
    parsed, model, asked_for, tokens = await _prompt(st, request, b, True)
    n_ctx = model.engine.n_ctx
    if len(tokens) >= n_ctx:  # Claude Code reads this text to know it must compact the history
        raise prompt_too_long(len(tokens), n_ctx)
    try:
        job = await submit(model, tokens, parsed.request)
    except ContextExceededError:
        raise prompt_too_long(len(tokens), n_ctx) from None
    stops = parsed.request.stop
    if b.bool("stream", False):
        body = message_events(model, job, asked_for, len(tokens), stops, parsed.omit_thinking)
        return stream(request, body, "text/event-stream", lambda: model.scheduler.cancel(job))
    res = await collect(request, model, job)
    return JSONResponse(message_body(model.engine, res, asked_for, stops, parsed.omit_thinking))


async def count_tokens(request: Request):
    st = state(request)
    b = await st.body(request)
    _, _, _, tokens = await _prompt(st, request, b, False)
    return JSONResponse({"input_tokens": len(tokens)})


# This dialect's routes, in one place (app.py mounts every dialect's list).
ROUTES = [
    Route("/v1/messages", endpoint(create_message), methods=["POST"]),
    Route("/v1/messages/count_tokens", endpoint(count_tokens), methods=["POST"]),
]
