"""The OpenAI Responses API (POST /v1/responses) through the official `openai` SDK's
`client.responses`, against a real `localrun serve`: text answers whole and streamed
(the stream's final response equals `create`'s when greedy), max_output_tokens ending
as `incomplete`, function, namespace and custom tools whose calls validate, a tool
result read back, structured output, the fields Codex and the SDK send, the server's
statelessness, prompt caching, and hostile requests refused quickly in OpenAI's error
shape while another client streams.

One server serves the module: Qwen2.5-Coder-0.5B (a Hermes tools template; ~20 tokens/s
on the test machine, so answers are capped) and SmolLM2-135M for the plain-text checks,
which it decodes several times faster. A test that compares two greedy answers first
puts their prompt in the cache (a one-token request): llama.cpp's logits for a row depend
on how many rows share its batch, so a prompt read whole and one found in the cache can
flip a near-tie (tests/test_server_tools.py says the same)."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx
import jsonschema
import pytest

from serving import Server

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
SMOL = "smollm2-135m-instruct-q4_1"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER,
     "strict": True},
    {"type": "function", "name": "get_time", "description": "The current time in a time zone", "parameters": ZONE},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
ASK = "What is the weather like in Paris today?"
CALL_LIMIT = 40  # tokens: a bounded call of these tools needs about 25
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(qwen_coder_gguf, smollm2_gguf):
    srv = Server("--model", str(qwen_coder_gguf), "--model", str(smollm2_gguf), "--ctx", "4096", "--parallel", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def streamed(oai, **ask):
    """(the stream's events, its final response) through the SDK's own accumulation."""
    with oai.responses.stream(**ask) as stream:
        evs = list(stream)
        return evs, stream.get_final_response()


def items(response) -> list[dict]:
    """The output items without their random ids, to compare two answers."""
    out = []
    for item in response.output:
        d = item.model_dump(exclude_none=True)
        for key in ("id", "call_id", "parsed_arguments"):  # random ids; the SDK's parse of a strict tool's call
            d.pop(key, None)
        out.append(d)
    return out


def valid_calls(response, names=tuple(SCHEMAS)) -> list[tuple[str, dict]]:
    """(name, arguments) of the function_call items, each checked against its tool's schema."""
    calls = [o for o in response.output if o.type == "function_call"]
    assert calls, f"no function_call in {response.output}"
    out = []
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        assert call.name in names
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.name])
        out.append((call.name, arguments))
    return out


# -- text ------------------------------------------------------------------------------


def test_string_input_answers_with_a_full_response_object(oai):
    r = oai.responses.create(model=SMOL, input="Say hello.", max_output_tokens=16, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == SMOL
    assert r.status in ("completed", "incomplete") and r.error is None
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text and r.output_text == message.content[0].text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 16 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 16 and r.temperature == 0 and r.tools == [] and r.tool_choice == "auto"


def test_items_with_instructions_and_a_developer_message(oai):
    r = oai.responses.create(
        model=SMOL, instructions="You are a terse math tutor.", max_output_tokens=12, **GREEDY,
        input=[
            {"role": "developer", "content": "Answer with a number only."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 1 + 1?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "2"}]},
            {"role": "user", "content": "What is 2 + 2?"},
        ],
    )
    assert r.output_text and r.instructions == "You are a terse math tutor."
    # the prompt is the chat route's for the same turns, with the instructions and the
    # developer message as one leading system message
    chat = oai.chat.completions.create(model=SMOL, max_tokens=1, **GREEDY, messages=[
        {"role": "system", "content": "You are a terse math tutor.\n\nAnswer with a number only."},
        {"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"},
        {"role": "user", "content": "What is 2 + 2?"}])
    assert chat.usage.prompt_tokens == r.usage.input_tokens


def test_stream_equals_create_when_greedy(oai):
    ask = dict(model=SMOL, input="Name one colour. Answer with one word.", max_output_tokens=8, **GREEDY)
    oai.responses.create(**{**ask, "max_output_tokens": 1})
    whole = oai.responses.create(**ask)
    evs, final = streamed(oai, **ask)
    assert items(final) == items(whole) and final.output_text == whole.output_text
    assert final.status == whole.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == whole.output_text


