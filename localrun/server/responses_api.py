"""The OpenAI Responses dialect: POST /v1/responses, as the `openai` SDK's
`client.responses` and Codex CLI (`wire_api = "responses"`) speak it.

A request is read into the same chat-shaped messages and tools the chat route uses, and
runs the same engine path; responses_items.py reads the input items and renders the
events as output items.

- `instructions` and the system/developer messages at the head of `input` become one
  leading system message; a later one stays where it is, unless the model's template
  refuses that (many accept one system message only), then it joins the leading one.
- `tools`: `function` (flat), `custom` (a function of one string `input`; a `regex`
  grammar holds that string to the pattern, a `lark` grammar is shown to the model but
  not enforced), `namespace` (its tools flattened to `<namespace>__<name>`, mapped back
  to name + namespace in the output); hosted tools (web_search, file_search, mcp, ...)
  are left out of the prompt, logged, never refused.
- The server is stateless: `store` is accepted and nothing is stored;
  `previous_response_id`, `conversation`, `background` and `item_reference` are 400s.
- Unknown top-level fields are accepted and logged at debug level, as OpenAI's own
  clients send fields newer than any server.
- Thinking comes as a `reasoning` output item ahead of the answer (its text in
  `content: [{type: "reasoning_text"}]`, `summary: []`), streamed as
  `response.reasoning_text.delta`; `reasoning.effort` reaches the template
  (reasoning.py), and input `reasoning` items with text reach it as the next assistant
  turn's `reasoning_content`."""

from __future__ import annotations

import asyncio
import logging
import re
import time

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..prompt.chat_template import TemplateRefusal
from ..errors import BadRequestError, ContextExceededError, LocalrunError
from ..grammar.core import Grammar
from ..request import MAX_TOKENS_LIMIT, GenerationRequest
from ..tools import MAX_DESCRIPTION_CHARS, MAX_TOOLS, parse_tool_choice, parse_tools
from .fields import SAMPLING_FIELDS, Body, _show, generation_request, sampling_params, schema_grammar
from .http import stream, until_done_or_disconnect
from .openai_api import chat_tokens
from .reasoning import NO_REASONING, Reasoning, responses
from .responses_items import Reply, ToolNames, flat_name, new_id, read_input, sse_event
from .runner import events, reasoning_tokens, submit
from .state import endpoint, state

log = logging.getLogger("localrun.server")

# the fields this dialect reads or knowingly accepts; any other is logged and ignored
KNOWN_FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "text", "reasoning", "stream", "stream_options", "include", "store",
    "previous_response_id", "prompt_cache_key", "prompt_cache_retention", "metadata", "client_metadata", "user",
    "safety_identifier", "service_tier", "truncation", "background", "conversation", "prompt",
    "lookup", "stop", "keep_alive",
}
MAX_METADATA_PAIRS = 16  # OpenAI's limit


# -- the request -----------------------------------------------------------------------


class Parsed:
    """A Responses request read into the chat path's terms."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.merged: list[dict] | None = None  # every system message at the head (a template's fallback)
        self.prompt_tools: tuple = ()  # the tools the template shows the model
        self.names: ToolNames = {}  # flat tool name -> (kind, the client's name, namespace)
        self.request: GenerationRequest | None = None
        self.echo: dict = {}  # the request's fields the response object repeats


def read_request(b: Body, defaults: Reasoning = NO_REASONING) -> Parsed:
    """Everything a request asks, checked and bounded; compiles schemas and grammars, so
    it runs off the event loop. `defaults`: the server's reasoning controls."""
    _refuse_state(b)
    for key in b.data:
        if key not in KNOWN_FIELDS and key not in _SAMPLING_KEYS:
            log.debug("/v1/responses: ignoring the unknown field %r", key[:64])
    p = Parsed()
    p.messages, p.merged = read_input(b)  # the cheap checks first: a bad item fails before any schema compiles
    flat, wheres, p.names = read_tools(b)
    allowed, choice = read_tool_choice(b, p.names)
    try:
        p.prompt_tools = parse_tools(flat, "tools")
    except BadRequestError as exc:
        raise BadRequestError(_relocate(str(exc), wheres)) from None
    # `allowed_tools` limits what may be called; the model still reads every tool (as
    # OpenAI does, so a prompt stays the same, and cached, while the allowed set changes)
    tools = p.prompt_tools if allowed is None else tuple(t for t in p.prompt_tools if t.name in allowed)
    if p.prompt_tools and not tools and choice == "auto":
        tools, choice = p.prompt_tools, "none"  # tools shown, none allowed: text only, no call markup
    format_grammar = read_text_format(b)
    parsed_choice = parse_tool_choice(choice, tools, "tool_choice")
    parallel = b.bool("parallel_tool_calls", True)
    run_tools = tools
    if tools and format_grammar is not None:
        if parsed_choice is not None and parsed_choice.mode == "none":
            run_tools = ()  # no call can come: the answer follows text.format, the tools are only shown
        else:
            # a call brings its own grammar and the two cannot be combined without engine
            # work (issue 48 leaves it): calls stay enforced, the format is not
            log.info("/v1/responses: 'text.format' is not enforced on an answer that may call tools")
            format_grammar = None
    max_tokens = b.int("max_output_tokens", lo=0, hi=MAX_TOKENS_LIMIT)
    extra = {"tools": run_tools, "tool_choice": parsed_choice, "parallel_tool_calls": parallel} if run_tools else {}
    reasoning = responses(b).over(defaults)
    p.request = generation_request(b, sampling_params(b), max_tokens, format_grammar, **extra,
                                   **reasoning.request_fields())
    p.echo = _echo(b, parallel)
    return p


