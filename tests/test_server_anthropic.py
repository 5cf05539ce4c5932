"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through
`localrun serve`, against the official `anthropic` SDK: whole and streamed answers (the
SDK's accumulated stream equals the whole answer when greedy), stop reasons, usage with
the prompt cache, tools (every tool_use validates against its input_schema), a tool
result round trip, the fields Claude Code sends (accepted, never refused), errors in
Anthropic's shape, and hostile bodies refused while a victim streams.

One server for the module: Qwen2.5-Coder-0.5B (a real Hermes tools template) answers,
SmolLM2 is the default model the attack victim streams from. Qwen decodes ~20 tokens/s
on the test machine, so answers are a few tokens long."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import anthropic
import httpx
import jsonschema
import pytest

from test_server_tools import TIME_SCHEMA, WEATHER_SCHEMA  # the same two tools as the OpenAI tests
from serving import Server
from test_server_attacks import stream_victim, under_attack
from test_tool_calls_models import HERMES_CHATML


QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
CTX = 4096
# the SDK (2.x) no longer takes sampling parameters as arguments; the body still may
GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
TOOLS = [
    {"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "description": "The current time in a time zone", "input_schema": TIME_SCHEMA},
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# Input schemas as Claude Code writes them (zod-to-json-schema: `$schema`, closed objects;
# zod 4: draft 2020-12, `propertyNames` on records, integer bounds) and as MCP servers do
# (`uniqueItems`, formats llguidance does not know): the reader relaxes what llguidance
# cannot enforce instead of refusing the request.
D7, D2020 = "http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft/2020-12/schema"
S = {"type": "string"}


def closed(props: dict, required: list, dialect: str = D7) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False, "$schema": dialect}


CLAUDE_CODE_TOOLS = [
    {"name": "Bash", "description": "Executes a bash command.", "input_schema": closed(
        {"command": S, "timeout": {"type": "number"}, "description": S, "run_in_background": {"type": "boolean"}},
        ["command"])},
    {"name": "Read", "description": "Reads a file.", "input_schema": closed(
        {"file_path": S, "offset": {"type": "number"}, "limit": {"type": "number"}}, ["file_path"])},
    {"name": "Grep", "description": "Searches files.", "input_schema": closed(
        {"pattern": S, "path": S, "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
         "-A": {"type": "number"}, "-n": {"type": "boolean"}, "head_limit": {"type": "number"}}, ["pattern"])},
    {"name": "TodoWrite", "description": "Updates the todo list.", "input_schema": closed({"todos": {
        "type": "array", "items": {"type": "object", "properties": {
            "content": {"type": "string", "minLength": 1},
            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
            "activeForm": {"type": "string", "minLength": 1}},
            "required": ["content", "status", "activeForm"], "additionalProperties": False}}}, ["todos"])},
    {"name": "WebFetch", "description": "Fetches a URL.", "input_schema": closed(
        {"url": {"type": "string", "format": "uri"}, "prompt": S}, ["url", "prompt"])},
    {"name": "Task", "description": "Starts a sub-agent.", "input_schema": closed(
        {"description": S, "prompt": S, "subagent_type": S, "env": {"type": "object", "propertyNames": S,
                                                                  "additionalProperties": S}},
        ["description", "prompt", "subagent_type"], D2020)},
    {"name": "mcp__ide__getDiagnostics", "description": "Diagnostics from the IDE.", "input_schema": closed(
        {"uri": {"type": "string", "format": "uri-reference"},
         "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991},
         "tags": {"type": "array", "items": S, "uniqueItems": True}}, [], D2020)},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},  # a server tool: left out
]
CLAUDE_CODE_FIELDS = {  # what Claude Code sends besides model, messages, system, tools, max_tokens
    "metadata": {"user_id": "user_abc_account_def_session_123"},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "service_tier": "auto",
    "a_field_from_next_year": {"x": [1, 2]},
}
CLAUDE_CODE_SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
     "cache_control": {"type": "ephemeral"}},
]