def test_max_output_tokens_ends_incomplete_whole_and_streamed(oai, server):
    ask = dict(model=SMOL, input="Write a long story about a dragon.", max_output_tokens=4, **GREEDY)
    r = oai.responses.create(**ask)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete"
    evs = list(oai.responses.create(**ask, stream=True))
    assert evs[-1].type == "response.incomplete"
    assert evs[-1].response.incomplete_details.reason == "max_output_tokens"
    assert evs[-1].response.output_text == r.output_text
    # OpenAI's wire format: each event named, its data carrying the same type
    raw = httpx.post(server.url + "/v1/responses", json={**ask, "stream": True}, timeout=60).text
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(re.fullmatch(r"event: ([a-z_.]+)\ndata: (.*)", b, re.S) for b in blocks)
    assert all(json.loads(b.split("data: ", 1)[1])["type"] == b.split("\n")[0][7:] for b in blocks)


def test_accepted_fields_and_a_cached_second_request(oai):
    ask = dict(
        model=SMOL, input="Tell me a fact about the moon.", max_output_tokens=4, **GREEDY,
        store=True, include=["reasoning.encrypted_content"], reasoning={"effort": "low", "summary": "auto"},
        prompt_cache_key="session-1", metadata={"who": "test"}, user="u1", safety_identifier="s1",
        service_tier="auto", truncation="disabled", parallel_tool_calls=False, top_p=0.9,
        text={"format": {"type": "text"}, "verbosity": "low"},
        extra_body={"client_metadata": {"a": "b"}, "some_future_field": {"x": 1}, "top_k": 40, "lookup": False},
    )
    first = oai.responses.create(**ask)
    second = oai.responses.create(**ask)
    assert first.status == second.status == "incomplete" and second.output_text == first.output_text
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.store is True and second.metadata == {"who": "test"} and second.top_p == 0.9


def test_previous_response_id_and_background_are_clear_400s(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=SMOL, input="hi", previous_response_id="resp_123")
    assert "stateless" in err.value.message and "previous_response_id" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=SMOL, input="hi", background=True)
    assert "background" in err.value.message
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_123")


def test_bad_items_are_400s_naming_the_field(oai):
    import openai

    cases = [
        ([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image",
                                                                                "image_url": "data:,"}]}],
         "'input[0].content[1]'", "text only"),
        ([{"role": "user", "content": [{"type": "input_text", "text": 3}]}], "'input[0].content[0].text'", "string"),
        ([{"role": "robot", "content": "hi"}], "'input[0].role'", "developer"),
        ([{"type": "function_call_output", "output": "x"}], "'input[0].call_id'", "required"),
    ]
    for given, field, says in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oai.responses.create(model=SMOL, input=given)
        assert field in err.value.message and says in err.value.message, err.value.message


def test_an_image_in_a_tool_output_is_left_out_not_refused(oai):
    """Codex's view_image answers with an image part: the session must go on."""
    call = {"type": "function_call", "call_id": "call_1", "name": "view_image", "arguments": "{}"}
    image = {"type": "function_call_output", "call_id": "call_1",
             "output": [{"type": "input_image", "image_url": "data:,"}]}
    r = oai.responses.create(model=SMOL, input=[{"role": "user", "content": "Look."}, call, image],
                             max_output_tokens=2, temperature=0)
    assert r.status in ("completed", "incomplete")


def test_a_prompt_over_the_context_is_a_400_naming_the_counts(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=SMOL, input="word " * 5000, max_output_tokens=4)
    assert re.search(r"has \d+ tokens but the context holds 4096", err.value.message), err.value.message


# -- tools -------------------------------------------------------------------------------


def test_required_calls_whole_and_streamed_agree(oai):
    ask = dict(model=QWEN, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=CALL_LIMIT, **GREEDY)
    oai.responses.create(**{**ask, "max_output_tokens": 1})
    whole = oai.responses.create(**ask)
    assert whole.status == "completed" and all(o.type == "function_call" for o in whole.output)
    calls = valid_calls(whole)
    evs, final = streamed(oai, **ask)
    assert valid_calls(final) == calls and items(final) == items(whole)
    added = [e.item for e in evs if e.type == "response.output_item.added"]
    assert all(a.type == "function_call" and a.arguments == "" for a in added)
    for item in final.output:
        deltas = [e.delta for e in evs if e.type == "response.function_call_arguments.delta" and e.item_id == item.id]
        (done,) = [e for e in evs if e.type == "response.function_call_arguments.done" and e.item_id == item.id]
        assert "".join(deltas) == done.arguments == item.arguments


