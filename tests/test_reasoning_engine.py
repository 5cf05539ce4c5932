"""The engine's side of reasoning (issue 50): the answer's parts come apart in its events
(`Event.reasoning`, never in `Event.text`), a reasoning budget ends the thinking with the
model's own marker after N tokens and the answer follows, and `reasoning_format: "none"`
keeps the raw text. On the scripted thinking model (tests/thinking_fakes.py), then on
real test models given a template that opens the thinking in the prompt (llama.cpp's
DeepSeek-R1 template, scripts/fetch_templates.py), on both backends."""

from __future__ import annotations

import pytest

from conftest import MODELS
from localrun.engine import Engine
from localrun.sampling import SamplingParams

from thinking_fakes import ANSWER, PLAN, thinking_engine

GREEDY = SamplingParams(temperature=0)
HI = [{"role": "user", "content": "hi"}]
TEMPLATES = MODELS / "templates"


def _run(eng: Engine, prompt, **options):
    """(reasoning, content, tokens, the generation) of one answer, step by step."""
    gen = eng.start(prompt, **options)
    reasoning, content, tokens = [], [], []
    while not gen.done:
        ev = eng.step([gen]).get(gen.seq)
        if ev is not None:
            reasoning.append(ev.reasoning)
            content.append(ev.text)
            tokens += ev.tokens
    return "".join(reasoning), "".join(content), tokens, gen


@pytest.mark.parametrize("lookup", [False, True])
def test_a_budget_ends_the_thinking_after_n_tokens_and_the_answer_follows(lookup):
    eng = thinking_engine()
    prompt = eng.chat_prompt(HI)
    for budget in (None, 0, 1, 3, len(PLAN), 50):
        reasoning, content, tokens, gen = _run(eng, prompt, sampling=GREEDY, max_tokens=40, lookup=lookup,
                                               reasoning_budget=budget)
        shown = PLAN if budget is None else PLAN[:budget]
        assert (reasoning, content) == (shown, ANSWER), budget
        if budget is None:
            assert gen.reasoning_tokens == 0  # counted only under a budget
        elif budget <= len(PLAN):
            assert gen.reasoning_tokens == budget  # the engine wrote the marker right there
        else:  # the model's own marker, one byte a token here, counts until it is whole
            assert len(PLAN) < gen.reasoning_tokens <= len(PLAN) + len("</think")
        written = bytes(t for t in tokens if t < 256).decode()
        # the model's own marker closed the thinking: written by the engine where the budget ran out
        assert written.startswith(f"<think>{shown}</think>"), written


def test_the_reasoning_never_reaches_the_content_and_a_raw_request_keeps_it():
    eng = thinking_engine()
    done = eng.complete(eng.chat_prompt(HI), sampling=GREEDY, max_tokens=40)
    assert (done.reasoning, done.text, done.finish_reason) == (PLAN, ANSWER, "stop")
    raw = eng.complete(eng.chat_prompt(HI), sampling=GREEDY, max_tokens=40, reasoning_format="none")
    assert (raw.reasoning, raw.text) == ("", f"<think>{PLAN}</think>{ANSWER}")
    off = eng.chat_prompt(HI, template_kwargs={"enable_thinking": False})  # the template writes an empty block
    done = eng.complete(off, sampling=GREEDY, max_tokens=40)
    assert (done.reasoning, done.text) == ("", ANSWER)


def test_a_stop_string_applies_to_the_answer_only():
    eng = thinking_engine()
    done = eng.complete(eng.chat_prompt(HI), sampling=GREEDY, max_tokens=40, stop=["la", "sw"])
    assert (done.reasoning, done.text, done.finish_reason) == (PLAN, "an", "stop")


@pytest.mark.parametrize("backend, budget", [("llama.cpp", 0), ("llama.cpp", 3), ("llama.cpp", 12), ("mlx", 3)])
def test_a_real_model_thinks_within_its_budget_under_a_template_that_opens_the_thinking(request, backend, budget):
    """llama.cpp's DeepSeek-R1 template ends the prompt inside `<think>`: whatever these
    small models write there is thinking, until the budget makes the engine write
    `</think>` for them. Sampled at temperature 1.0 with a seed, on both backends (MLX
    once: its CPU build decodes ~3 tokens a second here)."""
    engine = request.getfixturevalue("llama_engine" if backend == "llama.cpp" else "mlx_engine")
    template = (TEMPLATES / "llama-cpp-deepseek-r1.jinja").read_text()
    eng = Engine(engine.backend, chat_template=template)
    assert eng.reasoning is not None and eng.reasoning.opens_in_prompt
    prompt = eng.chat_prompt([{"role": "user", "content": "What is 7 times 8?"}])
    assert eng.detokenize(prompt).endswith("<think>\n")
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=budget + 1)
    reasoning, content, tokens, gen = _run(eng, prompt, sampling=sampling, max_tokens=budget + 24,
                                           reasoning_budget=budget)
    assert gen.reasoning_tokens <= budget
    assert "</think>" not in reasoning
    written = eng.detokenize(tokens)
    closed = written.find("</think>")
    assert closed >= 0 and len(eng.tokenize(written[:closed], add_special=False)) <= budget + 1  # its pieces, re-read
    assert written[:closed].strip() == reasoning.strip()  # every token before the marker was thinking
    assert not content.startswith("</think>")  # the marker is markup, not answer


def test_a_request_grammar_holds_the_answer_after_a_thinking_block_the_prompt_opened(llama_engine):
    """A JSON schema constrains the answer, not the thinking: under a template that opens
    `<think>` in the prompt, the engine closes it at once (outside the grammar) and the
    whole answer is valid JSON, in the content."""
    import json

    import jsonschema

    from localrun.grammar.core import Grammar

    schema = {"type": "object", "properties": {"product": {"type": "integer"}}, "required": ["product"]}
    eng = Engine(llama_engine.backend, chat_template=(TEMPLATES / "llama-cpp-deepseek-r1.jinja").read_text())
    prompt = eng.chat_prompt([{"role": "user", "content": "What is 7 times 8? Answer in JSON."}])
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    reasoning, content, tokens, gen = _run(eng, prompt, sampling=sampling, max_tokens=48,
                                           grammar=Grammar.from_json_schema(schema))
    assert (reasoning, gen.finish_reason) == ("", "stop")
    assert eng.detokenize(tokens).startswith("</think>")
    jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize("template, on_marker, off_marker", [
    # Granite 3.3 reads `thinking`: on, its system prompt asks for <think></think>
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "Write your thoughts between <think></think>", None),
    # Seed-OSS reads `thinking_budget`: 0 tells the model to skip thinking
    ("ByteDance-Seed-OSS.jinja", None, "your thinking budget is 0"),
])
def test_the_thinking_switch_reaches_templates_that_read_other_names(template, on_marker, off_marker):
    """`enable_thinking` (what think / reasoning_effort / Anthropic thinking arrive as)
    also reaches templates that read `thinking` or `thinking_budget`."""
    from fakes import ScriptedBackend

    eng = Engine(ScriptedBackend(), chat_template=(TEMPLATES / template).read_text())
    messages = [{"role": "user", "content": "hi"}]

    def text(kwargs):
        return eng.detokenize(eng.chat_prompt(messages, template_kwargs=kwargs))

    on, off = text({"enable_thinking": True}), text({"enable_thinking": False})
    if on_marker:
        assert on_marker in on and on_marker not in off
    if off_marker:
        assert off_marker in off and off_marker not in on
    # a name the caller sets stays as set
    assert text({"enable_thinking": False, "thinking_budget": -1}) == text({})
