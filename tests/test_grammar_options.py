"""Issue 49, part A: localrun owns llguidance's options, every grammar is compiled in
`prepare` (off the scheduler thread), and JSON output has bounded whitespace.

- Every grammar text is made by `localrun.grammar.core.lark_spec`: a scan of the source tree
  fails on any other place that builds one (llguidance's builders, `%llguidance` or
  `x-guidance` text), and a request's `%llguidance` line may not set an option.
- The two attacks of the issue (a grammar that turned forcing back on; a tool schema of
  10,000 strings of `^a{10000}$` under tool_choice "required") are answered within
  seconds and a bounded amount of memory, on a real model, in a child process with a
  memory limit.
- After `prepare`, starting a generation compiles nothing; a compile past its budget is
  a 400 naming the field.
- JSON grammars allow one newline and at most 20 spaces/tabs between tokens, whatever
  the schema's own `x-guidance` says, and an answer's last tokens close what is open
  (json_budget); sampled answers on the small models (seeded, temperature 1.0) all
  validate, loops cut by max_tokens too, and never hold a blank line
  (scripts/bench/check_json_whitespace.py runs the same on 100 seeds).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import localrun.grammar.core as grammar_module
from localrun.engine import Engine
from localrun.errors import BadRequestError
from localrun.grammar.core import LLG_OPTIONS, Grammar, lark_spec
from localrun.grammar.json_budget import budget_tokens, inside_string, narrow
from localrun.grammar.matcher import GrammarMatcher
from localrun.grammar.tokenizer import build_tokenizer
from localrun.request import GenerationRequest, prepare
from localrun.sampling import SamplingParams
from localrun.tools import HERMES, ToolChoice, call_grammar, parse_tools

from fakes import ScriptedBackend
from scripts.bench.check_json_whitespace import SCHEMA, sample_answers
from test_grammar_limits import TwoByteBackend  # the byte vocabulary plus "aa", which forcing would refuse

ROOT = Path(__file__).resolve().parent.parent

# -- one constructor ---------------------------------------------------------------------

SCANNED = ("localrun", "backends", "quant", "tui")
# llguidance's ways to make or compile a grammar; its names appear only in grammar.py
# (its `grammar_from` function is caught by the import rule: localrun has a function of
# that name, localrun.server.fields.grammar_from)
BUILDERS = {"grammar_from_lark", "grammar_from_json_schema", "grammar_from_regex",
            "validate_grammar", "LLMatcher", "LLInterpreter", "regex_to_lark"}
CONSTRUCTOR = ("localrun/grammar/core.py", "lark_spec")  # the only function that may call grammar_from_lark
# text that sets llguidance options (a Lark options line) or JSON-schema layout
OPTION_TEXT = ("%llguidance", "x-guidance")
LLGUIDANCE_IMPORTERS = {"localrun/grammar/core.py", "localrun/grammar/gbnf.py"}  # gbnf.py: the GBNF converter only


def grammar_builders(root: Path, files) -> list[str]:
    """Every place in `files` (paths relative to `root`) that builds llguidance grammar
    text or compiles one outside the constructor: 'path:line: what'."""
    found = []
    for rel in files:
        rel = str(rel)
        tree = ast.parse((root / rel).read_text(), rel)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        docstrings = {
            id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }

        def enclosing(node, kinds):
            while node in parents:
                node = parents[node]
                if isinstance(node, kinds):
                    return node
            return None

        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in BUILDERS:
                fn = enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                if rel != CONSTRUCTOR[0]:
                    found.append(f"{where}: {name}")
                elif name == "grammar_from_lark" and (fn is None or fn.name != CONSTRUCTOR[1]):
                    found.append(f"{where}: grammar_from_lark outside {CONSTRUCTOR[1]}()")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                imported = {a.name for a in node.names}
                if any(m.split(".")[0] == "llguidance" for m in modules) and rel not in LLGUIDANCE_IMPORTERS:
                    found.append(f"{where}: imports llguidance")
                if imported & BUILDERS and rel != CONSTRUCTOR[0]:
                    found.append(f"{where}: imports {sorted(imported & BUILDERS)}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and rel != CONSTRUCTOR[0]:
                # a docstring or an error message may tell a user what to write; any other
                # text holding these is grammar text or options made outside the constructor
                hits = [t for t in OPTION_TEXT if t in node.value.lower()]
                if hits and id(node) not in docstrings and enclosing(node, ast.Raise) is None:
                    found.append(f"{where}: writes {hits[0]}")
    return found


def source_files() -> list[Path]:
    files = [p.relative_to(ROOT) for d in SCANNED if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50 and Path("localrun/tools/constraint.py") in files  # the scan reads the real tree
    return files


def test_every_grammar_is_built_by_the_one_constructor():
    assert grammar_builders(ROOT, source_files()) == []


def test_the_scan_finds_each_kind_of_bypass(tmp_path):
    """The scan itself fails on each way around lark_spec (the pre-issue tool grammar among them)."""
    bypasses = {
        "a.py": 'import llguidance\ndef g(t):\n    return llguidance.LLMatcher.grammar_from_lark(t)\n',
        "b.py": 'LINES = ["%llguidance {}", "start: x"]\n',
        "c.py": 'def s(p):\n    return {**p, "x-guidance": {"whitespace_flexible": True}}\n',
        "d.py": 'from llguidance import LLMatcher\n',
        "localrun/grammar/core.py": 'def other(t):\n    return _llg.LLMatcher.grammar_from_lark(t)\n',
        "ok.py": 'def f():\n    """Write %llguidance {} first."""\n    raise ValueError("use %llguidance {}")\n',
    }
    for rel, text in bypasses.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = grammar_builders(tmp_path, list(bypasses))
    assert {f.split(":")[0] for f in found} == set(bypasses) - {"ok.py"}, found
    assert any("grammar_from_lark outside lark_spec" in f for f in found)


def test_a_spec_not_made_by_the_constructor_is_refused():
    with pytest.raises(ValueError, match="lark_spec"):
        Grammar("lark", 'start: "a"', 'start: "a"')


@pytest.mark.parametrize(
    "text, line",
    [
        ('%llguidance {"no_forcing": false}\nstart: R{10000}\nR: /[a]{10000}/', 1),  # the issue's attack
        ('start: "a"\n%llguidance {"no_forcing": false}\n', 2),  # llguidance merges lines, the last winning
        ('%llguidance {\n  "no_forcing": true,\n  "no_forcing": false\n}\nstart: "a"', 1),  # a repeated key
        ('%llguidance {"allow_invalid_utf8": true}\nstart: /[\\x00-\\xff]+/', 1),
        ('%llguidance {"ignore_once": true}\nstart: "a"', 1),  # any option localrun does not set
        ('start: "a" sub\nsub: %lark {\n  %llguidance {"no_forcing": false}\n  start: "b"\n}\n', 3),  # a nested grammar's own
    ],
    ids=["forcing-on", "later-line", "repeated-key", "invalid-utf8", "other-option", "nested-lark"],
)
def test_a_request_may_not_set_llguidance_options(text, line):
    # GBNF text whose first line is %llguidance is Lark (llama.cpp's convention)
    for make in (Grammar.from_lark, Grammar.from_gbnf) if text.startswith("%") else (Grammar.from_lark,):
        with pytest.raises(BadRequestError, match=rf"^bad Lark grammar at line {line}: %llguidance may not set"):
            make(text)


@pytest.mark.parametrize("line", ["%llguidance {}", '%llguidance {"no_forcing": true}', "%llguidance{}"])
def test_options_lines_that_set_nothing_new_are_kept(line):
    """llama.cpp's "this text is Lark" mark, and localrun's own values, still work."""
    g = Grammar.from_gbnf(f'{line}\nstart: "a"+')
    assert g.kind == "lark" and g.spec.endswith("%llguidance " + json.dumps(LLG_OPTIONS) + "\n")


def test_reading_options_lines_stays_linear():
    """Each mention is read to the end of its JSON, so their number is capped; JSON
    nested past Python's recursion limit is no options object (llguidance refuses it)."""
    with pytest.raises(BadRequestError, match=r"^bad Lark grammar: it mentions %llguidance over 16 times$"):
        Grammar.from_lark("%llguidance {}\n" * 17 + 'start: "a"')
    with pytest.raises(BadRequestError, match="^bad Lark grammar"):
        Grammar.from_lark('%llguidance {"a": ' + "[" * 100_000 + '\nstart: "a"')


