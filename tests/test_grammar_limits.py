"""Grammars from a request cannot hang or crash the process (localrun.grammar.core).

Pre-processing is linear (unclosed literals and classes, thousands of rules), every size
cap answers with one line naming its constant, a grammar over llguidance's limits is
refused when validated, nested repeats no longer cost seconds a mask (llguidance's forcing
is off), and a rule chain deep enough to overflow a default thread stack in llguidance
compiles on the deep-stack compile thread. Normal grammars still work. No model: the
tokenizer is the scripted byte vocabulary of tests/fakes.py.

`within(...)` is a hang guard (10 s, against inputs that took 10 s to hours on the
quadratic code this replaced), not a speed check.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fakes import EOS, ScriptedBackend, make_info
from localrun.grammar import gbnf
from localrun.grammar import core as grammar
from localrun.errors import BadRequestError
from localrun.grammar.core import Grammar
from localrun.grammar.matcher import GrammarMatcher
from localrun.grammar.tokenizer import build_tokenizer

GUARD_S = 10
REPO = Path(__file__).resolve().parents[1]


class _StillRunning(Exception):
    """Raised by the hang guard's alarm: the call under test did not return in time."""


def within(fn, *args):
    """fn(*args), failing the test if it runs past GUARD_S. SIGALRM interrupts Python
    code, the regex engine and a wait for the compile thread alike (a watchdog thread
    would not: a long regex match never hands back the GIL)."""

    def alarm(signum, frame):
        raise _StillRunning

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, GUARD_S)
    try:
        return fn(*args)
    except _StillRunning:
        pytest.fail(f"{getattr(fn, '__qualname__', fn)} still running after {GUARD_S} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refused(fn, *args) -> str:
    """The one-line BadRequestError message fn(*args) raises (within the guard)."""
    with pytest.raises(BadRequestError) as exc:
        within(fn, *args)
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def byte_backend():
    return ScriptedBackend()  # held by the test: the tokenizer refers to it weakly


@pytest.fixture(scope="module")
def tok(byte_backend):
    return build_tokenizer(byte_backend)


def first_bytes(g: Grammar, tok) -> bytes:
    """The bytes a fresh matcher allows first (EOS left out)."""
    allowed = np.flatnonzero(GrammarMatcher(g, tok).allowed_mask())
    return bytes(int(t) for t in allowed if t < 256)


# -- linear pre-processing --------------------------------------------------------------


def regex_blank(text: str) -> str:
    """The blanking regex the scanner replaced (quadratic on unclosed openers)."""
    return re.sub(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', lambda m: " " * len(m.group()), text)


def test_scanner_blanks_exactly_what_the_regex_did():
    rng = random.Random(13)
    samples = ['root ::= "a[" [x"] # "q\n', '"\\"" [\\]] "\\\n" [a', '# x\n"#" [#]', '[[]"["', '\\"a"']
    samples += ["".join(rng.choice('"[]\\#\na ') for _ in range(rng.randint(0, 24))) for _ in range(20000)]
    for text in samples:
        assert gbnf.blank_quoted(text) == regex_blank(text), repr(text)


@pytest.mark.parametrize("body", ["[", '\\"', "[\\]"], ids=["brackets", "escaped-quotes", "escaped-closers"])
def test_unclosed_openers_scan_in_one_pass(body):
    """Every opener here fails to close, and each one made the regex rescan to the end."""
    text = "root ::= " + body[-2:] + body * (200_000 // len(body))
    assert within(gbnf.blank_quoted, text) == text  # nothing closes: nothing blanked


def test_forty_thousand_brackets_are_refused_quickly():
    msg = refused(Grammar.from_gbnf, "root ::= " + "[" * 40_000)
    assert msg == "bad GBNF grammar at line 1, column 40010: Unexpected end of input"


def chain_gbnf(n: int, big_rule_items: int = 0) -> str:
    """root -> big -> r1 -> r2 ... -> rn -> "a", defined head first: llguidance's own
    terminal marking needs one pass per link of such a chain."""
    big = 'big ::= ' + '"a" ' * big_rule_items + "r1\n"
    return "root ::= big\n" + big + "".join(f"r{i} ::= r{i + 1}\n" for i in range(1, n)) + f'r{n} ::= "a"\n'


def test_a_long_chain_of_rules_converts_in_linear_time(tok):
    text = chain_gbnf(4000, big_rule_items=16_000)  # ~120 KiB; 18 s on the quadratic marking
    assert len(text.encode()) <= grammar.MAX_GRAMMAR_BYTES
    g = within(Grammar.from_gbnf, text)
    assert first_bytes(g, tok) == b"a"


def test_terminal_rules_match_llguidances_own_conversion():
    """Preset marks, same answer: every rule of the chain becomes a Lark token (upper
    case), exactly as llguidance's converter writes it, and a recursive rule does not."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    text = chain_gbnf(30, big_rule_items=3) + 'loop ::= "(" loop ")" | "x"\nroot2 ::= loop\n'
    ours, theirs = gbnf.gbnf_to_lark_text(text), gbnf_to_lark(text)
    # theirs opens with a `%llguidance {}` line; ours has none (grammar.lark_spec adds localrun's options)
    assert [l for l in ours.splitlines() if l] == [l for l in theirs.splitlines() if l][1:]
    assert "R30: \"a\"" in ours and "\nloop: " in ours and ours.startswith("start: BIG\n")


def test_every_reference_to_a_rule_named_start_is_renamed_in_one_pass(tok):
    n = 1500  # each rule refers to `start`
    refs = "".join(f'r{i} ::= start | "," r{i + 1}\n' for i in range(n))
    text = f'root ::= start\nstart ::= "a" | "(" r0 ")"\n{refs}r{n} ::= start\n'
    g = within(Grammar.from_gbnf, text)
    assert first_bytes(g, tok) == b"(a"


def test_deeply_nested_groups_are_one_line():
    msg = refused(Grammar.from_gbnf, "root ::= " + "(" * 2000 + '"a"' + ")" * 2000)
    assert "nested too deeply" in msg


def test_a_grammar_that_matches_no_text_is_refused():
    assert "matches no text" in refused(Grammar.from_lark, 'start: s\ns: s s "a"')


# -- size caps, checked before any work -----------------------------------------------


@pytest.mark.parametrize(
    "make, constant",
    [
        (lambda n: Grammar.from_gbnf("root ::= [" + "a" * n), "MAX_GRAMMAR_BYTES"),  # also unclosed
        (lambda n: Grammar.from_gbnf("%llguidance {}\nstart: " + '"é"' * (n // 4)), "MAX_GRAMMAR_BYTES"),
        (lambda n: Grammar.from_lark("start: " + '"x" ' * (n // 4)), "MAX_GRAMMAR_BYTES"),
        (lambda n: Grammar.from_regex("(" + "a|" * (n // 2) + "b"), "MAX_REGEX_BYTES"),  # also unclosed
        (lambda n: Grammar.from_json_schema('{"enum": [' + '"x",' * (n // 4)), "MAX_SCHEMA_BYTES"),
        (lambda n: Grammar.from_json_schema({"enum": ["x" * 1000] * (n // 1000)}), "MAX_SCHEMA_BYTES"),
        (lambda n: Grammar.from_json_schema({"enum": list(range(n))}), "MAX_SCHEMA_BYTES"),
    ],
)
def test_each_size_cap_names_its_limit(make, constant):
    limit = getattr(grammar, constant)
    msg = refused(make, limit + 16)
    assert constant in msg and f"{limit:,}" in msg, msg


def test_a_source_just_under_the_cap_is_read():
    text = "root ::= " + '"x" ' * ((grammar.MAX_GRAMMAR_BYTES - 20) // 4)
    assert within(Grammar.from_gbnf, text).kind == "gbnf"


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "schema",
    [
        nested(grammar.MAX_SCHEMA_DEPTH),  # each level: the array's schema object
        nested(5000),  # json.dumps would end in RecursionError
        "[" * 100_000 + "]" * 100_000,  # and so would json.loads
    ],
    ids=["just-over", "5000-deep", "text-100000-deep"],
)
def test_schema_nesting_is_capped(schema):
    assert "MAX_SCHEMA_DEPTH" in refused(Grammar.from_json_schema, schema)


def test_schema_nesting_under_the_cap_compiles(tok):
    g = within(Grammar.from_json_schema, nested(grammar.MAX_SCHEMA_DEPTH // 2 - 1))
    assert first_bytes(g, tok) == b"["


def test_a_self_referencing_schema_object_is_refused_not_looped():
    schema: dict = {"type": "object", "properties": {}}
    schema["properties"]["me"] = schema
    assert "MAX_SCHEMA_DEPTH" in refused(Grammar.from_json_schema, schema)


# -- llguidance's budget ------------------------------------------------------------------


def test_lexer_work_over_the_budget_is_refused_when_validated(monkeypatch, tok):
    enum = {"enum": [f"item {i:05d}" for i in range(2000)]}
    assert first_bytes(within(Grammar.from_json_schema, enum), tok) == b'"'
    monkeypatch.setattr(grammar, "LEXER_FUEL", 10_000)
    msg = refused(Grammar.from_json_schema, enum)
    assert "too big" in msg and "LEXER_FUEL=10,000" in msg, msg


def test_parser_limits_are_refused_when_validated():
    msg = refused(Grammar.from_gbnf, "%llguidance {}\nstart: " + " | ".join(f'"w{i}"' for i in range(3000)))
    assert "max is 2000" in msg


@pytest.mark.parametrize(
    "make, first",
    [
        (lambda: Grammar.from_regex("a{1000}{1000}"), b"a"),  # 0.9-4.7 s a mask with llguidance's forcing
        (lambda: Grammar.from_json_schema({"type": "string", "pattern": "^a{1000}{1000}$"}), b'"'),
        (lambda: Grammar.from_gbnf("root ::= x\nx ::= y{300}\ny ::= [a]{300}"), b"a"),
        (lambda: Grammar.from_regex("(?:(a|aa)*b)" * 50), b"ab"),
        (lambda: Grammar.from_regex("[^x]{5000}"), None),
        (lambda: Grammar.from_regex("(" + "|".join(f"w{i}" for i in range(2000)) + ")"), b"w"),
        (lambda: Grammar.from_json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 10**6}), b"["),
        (lambda: Grammar.from_json_schema({"type": "string", "minLength": 10**5, "maxLength": 10**6}), b'"'),
        (lambda: Grammar.from_json_schema({"enum": [f"{i:06d}" + "x" * 94 for i in range(2500)]}), b'"'),
        (lambda: Grammar.from_json_schema({"type": "object", "required": [f"p{i}" for i in range(1000)],
                                           "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}), b"{"),
    ],
    ids=["nested-repeat", "schema-pattern", "gbnf-nested-repeat", "alternation-star", "class-5000", "2000-words", "minItems-1e6", "maxLength-1e6", "enum-256KiB", "1000-props"],
)
def test_large_but_cheap_constraints_still_compile(tok, make, first):
    g = within(make)
    allowed = first_bytes(g, tok)
    assert allowed and (first is None or allowed == first), allowed


class TwoByteBackend(ScriptedBackend):
    """The byte vocabulary plus token 257, "aa"; `tokenize` still spells bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.info = make_info(n_vocab=258)

    def token_bytes(self, token: int) -> bytes:
        return b"aa" if token == 257 else super().token_bytes(token)

    def is_control(self, token: int) -> bool:
        return token == EOS


def test_fixed_text_is_not_walked_ahead_or_force_tokenized():
    """llguidance's forcing walks through text the grammar fixes (10^4 bytes here, 10^8
    for `r{10000}` of `[a]{10000}`: 2.9 s and 1.6 GB per mask) and then allows only its
    canonical tokens ("a" here). Off: "aa" is allowed too, and the walk never happens."""
    be = TwoByteBackend()
    tok2 = build_tokenizer(be)
    for text in ("root ::= r{100}\nr ::= [a]{100}", "root ::= r{10000}\nr ::= [a]{10000}"):
        m = within(GrammarMatcher, within(Grammar.from_gbnf, text), tok2)
        allowed = np.flatnonzero(within(m.allowed_mask)).tolist()
        assert allowed == [ord("a"), 257], allowed
        m.accept(257)
        assert np.flatnonzero(within(m.allowed_mask)).tolist() == [ord("a"), 257]


DEEP_CHAIN = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    from fakes import EOS, ScriptedBackend, make_info
    from localrun.grammar.core import Grammar
    from localrun.grammar.matcher import GrammarMatcher
    from localrun.grammar.tokenizer import build_tokenizer
    n = 8000  # about 100 KiB of Lark
    lark = "%llguidance {}\\nstart: r1\\n" + "".join(f"r{i}: r{i + 1}\\n" for i in range(1, n)) + f'r{n}: "a"\\n'
    n = 5000  # about 180 KiB of JSON
    defs = {f"{i:x}": {"$ref": f"#/$defs/{i + 1:x}"} for i in range(n)}
    defs[f"{n:x}"] = {"type": "integer"}
    be = ScriptedBackend()
    tok = build_tokenizer(be)
    for g in (Grammar.from_gbnf(lark), Grammar.from_json_schema({"$ref": "#/$defs/0", "$defs": defs})):
        m = GrammarMatcher(g, tok)
        print(g.kind, bool(m.allowed_mask().any()))
    """
)


def test_a_deep_rule_chain_compiles_without_overflowing_the_stack():
    """8,000 chained rules (or 5,000 $refs) recurse past a default 8 MiB thread stack inside
    llguidance: a segfault, on the old code, of whatever process validated the request.
    In a subprocess, from its main thread, so a crash fails this test and only it."""
    done = subprocess.run([sys.executable, "-c", DEEP_CHAIN], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split() == ["lark", "True", "json_schema", "True"]


# -- normal grammars, and the matcher as a copy of a compiled start ---------------------


SUM_GBNF = r"""
root ::= expr " = " num "\n"
expr ::= term (op term){0,3}
term ::= num | "(" expr ")"
op   ::= " + " | " - " | " * "
num  ::= [0-9]{1,3}
"""


def two_hundred_rules() -> str:
    rules = [f'r{i} ::= "w{i} " (r{i + 1} | [a-z]{{1,5}} | "(" r0 ")")' for i in range(199)]
    return "root ::= r0\n" + "\n".join(rules) + '\nr199 ::= "end"\n'


@pytest.mark.parametrize(
    "make, first",
    [
        (lambda: Grammar.from_gbnf(SUM_GBNF), b"(0123456789"),
        (lambda: Grammar.from_gbnf(two_hundred_rules()), b"w"),
        (lambda: Grammar.from_gbnf('root ::= start\nstart ::= "a" # start'), b"a"),
        (lambda: Grammar.from_lark('start: "ok" <[256]>'), b"o"),  # names a token: no byte probe
        (lambda: Grammar.from_regex(r"(yes|no|maybe), [0-9]{1,3} (apples|pears|plums)\."), b"mny"),
        (lambda: Grammar.from_json_schema({"type": "object", "properties": {"a": {"type": "string"}}}), b"{"),
    ],
    ids=["sum", "200-rules", "start-rule", "lark-token", "regex", "schema"],
)
def test_normal_grammars_still_work(tok, make, first):
    assert first_bytes(within(make), tok) == first


def test_matchers_copy_one_compiled_start(tok):
    g = Grammar.from_json_schema({"type": "array", "items": {"type": "integer"}})
    assert not g._compiled
    g.compile(tok)
    assert list(g._compiled) == [id(tok)]
    start = g._compiled[id(tok)][1]
    a, b = GrammarMatcher(g, tok), GrammarMatcher(g, tok)
    assert g._compiled[id(tok)][1] is start  # compiled once, copied twice
    for t in b"[1,":
        a.accept(t)
    assert first_bytes(g, tok) == b"["  # neither the start state nor b moved
    assert b.allowed_mask()[ord("[")] and not a.allowed_mask()[ord("[")]


def test_a_grammar_equal_in_value_shares_nothing_mutable():
    g, h = Grammar.from_regex("[ab]"), Grammar.from_regex("[ab]")
    assert g == h and g._compiled is not h._compiled
    assert json.loads(Grammar.from_json_schema({"type": "object"}).source) == {"type": "object"}
