"""Reasoning split out of an answer: each reasoning format detected from its real
template (llama.cpp's, from scripts/fetch_templates.py), whether the rendered prompt left
the model inside the block, the ReplyParser's parts at every cut, markers as control
tokens, raw mode, and the grammar's room for reasoning before a forced call."""

from __future__ import annotations

import pytest

from localrun.grammar.tokenizer import build_tokenizer
from localrun.prompt.chat_template import render
from localrun.tools import ToolChoice, collect_calls
from localrun.tools.model import ModelTools
from localrun.tools.reasoning import THINK
from localrun.tools.reply import ReplyParser, answer_parser

from fakes import ScriptedBackend
from test_tool_formats import TOOLS, allows, load

ASK = [{"role": "user", "content": "hi"}]
# template, reasoning format, opened by the default prompt / with enable_thinking=False
REASONING = {
    "Qwen-Qwen3-0.6B.jinja": ("think", False, False),
    "Qwen3.5-4B.jinja": ("think", True, False),
    "Qwen-QwQ-32B.jinja": ("think", False, False),
    "GLM-4.6.jinja": ("think", False, False),
    "GLM-4.7-Flash.jinja": ("think", True, False),
    "Kimi-K2-Thinking.jinja": ("think", False, False),
    "llama-cpp-deepseek-r1.jinja": ("think", True, True),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("think", False, False),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("think", False, False),
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": ("mistral", False, False),
    "ByteDance-Seed-OSS.jinja": ("seed", False, False),
    "openai-gpt-oss-120b.jinja": ("harmony", False, False),
    "Qwen-Qwen2.5-7B-Instruct.jinja": (None, False, False),
    "Qwen3-Coder.jinja": (None, False, False),
}


@pytest.mark.parametrize("name", REASONING)
def test_reasoning_format_and_open_block_come_from_the_template(name):
    fmt, opened, opened_without_thinking = REASONING[name]
    template = load(name)
    mt = ModelTools(ScriptedBackend(), template)
    assert (mt.reasoning.name if mt.reasoning else None) == fmt
    prompt = render(template, ASK, bos_token="<s>", eos_token="</s>")
    assert mt.reasoning_open(prompt) is opened
    quiet = render(template, ASK, bos_token="<s>", eos_token="</s>", enable_thinking=False)
    assert mt.reasoning_open(quiet) is opened_without_thinking


def test_thinking_on_and_off_render_an_open_and_a_closed_block():
    """Qwen3.5 with thinking opens the block in the prompt; `enable_thinking=False`
    renders an empty block, after which the answer is content from its first token."""
    template = load("Qwen3.5-4B.jinja")
    mt = ModelTools(ScriptedBackend(), template)
    on = render(template, ASK, enable_thinking=True)
    off = render(template, ASK, enable_thinking=False)
    assert on.endswith("<think>\n") and off.endswith("<think>\n\n</think>\n\n")
    assert split(mt, ["Hmm, a greeting.\n</think>\n\nHello!"], prompt=on) == ("Hmm, a greeting.\n", "Hello!", [])
    assert split(mt, ["Hello!"], prompt=off) == ("", "Hello!", [])


def split(mt, pieces, prompt="", choice=ToolChoice("auto"), reasoning=True):
    p = mt.output(choice, reasoning=reasoning, tools=TOOLS, prompt=prompt)
    parts = [p.feed(0, piece) for piece in pieces] + [p.finish("")]
    calls = collect_calls(d for part in parts for d in part.calls)
    return ("".join(x.reasoning for x in parts), "".join(x.content for x in parts),
            [(c.name, c.arguments) for c in calls])


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
# template, answer, (reasoning, content, calls)
ANSWERS = {
    "qwen3 think then call": ("Qwen-Qwen3-0.6B.jinja", f"<think>\nI could write {CALL} but first...\n</think>\n\n{CALL}",
                              (f"\nI could write {CALL} but first...\n", "", [("add", '{"a": 1, "b": 2}')])),
    "qwen3 think then text": ("Qwen-Qwen3-0.6B.jinja", "<think>short</think>\n\nHi there.", ("short", "Hi there.", [])),
    "qwen3 no think": ("Qwen-Qwen3-0.6B.jinja", "  Hi <think> is a tag.", ("", "  Hi <think> is a tag.", [])),
    "magistral": ("mistralai-Ministral-3-14B-Reasoning-2512.jinja",
                  '[THINK]add them[/THINK][TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
                  ("add them", "", [("add", '{"a": 1, "b": 2}')])),
    "seed": ("ByteDance-Seed-OSS.jinja", "<seed:think>why</seed:think>\nBecause.", ("why", "Because.", [])),
    "gpt-oss": ("openai-gpt-oss-120b.jinja",
                "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Two.<|return|>",
                ("Easy.", "Two.", [])),
    "glm-4.6": ("GLM-4.6.jinja", "<think>ok</think>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
                "<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
                ("ok", "", [("add", '{"a": 1, "b": 2}')])),
}