def test_lark_errors_keep_the_request_s_line_numbers():
    with pytest.raises(BadRequestError, match=r"^bad Lark grammar at line 3, column \d+"):
        Grammar.from_lark('%llguidance {}\nstart: x\nx: "a" (\n')


def test_localrun_options_win_over_a_line_the_check_would_miss():
    """lark_spec appends its options after all of the text, so even an options line that
    skipped the request check (from_request=False) cannot turn forcing back on: the
    issue's grammar costs ~0.1 ms a mask and "aa" stays allowed (forcing allows only the
    canonical "a", after walking 10^8 bytes a mask)."""
    text = '%llguidance {"no_forcing": false}\nstart: R{10000}\nR: /[a]{10000}/'
    tok = build_tokenizer(TwoByteBackend())
    g = Grammar("lark", text, lark_spec(text, from_request=False))
    m = GrammarMatcher(g, tok)
    for _ in range(3):
        assert np.flatnonzero(m.allowed_mask()).tolist() == [ord("a"), 257]
        m.accept(257)


# -- the issue's attacks, on a real model, in a child with a memory limit ----------------

ATTACKS = textwrap.dedent(
    """
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a regression fails here, not the machine
    from localrun.engine import Engine
    from localrun.errors import BadRequestError
    from localrun.grammar.core import Grammar
    from localrun.grammar.tokenizer import build_tokenizer
    from localrun.request import GenerationRequest, prepare
    from localrun.sampling import SamplingParams

    def rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def run(eng, req, steps=4):
        # (seconds in prepare, the slowest of `steps` constrained decode steps)
        t0 = time.perf_counter()
        req = prepare(eng, req)  # compiles and builds the first mask
        took = time.perf_counter() - t0
        gen = eng.start(eng.chat_prompt([{"role": "user", "content": "hi"}], tools=req.tools), req)
        slowest = 0.0
        try:
            while not gen.decoding:  # the prompt (its last chunk samples the first token)
                eng.step([gen])
            for _ in range(steps):  # a mask and a token each
                t1 = time.perf_counter()
                eng.step([gen])
                slowest = max(slowest, time.perf_counter() - t1)
        finally:
            eng.release(gen)
        return took, slowest

    with Engine.open(sys.argv[1], n_ctx=512) as eng:
        build_tokenizer(eng.backend)
        greedy = SamplingParams(temperature=0)
        before = rss()
        out = {}
        t0 = time.perf_counter()
        try:
            Grammar.from_gbnf('%llguidance {"no_forcing": false}\\nstart: R{10000}\\nR: /[a]{10000}/')
            out["forcing_line"] = "accepted"
        except BadRequestError as exc:
            out["forcing_line"] = str(exc)
        out["forcing_line_s"] = time.perf_counter() - t0
        g = Grammar.from_gbnf('%llguidance {}\\nstart: R{10000}\\nR: /[a]{10000}/')
        out["grammar_s"] = run(eng, GenerationRequest(sampling=greedy, max_tokens=8, grammar=g))
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "xs": {"type": "array", "items": {"type": "string", "pattern": "^a{10000}$"}, "minItems": 10000}},
            "required": ["xs"]}}}]
        out["tools_s"] = run(eng, GenerationRequest(sampling=greedy, max_tokens=8, tools=tools, tool_choice="required"))
        out["rss_growth"] = rss() - before
    print(json.dumps(out))
    """
)