@pytest.fixture(scope="module")
def server(smollm2_gguf, qwen_coder_gguf):
    # SmolLM2 first: the default model, which the attack victim streams from
    srv = Server("--model", str(smollm2_gguf), "--model", str(qwen_coder_gguf), "--ctx", str(CTX), "--parallel", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def greedy(kw: dict) -> dict:
    return {"model": QWEN, "max_tokens": 24, **kw, "extra_body": {**GREEDY, **kw.get("extra_body", {})}}


def create(client, **kw):
    return client.messages.create(**greedy(kw))


def streamed(client, **kw):
    with client.messages.stream(**greedy(kw)) as s:
        return s.get_final_message()


def warm(client, **kw) -> None:
    """llama.cpp's logits for a row depend on how many rows share its batch, so a near-tie
    can flip between a prompt read whole and one found in the cache: two greedy answers
    that are compared decode from the same cached prompt (see test_server_tools.WARM)."""
    create(client, **{**kw, "max_tokens": 1})


def blocks(message) -> list[dict]:
    """A message's content without the tool_use ids (fresh per answer)."""
    return [{k: v for k, v in b.model_dump().items() if k != "id" and v is not None} for b in message.content]


def test_create_and_stream_agree_when_greedy(client):
    ask = [{"role": "user", "content": "Name three colors of the rainbow."}]
    warm(client, messages=ask)
    whole = create(client, messages=ask, max_tokens=12)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == QWEN and whole.stop_reason in ("end_turn", "max_tokens")
    (block,) = whole.content
    assert block.type == "text" and block.text.strip()
    assert whole.usage.output_tokens > 0 and whole.usage.cache_creation_input_tokens == 0
    final = streamed(client, messages=ask, max_tokens=12)
    assert blocks(final) == blocks(whole)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_stop_sequence_and_max_tokens_reasons(client):
    ask = [{"role": "user", "content": "Count from 1 to 10, separated by commas. Only the numbers."}]
    whole = create(client, messages=ask, stop_sequences=["zzz", "5"], max_tokens=20)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "5")
    assert "5" not in whole.content[0].text and "4" in whole.content[0].text
    final = streamed(client, messages=ask, stop_sequences=["zzz", "5"], max_tokens=20)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "5")
    short = create(client, messages=ask, max_tokens=3)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)


def test_system_blocks_cache_reads_and_count_tokens(client):
    body = {"system": CLAUDE_CODE_SYSTEM, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>The date is 2026-01-01.</system-reminder>"},
        {"type": "text", "text": "Say hello.", "cache_control": {"type": "ephemeral"}}]}]}
    first = create(client, **body, max_tokens=2)
    again = create(client, **body, max_tokens=2)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens < first.usage.input_tokens + first.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model=QWEN, **body).input_tokens
    for m in (first, again):
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted


def test_a_system_message_inside_messages_joins_the_user_turn_before_it(client):
    """Claude Code 2.1 sends instructions as a `system` message after the user's turn."""
    split = [{"role": "user", "content": "Say hello."}, {"role": "system", "content": "Answer in French."}]
    joined = [{"role": "user", "content": "Say hello.\n\nAnswer in French."}]
    count = lambda msgs: client.messages.count_tokens(model=QWEN, system="Be brief.", messages=msgs).input_tokens
    assert count(split) == count(joined)
    alone = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hello."}]
    assert count(alone) > count([alone[1]])  # no user turn before it: it stands as a system message
    assert create(client, messages=split, max_tokens=2).content


