"""Tool-call formats from llama.cpp's own chat templates (scripts/fetch_templates.py copies
them from the llama-cpp-python sdist): each is detected from its real template, its
grammar takes exactly the calls written in the model's own syntax (and refuses calls that
break a tool's schema), and its parser gives back exactly those calls, however the text
is cut into pieces. Byte vocabulary (the scripted backend): every marker is text here,
the path the test models take."""

from __future__ import annotations

import json

import pytest

from conftest import MODELS
from localrun.grammar.matcher import GrammarMatcher
from localrun.grammar.tokenizer import build_tokenizer
from localrun.tools import DEEPSEEK_V31, ToolChoice, collect_calls, detect_call_format, parse_tools
from localrun.tools.model import ModelTools

from fakes import ScriptedBackend

TEMPLATES = MODELS / "templates"

FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "alerts": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["city", "days"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
])
# a string that spans lines and holds markup-like text; numbers, a boolean, an array
CALLS = [
    ("get_forecast", {"city": "Lisboa\nnorte <b>", "days": 3, "unit": "celsius", "alerts": True, "hours": [6, 18]}),
    ("add", {"a": 1, "b": 2.5}),
]
TEXT = "Let me check."


def load(name: str) -> str:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.fail(f"llama.cpp template {path} is missing: run scripts/fetch_templates.py (scripts/setup.sh runs it)")
    return path.read_text()


def xml(v) -> str:
    """A parameter as the XML formats' templates print it: strings raw, the rest JSON."""
    return v if isinstance(v, str) else json.dumps(v)


# -- the model's own syntax, written as each template prints past calls -----------------


def hermes(calls, text=TEXT):
    body = "\n</tool_call>\n<tool_call>\n".join(json.dumps({"name": n, "arguments": a}) for n, a in calls)
    return f"{text}\n" * bool(text) + f"<tool_call>\n{body}\n</tool_call>"


def qwen3_coder(calls, text=TEXT):
    def one(name, args):
        params = "".join(f"<parameter={k}>\n{xml(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    return f"{text}\n" * bool(text) + "\n".join(one(n, a) for n, a in calls)


def seed_oss(calls, text=TEXT):
    def one(name, args):
        params = "".join(f"<parameter={k}>{xml(v)}</parameter>\n" for k, v in args.items())
        return f"<seed:tool_call>\n<function={name}>\n{params}</function>\n</seed:tool_call>"
    return f"{text}\n" * bool(text) + "\n".join(one(n, a) for n, a in calls)


def glm(calls, text=TEXT, nl="\n"):
    def one(name, args):
        params = "".join(f"{nl}<arg_key>{k}</arg_key>{nl}<arg_value>{xml(v)}</arg_value>" for k, v in args.items())
        return f"<tool_call>{name}{params}{nl}</tool_call>"
    return text + nl.join(one(n, a) for n, a in calls)


def kimi(calls, text=TEXT):
    body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
                   for i, (n, a) in enumerate(calls))
    return f"{text}<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def deepseek_v31(calls, text=TEXT):
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"{text}<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseek_r1(calls, text=TEXT):
    body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
                     for n, a in calls)
    return f"{text}<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def mistral(calls, text=TEXT):
    return text + "[TOOL_CALLS][" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"


def mistral_args(calls, text=TEXT):
    return text + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def granite(calls, text=TEXT):
    return text + "<|tool_call|>[" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"


def llama3(calls, text=""):
    body = "\n".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return f"{text} {body}" if text else body


def llama3_tagged(calls, text=TEXT):
    return text + "<|python_tag|>" + "\n".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def harmony(calls, text=""):
    (name, args), = calls
    return ("<|channel|>analysis<|message|>The user wants a call.<|end|><|start|>assistant"
            f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}<|call|>")


# template file, format name, writer, content before the calls, several calls in one answer
FORMATS = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", hermes, TEXT + "\n", True),
    "hermes3": ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", hermes, TEXT + "\n", True),
    "granite4": ("ibm-granite-granite-4.0.jinja", "hermes", hermes, TEXT + "\n", True),
    "qwen3-coder": ("Qwen3-Coder.jinja", "qwen3-coder", qwen3_coder, TEXT + "\n", True),
    "seed-oss": ("ByteDance-Seed-OSS.jinja", "seed-oss", seed_oss, TEXT + "\n", True),
    "glm-4.6": ("GLM-4.6.jinja", "glm", glm, TEXT, True),
    "glm-4.7": ("GLM-4.7-Flash.jinja", "glm", lambda c, text=TEXT: glm(c, text, nl=""), TEXT, True),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", "harmony", harmony, "", False),
    "kimi-k2": ("Kimi-K2-Instruct.jinja", "kimi", kimi, TEXT, True),
    "kimi-k2-moonshot": ("moonshotai-Kimi-K2.jinja", "kimi", kimi, TEXT, True),
    "deepseek-r1": ("llama-cpp-deepseek-r1.jinja", "deepseek-r1", deepseek_r1, TEXT, True),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", mistral, TEXT, True),
    "devstral": ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral-args", mistral_args, TEXT, True),
    "ministral-3": ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral-args", mistral_args, TEXT, True),
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3", llama3, "", True),
    "llama-3.1-after-text": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3",
                             lambda c, text=TEXT: llama3(c, text), TEXT + " ", True),
    "llama-3.3-tag": ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3", llama3_tagged, TEXT, True),
    "granite-3.3": ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite", granite, TEXT, True),
}


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer(ScriptedBackend())


