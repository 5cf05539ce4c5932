"""Constrained decoding (localrun.grammar's core, tokenizer and matcher): grammar
sources and their errors, the tokenizer built from each backend, the matcher's state
moves, and seeded generations on real models (and random walks through MLX's masks)
whose every finished output must parse.

The llama.cpp example grammars come from scripts/fetch_grammars.py. Timings print with
`pytest -s`, prefixed "grammar-timing".
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from conftest import MODELS
from localrun.backends.base import BatchEntry
from localrun.errors import BadRequestError
from localrun.grammar.core import Grammar
from localrun.grammar.matcher import GrammarMatcher
from localrun.grammar.tokenizer import build_tokenizer

GRAMMARS = MODELS / "grammars"
GBNF_FILES = sorted(GRAMMARS.glob("*.gbnf")) if GRAMMARS.is_dir() else []
MISSING = pytest.param(None, marks=pytest.mark.skip(
    reason=f"no llama.cpp grammars in {GRAMMARS}: run scripts/fetch_grammars.py"))

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ANSWER = r"(yes|no|maybe), [0-9]{1,3} (apples|pears|plums)\."
# context-free, not regular: parentheses must balance
SUM_GBNF = r"""
root ::= expr " = " num "\n"
expr ::= term (op term){0,3}
term ::= num | "(" expr ")"
op   ::= " + " | " - " | " * "
num  ::= [0-9]{1,3}
"""


def parse_sum(text: str) -> bool:
    """A recursive-descent recogniser for SUM_GBNF, independent of llguidance."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.match(r"[0-9]{1,3}(?![0-9])", text[pos:])
        pos += m.end() if m else 0
        return bool(m)

    def term() -> bool:
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            if not expr() or not text.startswith(")", pos):
                return False
            pos += 1
            return True
        return num()

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        for _ in range(3):
            m = re.match(r" [-+*] ", text[pos:])
            if not m:
                break
            pos += 3
            if not term():
                return False
        return True

    if not expr() or not text.startswith(" = ", pos):
        return False
    pos += 3
    return num() and text[pos:] == "\n"


def test_parse_sum_recogniser():
    assert parse_sum("(1 + 2) * 3 = 9\n") and parse_sum("7 = 7\n")
    assert not parse_sum("(1 + 2 = 3\n") and not parse_sum("1 + 2 = 3") and not parse_sum("1234 = 1\n")


# -- grammar sources, no model ---------------------------------------------------------


@pytest.mark.parametrize("path", GBNF_FILES or [MISSING], ids=lambda p: p.stem if p else "missing")
def test_llama_cpp_grammar_compiles(path, llama_tok):
    g = Grammar.from_gbnf(path.read_text())
    m = GrammarMatcher(g, llama_tok)
    assert m.allowed_mask().any() and not m.error