def test_named_function_without_parallel_calls(oai):
    r = oai.responses.create(model=QWEN, input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                             parallel_tool_calls=False, max_output_tokens=CALL_LIMIT, **GREEDY)
    assert [name for name, _ in valid_calls(r)] == ["get_time"]


def test_allowed_tools_limits_the_calls_but_not_the_prompt(oai):
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    r = oai.responses.create(model=QWEN, input=ASK, tools=TOOLS, tool_choice=allowed, parallel_tool_calls=False,
                             max_output_tokens=CALL_LIMIT, **GREEDY)
    assert [name for name, _ in valid_calls(r)] == ["get_time"]
    free = oai.responses.create(model=QWEN, input=ASK, tools=TOOLS, max_output_tokens=1, **GREEDY)
    assert free.usage.input_tokens == r.usage.input_tokens  # every tool is still shown


def test_a_tool_result_is_read_back_and_renders_as_the_chat_route_does(oai):
    """A function_call and its function_call_output make the same prompt as the chat
    route's assistant tool_calls + tool message; the answer reads the result."""
    result = '{"temperature_c": 18, "sky": "sunny"}'
    history = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": result}]},
    ]
    r = oai.responses.create(model=QWEN, input=history, tools=TOOLS, tool_choice="none", max_output_tokens=32,
                             **GREEDY)
    assert [o.type for o in r.output] == ["message"] and "18" in r.output_text
    chat = oai.chat.completions.create(
        model=QWEN, max_tokens=1, **GREEDY,
        tools=[{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
               for t in TOOLS],
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": result}],
    )
    assert chat.usage.prompt_tokens == r.usage.input_tokens


def test_a_namespace_tool_is_called_and_mapped_back(oai):
    tools = [{"type": "namespace", "name": "clock", "description": "Clocks around the world",
              "tools": [{"type": "function", "name": "get_time", "description": "The current time in a time zone",
                         "parameters": ZONE}]},
             {"type": "web_search"}]  # a hosted tool: left out, never refused
    ask = dict(model=QWEN, input="What time is it in Tokyo?", tools=tools, max_output_tokens=CALL_LIMIT, **GREEDY,
               tool_choice={"type": "function", "name": "get_time", "namespace": "clock"})
    r = oai.responses.create(**ask)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_time" and call.namespace == "clock"
    jsonschema.validate(json.loads(call.arguments), ZONE)
    # sent back as history under its namespace, the call renders as the model made it:
    # the prompt equals the chat route's with the flattened name
    history = [{"role": "user", "content": "What time is it in Tokyo?"},
               {"type": "function_call", "call_id": call.call_id, "name": "get_time", "namespace": "clock",
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "It is 09:41 in Tokyo."}]
    again = oai.responses.create(model=QWEN, input=history, tools=tools, tool_choice="none", max_output_tokens=1,
                                 **GREEDY)
    chat = oai.chat.completions.create(
        model=QWEN, max_tokens=1, **GREEDY,
        tools=[{"type": "function", "function": {"name": "clock__get_time", "description": tools[0]["tools"][0][
            "description"], "parameters": ZONE}}],
        messages=[{"role": "user", "content": "What time is it in Tokyo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": "clock__get_time", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "It is 09:41 in Tokyo."}])
    assert chat.usage.prompt_tokens == again.usage.input_tokens


def test_a_custom_tool_gets_its_input_as_a_string_whole_and_streamed(oai):
    tools = [{"type": "custom", "name": "shout", "description": "Shout a text in capitals"}]
    ask = dict(model=QWEN, input="Shout: good morning, everyone!", tools=tools,
               tool_choice={"type": "custom", "name": "shout"}, max_output_tokens=CALL_LIMIT, **GREEDY)
    oai.responses.create(**{**ask, "max_output_tokens": 1})
    whole = oai.responses.create(**ask)
    (call,) = whole.output
    assert call.type == "custom_tool_call" and call.name == "shout" and call.id.startswith("ctc_")
    assert isinstance(call.input, str) and call.input.strip()
    evs, final = streamed(oai, **ask)
    assert items(final) == items(whole)
    deltas = [e.delta for e in evs if e.type == "response.custom_tool_call_input.delta"]
    (done,) = [e for e in evs if e.type == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done.input == call.input


def test_a_custom_tool_with_a_regex_grammar_gets_matching_input(oai):
    pattern = "(low|medium|high)-[0-9]"
    tools = [{"type": "custom", "name": "set_priority", "description": "Set a bug's priority",
              "format": {"type": "grammar", "syntax": "regex", "definition": pattern}}]
    r = oai.responses.create(model=QWEN, input="The app crashes on start. Set its priority.", tools=tools,
                             tool_choice="required", max_output_tokens=CALL_LIMIT, **GREEDY)
    (call,) = r.output
    assert call.type == "custom_tool_call" and re.fullmatch(pattern, call.input), call.input


def test_a_custom_tool_with_a_lark_grammar_is_accepted(oai):
    """Lark grammars are shown to the model, not enforced (see responses_api.py)."""
    tools = [{"type": "custom", "name": "say", "description": "Say a greeting",
              "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "hi" | "hello"'}}]
    r = oai.responses.create(model=QWEN, input="Greet me.", tools=tools, tool_choice="required",
                             max_output_tokens=CALL_LIMIT, **GREEDY)
    assert r.output[0].type == "custom_tool_call" and isinstance(r.output[0].input, str)


def test_json_schema_text_format_gives_valid_json(oai):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
              "required": ["capital"], "additionalProperties": False}
    r = oai.responses.create(model=QWEN, input="What is the capital of France? Answer in JSON.", max_output_tokens=40,
                             text={"format": {"type": "json_schema", "name": "capital", "schema": schema,
                                              "strict": True}}, **GREEDY)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_only_hosted_tools_is_a_plain_answer(oai):
    r = oai.responses.create(model=SMOL, input="Say hi.", tools=[{"type": "web_search"}, {"type": "code_interpreter",
                             "container": {"type": "auto"}}], max_output_tokens=6, **GREEDY)
    assert r.output[0].type == "message" and r.output_text


def test_a_codex_shaped_request_streams_in_openais_event_sequence(server):
    """The fields Codex CLI sends (`wire_api = "responses"`): long instructions, a
    developer message, function tools with strict false, its freeform apply_patch tool (a
    Lark grammar), a hosted web_search, reasoning settings, include, store false."""
    body = {
        "model": QWEN, "instructions": "You are a coding agent running in a terminal.", "stream": True,
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                                          "text": "Sandbox: read-only."}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
                   "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {
                       "type": "string"}}}, "required": ["command"], "additionalProperties": False}},
                  {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
                   "format": {"type": "grammar", "syntax": "lark",
                              "definition": 'start: "*** Begin Patch" LF "*** End Patch" LF?\nLF: "\\n"'}},
                  {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-session",
        "text": {"verbosity": "medium"}, "max_output_tokens": 24, "temperature": 0,
    }
    kinds, last = [], None
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
                kinds.append(last["type"])
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert last["type"] in ("response.completed", "response.incomplete") and kinds.count(last["type"]) == 1
    response = last["response"]
    assert response["usage"]["input_tokens"] > 0 and response["usage"]["output_tokens"] > 0
    assert response["output"] and all(o["type"] in ("message", "function_call", "custom_tool_call")
                                      for o in response["output"])
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(
        response["output"])