_SAMPLING_KEYS = frozenset(SAMPLING_FIELDS)  # llama-server's sampler fields, read by sampling_params


def _refuse_state(b: Body) -> None:
    if b.has("previous_response_id"):
        raise BadRequestError(
            "this server is stateless: send the whole conversation in 'input' (previous_response_id is not supported)"
        )
    if b.has("conversation"):
        raise BadRequestError("this server is stateless: send the whole conversation in 'input' ('conversation' is not supported)")
    if b.bool("background", False):
        raise BadRequestError("'background': this server answers in the request itself; send background: false")
    if b.has("prompt"):
        raise BadRequestError("'prompt': stored prompt templates are not supported; send 'instructions' and 'input'")
    b.bool("store", False)  # accepted either way: nothing is stored
    include = b.list("include", most=64) or []
    if not all(isinstance(s, str) for s in include):
        raise BadRequestError(f"'include' must be a list of strings, got {_show(include)}")
    metadata = b.obj("metadata").data
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequestError(f"'metadata' may hold at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key in ("prompt_cache_key", "user", "safety_identifier", "service_tier", "truncation"):
        b.str(key)


def _echo(b: Body, parallel: bool) -> dict:
    """The request's settings as the response object repeats them."""
    return {
        "instructions": b.str("instructions"), "tools": b.get("tools") or [],
        "tool_choice": b.get("tool_choice", "auto"), "parallel_tool_calls": parallel,
        "temperature": b.float("temperature"), "top_p": b.float("top_p"),
        "max_output_tokens": b.get("max_output_tokens"), "text": b.get("text") or {"format": {"type": "text"}},
        "reasoning": b.get("reasoning") or {"effort": None, "summary": None}, "store": b.bool("store", False),
        "metadata": b.get("metadata") or {}, "previous_response_id": None, "truncation": b.get("truncation", "disabled"),
        "user": b.get("user"), "prompt_cache_key": b.get("prompt_cache_key"), "background": False,
        "service_tier": b.get("service_tier", "default"), "safety_identifier": b.get("safety_identifier"),
    }


# -- tools -------------------------------------------------------------------------------


def read_tools(b: Body) -> tuple[list[dict], list[tuple[str, str]], ToolNames]:
    """The declared function and custom tools as OpenAI chat tools (namespaces flattened),
    each with where it sits in the request and its kind, and the flat names' map back."""
    raw = b.list("tools", most=MAX_TOOLS) or []
    flat: list[dict] = []
    wheres: list[tuple[str, str]] = []
    names: ToolNames = {}
    count = 0
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        t = _tool_body(tool, at)
        kind = t.str("type", required=True)
        if kind in ("function", "custom"):
            members = [(t, at, None)]
        elif kind == "namespace":
            ns = t.str("name", required=True)
            if not 0 < len(ns) <= 64:
                raise BadRequestError(f"'{at}.name' must be 1..64 characters, got {_show(ns)}")
            t.str("description")
            inner = t.list("tools", required=True, most=MAX_TOOLS)
            members = [(_tool_body(x, f"{at}.tools[{j}]"), f"{at}.tools[{j}]", ns) for j, x in enumerate(inner)]
        else:
            log.info("/v1/responses: leaving out the %r tool (%s): this server runs no hosted tools", kind[:64], at)
            continue
        count += len(members)
        if count > MAX_TOOLS:
            raise BadRequestError(
                f"'tools' may declare at most {MAX_TOOLS} function and custom tools (a namespace's tools count), got over {MAX_TOOLS}"
            )
        for member, where, ns in members:
            fn, member_kind = _function_of(member, where)
            name = member.str("name", required=True)
            model_name = flat_name(ns, name) if ns is not None else name
            fn["name"] = model_name
            names[model_name] = (member_kind, name, ns)
            flat.append({"type": "function", "function": fn})
            wheres.append((where, member_kind))
    return flat, wheres, names


def _tool_body(tool, at: str) -> Body:
    if not isinstance(tool, dict):
        raise BadRequestError(f"'{at}' must be a tool object with a type, got {_show(tool)}")
    return Body(tool, f"{at}.")


def _function_of(t: Body, at: str) -> tuple[dict, str]:
    """One function or custom tool as the chat path's function object (name set later)."""
    kind = t.str("type", required=True)
    t.str("name", required=True)
    description = t.str("description", "")
    if kind == "function":
        t.bool("strict", False)  # every call is held to its schema either way
        return {"description": description, "parameters": t.get("parameters")}, "function"
    if kind != "custom":
        raise BadRequestError(f"'{at}.type' must be \"function\" or \"custom\" inside a namespace, got {_show(kind)}")
    fmt = t.obj("format")
    syntax = fmt.str("type", "text")
    value: dict = {"type": "string"}
    if syntax == "grammar":
        lang = fmt.str("syntax", required=True)
        definition = fmt.str("definition", required=True)
        if lang == "regex":
            # the input string is held to the pattern by the call's JSON schema (llguidance
            # enforces `pattern` over the decoded string; it is anchored here, as a
            # custom tool's regex means the whole input)
            value["pattern"] = f"^(?:{definition})$"
        elif lang == "lark":
            # Not enforced: the call grammar holds the string inside JSON text, and a Lark
            # grammar cannot be embedded there without changing the tools' constraint.
            # The model reads the grammar instead.
            description = f"{description}\n\nThe input follows this Lark grammar:\n{definition}".strip()
        else:
            raise BadRequestError(f"'{at}.format.syntax' must be \"lark\" or \"regex\", got {_show(lang)}")
    elif syntax != "text":
        raise BadRequestError(f"'{at}.format.type' must be \"text\" or \"grammar\", got {_show(syntax)}")
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise BadRequestError(f"'{at}.description' (with its grammar) may hold at most {MAX_DESCRIPTION_CHARS:,} characters")
    schema = {"type": "object", "properties": {"input": value}, "required": ["input"], "additionalProperties": False}
    return {"description": description, "parameters": schema}, "custom"


_TOOL_FIELD = re.compile(r"tools\[(\d+)\]((?:\.function)?(?:\.\w+)?)")


def _relocate(message: str, wheres: list[tuple[str, str]]) -> str:
    """parse_tools names fields of the flattened chat tools (`tools[3].function.name`);
    say where they sit in this request instead (`tools[1].tools[2].name`)."""

    def where(m: re.Match) -> str:
        k = int(m.group(1))
        if k >= len(wheres):
            return m.group(0)
        at, kind = wheres[k]
        field = m.group(2).removeprefix(".function")
        if kind == "custom" and field == ".parameters":
            field = ".format.definition"
        return at + field

    return _TOOL_FIELD.sub(where, message)


def read_tool_choice(b: Body, names: ToolNames) -> tuple[set[str] | None, object]:
    """(the flat names `allowed_tools` lets the model call, None for all; `tool_choice` in
    the chat path's form)."""
    raw = b.get("tool_choice")
    if raw is None or isinstance(raw, str):
        return None, raw
    c = b.obj("tool_choice")
    kind = c.str("type", required=True)
    if kind in ("function", "custom"):
        return None, {"type": "function", "function": {"name": _choose(c, kind, names)}}
    if kind == "allowed_tools":
        mode = c.str("mode", "auto")
        if mode not in ("auto", "required"):
            raise BadRequestError(f"'tool_choice.mode' must be \"auto\" or \"required\", got {_show(mode)}")
        allowed = set()
        for j, entry in enumerate(c.list("tools", required=True, most=MAX_TOOLS)):
            e = _tool_body(entry, f"tool_choice.tools[{j}]")
            if e.str("type", required=True) in ("function", "custom"):
                allowed.add(_choose(e, e.str("type"), names))
        return allowed, mode
    raise BadRequestError(f"'tool_choice' forces the hosted tool {_show(kind)}, which this server does not run")


def _choose(c: Body, kind: str, names: ToolNames) -> str:
    name = c.str("name", required=True)
    ns = c.str("namespace")
    model_name = flat_name(ns, name) if ns else name
    if names.get(model_name, (None,))[0] != kind:
        raise BadRequestError(f"'{c.where}name' names {name!r}, which is not among the {kind} tools")
    return model_name


def read_text_format(b: Body) -> Grammar | None:
    text = b.obj("text")
    text.str("verbosity")  # accepted: a local model has one verbosity
    fmt = text.obj("format")
    kind = fmt.str("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        fmt.str("name"), fmt.bool("strict", False)
        if fmt.get("schema") is None:
            raise BadRequestError("'text.format.schema' is required")
        return schema_grammar(fmt.get("schema"), "text.format.schema")
    raise BadRequestError(f"'text.format.type' must be text, json_object or json_schema, got {_show(kind)}")


# -- the route ---------------------------------------------------------------------------


def prompt_tokens(engine, p: Parsed, name: str) -> list[int]:
    """The prompt; a template that refuses a system message after the first gets them all
    joined at the head."""
    try:
        return chat_tokens(engine, p.messages, p.prompt_tools, name, p.request.template_kwargs)
    except BadRequestError as exc:
        if p.merged is None or not isinstance(exc.__cause__, TemplateRefusal):
            raise
    return chat_tokens(engine, p.merged, p.prompt_tools, name, p.request.template_kwargs)


def _usage(t, thought: int) -> dict:
    return {
        "input_tokens": t.prompt_tokens,
        "input_tokens_details": {"cached_tokens": t.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": t.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": thought},
        "total_tokens": t.prompt_tokens + t.generated_tokens,
    }


async def create_response(request: Request):
    st = state(request)
    b = await st.body(request)
    p = await asyncio.to_thread(read_request, b, st.reasoning)
    streaming = b.bool("stream", False)
    model = await st.manager.get(b.str("model"), b.get("keep_alive"))
    asked_for = b.str("model") or model.name
    tokens = await asyncio.to_thread(prompt_tokens, model.engine, p, asked_for)
    try:
        job = await submit(model, tokens, p.request)
    except ContextExceededError as exc:
        raise ContextExceededError(f"'input' is too long for this model: {exc}") from None
    head = {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "model": model.name, **p.echo}
    reply = Reply(p.names, head)
    thought = 0  # tokens of thinking, for the usage

    if streaming:

        async def body():
            for ev in reply.start():
                yield sse_event(ev)
            nonlocal thought
            try:
                async for ev in events(model, job):
                    thought += reasoning_tokens(ev)
                    for out in reply.feed(ev.text, ev.tool_calls, ev.reasoning):
                        yield sse_event(out)
                    if ev.finish_reason:
                        for out in reply.finish(ev.finish_reason, _usage(ev.timings, thought)):
                            yield sse_event(out)
                        return
            except Exception as exc:  # the stream has begun: report in-band, in the response's shape
                for out in reply.fail(_failure(exc)):
                    yield sse_event(out)

        return stream(request, body(), "text/event-stream", lambda: model.scheduler.cancel(job))

    async def gather() -> dict:
        nonlocal thought
        async for ev in events(model, job):
            thought += reasoning_tokens(ev)
            reply.feed(ev.text, ev.tool_calls, ev.reasoning)
            if ev.finish_reason:
                return reply.finish(ev.finish_reason, _usage(ev.timings, thought))[-1]["response"]
        raise RuntimeError("the generation ended without a last event")

    final = await until_done_or_disconnect(request, gather(), lambda: model.scheduler.cancel(job))
    return JSONResponse(final)


def _failure(exc: Exception) -> str:
    if isinstance(exc, LocalrunError):
        return str(exc)
    log.error("/v1/responses: the generation failed", exc_info=exc)
    return "internal error (see the server log)"


class NotStoredError(LocalrunError):
    http_status = 404


async def stateless(request: Request):
    """GET/DELETE /v1/responses/{id} and its cancel: nothing is ever stored here."""
    raise NotStoredError(
        f"response {request.path_params['rid'][:80]!r} not found: this server is stateless and stores no responses"
    )


ROUTES = [
    Route("/v1/responses", endpoint(create_response), methods=["POST"]),
    Route("/v1/responses/{rid}", endpoint(stateless), methods=["GET", "DELETE"]),
    Route("/v1/responses/{rid}/cancel", endpoint(stateless), methods=["POST"]),
]
