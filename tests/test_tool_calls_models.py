"""Tool calls on real models: Qwen2.5-Coder-0.5B with its own tools template (Hermes
`<tool_call>` format), and SmolLM2 on both backends given a tools template with
`--chat-template`. Every call that comes out must parse and validate against its tool's
schema (jsonschema), whatever the sampler draws. Kept short: Qwen decodes ~20 tok/s here,
MLX ~5."""

from __future__ import annotations

import jsonschema
import pytest

from localrun.engine import Engine
from localrun.request import GenerationRequest
from localrun.sampling import SamplingParams
from localrun.tools import collect_calls

GREEDY = SamplingParams(temperature=0)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "alerts": {"type": "boolean"},
    },
    "required": ["city"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def qwen(qwen_coder_gguf):
    with Engine.open(qwen_coder_gguf, n_ctx=1024) as eng:
        yield eng


def answer(engine, messages=ASK, **options):
    """(content, calls, last event) of one streamed answer."""
    options.setdefault("sampling", GREEDY)
    events = list(engine.chat(messages, tools=TOOLS, **options))
    deltas = [d for e in events for d in (e.tool_calls or [])]
    return "".join(e.text for e in events), collect_calls(deltas), events[-1]


def assert_valid(calls):
    for call in calls:
        assert call.name in SCHEMAS and call.id.startswith("call_")
        jsonschema.validate(call.arguments_obj(), SCHEMAS[call.name])


def test_qwen_has_a_hermes_tools_template(qwen):
    assert qwen.supports_tools and qwen.tool_format.name == "hermes"
    prompt = qwen.detokenize(qwen.chat_prompt(ASK, tools=TOOLS))
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt


def test_required_call_validates_and_streams_like_the_whole_answer(qwen):
    text, calls, last = answer(qwen, tool_choice="required", max_tokens=60)
    assert text == "" and last.finish_reason == "tool_calls" and len(calls) >= 1
    assert_valid(calls)
    whole = qwen.complete(qwen.chat_prompt(ASK, tools=TOOLS), tools=TOOLS, tool_choice="required",
                          max_tokens=60, sampling=GREEDY)
    assert whole.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [(c.name, c.arguments) for c in calls]


def test_named_tool_is_called_even_when_the_question_is_about_another(qwen):
    _, calls, last = answer(qwen, tool_choice={"type": "function", "function": {"name": "add"}},
                            parallel_tool_calls=False, max_tokens=40)
    assert [c.name for c in calls] == ["add"] and last.finish_reason == "tool_calls"
    assert_valid(calls)


def test_parallel_false_allows_one_call(qwen):
    two = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    _, calls, last = answer(qwen, two, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    assert len(calls) == 1 and last.finish_reason == "tool_calls"
    assert_valid(calls)


def test_none_never_calls(qwen):
    """The same question under "required" calls at once; under "none" the trigger is
    banned, so whatever Qwen writes is content without a call's markup."""
    text, calls, last = answer(qwen, tool_choice="none", max_tokens=24)
    assert calls == [] and "<tool_call>" not in text and last.finish_reason in ("stop", "length")


def test_auto_calls_hold_to_the_schema_and_content_has_no_markup(qwen):
    ask = [{"role": "user", "content": "Call get_weather for Tokyo."}]
    text, calls, last = answer(qwen, ask, max_tokens=60)
    assert "<tool_call>" not in text and "</tool_call>" not in text
    assert calls and last.finish_reason == "tool_calls"
    assert_valid(calls)


def test_sampled_calls_validate_for_every_seed(qwen):
    """Temperature 1.0 over the whole vocabulary (no top-k, so every step takes the full
    mask): ten seeds, ten valid calls."""
    prompt = qwen.chat_prompt(ASK, tools=TOOLS)
    for seed in range(10):
        sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        req = GenerationRequest(sampling=sampling, tools=TOOLS, tool_choice="required", max_tokens=80,
                                parallel_tool_calls=False)
        done = qwen.complete(prompt, req)
        assert done.finish_reason == "tool_calls", (seed, done)
        assert len(done.tool_calls) == 1
        assert_valid(done.tool_calls)


def test_a_tool_result_round_trips(qwen):
    """History with the call (OpenAI's shape, arguments as text) and its result renders
    through Qwen's template; the model then answers in text."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    prompt = qwen.detokenize(qwen.chat_prompt(history, tools=TOOLS))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n{\"temperature\": 21" in prompt
    text, calls, _ = answer(qwen, history, tool_choice="none", max_tokens=20)
    assert text.strip() and calls == []


# -- SmolLM2 with a tools template, on both backends -------------------------------------

HERMES_CHATML = """{%- if tools %}<|im_start|>system
You can call these functions:
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Call one like this:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
SHORT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


@pytest.fixture(scope="module", params=["llama.cpp", "mlx"])
def smol_with_tools(request, tmp_path_factory):
    path = request.getfixturevalue("smollm2_gguf" if request.param == "llama.cpp" else "smollm2_mlx")
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_CHATML)
    with Engine.open(path, n_ctx=512, chat_template=template) as eng:
        if request.param == "mlx":
            # MLX's CPU build steps ~2.5x faster in float32 than with the f16 weights as
            # shipped; the calls' grammar and parsing do not depend on the weights' type
            import mlx.core as mx

            eng.backend.model.set_dtype(mx.float32)
        yield eng


def test_required_call_validates_on_both_backends(smol_with_tools):
    eng = smol_with_tools
    assert eng.tool_format.name == "hermes"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SHORT}}]
    events = list(eng.chat(ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
                           sampling=GREEDY, max_tokens=40))
    (call,) = collect_calls(d for e in events for d in (e.tool_calls or []))
    assert call.name == "get_weather" and events[-1].finish_reason == "tool_calls"
    jsonschema.validate(call.arguments_obj(), SHORT)
    assert "".join(e.text for e in events) == ""


FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed, chain", [
    (0, {}),  # the default chain, top-k 40 first: the mask checks only the ranked head
    (1, dict(top_k=0, top_p=1.0, min_p=0.0)),  # the whole vocabulary: the full mask
    (2, dict(top_k=0, top_p=1.0, min_p=0.0)),
])
def test_sampled_calls_validate_on_both_backends(smol_with_tools, seed, chain):
    """Temperature 0.8, three seeds, a call required: every answer is one call that parses
    and validates against its tool's schema (a length cap that "San Francisco" exceeds, an
    integer range, an enum, every property required, no others), whatever the seed draws.
    Three seeds, because on MLX a call costs ~10 s here (~40 tokens at ~4 tok/s)."""
    eng = smol_with_tools
    tools = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}}]
    ask = [{"role": "user", "content": "What will the weather be like in San Francisco over the next few days?"}]
    req = GenerationRequest(sampling=SamplingParams(temperature=0.8, seed=seed, **chain), tools=tools,
                            tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    done = eng.complete(eng.chat_prompt(ask, tools=tools), req)
    assert done.finish_reason == "tool_calls" and done.text == "", (seed, done)
    (call,) = done.tool_calls
    assert call.name == "get_forecast"
    jsonschema.validate(call.arguments_obj(), FORECAST)