def test_a_later_system_message_joins_the_first_when_the_template_refuses_it():
    """Many templates take one leading system message only; a developer message later in
    `input` then joins it rather than failing the request."""
    from localrun.prompt import chat_template
    from localrun.server.fields import Body
    from localrun.server.responses_api import prompt_tokens, read_request

    strict = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
              "{{ raise_exception('System role must be first') }}{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")

    class Engine:
        tools = None

        def chat_prompt(self, messages, tools=(), template_kwargs=None):
            self.text = chat_template.render(strict, messages, "", "", False, **(template_kwargs or {}))
            return [1]

    engine = Engine()
    p = read_request(Body({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"}, {"role": "developer", "content": "Use French."},
        {"role": "user", "content": "again"}]}))
    prompt_tokens(engine, p, "m")
    assert engine.text == "[system] Be brief.\n\nUse French.\n[user] hi\n[user] again\n"


def test_mlx_forced_function_call_validates(smollm2_mlx, tmp_path):
    """The same route on the MLX backend: SmolLM2 (MLX) under a Hermes tools template."""
    from test_tool_calls_models import HERMES_CHATML, SHORT

    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_CHATML)
    srv = Server("--model", str(smollm2_mlx), "--chat-template", str(template), "--ctx", "1024")
    try:
        import openai

        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        tools = [{"type": "function", "name": "get_weather", "parameters": SHORT}]
        r = client.responses.create(model=smollm2_mlx.name, input=ASK, tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=40, **GREEDY)
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SHORT)
    finally:
        srv.stop()