def test_the_issue_s_attacks_are_answered_fast_in_bounded_memory(qwen_coder_gguf):
    """Before: the grammar froze a server ~100 s (13.6 GiB); the tool schema stalled
    every stream 35-104 s (5.8 GiB). Now: the options line is a 400 at once; the same
    grammar without it, and the tool schema, compile, build their first mask and decode a
    few constrained steps within seconds on Qwen2.5-Coder's 151k vocabulary."""
    proc = subprocess.run([sys.executable, "-c", ATTACKS, str(qwen_coder_gguf)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["forcing_line"].startswith("bad Lark grammar at line 1: %llguidance may not set"), out
    assert out["forcing_line_s"] < 1.0, out
    # measured on 2 busy cores: prepare (compile + first mask) 1 ms and 8 ms, the slowest
    # constrained step ~0.1 s (a 0.5B model's decode)
    assert out["grammar_s"][0] < 2.0 and out["tools_s"][0] < 2.0, out
    assert out["grammar_s"][1] < 1.0 and out["tools_s"][1] < 1.0, out
    assert out["rss_growth"] < 1 << 30, out


# -- every grammar compiled in prepare ----------------------------------------------------

KINDS = {
    "gbnf": lambda: Grammar.from_gbnf('root ::= "yes" | "no"'),
    "lark": lambda: Grammar.from_lark('start: "a"+'),
    "json_schema": lambda: Grammar.from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
    "regex": lambda: Grammar.from_regex("[0-9]{1,4}"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_after_prepare_starting_a_generation_compiles_nothing(llama_engine, monkeypatch, kind):
    eng = llama_engine
    req = prepare(eng, GenerationRequest(sampling=SamplingParams(temperature=0), max_tokens=3, grammar=KINDS[kind]()))
    tok = build_tokenizer(eng.backend)
    _, first_mask = req.grammar._start_state(tok)
    assert first_mask is not None and first_mask.any()  # the first mask is ready too

    def no_compiling(*args):
        raise AssertionError("compiled on the scheduler's side of prepare()")

    monkeypatch.setattr(grammar_module, "_compile_matcher", no_compiling)
    gen = eng.start(eng.chat_prompt([{"role": "user", "content": "Say yes"}]), req)
    try:
        assert gen.matcher is not None and gen.matcher.allowed_mask() is first_mask  # a copy of the ready state
        while not gen.done:
            eng.step([gen])
        assert gen.error is None
    finally:
        eng.release(gen)


def test_prepare_compiles_the_tools_call_grammar_too(monkeypatch):
    """The tools' call grammar, made per model and tool set, is compiled in prepare."""
    from test_tools import HERMES_TEMPLATE

    eng = Engine(ScriptedBackend(), chat_template=HERMES_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = prepare(eng, GenerationRequest(max_tokens=2, tools=tools, tool_choice="required"))
    monkeypatch.setattr(grammar_module, "_compile_matcher", lambda *a: pytest.fail("compiled in start"))
    gen = eng.start([1, 2, 3], req)
    assert gen.matcher is not None
    eng.release(gen)


def test_a_compile_over_its_budget_is_a_400_naming_the_field(monkeypatch):
    """The budget counts from when the compile starts on its thread."""
    import time

    import localrun.request as request_module

    real = grammar_module._compile_matcher

    def slow(spec, tok):
        time.sleep(0.5)
        return real(spec, tok)

    monkeypatch.setattr(grammar_module, "_compile_matcher", slow)
    monkeypatch.setattr(request_module, "COMPILE_BUDGET_S", 0.1)
    eng = Engine(ScriptedBackend())
    for make, field in ((KINDS["json_schema"], "json_schema"), (KINDS["gbnf"], "grammar"), (KINDS["regex"], "regex")):
        with pytest.raises(BadRequestError, match=rf"^'{field}': the grammar took over 0.1 s to compile .*COMPILE_BUDGET_S"):
            prepare(eng, GenerationRequest(grammar=make()))


def test_a_grammar_the_model_cannot_compile_is_a_400_in_prepare():
    """A token name this vocabulary lacks: refused in prepare, naming the field."""
    eng = Engine(ScriptedBackend())
    with pytest.raises(BadRequestError, match=r"^'grammar': the grammar does not compile for this model"):
        prepare(eng, GenerationRequest(grammar=Grammar.from_lark('start: "a" <|no_such_token|>')))


# -- bounded JSON whitespace --------------------------------------------------------------

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}},
                                        "c": {"type": "object"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer(ScriptedBackend())


def accepts(g: Grammar, tok, text: str) -> bool:
    m = GrammarMatcher(g, tok)
    for b in text.encode():
        if not m.allows(b):
            return False
        m.accept(b)
    return m.is_accepting()


GOOD = ['{"a":1}', '{"a": 1, "b": ["x", "y"]}', '{\n  "a": 1,\n  "b": [\n    "x"\n  ],\n  "c": {}\n}',
        '{"a":1' + " " * 20 + "}", '{"a"\n:\n1}']
BAD = ['{\n\n"a":1}', '{"a":1,"b":[\n\n]}', '{"a":1,"c":{\n \n}}', '{"a":1' + " " * 21 + "}", '{"a":1 \n}',
       '{"a":1\t\n}', '{"a":1}\n']


@pytest.mark.parametrize("own", [None, {"whitespace_flexible": True}, {"whitespace_pattern": "\\s+"},
                                 {"item_separator": "\\s*,\\s*", "key_separator": "\\s*:\\s*"}],
                         ids=["no-x-guidance", "flexible", "own-pattern", "own-separators"])
def test_json_whitespace_is_one_newline_and_20_columns(byte_tok, own):
    """A schema's own x-guidance cannot lift the bound (llguidance reads its layout keys
    from the top-level x-guidance, which localrun writes)."""
    g = Grammar.from_json_schema(OBJ if own is None else {**OBJ, "x-guidance": own})
    assert [t for t in GOOD if not accepts(g, byte_tok, t)] == []
    assert [t for t in BAD if accepts(g, byte_tok, t)] == []


def test_every_json_grammar_has_the_bound(byte_tok):
    """json_object (response_format / Ollama "json" / --json), `true`, and a schema string;
    the schema's own non-layout options (lenient) still apply."""
    for g in (Grammar.json_object(), Grammar.from_json_schema(True), Grammar.from_json_schema(json.dumps(OBJ))):
        assert accepts(g, byte_tok, '{\n  "a": 1\n}') and not accepts(g, byte_tok, '{\n\n  "a": 1\n}')
    with pytest.raises(BadRequestError):
        Grammar.from_json_schema({"type": "string", "format": "no-such-format"})
    lenient = Grammar.from_json_schema({"type": "string", "format": "no-such-format", "x-guidance": {"lenient": True}})
    assert accepts(lenient, byte_tok, '"x"')


def test_tool_arguments_keep_the_compact_layout(byte_tok):
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "x-guidance": {"whitespace_flexible": True}}}}])
    g = call_grammar(HERMES, tools, ToolChoice("required"))
    call = '<tool_call>\n{{"name": "f", "arguments": {}}}\n</tool_call>'
    assert accepts(g, byte_tok, call.format('{"a": 1, "b": 2}'))
    assert not accepts(g, byte_tok, call.format('{"a": 1,\n"b": 2}'))