@pytest.mark.parametrize(
    "text, where",
    [
        ('root ::= "a" item\nitem ::= "b" [a-', "line 2, column 17"),  # input ends inside [...
        ('root ::= "a" (', "line 1, column 15"),
        ('root ::= "x"\nfoo ::= "y" bar', "line 2, column 13"),  # undefined rule
        ('root ::= "a" item\nitem ::= "a"{2,1}', "line 2, column 10"),  # caught after conversion
        ('root ::= [z-a]', "line 1, column 10"),
        ('root ::= "\\q"', "line 1, column 12"),
    ],
)
def test_broken_gbnf_names_line_and_column(text, where):
    with pytest.raises(BadRequestError) as exc:
        Grammar.from_gbnf(text)
    msg = str(exc.value)
    assert where in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: Grammar.from_gbnf('item ::= "x"'), "no 'root' rule"),
        (lambda: Grammar.from_gbnf('root ::= "a" <|im_end|>'), "Lark syntax"),
        (lambda: Grammar.from_lark('start: "a"\n  | ('), "line 2, column 6"),
        (lambda: Grammar.from_regex("a(b"), "unclosed group"),
        (lambda: Grammar.from_json_schema('{"type": '), "line 1, column 10"),
        (lambda: Grammar.from_json_schema({"type": "foo"}), "Invalid type"),
        (lambda: Grammar.from_json_schema({"type": "string", "pattern": "(("}), "unclosed group"),
        (lambda: Grammar.from_json_schema([1]), "object or a boolean"),
    ],
)
def test_other_bad_grammars_are_one_line_bad_requests(make, needle):
    with pytest.raises(BadRequestError) as exc:
        make()
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_sources_that_parse():
    assert Grammar.from_gbnf("%llguidance {}\nstart: \"a\"+").kind == "lark"
    # a GBNF rule may be called `start`, though the Lark the converter writes uses that name
    assert Grammar.from_gbnf('root ::= start\nstart ::= "a" # start').kind == "gbnf"
    with pytest.raises(BadRequestError, match="line 1, column 10: undefined rule 'start'"):
        Grammar.from_gbnf("root ::= start")
    for schema in (True, {}, PERSON, json.dumps(PERSON)):
        assert Grammar.from_json_schema(schema).kind == "json_schema"
    assert Grammar.json_object().kind == "json_schema"


def test_mask_steers_a_scripted_backend():
    """Byte vocabulary + EOS (tests/fakes.py): the model wants 'x', then EOS; the grammar
    allows two digits, so the best allowed token (7) wins until the grammar is done."""
    from fakes import EOS, ScriptedBackend

    be = ScriptedBackend()
    m = GrammarMatcher(Grammar.from_regex("[0-9]{2}"), build_tokenizer(be))
    row = np.zeros(be.info.n_vocab, np.float32)
    row[[ord("x"), EOS, ord("7")]] = [10.0, 5.0, 1.0]
    out = []
    while not m.is_done():
        t = int(np.argmax(m.apply(row)))
        m.accept(t)
        out.append(t)
    assert bytes(out) == b"77" and m.is_accepting()  # never 'x', and no EOS after one digit


# -- tokenizer and matcher on SmolLM2 -------------------------------------------------


@pytest.fixture(scope="module")
def llama_backend(smollm2_gguf):
    from localrun.backends.llamacpp import LlamaCppBackend

    # 25 sequences decode in one batch for the seeded runs; one thread, because two
    # threads on a 2-core machine shared with other runs are several times slower.
    be = LlamaCppBackend(smollm2_gguf, n_ctx=80, n_seq=25, n_batch=512, threads=1)
    yield be
    be.close()


@pytest.fixture(scope="module")
def llama_tok(llama_backend):
    t = time.perf_counter()
    tok = build_tokenizer(llama_backend)
    print(f"\ngrammar-timing tokenizer build, SmolLM2 llama.cpp: {time.perf_counter() - t:.3f} s")
    return tok


def ids(backend, text):
    return backend.tokenize(text, add_special=False, parse_special=False)


def test_tokenizer_is_cached_and_knows_the_stop_ids(llama_backend, llama_tok):
    # a build reads every token's bytes (~0.3 s); a cache hit reads none, same object back
    reads = []
    token_bytes = llama_backend.token_bytes
    llama_backend.token_bytes = lambda t: reads.append(t) or token_bytes(t)
    try:
        assert build_tokenizer(llama_backend) is llama_tok
    finally:
        del llama_backend.token_bytes  # the class's method again
    assert reads == []
    assert sorted(llama_tok.eos_tokens) == sorted(llama_backend.info.stop_ids)
    assert llama_tok.vocab_size == llama_backend.info.n_vocab


