"""Tool calls through `localrun serve`, against the official `openai` and `ollama` clients
and a real tools model: Qwen2.5-Coder-0.5B-Instruct, whose template renders `tools` and
calls as Hermes' `<tool_call>` JSON.

Every call a client gets must validate against its tool's JSON schema: at temperature 0,
in seeded runs at temperature 1.0, streamed and whole, for every `tool_choice`. Streamed
deltas join to the same calls as the whole answer; a tool result goes back to the model;
bad tool requests are 400s naming the field; a model whose template has no tools gets
Ollama's text, and `--chat-template` gives such a model one.

One server (Qwen, plus SmolLM2, whose template has no tools) serves the module; Qwen
decodes ~20 tokens/s on the test machine, so answers are capped and schemas bounded."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from gguf import GGUFReader

from serving import Server

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
SMOL = "smollm2-135m-instruct-q4_1"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 40}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}


def function_tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [
    function_tool("get_weather", "The current weather in a city", WEATHER_SCHEMA),
    function_tool("get_time", "The current time in a time zone", TIME_SCHEMA),
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL_LIMIT = 96  # tokens: a bounded call of these tools needs about 30
# llama.cpp's logits for a row depend on how many rows share its batch, so a near-tie can
# flip between a prompt read whole and one found in the cache: a test that compares two
# greedy answers first puts their prompt in the cache (a one-token request), so both
# answers decode from the same state
WARM = {"max_tokens": 1}
# Ollama has no tool_choice: a system line makes the call the greedy answer
CALL_ASK = [{"role": "system", "content": "You answer by calling the tools."}, *ASK]


@pytest.fixture(scope="module")
def server(qwen_coder_gguf, smollm2_gguf):
    srv = Server("--model", str(qwen_coder_gguf), "--model", str(smollm2_gguf), "--ctx", "2048", "--parallel", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai", reason="the openai client is a test extra")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def olm(server):
    ollama = pytest.importorskip("ollama", reason="the ollama client is a test extra")
    return ollama.Client(host=server.url)


def valid_openai_calls(calls, names=tuple(SCHEMAS)) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI tool calls, each checked: an id, a declared tool, and
    arguments that are JSON text validating against that tool's schema."""
    assert calls, "the answer made no tool call"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


# -- OpenAI ----------------------------------------------------------------------------


def test_required_call_whole_and_streamed_agree(oai):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    ask = dict(model=QWEN, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=CALL_LIMIT)
    oai.chat.completions.create(**{**ask, **WARM})
    whole = oai.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content is None  # the answer is only calls
    calls = valid_openai_calls(whole.message.tool_calls)

    chunks = list(oai.chat.completions.create(**ask, stream=True))
    state = ChatCompletionStreamState(input_tools=TOOLS)  # the SDK's own accumulation
    for chunk in chunks:
        state.handle_chunk(chunk)
    joined = state.get_final_completion().choices[0]
    assert valid_openai_calls(joined.message.tool_calls) == calls
    assert joined.finish_reason == "tool_calls"

    # the wire shape: a call's first delta names it with empty arguments, later ones carry
    # only argument fragments, and no delta carries the model's markup as content
    entries = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    firsts = [e for e in entries if e.id is not None]
    assert [e.index for e in firsts] == list(range(len(calls)))
    for e in firsts:
        assert e.type == "function" and e.function.name and e.function.arguments == ""
    assert all(e.function.name is None for e in entries if e.id is None)
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_named_tool_without_parallel_calls_gives_exactly_that_call(oai):
    r = oai.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, temperature=0, max_tokens=CALL_LIMIT,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False,
    ).choices[0]
    assert r.finish_reason == "tool_calls"
    assert [name for name, _ in valid_openai_calls(r.message.tool_calls)] == ["get_time"]


def test_none_never_calls(oai):
    r = oai.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
    ).choices[0]
    assert r.message.tool_calls is None and r.message.content
    assert r.finish_reason in ("stop", "length") and "<tool_call>" not in r.message.content