def test_an_image_in_a_tool_result_is_left_out_not_refused(client):
    """Claude Code's Read of a picture returns an image block: the session must go on."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    turn = [{"role": "user", "content": "Look at a.png"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]}]
    with_image = turn + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [image]}]}]
    said = turn + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                 "content": "[image left out: this server reads text only]"}]}]
    count = lambda msgs: client.messages.count_tokens(model=QWEN, tools=TOOLS, messages=msgs).input_tokens
    assert count(with_image) == count(said)


def tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def test_forced_tool_use_validates_and_streams_equal(client):
    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
          "max_tokens": 40}
    warm(client, **kw)
    whole = create(client, **kw)
    (call,) = tool_uses(whole)  # one call: "any" without parallel calls
    assert whole.stop_reason == "tool_use" and call.id.startswith("toolu_")
    assert all(b.type == "tool_use" for b in whole.content), "no empty text block before the call"
    jsonschema.validate(call.input, SCHEMAS[call.name])
    final = streamed(client, **kw)
    assert blocks(final) == blocks(whole) and final.stop_reason == "tool_use"


def test_streamed_named_tool_use_events(server):
    """The raw event sequence for a named tool: message_start, one tool_use block whose
    partial_json fragments join to an input that validates, message_delta with
    stop_reason tool_use, message_stop; each event's name is its data's type."""
    body = {"model": QWEN, "max_tokens": 40, "stream": True, "temperature": 0, "messages": ASK, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}}
    names, parts, start = [], [], None
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    for name_line, data_line in zip(lines[::2], lines[1::2]):
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        names.append(name)
        if name == "content_block_start":
            start = data
        if name == "content_block_delta":
            assert data["index"] == 0 and data["delta"]["type"] == "input_json_delta"
            parts.append(data["delta"]["partial_json"])
        if name == "message_delta":
            assert data["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
            assert data["usage"]["output_tokens"] > 0
    assert [n for n in names if n != "ping"] == (
        ["message_start", "content_block_start"] + ["content_block_delta"] * len(parts)
        + ["content_block_stop", "message_delta", "message_stop"])
    assert start["index"] == 0 and start["content_block"]["name"] == "get_time"
    assert start["content_block"]["id"].startswith("toolu_") and start["content_block"]["input"] == {}
    jsonschema.validate(json.loads("".join(parts)), TIME_SCHEMA)


def test_tool_result_round_trip(client):
    history = ASK + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": '{"temperature": 21, "sky": "sunny"}'}]},
            {"type": "text", "text": "Answer in one sentence."}]},
    ]
    answer = create(client, messages=history, tools=TOOLS, max_tokens=8)
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()
    counted = client.messages.count_tokens(model=QWEN, messages=history, tools=TOOLS).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted


def test_claude_code_request_is_accepted(client):
    """Claude Code's shape: system blocks, reminders in user blocks, its tools' schemas
    (relaxed where llguidance cannot enforce them; a server tool left out), thinking,
    context_management, output_config, metadata, an unknown field, a beta header, and
    llama-server sampler fields; max_tokens 32000 is capped to the context, never refused."""
    body = {"system": CLAUDE_CODE_SYSTEM, "tools": CLAUDE_CODE_TOOLS,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Use the tools.</system-reminder>"},
                {"type": "text", "text": "Read the file README.md", "cache_control": {"type": "ephemeral"}}]}]}
    extra = {**CLAUDE_CODE_FIELDS, "repeat_penalty": 1.0, "min_p": 0.0, "lookup": False}
    counted = client.messages.count_tokens(model=QWEN, **body, extra_body=extra).input_tokens
    assert counted > 200
    # one call and then the end of the turn: max_tokens 32000 costs nothing more here
    forced = create(client, **body, extra_body=extra, max_tokens=32000,
                    tool_choice={"type": "tool", "name": "Read", "disable_parallel_tool_use": True},
                    extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14", "anthropic-version": "2023-06-01"})
    (call,) = tool_uses(forced)
    assert call.name == "Read" and forced.stop_reason == "tool_use"
    jsonschema.validate(call.input, CLAUDE_CODE_TOOLS[1]["input_schema"])
    assert forced.usage.input_tokens + forced.usage.cache_read_input_tokens == counted


def test_hang_up_cancels_the_job(client, server):
    """A client that closes a stream (max_tokens 32000, the whole context) frees its slot."""
    smol = "smollm2-135m-instruct-q4_1"
    ask = [{"role": "user", "content": "Write a long story about the sea."}]
    with client.messages.stream(**greedy({"model": smol, "max_tokens": 32000, "messages": ask})) as s:
        first = next(e for e in s if e.type == "message_start")
        assert first.message.usage.input_tokens > 0 and first.message.model == smol
        next(e for e in s if e.type == "content_block_delta")
    deadline = time.monotonic() + 10
    while any(slot["is_processing"] for slot in httpx.get(server.url + "/slots").json()):
        assert time.monotonic() < deadline, "the hung-up stream's job still holds its slot"
        time.sleep(0.1)


def test_errors_in_anthropic_shape(client):
    def refused(exc_type, **kw) -> str:
        with pytest.raises(exc_type) as info:
            create(client, **kw)
        error = info.value.body["error"]
        assert info.value.body["type"] == "error" and error["type"] == {
            anthropic.BadRequestError: "invalid_request_error", anthropic.NotFoundError: "not_found_error"}[exc_type]
        return error["message"]

    assert "'max_tokens' is required" in refused(anthropic.BadRequestError, messages=ASK, max_tokens=anthropic.NOT_GIVEN)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    message = refused(anthropic.BadRequestError, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, image]}])
    assert message == "'messages[0].content[1]': image blocks are not supported: this server reads text only"
    assert "'tool_choice.type'" in refused(anthropic.BadRequestError, messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "sometimes"})
    assert "'tool_choice.name'" in refused(anthropic.BadRequestError, messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "tool", "name": "launch"})
    assert "'thinking.type'" in refused(anthropic.BadRequestError, messages=ASK, thinking={"type": "deep"})
    refused(anthropic.NotFoundError, messages=ASK, model="claude-opus-9-nonexistent")
    long = [{"role": "user", "content": "lighthouse " * (CTX + 500)}]
    assert refused(anthropic.BadRequestError, messages=long).startswith("prompt is too long: ")
    assert f"> {CTX - 1} maximum" in refused(anthropic.BadRequestError, messages=long)


def test_pings_while_nothing_else_is_sent(monkeypatch):
    """A long prompt produces no event for a minute on a CPU: the stream pings meanwhile."""
    from localrun.server import anthropic_stream

    monkeypatch.setattr(anthropic_stream, "PING_S", 0.05)

    async def slow():
        await asyncio.sleep(0.22)
        yield "first"
        yield "second"

    async def run():
        return [x async for x in anthropic_stream._with_pings(slow())]

    got = asyncio.run(run())
    assert got[-2:] == ["first", "second"] and set(got[:-2]) == {None} and len(got) >= 3


def test_an_error_after_the_stream_began_is_an_error_event():
    from localrun.errors import DecodeError
    from localrun.server.anthropic_stream import error_event

    name, data = error_event(DecodeError("llama_decode failed")).decode().split("\n", 1)
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "llama_decode failed"}}


def test_forced_tool_use_on_mlx(smollm2_mlx, tmp_path):
    """The same request on the MLX backend: SmolLM2 under a Hermes tools template."""
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_CHATML)
    srv = Server("--model", str(smollm2_mlx), "--chat-template", str(template), "--ctx", "512", "--parallel", "1")
    try:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        mlx = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
        # one short argument: MLX decodes SmolLM2 at a few tokens/s on the test machine's CPU
        answer = create(mlx, model=name, messages=ASK, tools=[{"name": "get_weather", "input_schema": CITY}],
                        max_tokens=40, tool_choice={"type": "any", "disable_parallel_tool_use": True})
        (call,) = tool_uses(answer)
        assert call.name == "get_weather" and answer.stop_reason == "tool_use"
        jsonschema.validate(call.input, CITY)
    finally:
        srv.stop()


# -- hostile bodies, while a victim streams from the same server ------------------------


def _messages(body: dict):
    return lambda url: httpx.post(url + "/v1/messages", json={"model": QWEN, "max_tokens": 4, **body}, timeout=60)


ATTACKS = {
    "100,000 messages": _messages({"messages": [{"role": "user", "content": "hi"}] * 100_000}),
    "100,000 content blocks": _messages({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}] * 100_000}]}),
    "a tool_result nested in a tool_result": _messages({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x"}] * 1000}] * 200}]}]}),
    "10,000 tools": _messages({"messages": ASK, "tools": [
        {"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(10_000)]}),
    "a tool_use input that is not an object": _messages({"messages": ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": "Paris"}]}]}),
    "a tool_use input nested 500 deep": _messages({"messages": ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": json.loads('{"a":' * 500 + "1" + "}" * 500)}]}]}),
    "an unknown block type": _messages({"messages": [{"role": "user", "content": [{"type": "hologram", "data": "x"}]}]}),
    "1,000,000 stop sequences": _messages({"messages": ASK, "stop_sequences": ["s"] * 1_000_000}),
    "an unknown thinking.display": _messages({"messages": ASK, "thinking": {"type": "adaptive", "display": "all"}}),
    "a 9 MB thinking signature": _messages({"messages": ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "", "signature": "localrun-thinking." + "QUFB" * 2_400_000}]},
        {"role": "user", "content": "hi"}]}),
    "a count_tokens of 100,000 messages": lambda url: httpx.post(
        url + "/v1/messages/count_tokens", json={"model": QWEN, "messages": [{"role": "user", "content": "hi"}] * 100_000},
        timeout=60),
}


def test_hostile_bodies_are_refused_while_a_victim_streams(server):
    baseline: dict = {}
    stream_victim(server.url, baseline, threading.Event())
    assert "error" not in baseline and baseline["text"]
    answers = {}

    def attack(url):
        for name, send in ATTACKS.items():
            t0 = time.monotonic()
            answers[name] = (send(url), time.monotonic() - t0)

    under_attack(server, baseline["text"], attack)
    for name, (resp, took) in answers.items():
        assert 400 <= resp.status_code < 500, f"{name}: {resp.status_code} {resp.text[:200]}"
        body = resp.json()
        assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "request_too_large"), name
        assert took < 3, f"{name} took {took:.1f} s"