def test_rollback_restores_the_earlier_mask(llama_backend, llama_tok):
    m = GrammarMatcher(Grammar.from_json_schema(PERSON), llama_tok)
    toks = ids(llama_backend, '{"name": "Bob')
    assert len(toks) >= 3
    m.accept(toks[0])
    after_one = m.allowed_mask().copy()
    m.accept(toks[1])
    m.accept(toks[2])
    assert not np.array_equal(m.allowed_mask(), after_one)
    m.rollback(2)
    assert np.array_equal(m.allowed_mask(), after_one)


def test_snapshot_restore_and_draft_checks(llama_backend, llama_tok):
    m = GrammarMatcher(Grammar.from_json_schema(PERSON), llama_tok)
    good = ids(llama_backend, '{"name": "Al", "age": 7}')
    snap = m.snapshot()
    expected = []
    for t in good[:4]:
        expected.append(m.allowed_mask().copy())
        m.accept(t)
    expected.append(m.allowed_mask().copy())
    m.rollback(4)
    assert np.array_equal(m.draft_masks(good[:4]), np.stack(expected))
    bad = good[:2] + ids(llama_backend, "}") + good[3:5]  # a verifier stops at the third
    masks = m.draft_masks(bad)
    assert np.array_equal(masks[:3], np.stack(expected[:3])) and (masks[3:] == masks[2]).all()
    assert m.count_valid(bad) == 2 and m.count_valid(good + good) == len(good)
    assert np.array_equal(m.allowed_mask(), expected[0])  # the checks leave the state alone
    for t in good:
        assert m.allows(t)
        m.accept(t)
    assert m.is_accepting() and m.is_done()
    m.restore(snap)
    m.restore(snap)  # a snapshot restores more than once
    assert np.array_equal(m.allowed_mask(), expected[0]) and not m.is_accepting()


def test_eos_only_where_the_grammar_accepts(llama_backend, llama_tok):
    stops = sorted(llama_backend.info.stop_ids)
    m = GrammarMatcher(Grammar.from_regex("[0-9]{1,3}"), llama_tok)
    assert not m.allowed_mask()[stops].any()  # nothing yet: the answer needs a digit
    m.accept(ids(llama_backend, "4")[0])
    assert m.is_accepting() and not m.is_done() and m.allowed_mask()[stops].all()
    with pytest.raises(ValueError):
        m.accept(ids(llama_backend, "x")[0])


def test_apply_masks_without_touching_the_row(llama_backend, llama_tok):
    m = GrammarMatcher(Grammar.from_regex("(yes|no)"), llama_tok)
    row = np.random.default_rng(0).standard_normal(llama_backend.info.n_vocab).astype(np.float32)
    keep = row.copy()
    out = m.apply(row)
    allowed = m.allowed_mask()
    assert np.array_equal(row, keep) and out.dtype == np.float32
    assert np.array_equal(out[allowed], row[allowed]) and np.isneginf(out[~allowed]).all()
    assert allowed[ids(llama_backend, "yes")[0]] and not allowed[ids(llama_backend, "maybe")[0]]
    free = GrammarMatcher(Grammar.from_regex("[^\n]*"), llama_tok)  # a dense mask takes the other path
    out = free.apply(row)
    assert np.array_equal(np.isneginf(out), ~free.allowed_mask())


def test_special_tokens_by_name(llama_backend):
    """The backend's token_text names its special tokens, so a Lark grammar can say
    <|im_end|>; explicit special_names give the same result."""
    import llama_cpp

    vocab = llama_backend._vocab
    names = {t: llama_cpp.llama_vocab_get_text(vocab, t).decode() for t in range(llama_backend.info.n_vocab)
             if llama_backend.is_control(t)}
    g = Grammar.from_lark('start: "ok" <|im_end|>')
    im_end = llama_backend.tokenize("<|im_end|>", parse_special=True)[0]
    for tok in (build_tokenizer(llama_backend), build_tokenizer(llama_backend, special_names=names)):
        m = GrammarMatcher(g, tok)
        m.accept(ids(llama_backend, "ok")[0])
        assert np.flatnonzero(m.allowed_mask()).tolist() == [im_end]