@pytest.mark.parametrize("case", ANSWERS)
def test_reasoning_content_and_calls_at_every_cut(case):
    name, answer, expected = ANSWERS[case]
    mt = ModelTools(ScriptedBackend(), load(name))
    assert split(mt, [answer]) == expected
    for cut in range(len(answer) + 1):
        assert split(mt, [answer[:cut], answer[cut:]]) == expected, cut
    assert split(mt, list(answer)) == expected


def test_the_prompt_opened_block_streams_as_reasoning():
    mt = ModelTools(ScriptedBackend(), load("llama-cpp-deepseek-r1.jinja"))
    prompt = render(load("llama-cpp-deepseek-r1.jinja"), ASK)
    p = mt.output(ToolChoice("auto"), reasoning=True, tools=TOOLS, prompt=prompt)
    assert p.in_reasoning and p.end_of_reasoning == "</think>\n\n"
    assert p.feed(0, "Let me think").reasoning == "Let me think"
    piece = p.feed(0, ".</thi")
    assert (piece.reasoning, p.in_reasoning) == (".", True)
    piece = p.feed(0, "nk>\n\nThe answer.")
    assert (piece.content, p.in_reasoning) == ("The answer.", False)
    assert not p.made_calls


def test_raw_mode_leaves_the_reasoning_in_the_content():
    mt = ModelTools(ScriptedBackend(), load("Qwen-Qwen3-0.6B.jinja"))
    answer = "<think>hm</think>\n\nHi."
    assert split(mt, [answer], reasoning=False) == ("", answer, [])
    harmony = ModelTools(ScriptedBackend(), load("openai-gpt-oss-120b.jinja"))
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Two."
    assert split(harmony, [text], reasoning=False) == ("", "Easy.Two.", [])


def test_end_of_reasoning_per_format():
    def end(name):
        return ModelTools(ScriptedBackend(), load(name)).output(ToolChoice("auto"), reasoning=True).end_of_reasoning
    assert end("Qwen-Qwen3-0.6B.jinja") == "</think>\n\n"
    assert end("mistralai-Ministral-3-14B-Reasoning-2512.jinja") == "[/THINK]"
    assert end("openai-gpt-oss-120b.jinja") == "<|end|><|start|>assistant<|channel|>final<|message|>"
    # without tools a reasoning model still gets a parser; a model that neither reasons nor calls none
    assert ModelTools(ScriptedBackend(), load("Qwen-Qwen3-0.6B.jinja")).output(None, reasoning=True) is not None
    assert ModelTools(ScriptedBackend(), load("Qwen-Qwen2.5-7B-Instruct.jinja")).output(None, reasoning=True) is None


def test_reasoning_markers_as_control_tokens():
    """`<think>` as a control token (no text): only the token opens the block."""
    parser = ReplyParser(answer_parser(None, (), frozenset(), None), THINK, False, {300: "<think>", 301: "</think>"})
    parts = [parser.feed(0, "\n"), parser.feed(300, ""), parser.feed(0, "a <think> b"), parser.feed(301, ""),
             parser.feed(0, "\n\nDone."), parser.finish("")]
    assert "".join(p.reasoning for p in parts) == "a <think> b" and "".join(p.content for p in parts) == "Done."


def test_grammar_leaves_room_for_reasoning_before_a_forced_call():
    tok = build_tokenizer(ScriptedBackend())
    mt = ModelTools(ScriptedBackend(), load("Qwen-Qwen3-0.6B.jinja"))
    required = mt.grammar(TOOLS, ToolChoice("required"), True, prompt="")
    auto = mt.grammar(TOOLS, ToolChoice("auto"), True, prompt="")
    assert allows(required, tok, f"<think>\nadd: mention {CALL} in passing\n</think>\n\n{CALL}")
    assert allows(required, tok, CALL) and not allows(required, tok, "<think>no end" + CALL)
    # in the thinking the trigger is only text; after it, it starts a call
    assert allows(auto, tok, f"<think>maybe {CALL}?</think>\n\nNo call needed.")
    assert not allows(auto, tok, "Text then <tool_call> mentioned")
    # a prompt that opened the block: the answer must close it, and a budget's injected end fits anywhere
    opened = load("Qwen3.5-4B.jinja")
    mt = ModelTools(ScriptedBackend(), opened)
    prompt = render(opened, ASK)
    g = mt.grammar(TOOLS, ToolChoice("required"), True, prompt=prompt)
    call = ('<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n'
            '</function>\n</tool_call>')
    assert allows(g, tok, "half a thou" + mt.reasoning.end_of_reasoning + call)
    assert not allows(g, tok, call)  # the block is open: it must be closed first