def test_custom_input_decodes_across_any_fragment_boundary():
    """A custom call's input streams as decoded text however its JSON-string arguments are
    cut: escapes and surrogate pairs split across fragments, and a lone surrogate is U+FFFD."""
    from localrun.server.responses_items import InputText

    rng = random.Random(7)
    cases = [(json.dumps({"input": s}, ensure_ascii=a), s) for s in
             ['*** Begin Patch\n+ x = "y\\n"\n', "caf\u00e9 \U0001f600 \u2028 \\u0041 \t/", ""] for a in (True, False)]
    cases += [('{"input": "a\\ud83dxy"}', "a\ufffdxy"), ('{"input": "\\ud83d\\u0041"}', "\ufffdA"),
              ('{"input": "\\ud83d"}', "\ufffd")]
    for text, want in cases:
        for _ in range(60):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(8, len(text)))))
            decoder = InputText()
            pieces = [decoder.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert "".join(pieces) == decoder.value() == want, (text, cuts)


# -- hostile requests while another client streams ---------------------------------------

ATTACK_WAIT_S = 10.0  # generous for a loaded 2-core machine
VICTIM = {"model": SMOL, "input": "Write a long story about a lighthouse keeper and the sea.",
          "max_output_tokens": 48, "temperature": 0, "lookup": False, "stream": True}


def stream_victim(url: str, out: dict, started: threading.Event) -> None:
    parts = []
    with httpx.stream("POST", url + "/v1/responses", json=VICTIM, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "response.failed":
                out["error"] = ev["response"]["error"]
            if ev["type"] == "response.output_text.delta":
                parts.append(ev["delta"])
                if len(parts) >= 2:
                    started.set()
    out["text"] = "".join(parts)
    started.set()


@pytest.fixture(scope="module")
def baseline(server) -> str:
    httpx.post(server.url + "/v1/responses", json={**VICTIM, "stream": False, "max_output_tokens": 1}, timeout=60)
    out: dict = {}
    stream_victim(server.url, out, threading.Event())
    assert "error" not in out and out["text"]
    return out["text"]


def nested(depth: int):
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


ATTACKS = {
    "100,000 input items": {"input": [{"role": "user", "content": "hi"}] * 100_000},
    "10,000 tools": {"input": "hi", "tools": [{"type": "function", "name": f"t{i}"} for i in range(10_000)]},
    "a namespace of 10,000 tools": {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "description": "",
                                                              "tools": [{"type": "function", "name": f"t{i}"}
                                                                        for i in range(10_000)]}]},
    "arguments that are not JSON": {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                               "arguments": "{not json" * 1000}]},
    "an unknown item type": {"input": [{"type": "telepathy", "content": "hi"}]},
    "deeply nested content": {"input": [{"role": "user", "content": [{"type": "input_text", "text": nested(500)}]}]},
    # deeper than any JSON library nests (written by hand: json.dumps would recurse too)
    "content nested past the parser": (
        f'{{"model": "{SMOL}", "input": [{{"role": "user", "content": ' + "[" * 100_000 + '"x"' + "]" * 100_000 + "}]}"
    ),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_hostile_request_is_refused_while_a_victim_streams(server, baseline, name):
    out: dict = {}
    started = threading.Event()
    victim = threading.Thread(target=stream_victim, args=(server.url, out, started))
    victim.start()
    assert started.wait(60), "the victim never started streaming"
    t0 = time.monotonic()
    attack = ATTACKS[name]
    if isinstance(attack, str):
        resp = httpx.post(server.url + "/v1/responses", content=attack, timeout=60,
                          headers={"content-type": "application/json"})
    else:
        resp = httpx.post(server.url + "/v1/responses", json={"model": SMOL, **attack}, timeout=60)
    elapsed = time.monotonic() - t0
    victim.join(120)
    assert elapsed < ATTACK_WAIT_S, f"the attack took {elapsed:.1f} s"
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]  # OpenAI's shape
    assert error["type"] == "invalid_request_error" and error["message"] and "Traceback" not in resp.text
    assert "error" not in out, out.get("error")
    assert out["text"] == baseline, "the victim's answer changed under the attack"
    assert server.proc.poll() is None, server.output()