# -- seeded generation ----------------------------------------------------------------


def chat_prompt(backend, text):
    return backend.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", parse_special=True)


def generate(backend, tok, grammar, prompt, seeds, max_tokens=40, temperature=0.8):
    """The engine's loop in small: per step, mask -> sample -> accept, for up to
    backend.n_seq sequences per decode. Returns [(text, finish)], mask ms per token."""
    stops = backend.info.stop_ids
    out, mask_s = [], []
    for at in range(0, len(seeds), backend.n_seq):
        group = seeds[at : at + backend.n_seq]
        ms = [GrammarMatcher(grammar, tok) for _ in group]
        rngs = [np.random.default_rng(s) for s in group]
        toks: list[list[int]] = [[] for _ in group]
        finish = [""] * len(group)
        backend.kv_clear(0)
        first = backend.decode([BatchEntry(0, prompt, 0, 1)])[0][-1].copy()
        for s in range(1, len(group)):  # one prefill, shared
            backend.kv_copy(0, s, len(prompt))
        live = {s: first for s in range(len(group))}
        while live:
            step = {}
            for s, row in live.items():
                t0 = time.perf_counter()
                z = ms[s].apply(row)
                mask_s.append(time.perf_counter() - t0)
                cand = np.flatnonzero(np.isfinite(z))
                p = np.exp((z[cand] - z[cand].max()) / temperature)
                t = int(cand[rngs[s].choice(cand.size, p=p / p.sum())])
                ms[s].accept(t)
                if t in stops:
                    finish[s] = "eos"
                    continue
                toks[s].append(t)
                if ms[s].is_done():
                    finish[s] = "done"
                elif len(toks[s]) >= max_tokens:
                    finish[s] = "length"
                else:
                    step[s] = t
            if not step:
                break
            rows = backend.decode([BatchEntry(s, [t], len(prompt) + len(toks[s]) - 1, 1) for s, t in step.items()])
            live = {s: r[-1] for s, r in zip(step, rows)}
        for s in range(len(group)):
            out.append((b"".join(backend.token_bytes(t) for t in toks[s]).decode("utf-8"), finish[s]))
    return out, np.array(mask_s) * 1000


def check_json(text):
    import jsonschema

    jsonschema.validate(json.loads(text), PERSON)
    return True


CASES = {
    "json_schema": (lambda: Grammar.from_json_schema(PERSON), "Describe a person as JSON with a name and an age.", check_json),
    "regex": (lambda: Grammar.from_regex(ANSWER), "Do you have apples? How many?", lambda s: re.fullmatch(ANSWER, s)),
    "gbnf": (lambda: Grammar.from_gbnf(SUM_GBNF), "Write a sum and its result.", parse_sum),
}


def run_case(backend, tok, kind, seeds):
    make, question, check = CASES[kind]
    t = time.perf_counter()
    results, mask_ms = generate(backend, tok, make(), chat_prompt(backend, question), seeds)
    wall = time.perf_counter() - t
    done = [text for text, finish in results if finish in ("eos", "done")]
    print(f"\ngrammar-timing {backend.name} {kind}: {len(seeds)} runs in {wall:.1f} s, {len(done)} finished"
          f" ({len(set(done))} distinct),"
          f" mask+apply median {np.median(mask_ms):.3f} ms p99 {np.percentile(mask_ms, 99):.3f} ms;"
          f" e.g. {done[0] if done else results[0][0]!r}")
    for text in done:
        assert check(text), f"{kind} output does not parse: {text!r}"
    return results, done


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_fifty_seeded_runs_on_llama_cpp(llama_backend, llama_tok, kind):
    results, done = run_case(llama_backend, llama_tok, kind, list(range(50)))
    # every grammar here bounds its length well under 40 tokens, save for nesting
    assert len(done) >= 45, results
    assert len(set(done)) >= 10, done  # the seeds really sample


