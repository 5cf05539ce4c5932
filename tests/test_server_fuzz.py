"""Random constraints against a real server while a victim streams (issue 49).

hypothesis writes GBNF and Lark grammars, JSON schemas and tool schemas from small
alphabets of the shapes that have hurt llguidance before (repeats with big counts,
alternations, nested quantifiers, enums, patterns, ambiguous recursion, an options line
of its own), all within the documented caps. Each must be answered within
ANSWER_WAIT_S (a 4xx or a short answer, never a 5xx), while a greedy victim streams
on the same model the whole time and keeps its text. Derandomized: CI sees the same
examples every run.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import Server

MODEL = "smollm2-135m-instruct-q4_1"
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"  # SmolLM2's template has no tools
ANSWER_WAIT_S = 10.0
VICTIM = {"prompt": "Describe a walk through an old city at night.", "n_predict": 48, "temperature": 0,
          "ignore_eos": True, "stream": True, "lookup": False}
FUZZ = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(smollm2_gguf, qwen_coder_gguf):
    srv = Server("--model", str(smollm2_gguf), "--model", str(qwen_coder_gguf), "--ctx", "1024", "--parallel", "2",
                 "--threads", "1")
    yield srv
    srv.stop()


def _victim_text(url: str) -> str:
    parts = []
    with httpx.stream("POST", url + "/completion", json=VICTIM, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                msg = json.loads(line[6:])
                assert "error" not in msg, msg["error"]
                parts.append(msg.get("content", ""))
    return "".join(parts)


@pytest.fixture(scope="module")
def victim(server):
    """A greedy victim streaming back to back while the fuzzing runs; each of its texts
    must equal the text it has alone."""
    alone = _victim_text(server.url)
    texts: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                texts.append(_victim_text(server.url))
            except BaseException as exc:  # reported by the check below, in the test's thread
                errors.append(exc)
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(120)
    assert not errors, errors[0]
    assert texts, "the victim never finished a text"
    assert all(t == alone for t in texts), "the victim's text changed under the fuzzing"


def _ask(server, path: str, body: dict) -> httpx.Response:
    t0 = time.monotonic()
    resp = httpx.post(server.url + path, json=body, timeout=60)
    took = time.monotonic() - t0
    assert took < ANSWER_WAIT_S, f"answered in {took:.1f} s: {json.dumps(body)[:300]}"
    assert resp.status_code < 500, (resp.status_code, resp.text[:300], json.dumps(body)[:300])
    assert "Traceback" not in resp.text
    return resp


# -- grammars ------------------------------------------------------------------------------

_COUNT = st.sampled_from([0, 1, 2, 7, 100, 1000, 10000])
_LITERAL = st.sampled_from(['"a"', '"ab"', '"{"', '"\\n"', '"hello"', '" "'])
_CLASS = st.sampled_from(["[a-z]", "[0-9]", "[^\"]", "[a]", "."])


def _gbnf_expr(depth: int = 0):
    leaf = st.one_of(_LITERAL, _CLASS)
    if depth >= 3:
        return leaf
    inner = st.deferred(lambda: _gbnf_expr(depth + 1))
    return st.one_of(
        leaf,
        st.tuples(inner, st.sampled_from(["*", "+", "?"])).map(lambda t: f"({t[0]}){t[1]}"),
        st.tuples(inner, _COUNT, _COUNT).map(lambda t: f"({t[0]}){{{min(t[1], t[2])},{max(t[1], t[2])}}}"),
        st.tuples(inner, _COUNT).map(lambda t: f"({t[0]}){{{t[1]}}}"),
        st.lists(inner, min_size=2, max_size=4).map(" | ".join),
        st.lists(inner, min_size=2, max_size=4).map(" ".join),
    )


@st.composite
def gbnf(draw) -> str:
    rules = draw(st.lists(_gbnf_expr(), min_size=1, max_size=3))
    lines = ["root ::= r0"] + [f"r{i} ::= {expr}" for i, expr in enumerate(rules)]
    if draw(st.booleans()) and len(rules) > 1:  # a rule that refers to others, maybe recursively
        lines[-1] += f" | r{draw(st.integers(0, len(rules) - 1))} r{len(rules) - 1}"
    return "\n".join(lines)


@st.composite
def lark(draw) -> str:
    options = draw(st.sampled_from(["", "%llguidance {}\n", '%llguidance {"no_forcing": false}\n',
                                    '%llguidance {"no_forcing": false, "allow_invalid_utf8": true}\n']))
    n = draw(st.integers(1, 60))
    shape = draw(st.sampled_from(["ambiguous", "repeat", "regex", "alternation"]))
    count = draw(_COUNT)
    if shape == "ambiguous":  # s_i: s_i s_(i+1) | "a", the row-limit grammar of issue 49
        body = "start: s0\n" + "\n".join(f's{i}: s{i} s{i + 1} | "a"' for i in range(n)) + f'\ns{n}: "a"'
    elif shape == "repeat":
        body = f"start: R{{{count}}}\nR: /[a]{{{draw(_COUNT)}}}/"
    elif shape == "regex":
        body = f"start: /({draw(st.sampled_from(['a', 'ab', '[a-z]', '(a|b)*']))}){{{count}}}/"
    else:
        body = "start: " + " | ".join(f'"w{i}"' for i in range(n * 50))
    return options + body


@FUZZ
@given(grammar=st.one_of(gbnf(), lark()))
def test_random_grammars_are_answered_in_time_without_touching_the_victim(server, victim, grammar):
    resp = _ask(server, "/completion", {"prompt": "a", "n_predict": 8, "temperature": 0, "grammar": grammar})
    if resp.status_code == 200:
        assert len(resp.json()["tokens"]) <= 8


@settings(FUZZ, max_examples=10)
@given(grammar=st.one_of(gbnf(), lark()))
def test_random_grammars_over_the_whole_vocabulary_are_answered_in_time(server, victim, grammar):
    """No truncation (top-k 0): the grammar holds the draw by redrawing what it refuses
    (localrun.grammar.redraw), then by its mask."""
    resp = _ask(server, "/completion", {"prompt": "a", "n_predict": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                        "min_p": 0.0, "seed": 1, "grammar": grammar})
    if resp.status_code == 200:
        assert len(resp.json()["tokens"]) <= 8


# -- fill-in-the-middle ------------------------------------------------------------------------

_FIM_TEXT = st.lists(st.sampled_from(["def ", "x = math.sq", "\n", "    ", "<|fim_middle|>", "<|fim_prefix|>",
                                      "<|endoftext|>", "\x00", "é", "😀", "\r\n", "a" * 1200, " " * 300, "\t"]),
                     max_size=6).map("".join)


@settings(FUZZ, max_examples=12)
@given(prefix=_FIM_TEXT, suffix=_FIM_TEXT, prompt=_FIM_TEXT)
def test_random_infill_texts_are_answered_in_time_without_touching_the_victim(server, victim, prefix, suffix,
                                                                              prompt):
    """The cursor's line moved after <MID> (long lines, special-token text, lone control
    bytes) and token healing of whatever the prompt ends on (server/fim.py)."""
    resp = _ask(server, "/infill", {"model": QWEN, "input_prefix": prefix, "input_suffix": suffix, "prompt": prompt,
                                    "n_predict": 4, "temperature": 0, "lookup": False})
    if resp.status_code == 200:
        assert len(resp.json()["tokens"]) <= 4


# -- JSON schemas and tool schemas ----------------------------------------------------------


def _schema(depth: int = 0, enum_sizes=_COUNT):
    """A JSON schema; `enum_sizes`: how many values an enum may have (a tool's schema is
    rendered into the prompt, so its enums stay short: 10,000 values there is a prompt
    beyond the context, 100 a few seconds of prefill on Qwen, not a grammar's cost)."""
    string = st.one_of(
        st.just({"type": "string"}),
        st.builds(lambda n: {"type": "string", "pattern": f"^a{{{n}}}$"}, _COUNT),
        st.builds(lambda n, m: {"type": "string", "minLength": min(n, m), "maxLength": max(n, m)}, _COUNT, _COUNT),
        st.builds(lambda n: {"enum": [f"value-{i}" for i in range(n)] or ["x"]}, enum_sizes),
        st.builds(lambda n: {"type": "string", "format": n}, st.sampled_from(["date-time", "email", "uuid"])),
    )
    scalar = st.one_of(string, st.just({"type": "integer"}), st.just({"type": "number", "minimum": 0}),
                       st.just({"type": "boolean"}))
    if depth >= 2:
        return scalar
    inner = st.deferred(lambda: _schema(depth + 1, enum_sizes))
    return st.one_of(
        scalar,
        st.builds(lambda s, n, m: {"type": "array", "items": s, "minItems": min(n, m), "maxItems": max(n, m)},
                  inner, _COUNT, _COUNT),
        st.builds(lambda props: {"type": "object", "properties": props, "required": list(props)},
                  st.dictionaries(st.sampled_from(["a", "b", "name", "x y"]), inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=2, max_size=3)),
    )


@FUZZ
@given(schema=_schema())
def test_random_json_schemas_are_answered_in_time_without_touching_the_victim(server, victim, schema):
    resp = _ask(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    if resp.status_code == 200:
        assert resp.json()["usage"]["completion_tokens"] <= 8


@settings(FUZZ, max_examples=5)
@given(params=_schema(enum_sizes=st.sampled_from([0, 1, 2, 7])), choice=st.sampled_from(["required", "auto"]))
def test_random_tool_schemas_are_answered_in_time_without_touching_the_victim(server, victim, params, choice):
    """On Qwen (the victim streams on SmolLM2: the server's loop, memory and CPU are shared)."""
    parameters = params if params.get("type") == "object" else {"type": "object", "properties": {"v": params},
                                                                  "required": ["v"]}
    resp = _ask(server, "/v1/chat/completions", {
        "model": QWEN, "max_tokens": 8, "temperature": 0, "tool_choice": choice, "lookup": False,
        "messages": [{"role": "user", "content": "call f"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]})
    if resp.status_code == 200:
        assert resp.json()["usage"]["completion_tokens"] <= 8