def tools_of(name: str) -> ModelTools:
    return ModelTools(ScriptedBackend(), load(FORMATS[name][0]))


def grammar(mt: ModelTools, choice, parallel=True):
    """The call grammar after a prompt that left no reasoning block open (GLM-4.7's opens
    one by default; tests/test_reply_parser.py takes that case)."""
    choice = choice if isinstance(choice, ToolChoice) else ToolChoice(choice)
    return mt.grammar(TOOLS, choice, parallel, prompt="")


grammar_of = grammar


def allows(grammar, tok, text: str) -> bool:
    m = GrammarMatcher(grammar, tok)
    for b in text.encode():
        if not m.allows(b):
            return False
        m.accept(b)
    return m.is_accepting()


def parse(mt: ModelTools, pieces, choice=ToolChoice("auto")):
    """(reasoning, content, calls as (name, arguments text)) of an answer fed in pieces."""
    p = mt.output(choice, reasoning=True, tools=TOOLS, prompt="")
    parts = [p.feed(0, piece) for piece in pieces] + [p.finish("")]
    calls = collect_calls(d for part in parts for d in part.calls)
    return ("".join(x.reasoning for x in parts), "".join(x.content for x in parts),
            [(c.name, c.arguments) for c in calls])


def want(calls):
    return [(n, json.dumps(a)) for n, a in calls]


@pytest.mark.parametrize("family", FORMATS)
def test_format_is_detected_from_the_real_template(family):
    mt = tools_of(family)
    assert mt.supported and mt.format.name == FORMATS[family][1]


@pytest.mark.parametrize("family", FORMATS)
def test_round_trip_the_grammar_allows_and_the_parser_recovers(family, byte_tok):
    _, _, write, content, several = FORMATS[family]
    mt = tools_of(family)
    calls = CALLS if several else CALLS[:1]
    answer = write(calls)
    assert allows(grammar(mt, "auto"), byte_tok, answer), answer
    assert parse(mt, [answer])[1:] == (content, want(calls))
    if several:  # parallel_tool_calls false: one call only
        assert not allows(grammar(mt, "auto", parallel=False), byte_tok, answer)
        assert allows(grammar(mt, "auto", parallel=False), byte_tok, write(CALLS[:1]))


@pytest.mark.parametrize("family", FORMATS)
def test_streamed_at_every_cut_equals_the_whole(family):
    _, _, write, content, several = FORMATS[family]
    mt = tools_of(family)
    calls = CALLS if several else CALLS[:1]
    answer = write(calls)
    whole = parse(mt, [answer])
    for cut in range(len(answer) + 1):
        assert parse(mt, [answer[:cut], answer[cut:]]) == whole, cut
    assert parse(mt, list(answer)) == whole  # character by character
    # each call's first delta names it, before any of its arguments
    p = mt.output(ToolChoice("auto"), reasoning=True, tools=TOOLS, prompt="")
    deltas = [d for ch in answer for d in p.feed(0, ch).calls] + p.finish("").calls
    firsts = [d for d in deltas if d.name is not None]
    assert [d.name for d in firsts] == [n for n, _ in calls] and all(d.id.startswith("call_") for d in firsts)
    assert p.made_calls


@pytest.mark.parametrize("family", FORMATS)
def test_grammar_per_choice_and_schema(family, byte_tok):
    _, _, write, _, _ = FORMATS[family]
    mt = tools_of(family)
    g = {c: grammar_of(mt, c) for c in ("auto", "required", "none")}
    named = grammar_of(mt, ToolChoice("named", "add"))
    plain = "The weather is fine."
    calls_only = write(CALLS[:1], text="")
    assert allows(g["auto"], byte_tok, plain)  # auto still lets the model answer in text
    assert allows(g["none"], byte_tok, plain)
    if not calls_only.startswith("{"):  # a bare call is only text where no call may come
        assert not allows(g["none"], byte_tok, calls_only)
    assert allows(g["required"], byte_tok, calls_only) and not allows(g["required"], byte_tok, plain)
    assert not allows(named, byte_tok, calls_only) and allows(named, byte_tok, write(CALLS[1:], text=""))
    # arguments that break the schema: out of range, a string for a number, an unknown tool
    for bad in ({"city": "Porto", "days": 9}, {"city": "Porto", "days": "three"}):
        assert not allows(g["required"], byte_tok, write([("get_forecast", bad)], text="")), bad
    assert not allows(g["required"], byte_tok, write([("rm", {"path": "/"})], text=""))
    # a required parameter left out
    assert not allows(g["required"], byte_tok, write([("add", {"a": 1})], text=""))


