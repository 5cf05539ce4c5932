"""Tool calling without a model: parsing and bounds, history, format detection, the
stream parser on literal texts, the call grammar, and the engine on the scripted
backend (byte vocabulary: every constraint decision is visible byte by byte)."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from localrun.prompt.chat_template import MAX_TEMPLATE_FILE_BYTES, load_template_file
from localrun.engine import Engine
from localrun.errors import BadRequestError
from localrun.grammar.core import Grammar
from localrun.grammar.matcher import GrammarMatcher
from localrun.grammar.tokenizer import build_tokenizer
from localrun.request import GenerationRequest
from localrun.sampling import SamplingParams
from localrun.tools import (
    GENERIC, HERMES, LLAMA3, MAX_TOOLS, MISTRAL, CallStream, Tool, ToolChoice, ToolsUnsupportedError,
    call_grammar, collect_calls, detect_format, history_messages, parse_tool_choice, parse_tools,
)

from fakes import ScriptedBackend, text_script

GREEDY = SamplingParams(temperature=0)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
RAW_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

# The shape of Qwen2.5's template: reads `tools`, writes past calls as <tool_call> blocks.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Answer with <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
W_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
A_CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


# -- parsing and bounds ------------------------------------------------------------------


def test_parse_tools_reads_openai_form():
    tools = parse_tools(RAW_TOOLS, "tools")
    assert [t.name for t in tools] == ["get_weather", "add"]
    assert tools[0].parameters == WEATHER and tools[0].description == "Weather in a city"
    assert tools[0].template_dict() == RAW_TOOLS[0]
    # no parameters: a call with no arguments
    (bare,) = parse_tools([{"type": "function", "function": {"name": "now"}}], "tools")
    assert bare.parameters == {"type": "object", "properties": {}}
    assert parse_tools(None, "tools") == ()


@pytest.mark.parametrize(
    "raw, field",
    [
        ("get_weather", "'tools' must be a list"),
        ([{"type": "code", "function": {"name": "x"}}], "'tools[0].type'"),
        ([{"type": "function"}], "'tools[0].function'"),
        ([{"type": "function", "function": {"name": "bad name"}}], "'tools[0].function.name'"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "'tools[0].function.name'"),
        ([{"type": "function", "function": {"name": 'a"b'}}], "'tools[0].function.name'"),
        ([{"type": "function", "function": {"name": "x", "description": 3}}], "'tools[0].function.description'"),
        ([{"type": "function", "function": {"name": "x", "parameters": []}}], "'tools[0].function.parameters'"),
        ([{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}],
         "'tools[0].function.parameters' must describe an object"),
        ([RAW_TOOLS[0], RAW_TOOLS[0]], "'tools[1].function.name' 'get_weather' repeats tools[0]"),
    ],
)
def test_parse_tools_names_the_bad_field(raw, field):
    with pytest.raises(BadRequestError) as exc:
        parse_tools(raw, "tools")
    assert field in str(exc.value)


def test_a_schema_llguidance_cannot_compile_is_a_400_naming_it():
    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    raw = [RAW_TOOLS[0], {"type": "function", "function": {"name": "x", "parameters": bad}}]
    with pytest.raises(BadRequestError, match=r"^'tools\[1\]\.function\.parameters' cannot be enforced: "):
        parse_tools(raw, "tools")


def test_tool_bounds():
    many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(MAX_TOOLS + 1)]
    with pytest.raises(BadRequestError, match=f"at most {MAX_TOOLS} tools"):
        parse_tools(many, "tools")
    assert len(parse_tools(many[:MAX_TOOLS], "tools")) == MAX_TOOLS
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(70)}}
    with pytest.raises(BadRequestError, match=r"'tools\[0\]\.function\.parameters' is .* bytes of JSON; the limit is 65,536"):
        parse_tools([{"type": "function", "function": {"name": "big", "parameters": big}}], "tools")
    # five schemas of ~60 KiB pass one by one, not together (256 KiB for all)
    near = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(58)}}
    five = [{"type": "function", "function": {"name": f"t{i}", "parameters": near}} for i in range(5)]
    with pytest.raises(BadRequestError, match=r"add up to over 262,144 bytes .* by tools\[4\]"):
        parse_tools(five, "tools")
    long_text = {"type": "function", "function": {"name": "x", "description": "d" * 40_000}}
    with pytest.raises(BadRequestError, match="description' may hold at most 32,768"):
        parse_tools([long_text], "tools")


def test_parse_tool_choice_forms():
    tools = parse_tools(RAW_TOOLS, "tools")
    assert parse_tool_choice(None, tools, "tool_choice") == ToolChoice("auto")
    assert parse_tool_choice(None, (), "tool_choice") is None
    for mode in ("auto", "none", "required"):
        assert parse_tool_choice(mode, tools, "tool_choice") == ToolChoice(mode)
    named = {"type": "function", "function": {"name": "add"}}
    assert parse_tool_choice(named, tools, "tool_choice") == ToolChoice("named", "add")


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"type": "function", "function": {"name": "nope"}}, "'tool_choice' names 'nope', which is not among the tools"),
        ("always", "'tool_choice' must be"),
        ({"type": "allowed_tools"}, "'tool_choice' as an object must be"),
        (3, "'tool_choice' must be a string or an object"),
    ],
)
def test_bad_tool_choice_is_a_400_naming_it(raw, match):
    with pytest.raises(BadRequestError, match=match):
        parse_tool_choice(raw, parse_tools(RAW_TOOLS, "tools"), "tool_choice")


def test_required_without_tools_is_refused():
    with pytest.raises(BadRequestError, match="needs 'tools'"):
        parse_tool_choice("required", (), "tool_choice")


def test_request_takes_tools_and_refuses_them_with_a_grammar():
    req = GenerationRequest(tools=RAW_TOOLS)
    assert [t.name for t in req.tools] == ["get_weather", "add"] and req.tool_choice == ToolChoice("auto")
    assert GenerationRequest(tools=RAW_TOOLS) == req  # parsed tools compare equal
    assert GenerationRequest.of(tools=RAW_TOOLS, tool_choice="required").tool_choice == ToolChoice("required")
    with pytest.raises(BadRequestError, match="'grammar' cannot be combined with 'tools'"):
        GenerationRequest(tools=RAW_TOOLS, grammar=Grammar.json_object())
    with pytest.raises(BadRequestError, match="parallel_tool_calls must be true or false"):
        GenerationRequest(tools=RAW_TOOLS, parallel_tool_calls="no")
    with pytest.raises(BadRequestError, match="not among the tools"):
        GenerationRequest(tools=RAW_TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})


# -- history ---------------------------------------------------------------------------


def test_history_openai_and_ollama_shapes_become_the_templates():
    openai = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    ollama = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_name": "add", "content": "5"},
    ]
    got = history_messages(openai)
    assert got[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert got[2] == {"role": "tool", "tool_call_id": "call_1", "content": "5", "name": "add"}
    assert history_messages(got) == got  # normalising twice changes nothing
    assert history_messages(ollama)[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert history_messages(ollama)[2] == {"role": "tool", "content": "5", "name": "add"}
    plain = [{"role": "user", "content": "hi"}]
    assert history_messages(plain) == plain


@pytest.mark.parametrize(
    "call, field",
    [
        ({"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}},
         "'messages[1].tool_calls[0].function.arguments' is not valid JSON"),
        ({"function": {"name": "add", "arguments": [1, 2]}}, "'messages[1].tool_calls[0].function.arguments' must be"),
        ({"function": {"arguments": {}}}, "'messages[1].tool_calls[0].function.name'"),
        ("add(1, 2)", "'messages[1].tool_calls[0]' must be an object"),
    ],
)
def test_malformed_history_is_a_400_naming_the_field(call, field):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(BadRequestError) as exc:
        history_messages(messages)
    assert str(exc.value).startswith(field)


# -- formats -----------------------------------------------------------------------------

LLAMA31_SNIPPET = (
    "{%- if tools %}<|start_header_id|>user<|end_header_id|>Given the following functions, respond with a JSON for a"
    ' function call: {"name": function name, "parameters": dictionary of argument name and its value}'
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}<|python_tag|>"
)


def test_detect_format_from_template_markers():
    assert detect_format(HERMES_TEMPLATE) == HERMES
    assert detect_format("{% for t in tools %}{{ t | tojson }}{% endfor %}[TOOL_CALLS]") == MISTRAL
    assert detect_format(LLAMA31_SNIPPET) == LLAMA3
    assert detect_format("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}") == GENERIC
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None  # never reads tools
    assert detect_format(None) is None
    qwen3 = HERMES_TEMPLATE + "{% if reasoning %}<think>{{ reasoning }}</think>{% endif %}"
    assert detect_format(qwen3).think and detect_format(qwen3).name == "hermes"
    assert HERMES.markers == ("<tool_call>", "</tool_call>") and MISTRAL.markers == ("[TOOL_CALLS]",)


# -- the stream parser on literal texts --------------------------------------------------


def parse_all(fmt, pieces, trigger_is_token=False):
    s = CallStream(fmt, trigger_is_token)
    text, deltas = [], []
    for p in pieces:
        t, d = s.feed(p)
        text.append(t)
        deltas += d
    text.append(s.flush())
    return "".join(text), deltas


HERMES_ANSWER = f"Let me check.\n<tool_call>\n{W_CALL}\n</tool_call>\n<tool_call>\n{A_CALL}\n</tool_call>"
CASES = {
    "hermes": (HERMES, HERMES_ANSWER),
    "hermes bare": (HERMES, f"\n{W_CALL}\n{A_CALL}"),
    "hermes fenced": (HERMES, f"```json\n{W_CALL}\n{A_CALL}\n```"),
    "mistral": (MISTRAL, f"[TOOL_CALLS][{W_CALL}, {A_CALL}]"),
    "llama3": (LLAMA3, "\n" + W_CALL.replace('"arguments"', '"parameters"') + "\n" + A_CALL.replace('"arguments"', '"parameters"')),
    "generic": (GENERIC, f"{W_CALL}\n{A_CALL}"),
}


@pytest.mark.parametrize("name", CASES)
def test_stream_parser_splits_content_and_calls_at_every_cut(name):
    fmt, answer = CASES[name]
    want_text = "Let me check.\n" if answer.startswith("Let") else ""
    want = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    for cut in range(len(answer) + 1):
        text, deltas = parse_all(fmt, [answer[:cut], answer[cut:]])
        assert text == want_text, cut
        calls = collect_calls(deltas)
        assert [(c.name, c.arguments_obj()) for c in calls] == want, cut
    # token by token (here: character by character)
    text, deltas = parse_all(fmt, list(answer))
    assert text == want_text
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in firsts] == [(0, "get_weather"), (1, "add")]
    assert all(d.id.startswith("call_") and len(d.id) == 29 for d in firsts)
    assert all(d.name is None for d in deltas if d.id is None)
    # the name arrives before any argument of its call
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name is not None
        assert "".join(d.arguments for d in mine) == json.dumps(want[index][1])


def test_markup_never_reaches_the_content():
    text, deltas = parse_all(HERMES, list(HERMES_ANSWER))
    assert "<tool" not in text and "{" not in text and len(collect_calls(deltas)) == 2


def test_an_unfinished_trigger_is_content_after_all():
    assert parse_all(HERMES, ["a <tool", "_c"]) == ("a <tool_c", [])
    assert parse_all(HERMES, ["x < y and <tool>"]) == ("x < y and <tool>", [])
    # bare calls open the answer: text that does not open with "{" stays text, braces included
    assert parse_all(GENERIC, ["  hello {", "x}"]) == ("  hello {x}", [])
    assert parse_all(GENERIC, ["   "]) == ("   ", [])
    assert parse_all(HERMES, ["``", "`json\n", "[1, 2]\n```"]) == ("```json\n[1, 2]\n```", [])
    assert parse_all(HERMES, ["``", "`py"]) == ("```py", [])
    assert parse_all(HERMES, [" ```json"]) == (" ```json", [])


def test_a_control_token_trigger_is_reported_as_a_marker():
    s = CallStream(MISTRAL, trigger_is_token=True)
    assert s.feed("Sure [TOOL_CALLS] is text here") == ("Sure [TOOL_CALLS] is text here", [])
    assert s.feed_marker("[TOOL_CALLS]") == ("", [])
    _, deltas = s.feed(f"[{A_CALL}]")
    assert [(c.name, c.arguments) for c in collect_calls(deltas)] == [("add", '{"a": 1, "b": 2}')]


def test_argument_text_is_kept_verbatim():
    weird = '{"name": "f", "arguments": {"s": "a}\\"{[", "n": [1, {"x": null}], "e": "\\u00e9"}}'
    _, deltas = parse_all(GENERIC, list(weird))
    (call,) = collect_calls(deltas)
    assert call.arguments == '{"s": "a}\\"{[", "n": [1, {"x": null}], "e": "\\u00e9"}'
    assert call.arguments_obj() == {"s": 'a}"{[', "n": [1, {"x": None}], "e": "é"}


# -- the call grammar (on the scripted backend's byte vocabulary) ------------------------


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer(ScriptedBackend())


def allows(grammar, tok, text: str) -> bool:
    m = GrammarMatcher(grammar, tok)
    for b in text.encode():
        if not m.allows(b):
            return False
        m.accept(b)
    return m.is_accepting()


def test_hermes_grammar_per_choice(byte_tok):
    tools = parse_tools(RAW_TOOLS, "tools")
    one = f"<tool_call>\n{W_CALL}\n</tool_call>"
    two = f"<tool_call>\n{W_CALL}\n</tool_call>\n<tool_call>\n{A_CALL}\n</tool_call>"
    bad_args = '<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'
    g = {c: call_grammar(HERMES, tools, ToolChoice(c)) for c in ("auto", "required", "none")}
    named = call_grammar(HERMES, tools, ToolChoice("named", "add"))
    single = call_grammar(HERMES, tools, ToolChoice("auto"), parallel=False)
    assert allows(g["auto"], byte_tok, "Hello") and allows(g["auto"], byte_tok, "Hi\n" + two)
    assert not allows(g["auto"], byte_tok, bad_args) and not allows(g["auto"], byte_tok, unknown)
    assert not allows(g["auto"], byte_tok, one + " and text after")  # after the calls: EOS only
    assert not allows(g["auto"], byte_tok, "a <tool_call> is mentioned")  # the trigger starts a call
    assert not allows(g["required"], byte_tok, "Hello") and allows(g["required"], byte_tok, two)
    assert allows(g["none"], byte_tok, "Hello <tool_c>") and not allows(g["none"], byte_tok, one)
    assert allows(named, byte_tok, f"<tool_call>\n{A_CALL}\n</tool_call>") and not allows(named, byte_tok, one)
    assert allows(single, byte_tok, one) and not allows(single, byte_tok, two)
    # bare calls at the start of the answer, as small models write them, held to the schema too
    assert allows(g["auto"], byte_tok, f"{W_CALL}\n{A_CALL}") and allows(g["auto"], byte_tok, f"```json\n{W_CALL}\n```")
    assert allows(g["auto"], byte_tok, f"\n```json\n{W_CALL}\n{A_CALL}\n```")
    assert not allows(g["auto"], byte_tok, '{"name": "rm"}') and not allows(g["auto"], byte_tok, "```json\n{}\n```")
    assert allows(g["auto"], byte_tok, "```json\n[1]\n```") and allows(g["auto"], byte_tok, "Text, then {braces}")
    assert not allows(single, byte_tok, f"{W_CALL}\n{A_CALL}")


def test_thinking_may_come_before_a_required_call(byte_tok):
    qwen3 = detect_format(HERMES_TEMPLATE + "<think>")
    g = call_grammar(qwen3, parse_tools(RAW_TOOLS, "tools"), ToolChoice("required"))
    assert allows(g, byte_tok, f"<think>\nweather, so get_weather\n</think>\n\n<tool_call>\n{W_CALL}\n</tool_call>")
    assert allows(g, byte_tok, f"<tool_call>\n{W_CALL}\n</tool_call>")
    assert not allows(g, byte_tok, f"no thinking tags\n<tool_call>\n{W_CALL}\n</tool_call>")


@pytest.mark.parametrize("fmt", [MISTRAL, LLAMA3, GENERIC], ids=lambda f: f.name)
def test_other_formats_grammar(fmt, byte_tok):
    tools = parse_tools(RAW_TOOLS, "tools")
    w, a = (c.replace('"arguments"', f'"{fmt.args_key}"') for c in (W_CALL, A_CALL))
    calls = fmt.trigger + fmt.head + w + fmt.separator + a + fmt.tail if fmt.trigger else f"{w}\n{a}"
    auto, none, required = (call_grammar(fmt, tools, ToolChoice(c)) for c in ("auto", "none", "required"))
    assert allows(auto, byte_tok, "Plain answer.") and allows(auto, byte_tok, calls)
    assert allows(required, byte_tok, calls) and not allows(required, byte_tok, "Plain answer.")
    assert allows(none, byte_tok, "Plain answer.")
    assert not allows(auto, byte_tok, calls.replace('"a": 1', '"a": "one"'))
    if fmt.trigger:  # "none" bans the trigger; a bare-call format's JSON is just text there
        assert not allows(none, byte_tok, calls)


# -- the engine on the scripted backend --------------------------------------------------


def tool_engine(answer: bytes, template: str = HERMES_TEMPLATE, **kw) -> Engine:
    return Engine(ScriptedBackend(text_script(answer), n_ctx=2048, n_batch=512, **kw), chat_template=template)


def chat(eng: Engine, **options):
    options.setdefault("sampling", GREEDY)
    options.setdefault("lookup", False)
    events = list(eng.chat([{"role": "user", "content": "weather in Paris?"}], tools=RAW_TOOLS, **options))
    deltas = [d for e in events for d in (e.tool_calls or [])]
    return "".join(e.text for e in events), collect_calls(deltas), events


def test_engine_streams_content_then_calls():
    eng = tool_engine(f"Checking.\n<tool_call>\n{W_CALL}\n</tool_call>".encode())
    text, calls, events = chat(eng)
    assert text == "Checking.\n"
    assert [(c.name, c.arguments_obj()) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert events[-1].finish_reason == "tool_calls"
    assert all("<tool_call>" not in e.text for e in events)
    # the same answer, not streamed
    eng = tool_engine(f"Checking.\n<tool_call>\n{W_CALL}\n</tool_call>".encode())
    done = eng.complete(eng.chat_prompt([{"role": "user", "content": "weather in Paris?"}], tools=RAW_TOOLS),
                        tools=RAW_TOOLS, sampling=GREEDY)
    assert done.text == "Checking.\n" and done.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in done.tool_calls] == [(c.name, c.arguments) for c in calls]


def test_a_fenced_json_call_at_the_start_is_a_call():
    """What Qwen2.5-Coder-0.5B writes under "auto" given its Hermes template."""
    eng = tool_engine(f"```json\n{W_CALL}\n```".encode())
    text, calls, events = chat(eng)
    assert text == "" and [c.name for c in calls] == ["get_weather"] and events[-1].finish_reason == "tool_calls"
    text, calls, _ = chat(tool_engine(b"```python\nprint(1)\n```"))
    assert text == "```python\nprint(1)\n```" and calls == []


def test_engine_holds_arguments_to_the_schema():
    """The script writes a unit outside the enum; the grammar steers every byte it
    refuses to an allowed one, and the call that comes out validates."""
    eng = tool_engine(b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}\n</tool_call>')
    _, (call,), events = chat(eng)
    jsonschema.validate(call.arguments_obj(), WEATHER)
    assert call.arguments_obj()["unit"] == "celsius" and events[-1].finish_reason == "tool_calls"


def test_required_forces_a_call_and_none_forbids_one():
    text, calls, _ = chat(tool_engine(b"I would rather chat."), tool_choice="required", max_tokens=200)
    assert text == "" and len(calls) == 1
    jsonschema.validate(calls[0].arguments_obj(), SCHEMAS[calls[0].name])
    text, calls, events = chat(tool_engine(f"<tool_call>\n{W_CALL}\n</tool_call>".encode()), tool_choice="none",
                               max_tokens=40)
    assert calls == [] and "<tool_call>" not in text and events[-1].finish_reason != "tool_calls"


def test_a_named_tool_is_the_one_called():
    eng = tool_engine(f"<tool_call>\n{W_CALL}\n</tool_call>".encode())
    _, calls, _ = chat(eng, tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=200)
    assert calls and {c.name for c in calls} == {"add"}
    for call in calls:
        jsonschema.validate(call.arguments_obj(), ADD)


def test_parallel_false_ends_after_one_call():
    two = f"<tool_call>\n{W_CALL}\n</tool_call>\n<tool_call>\n{A_CALL}\n</tool_call>"
    _, calls, events = chat(tool_engine(two.encode()), parallel_tool_calls=False)
    assert [c.name for c in calls] == ["get_weather"] and events[-1].finish_reason == "tool_calls"
    _, calls, _ = chat(tool_engine(two.encode()))
    assert [c.name for c in calls] == ["get_weather", "add"]


def test_stop_strings_apply_to_content_not_to_calls():
    eng = tool_engine(f"Ok.\n<tool_call>\n{W_CALL}\n</tool_call>".encode())
    text, calls, events = chat(eng, stop=["Paris", "\n</tool_call>"])
    assert text == "Ok.\n" and calls[0].arguments_obj() == {"city": "Paris"}
    assert events[-1].finish_reason == "tool_calls"
    text, calls, events = chat(tool_engine(b"Say Paris then stop"), stop=["Paris"])
    assert text == "Say " and calls == [] and events[-1].finish_reason == "stop"


def test_cut_off_call_finishes_with_length():
    _, _, events = chat(tool_engine(f"<tool_call>\n{W_CALL}\n</tool_call>".encode()), max_tokens=30)
    assert events[-1].finish_reason == "length"


def test_prompt_lookup_drafts_give_the_same_calls():
    # the answer repeats the prompt's own text, so prompt lookup drafts long runs of it
    answer = f"<tool_call>\n{W_CALL}\n</tool_call>\n<tool_call>\n{W_CALL}\n</tool_call>".encode()
    plain = chat(tool_engine(answer))
    drafted_eng = tool_engine(answer)
    drafted = chat(drafted_eng, lookup=True)
    assert drafted[0] == plain[0]
    assert [(c.name, c.arguments) for c in drafted[1]] == [(c.name, c.arguments) for c in plain[1]]
    assert drafted[2][-1].timings.drafted > 0


def test_tools_render_through_the_template():
    eng = tool_engine(b"")
    prompt = eng.detokenize(eng.chat_prompt([{"role": "user", "content": "hi"}], tools=RAW_TOOLS))
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    history = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    prompt = eng.detokenize(eng.chat_prompt(history, tools=RAW_TOOLS))
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt


def test_a_template_without_tools_refuses_them():
    eng = Engine(ScriptedBackend(text_script(b"hi"), n_ctx=512))  # ChatML fallback: no tools
    assert not eng.supports_tools and eng.tool_format is None
    with pytest.raises(ToolsUnsupportedError) as exc:
        eng.chat_prompt([{"role": "user", "content": "hi"}], tools=RAW_TOOLS)
    assert exc.value.for_model("smollm2") == "smollm2 does not support tools"
    assert isinstance(exc.value, BadRequestError)
    with pytest.raises(ToolsUnsupportedError):
        eng.start("hi", GenerationRequest(tools=RAW_TOOLS))


def test_tool_objects_are_checked_too():
    with pytest.raises(BadRequestError, match="tool name"):
        Tool("bad name")
    assert GenerationRequest(tools=(Tool("now"),)).tools[0].parameters == {"type": "object", "properties": {}}


# -- --chat-template FILE ----------------------------------------------------------------


def test_chat_template_file_overrides_the_models(tmp_path):
    path = tmp_path / "tools.jinja"
    path.write_text(HERMES_TEMPLATE)
    assert load_template_file(path) == HERMES_TEMPLATE
    eng = Engine(ScriptedBackend(n_ctx=512), chat_template=load_template_file(path))
    assert eng.supports_tools and eng.tool_format == HERMES


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "cannot read it"),
        (b"\xff\xfe{{", "not UTF-8"),
        (b"   ", "the file is empty"),
        (b"{% for m in messages %}", "does not parse"),
        (b"x" * (MAX_TEMPLATE_FILE_BYTES + 1), "over 256 KiB"),
    ],
)
def test_a_bad_chat_template_file_is_one_line(tmp_path, content, match):
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(BadRequestError, match=match) as exc:
        load_template_file(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_a_fifo_as_chat_template_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BadRequestError, match="not a regular file"):
        load_template_file(fifo)
    with pytest.raises(BadRequestError, match="not a regular file"):
        load_template_file(tmp_path)