def test_auto_answers_with_valid_calls_or_text(oai):
    r = oai.chat.completions.create(model=QWEN, messages=ASK, tools=TOOLS, temperature=0, max_tokens=CALL_LIMIT)
    choice = r.choices[0]
    if choice.message.tool_calls:
        valid_openai_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_required_calls_validate(oai, seed):
    r = oai.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
        max_tokens=CALL_LIMIT, parallel_tool_calls=False,  # one call: sampled, the model may repeat calls
    ).choices[0]
    assert r.finish_reason == "tool_calls"
    valid_openai_calls(r.message.tool_calls)


def test_sampled_named_calls_validate_streamed(oai):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in oai.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, temperature=1.0, seed=7, max_tokens=CALL_LIMIT, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
    ):
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert [name for name, _ in valid_openai_calls(final.message.tool_calls)] == ["get_weather"]


def test_pydantic_tool_parses_whole_and_streamed(oai):
    import openai
    import pydantic

    class GetWeather(pydantic.BaseModel):
        """The current weather in a city."""

        city: str
        unit: Literal["celsius", "fahrenheit"]

    ask = dict(model=QWEN, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
               temperature=0, max_tokens=CALL_LIMIT)
    oai.chat.completions.create(**{**ask, **WARM})
    parsed = oai.chat.completions.parse(**ask).choices[0].message.tool_calls
    assert parsed and all(isinstance(c.function.parsed_arguments, GetWeather) for c in parsed)
    with oai.chat.completions.stream(**ask) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert [c.function.parsed_arguments for c in streamed] == [c.function.parsed_arguments for c in parsed]


def test_tool_result_round_trip(oai):
    """A call and its result in the history render alike with the arguments as JSON text
    (OpenAI's form) or as an object (what llama-server accepts): the second prompt is
    found whole in the cache the first left. The answer reads the result."""
    result = {"role": "tool", "tool_call_id": "call_" + "0" * 24, "content": '{"temperature_c": 18, "sky": "sunny"}'}

    def ask(arguments, max_tokens: int):
        call = {"id": result["tool_call_id"], "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}
        messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, result]
        return oai.chat.completions.create(model=QWEN, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=max_tokens)

    as_text = ask('{"city": "Paris"}', 32)
    as_object = ask({"city": "Paris"}, 1)
    assert as_object.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_object.usage.prompt_tokens_details.cached_tokens >= as_text.usage.prompt_tokens - 1
    answer = as_text.choices[0].message
    assert answer.tool_calls is None and "18" in answer.content


def test_props_reports_tool_capabilities(server):
    caps = httpx.get(server.url + "/props", timeout=60).json()["chat_template_caps"]  # the first --model: Qwen
    assert caps["supports_tools"] is True and caps["supports_tool_calls"] is True


# -- Ollama ----------------------------------------------------------------------------