def test_xml_values_are_typed_by_the_schema():
    """A number parameter is a bare number in the XML, a JSON number in the arguments; a
    string parameter that looks like a number stays a string."""
    mt = tools_of("qwen3-coder")
    text = ("<tool_call>\n<function=get_forecast>\n<parameter=city>\n1984\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=alerts>\nFalse\n</parameter>\n</function>\n</tool_call>")
    assert parse(mt, [text])[2] == [("get_forecast", '{"city": "1984", "days": 2, "alerts": false}')]
    glm_mt = tools_of("glm-4.6")
    text = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>7</arg_value>\n<arg_key>b</arg_key>\n<arg_value>0.5</arg_value>\n</tool_call>"
    assert parse(glm_mt, [text])[2] == [("add", '{"a": 7, "b": 0.5}')]


def test_harmony_final_answer_and_plain_text():
    mt = tools_of("gpt-oss")
    answer = ("<|channel|>analysis<|message|>Simple question.<|end|><|start|>assistant"
              "<|channel|>final<|message|>Four.<|return|>")
    assert parse(mt, [answer]) == ("Simple question.", "Four.", [])
    assert parse(mt, ["  Four."]) == ("", "  Four.", [])
    # the recipient before the channel, as the template prints earlier calls
    other = '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>'
    assert parse(mt, [other])[2] == [("add", '{"a": 1, "b": 2}')]
    # no tools, or tool_choice "none": no call can come, so a message to a function is content
    for choice, tools in ((None, ()), (ToolChoice("none"), TOOLS)):
        p = mt.output(choice, reasoning=True, tools=tools, prompt="")
        parts = [p.feed(0, "<|channel|>analysis<|message|>Simple question.<|end|>"), p.feed(0, other), p.finish("")]
        assert not [d for x in parts for d in x.calls], choice
        assert "".join(x.reasoning for x in parts) == "Simple question."
        assert "".join(x.content for x in parts) == '{"a": 1, "b": 2}'


def test_deepseek_v31_template_prints_calls_but_not_tools():
    """Its template never reads `tools` (so tools are not supported through it), but the
    format it prints is known: the grammar and parser still work from the format."""
    template = load("deepseek-ai-DeepSeek-V3.1.jinja")
    mt = ModelTools(ScriptedBackend(), template)
    assert not mt.supported and mt.reasoning.name == "think"
    assert detect_call_format(template) == DEEPSEEK_V31
    mt.format = DEEPSEEK_V31  # as a template that also read `tools` would have it
    answer = deepseek_v31(CALLS)
    tok = build_tokenizer(ScriptedBackend())
    assert allows(mt.grammar(TOOLS, ToolChoice("auto"), True, prompt="<think></think>"), tok, answer)
    assert parse(mt, [answer])[1:] == (TEXT, want(CALLS))


def test_a_control_token_marker_counts_only_as_its_token():
    """Kimi's markers are control tokens in its vocabulary: written as text they are
    content; produced as tokens (no text) they frame the call."""
    mt = tools_of("kimi-k2")
    ids = {"<|tool_calls_section_begin|>": 300, "<|tool_call_begin|>": 301, "<|tool_call_argument_begin|>": 302,
           "<|tool_call_end|>": 303, "<|tool_calls_section_end|>": 304}
    mt.markers = ids
    p = mt.output(ToolChoice("auto"), reasoning=True, tools=TOOLS)
    parts = [p.feed(0, "Say <|tool_call_begin|> here. "), p.feed(300, ""), p.feed(301, ""),
             p.feed(0, "functions.add:0"), p.feed(302, ""), p.feed(0, '{"a": 1, "b": 2}'), p.feed(303, ""),
             p.feed(304, ""), p.finish("")]
    assert "".join(x.content for x in parts) == "Say <|tool_call_begin|> here. "
    (call,) = collect_calls(d for x in parts for d in x.calls)
    assert (call.name, call.arguments) == ("add", '{"a": 1, "b": 2}')
    source = grammar(mt, "auto").source
    assert "<[300]>" in source and "<[303]>" in source