# -- on MLX ---------------------------------------------------------------------------
# MLX's CPU build (Linux) decodes SmolLM2 a sequence at a time at ~2.5 tok/s with the f16
# weights (fifty runs per grammar took 16 min here), so the statistics come from random
# walks through MLX's masks, which cost no model step, and a few seeded runs show the
# masks steering MLX's own rows.


@pytest.fixture(scope="module")
def mlx_backend(smollm2_mlx):
    """SmolLM2 on MLX, one slot per seeded run, its weights upcast to float32: MLX's CPU
    build steps ~2.5x faster in f32 than in f16, and nothing on the grammar's path depends
    on the weights' type (the vocabulary is the same; rows reach the matcher as float32)."""
    import mlx.core as mx
    from localrun.backends.mlx import MLXBackend

    be = MLXBackend(smollm2_mlx, n_ctx=80, n_seq=3)
    be.model.set_dtype(mx.float32)
    yield be
    be.close()


@pytest.mark.parametrize("kind", list(CASES))
def test_random_walks_through_the_mlx_masks(mlx_backend, llama_tok, kind):
    """A hundred walks per grammar, each token drawn uniformly among those MLX's mask allows:
    every allowed token as likely as the best one, so a walk tries far more of the mask
    than a model's sampling does (odd whitespace, rare pieces, deep nesting), and a token
    the mask lets through wrongly would show in the outputs. Every finished walk must parse
    (the same checkers as the seeded runs), and at every step MLX's mask must equal the
    llama.cpp tokenizer's for the same SmolLM2 vocabulary."""
    make, _, check = CASES[kind]
    grammar, mlx_tok, stops = make(), build_tokenizer(mlx_backend), mlx_backend.info.stop_ids
    done = []
    for seed in range(100):
        rng = np.random.default_rng(seed)
        a, b = GrammarMatcher(grammar, mlx_tok), GrammarMatcher(grammar, llama_tok)
        toks: list[int] = []
        finished = False
        while not finished and len(toks) < 60:
            allowed = a.allowed_mask()
            differ = np.flatnonzero(allowed != b.allowed_mask())
            assert differ.size == 0, f"{kind} walk {seed} after {toks}: MLX's mask differs at ids {differ[:10]}"
            t = int(rng.choice(np.flatnonzero(allowed)))
            a.accept(t)
            b.accept(t)
            finished = t in stops
            if not finished:
                toks.append(t)
                finished = a.is_done()
        if finished:  # else it ran out of tokens (deep nesting): nothing to check yet
            text = b"".join(mlx_backend.token_bytes(t) for t in toks).decode("utf-8")
            assert check(text), f"{kind} walk {seed} does not parse: {text!r}"
            done.append(text)
    print(f"\ngrammar-walks {kind}: {len(done)} of 100 finished, e.g. {done[:2]!r}")
    assert len(done) >= 50


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_seeded_runs_on_mlx(mlx_backend, kind):
    """The llama.cpp runs above on MLX's own rows: same grammars, same checks, three seeds
    (each finished run parses, and the seeds really sample)."""
    results, done = run_case(mlx_backend, build_tokenizer(mlx_backend), kind, [0, 1, 2])
    assert len(done) >= 2 and len(set(done)) >= 2, results


def test_both_backends_give_the_same_masks(llama_backend, llama_tok, mlx_backend):
    """The same SmolLM2 vocabulary through either backend: identical masks, step by step."""
    mlx_tok = build_tokenizer(mlx_backend)
    g = Grammar.from_json_schema(PERSON)
    a, b = GrammarMatcher(g, llama_tok), GrammarMatcher(g, mlx_tok)
    for t in ids(llama_backend, '{"name": "Ann", "age": 31}'):
        assert np.array_equal(a.allowed_mask(), b.allowed_mask())
        a.accept(t)
        b.accept(t)
    assert a.is_done() and b.is_done()