def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
      city: the city's name
    """
    return "18 °C, sunny"


def test_ollama_python_function_tool_whole_streamed_and_round_trip(olm):
    asked = CALL_ASK
    options = {"temperature": 0, "num_predict": CALL_LIMIT}
    olm.chat(model=QWEN, messages=asked, tools=[get_weather], options={**options, "num_predict": 1})  # see WARM
    answer = olm.chat(model=QWEN, messages=asked, tools=[get_weather], options=options)
    calls = answer.message.tool_calls
    assert calls and [c.function.name for c in calls] == ["get_weather"] * len(calls)
    assert isinstance(calls[0].function.arguments, dict) and isinstance(calls[0].function.arguments["city"], str)

    parts = list(olm.chat(model=QWEN, messages=asked, tools=[get_weather], stream=True, options=options))
    with_calls = [p for p in parts if p.message.tool_calls]
    assert all(len(p.message.tool_calls) == 1 for p in with_calls)  # each call whole, in a chunk of its own
    assert [p.message.tool_calls[0].function for p in with_calls] == [c.function for c in calls]
    assert parts[-1].done and parts[-1].done_reason == "stop"

    # the result goes back as Ollama's role "tool" with tool_name; asked without tools, the
    # model can only answer, and the answer reads the result
    result = {"role": "tool", "tool_name": "get_weather", "content": get_weather(**calls[0].function.arguments)}
    reply = olm.chat(model=QWEN, messages=[*ASK, answer.message, result], options={"temperature": 0, "num_predict": 32})
    assert not reply.message.tool_calls and "18" in reply.message.content


# Ollama has no tool_choice, so a sampled answer may be text (seed 4 writes its call out as
# text): these seeds call, 12 both tools, and every call must come
@pytest.mark.parametrize("seed", [5, 12])
def test_ollama_sampled_calls_validate(olm, seed):
    r = olm.chat(model=QWEN, messages=CALL_ASK, tools=TOOLS,
                 options={"temperature": 1.0, "seed": seed, "num_predict": CALL_LIMIT})
    assert r.message.tool_calls, f"seed {seed} made no tool call: {r.message.content!r}"
    for call in r.message.tool_calls:
        jsonschema.validate(dict(call.function.arguments), SCHEMAS[call.function.name])


def test_show_lists_tools_only_for_a_tools_template(olm):
    assert olm.show(QWEN).capabilities == ["completion", "tools", "insert"]  # Qwen-Coder also has FIM tokens
    assert olm.show(SMOL).capabilities == ["completion"]


def test_model_without_tools_gets_ollamas_400(oai, olm):
    import ollama
    import openai

    with pytest.raises(ollama.ResponseError) as raised:
        olm.chat(model=SMOL, messages=ASK, tools=[get_weather])
    assert raised.value.status_code == 400 and raised.value.error == f"{SMOL} does not support tools"
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS)
    assert f"{SMOL} does not support tools" in str(refused.value)


# -- bad requests ----------------------------------------------------------------------

CHAT = "/v1/chat/completions"
UNCOMPILABLE = function_tool("f", "", {"type": "object", "properties": {"a": {"type": "x"}}})
BAD_HISTORY = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]


@pytest.mark.parametrize(
    "path, changes, named",
    [
        (CHAT, {"tools": [UNCOMPILABLE]}, "tools[0].function.parameters"),
        (CHAT, {"tools": [function_tool("get weather!", "", WEATHER_SCHEMA)]}, "tools[0].function.name"),
        (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"tools": TOOLS, "grammar": 'root ::= "a"'}, "'grammar' cannot be combined with 'tools'"),
        (CHAT, {"tools": TOOLS, "response_format": {"type": "json_object"}},
         "'response_format' cannot be combined with 'tools'"),
        (CHAT, {"tools": TOOLS, "json_schema": WEATHER_SCHEMA}, "'json_schema' cannot be combined with 'tools'"),
        ("/api/chat", {"tools": TOOLS, "format": "json", "stream": False}, "'format' cannot be combined with 'tools'"),
        (CHAT, {"tools": TOOLS, "messages": BAD_HISTORY}, "messages[1].tool_calls[0].function.arguments"),
        ("/api/chat", {"tools": TOOLS, "messages": BAD_HISTORY, "stream": False},
         "messages[1].tool_calls[0].function.arguments"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server, path, changes, named):
    r = httpx.post(server.url + path, json={"model": QWEN, "messages": ASK, **changes}, timeout=60)
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"] if path.startswith("/v1") else body["error"]
    assert named in message


# -- a template given on the command line ----------------------------------------------


def test_chat_template_flag_gives_a_model_tools(smollm2_gguf, qwen_coder_gguf, tmp_path):
    """SmolLM2 speaks ChatML like Qwen, so Qwen's tools template fits it: served with
    --chat-template, it lists "tools" and its calls are held to the schemas."""
    template = GGUFReader(str(qwen_coder_gguf)).fields["tokenizer.chat_template"].contents()
    path = tmp_path / "tools.jinja"
    path.write_text(template)
    srv = Server("--model", str(smollm2_gguf), "--chat-template", str(path), "--ctx", "1024", "--parallel", "1")
    try:
        show = httpx.post(srv.url + "/api/show", json={"model": SMOL}, timeout=60).json()
        assert "tools" in show["capabilities"] and show["template"] == template
        body = {"model": SMOL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
                "max_tokens": CALL_LIMIT, "parallel_tool_calls": False}  # SmolLM2 would repeat its call
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        assert r["finish_reason"] == "tool_calls" and len(r["message"]["tool_calls"]) == 1
        call = r["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    finally:
        srv.stop()