@pytest.fixture(scope="module")
def qwen_engine_8(qwen_coder_gguf):
    with Engine.open(qwen_coder_gguf, n_ctx=384, n_seq=8) as eng:
        yield eng


@pytest.fixture(scope="module")
def smollm2_engine_8(smollm2_gguf):
    with Engine.open(smollm2_gguf, n_ctx=384, n_seq=8) as eng:
        yield eng


@pytest.mark.parametrize("model, seeds", [("smollm2_engine_8", 16), ("qwen_engine_8", 8)])
def test_sampled_json_answers_validate_and_hold_no_blank_line(request, model, seeds):
    """The issue's failure: SmolLM2 at temperature 0.9 wandered into blank lines after an
    array and never closed the object. Seeded, temperature 1.0, 120 tokens, decoded 8 at
    a time: every answer that stopped on its own validates, and none holds "\\n\\n" (the
    100-seed numbers: scripts/bench/check_json_whitespace.py)."""
    answers = sample_answers(request.getfixturevalue(model), range(seeds), temperature=1.0, max_tokens=120)
    stopped = [a for a in answers if a.finish_reason == "stop"]
    # those that looped in their array too (SmolLM2's seed 8): closed in the last tokens
    assert [a.text for a in answers if not a.valid(SCHEMA)] == []
    assert [a.text for a in answers if a.blank_line] == []
    assert len(stopped) >= seeds // 2, [a.text for a in answers]  # most close their object within 120 tokens


