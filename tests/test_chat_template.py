"""Chat templates: real ones render exactly as a plain Jinja sandbox renders them, and
hostile ones (a model file anyone can publish carries its template) fail fast with one
BadRequestError line, never a hang, gigabytes of memory or a traceback."""

from __future__ import annotations

import threading
from datetime import datetime

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localrun.prompt import chat_template

from localrun.prompt import template_budget
from localrun.prompt.chat_template import CHATML, GEMMA, OVERRIDE_HINT, render
from localrun.errors import BadRequestError

from fakes import ScriptedBackend

# A thread cannot be killed, which is why the budget exists: a render still running after
# this long means the budget failed (the thread is left behind, as the server's would be).
HANG_GUARD_S = 20

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Grüße aus Köln — 東京は?"},
    {"role": "assistant", "content": "  Hallo!  "},
    {"role": "user", "content": "And the weather?"},
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "Name of the city, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        }},
    }},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    }},
]

TOOL_CHAT = [
    {"role": "system", "content": "You call tools when they help."},
    {"role": "user", "content": "Weather in Zürich and Köln?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'}},
    ]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"temp": 18}'},
    {"role": "assistant", "content": "21 °C in Zürich, 18 °C in Köln."},
    {"role": "user", "content": "Thanks"},
]

# ChatML with tools, written in the style of Hugging Face tool templates: tools as JSON
# lines in the system turn, calls as <tool_call> JSON, consecutive tool results in one turn.
TOOLS_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] + '\\n\\n' }}
{%- endif %}
{{- 'You may call the tools described by these JSON schemas:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\nTo call one, write {"name": ..., "arguments": ...} inside <tool_call></tool_call>.<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}
{{- '\\n' + message.content }}
{%- endif %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The Jinja features real templates use, each of which the budget's hooks touch: loop
# variables, filtered/recursive/else loops, break/continue, macros with caller, a schema
# macro that calls itself, namespaces, set/filter blocks, ~ + % * and str.format.
FEATURES_TEMPLATE = """
{%- macro schema(p, depth=0) -%}
{{ p.type }}{% if p.properties %}{ {% for k, v in p.properties | dictsort
%}{{ k }}: {{ schema(v, depth + 1) }}{{ ', ' if not loop.last }}{% endfor %} }{% endif %}
{%- if 'items' in p %}[{{ schema(p['items'], depth + 1) }}]{% endif %}
{%- endmacro -%}
{%- macro turn(role) -%}<{{ role }}>{{ caller() | trim }}</{{ role }}>{%- endmacro -%}
{%- set ns = namespace(last_user=-1, roles=[]) -%}
{%- for m in messages -%}
{%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- set ns.roles = ns.roles + [m.role] -%}
{%- endfor -%}
{%- set header %}{{ bos_token }}[{{ ns.roles | join(',') }}] last user at {{ ns.last_user }}{% endset -%}
{{ header | upper }}
{% for tool in tools | default([]) %}{{ loop.index }}/{{ loop.length }} {{ tool.function.name
}}({{ schema(tool.function.parameters) }}){{ loop.cycle(';', '.') }}
{% endfor %}
{%- for m in messages[::-1] if m.role != 'system' -%}
{%- if loop.index > 5 %}{% break %}{% endif -%}
{%- if m.content is not string %}{% continue %}{% endif -%}
{% call turn(m.role) %}{{ '%s #%d' % (m.content, loop.revindex) }} {{
'{0}|{1:>4}'.format(loop.first, loop.length) }}{% endcall %}
{% else %}no turns
{%- endfor %}
{% filter replace('  ', ' ') %}{{ messages | map(attribute='role') | unique | list | tojson(indent=2) }}{% endfilter %}
{% for x in [[1, [2, [3]]], 4] recursive %}({% if x is iterable %}{{ loop(x) }}{% else
%}{{ x ~ '@' ~ loop.depth }}{% endif %}){% endfor %}
{{ '=' * 3 ~ (2 ** 10) ~ (messages | length * 2) ~ ('ab' + 'cd') }} {{ messages[0].content[:3] }}
{{- eos_token if not add_generation_prompt }}
"""


def plain_render(template: str, messages: list[dict], bos_token="", eos_token="", add_generation_prompt=True,
                 **extra) -> str:
    """The renderer before the budget: a plain immutable sandbox with the same helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = chat_template._tojson
    env.globals["raise_exception"] = chat_template._raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                            add_generation_prompt=add_generation_prompt, **extra)


def render_guarded(template: str, messages: list[dict] = MESSAGES, **extra) -> str:
    box: dict = {}

    def run() -> None:
        try:
            box["text"] = render(template, messages, **extra)
        except BaseException as exc:  # handed to the test thread as-is
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_GUARD_S)
    if worker.is_alive():
        pytest.fail(f"the template was still rendering after {HANG_GUARD_S} s")
    if "error" in box:
        raise box["error"]
    return box["text"]


def assert_refused(template: str, expected: str | tuple[str, ...], messages: list[dict] = MESSAGES, **extra) -> str:
    """`expected`: a phrase the one-line error must contain, or a tuple of alternatives."""
    with pytest.raises(BadRequestError) as caught:
        render_guarded(template, messages, **extra)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("the model's chat template "), message
    assert any(phrase in message for phrase in ((expected,) if isinstance(expected, str) else expected)), message
    return message


# -- hostile templates: each refused with one line, promptly ----------------------------

S100K = "{% set s = 'x' * 100000 %}"
# A runaway loop meets the step budget in a second or so; on a much slower machine the
# deadline may come first, which is the budget working too.
STEPS = ("steps", "ran longer than")
HOSTILE = {
    # (template, a phrase the one-line error must contain)
    "nested huge ranges": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                           STEPS),
    "nested loops over a big list built by string ops": (
        "{% set s = 'ab' * 300000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", STEPS),
    "nested loops whose filter drops every item": (
        "{% for a in range(100000) %}{% for b in range(100000) if false %}{% endfor %}{% endfor %}", STEPS),
    "a recursive loop() that fans out": (
        "{% for x in [1] recursive %}{% if loop.depth < 4 %}{{ loop(range(1000)) }}{% endif %}{% endfor %}", STEPS),
    "huge string multiplication": ("{{ 'x' * 10**8 }}", "would build a value of 100,000,000"),
    "a macro that calls itself": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "deep"),
    "a block that renders itself": ("{% block a %}{{ self.a() }}{% endblock %}", "deep"),
    "a range too large for Python": ("{{ range(10**20) | list }}", "range"),
    "a huge power": ("{{ 2 ** 100000 }}", "bits"),
    "a huge str.ljust": ("{{ 'x'.ljust(10**8) }}", "padded text"),
    "a huge center filter": ("{{ 'x' | center(10**8) }}", "padded text"),
    "a huge str.format width": ("{{ '{:>100000000}'.format(1) }}", "formatted field"),
    "a huge % width": ("{{ '%100000000d' % 1 }}", "formatted field"),
    "a huge % star width": ("{{ '%*d' % (100000000, 1) }}", "formatted field"),
    "a list repeating a long string, printed": (S100K + "{{ [s] * 1000 }}", "text"),
    "a list literal of long strings, joined": (S100K + "{{ [s, s, s, s, s, s, s, s, s, s, s, s] ~ '' }}",
                                               "joined text"),
    "a namespace string doubled in a loop": (
        "{% set ns = namespace(s='x') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "would build"),
    "a set block collecting 100 MB": (
        S100K + "{% set b %}{% for i in range(1000) %}{{ s }}{% endfor %}{% endset %}{{ b | length }}",
        "block of output"),
    "100 MB of output": (S100K + "{% for i in range(1000) %}{{ s }}{% endfor %}", "wrote more than"),
    "str.replace of the empty string": ("{{ ('x' * 10000).replace('', 'y' * 10000) }}", "would build"),
    "str.join with a long separator": ("{{ ('y' * 100000).join(range(1000) | map('string')) }}", "joined text"),
    "indent by a huge width": ("{{ ('\\n' * 1000) | indent(100000) }}", "indented text"),
    "str.translate to long strings": ("{{ ('x' * 100000).translate({120: 'y' * 1000}) }}", "translated text"),
    "tojson with a huge indent": ("{{ messages | tojson(indent=100000) }}", "indent"),
    "sum of lists (quadratic)": ("{{ range(3000) | map('string') | map('list') | sum(start=[]) | length }}",
                                 "read and built"),
    "nested loops over the tools": (
        "{% for a in tools %}{% for b in tools %}{% for c in tools %}{% endfor %}{% endfor %}{% endfor %}", STEPS),
    # Python errors and Jinja errors that are not a refusal
    "a TypeError": ("{{ messages + 1 }}", "TypeError"),
    "a chain of undefined attributes": ("{{ messages[0].nope.deeper.still }}", "has no attribute 'nope'"),
    "a sandbox SecurityError": ("{{ ''.__class__.__mro__ }}", "unsafe"),
    "a mutation the sandbox refuses": ("{{ messages.append(1) }}", "unsafe"),
    "an OverflowError": ("{{ 10.0 ** 1000 }}", "OverflowError"),
    "a ZeroDivisionError": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "a KeyError": ("{{ '{x}'.format() }}", "KeyError"),
    "a ValueError": ("{{ 'abc'.index('z') }}", "ValueError"),
    "a RecursionError in the parser": ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "RecursionError"),
    "an include with no loader": ("{% include 'other.jinja' %}", "no loader"),
    "a syntax error": ("{% for %}", "does not parse (line 1)"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_one_bad_request_line(name):
    template, expected = HOSTILE[name]
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(100)]
    message = assert_refused(template, expected, tools=tools)
    assert message.endswith(OVERRIDE_HINT), message


def test_nested_loops_over_many_messages_stop_at_the_step_budget():
    chat = [{"role": "user", "content": str(i)} for i in range(1000)]
    assert_refused("{% for a in messages %}{% for b in messages %}{% for c in messages %}"
                   "{% endfor %}{% endfor %}{% endfor %}", STEPS, chat)


def test_raise_exception_is_a_refusal_of_the_messages_not_of_the_template():
    message = assert_refused("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
                             "refused these messages: Conversation roles must alternate user/assistant")
    assert OVERRIDE_HINT not in message


def test_a_long_exception_text_is_cut_to_one_short_line():
    message = assert_refused("{{ raise_exception('why\\n' * 1000) }}", "refused these messages: why why")
    assert len(message) < 400


def test_every_level_of_a_recursive_loop_counts_its_items(monkeypatch):
    monkeypatch.setattr(template_budget, "MAX_STEPS", 50)
    fan_out = "{%% for x in [1] recursive %%}{%% if loop.depth < 2 %%}{{ loop(range(%d)) }}{%% endif %%}{%% endfor %%}"
    assert render_guarded(fan_out % 40) == ""  # 1 item + 2 calls + 40 items
    assert_refused(fan_out % 60, "more than 50 steps")


def test_render_past_the_deadline_is_refused(monkeypatch):
    monkeypatch.setattr(template_budget, "RENDER_SECONDS", 1e-6)
    assert_refused("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", "ran longer than")


def test_each_render_has_its_own_budget(monkeypatch):
    template = "{% for i in range(700) %}{{ i }}{% endfor %}"
    monkeypatch.setattr(template_budget, "MAX_STEPS", 1000)
    for _ in range(3):  # 3 x ~700 steps: would pass 1,000 if the count carried over
        assert render_guarded(template).endswith("699")
    assert_refused("{% for i in range(1001) %}{% endfor %}", "more than 1,000 steps")


def test_a_runaway_render_in_one_thread_leaves_another_render_alone():
    errors = []
    runaway = threading.Thread(target=lambda: errors.append(
        pytest.raises(BadRequestError, render_guarded, HOSTILE["nested huge ranges"][0])))
    runaway.start()
    assert render_guarded(CHATML) == plain_render(CHATML, MESSAGES)
    runaway.join(HANG_GUARD_S)
    assert errors and "steps" in str(errors[0].value)


def test_engine_chat_prompt_raises_the_bad_request():
    from localrun.engine import Engine

    eng = Engine(ScriptedBackend())
    for name in ("a range too large for Python", "a TypeError"):
        eng.chat_template, expected = HOSTILE[name]
        with pytest.raises(BadRequestError, match=expected):
            eng.chat_prompt(MESSAGES)


# -- real templates: exactly what the plain sandbox renders ------------------------------

@pytest.mark.parametrize("template", [CHATML, GEMMA, TOOLS_TEMPLATE, FEATURES_TEMPLATE],
                         ids=["chatml", "gemma", "tools", "features"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_templates_render_as_before(template, add_generation_prompt):
    for messages in (MESSAGES, TOOL_CHAT):
        for extra in ({}, {"tools": TOOLS}):
            args = (template, messages, "<bos>", "<eos>", add_generation_prompt)
            assert render(*args, **extra) == plain_render(*args, **extra)


def test_the_tools_template_renders_tools_and_calls():
    text = render(TOOLS_TEMPLATE, TOOL_CHAT, tools=TOOLS)
    assert '"description": "Name of the city, e.g. Zürich"' in text  # tojson keeps non-ASCII
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text
    assert text.count("<|im_start|>user\n<tool_response>") == 1  # both results in one turn
    assert text.endswith("<|im_start|>assistant\n")


def test_strftime_now_and_the_compiled_template_cache():
    template = "{{ strftime_now('%Y') }}|{{ messages | length }}"
    before = chat_template._compile.cache_info()
    assert render(template, MESSAGES) == f"{datetime.now():%Y}|4"
    assert render(template, MESSAGES[:1]) == f"{datetime.now():%Y}|1"
    after = chat_template._compile.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


def test_the_test_models_templates_render_as_before(llama_engine, gemma3_gguf):
    from localrun.engine import Engine

    with Engine.open(gemma3_gguf, n_ctx=256) as gemma:
        templates = {"smollm2": llama_engine.chat_template, "gemma-3": gemma.chat_template}
    assert templates["gemma-3"] == GEMMA  # its GGUF carries none: the fallback
    for name, template in templates.items():
        for messages in (MESSAGES, TOOL_CHAT):
            args = (template, messages, "<bos>", "<eos>")
            assert render(*args) == plain_render(*args), name
        assert_far_below_the_budget(template)


def long_tool_chat(n: int) -> list[dict]:
    chat = [{"role": "system", "content": "You call tools when they help."}]
    while len(chat) < n:
        i = len(chat)
        chat += [
            {"role": "user", "content": f"Question {i}: " + "lorem ipsum dolor " * 15},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": f"City {i}"}}}]},
            {"role": "tool", "content": '{"temp": 21, "sky": "clear"}'},
            {"role": "assistant", "content": f"It is 21 °C and clear in City {i}."},
        ]
    return chat[:n]


def assert_far_below_the_budget(template: str) -> None:
    """The measurement behind the limits: a 100-message chat with tools (the numbers are in
    template_budget's header). Output tracks the input, so its cap is relative to it."""
    chat = long_tool_chat(100)
    variables = dict(messages=chat, bos_token="<bos>", eos_token="<eos>", add_generation_prompt=True, tools=TOOLS)
    budget = template_budget.RenderBudget.for_input(chat, {"tools": TOOLS})
    text = template_budget.render_bounded(chat_template._compile(template), budget, variables)
    assert text == plain_render(template, chat, "<bos>", "<eos>", tools=TOOLS)
    print(f"steps {budget.steps}, work {budget.work}, output {budget.output}, "
          f"input {template_budget.input_size([chat, TOOLS])}")
    assert budget.steps * 100 <= template_budget.MAX_STEPS
    assert budget.work * 100 <= budget.max_work
    assert budget.output * 20 <= budget.max_output


@pytest.mark.parametrize("template", [CHATML, GEMMA, TOOLS_TEMPLATE, FEATURES_TEMPLATE],
                         ids=["chatml", "gemma", "tools", "features"])
def test_real_templates_stay_far_below_the_budget(template):
    assert_far_below_the_budget(template)


def test_tojson_takes_what_map_and_select_give():
    """llama.cpp's DeepSeek-R1 template writes `tools | map(attribute='function') | tojson`:
    Jinja's map is a generator, which JSON gets as its items."""
    template = "{{ tools | map(attribute='function') | tojson }}|{{ messages | selectattr('role') | tojson }}"
    out = render(template, [{"role": "user", "content": "hi"}], tools=[{"function": {"name": "f"}}],
                 add_generation_prompt=False)
    assert out == '[{"name": "f"}]|[{"role": "user", "content": "hi"}]'
    with pytest.raises(BadRequestError):  # anything else JSON cannot hold is still the template's error
        render("{{ x | tojson }}", [{"role": "user", "content": "hi"}], x=object(), add_generation_prompt=False)