def test_an_answer_the_budget_would_cut_is_closed_as_valid_json(smollm2_engine_8):
    """json_budget: 48 tokens are too few for most of these answers, so their last
    CLOSING_RESERVE tokens only close what is open: each is valid JSON that validates,
    and the ones whose choices that narrowed end as "length". (At 40 tokens, one seed
    under flash attention ended a 10-token name as the reserve began, with two required
    keys and their values still to write, 15 tokens at the least: more than the 16-token
    reserve holds once one token went to padding, the limit json_budget's docstring names.)"""
    answers = sample_answers(smollm2_engine_8, range(8), temperature=1.0, max_tokens=48)
    assert [a.text for a in answers if not a.valid(SCHEMA)] == []
    assert sum(a.finish_reason == "length" for a in answers) >= 4, [(a.finish_reason, a.text) for a in answers]


def test_the_budget_prefers_closing_then_punctuation_then_unpadded_tokens():
    pieces = [b'"', b'"]', b'"}\n', b"\n}", b" ", b",", b'",', b"]", b"}}", b"a", b"", b'["', b" a", b"7", b'":', b" ,"]
    masks = budget_tokens(pieces, end_ids=[10])

    def named(mask):
        return [p for p, m in zip(pieces, mask) if m]

    assert named(masks.ends_string) == [b'"', b'"]', b'"}\n']
    assert named(masks.closing) == [b"\n}", b"]", b"}}", b""]
    assert named(masks.punctuation) == [b'"', b'"]', b'"}\n', b"\n}", b",", b'",', b"]", b"}}", b'["', b'":', b" ,"]
    assert named(masks.compact) == [b'"', b'"]', b",", b'",', b"]", b"}}", b"a", b'["', b"7", b'":']
    assert named(masks.tight_punctuation) == [b'"', b'"]', b",", b'",', b"]", b"}}", b'["', b'":']
    row = np.arange(len(pieces), dtype=np.float32)

    def kept(allowed_ids, inside=False):
        allowed = np.zeros(len(pieces), np.bool_)
        allowed[allowed_ids] = True
        narrowed = narrow(row, allowed, masks.preferred(inside))
        return None if narrowed is None else (np.flatnonzero(np.isfinite(narrowed[0])).tolist(), narrowed[1])

    assert kept([5, 7, 9]) == ([7], True)  # after an array item: "]" rather than "," or more of it
    assert kept([5, 13]) == ([5], True)  # a number with a required key still to come: "," ends it
    assert kept([9, 12]) == ([9], True)  # a key's name: no padding
    assert kept([5, 15]) == ([5], True)  # "," before " ,": padding spends the reserve's tokens
    assert kept([9, 15]) == ([15], True)  # padded punctuation still before a key's name
    assert kept([7]) == ([7], False)  # nothing else was allowed: the choice was not narrowed
    assert kept([4]) is None  # only padding: the grammar's row as it is
    # inside a string "]" and "}" are text: only a quote ends it
    assert kept([0, 1, 7, 8, 9], inside=True) == ([0, 1], True)
    assert kept([7, 8, 9, 12], inside=True) == ([7, 8, 9], True)  # under its minLength: unpadded text


def test_inside_string_reads_quotes_and_escapes():
    assert not inside_string(b'{"a": "b"')
    assert inside_string(b'{"a": "b')
    assert inside_string(b'{"a": "say \\"hi')  # an escaped quote stays in the string
    assert not inside_string(b'{"a": "back\\\\"')  # an escaped backslash, then the closing quote
