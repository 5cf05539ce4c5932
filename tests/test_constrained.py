"""Constrained decoding through the engine (grammar mask + sampler + prompt lookup), on
both backends and from the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from localrun.grammar.core import Grammar
from localrun.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), because [a-z ]{3,30}\."


def ask(engine, text):
    return engine.chat_prompt([{"role": "user", "content": text}])


@pytest.mark.parametrize("seed", range(10))
def test_json_schema_output_validates_with_lookup_and_sampling(llama_engine, seed):
    res = llama_engine.complete(
        ask(llama_engine, "Describe a person as JSON with name and age."),
        sampling=SamplingParams(temperature=0.9, seed=seed),
        max_tokens=60,
        grammar=Grammar.from_json_schema(SCHEMA),
    )
    assert res.finish_reason == "stop", res.text
    jsonschema.validate(json.loads(res.text), SCHEMA)


def test_regex_output_matches_on_both_backends(engine):
    res = engine.complete(
        ask(engine, "Is water wet? Answer yes or no and why."),
        sampling=SamplingParams(temperature=0),
        max_tokens=40,
        grammar=Grammar.from_regex(REGEX),
    )
    assert re.fullmatch(REGEX, res.text), res.text
    assert res.finish_reason == "stop"


def test_grammar_overrides_a_greedy_draft_it_forbids(llama_engine):
    """The prompt makes lookup draft a repeat; the grammar forbids it; output obeys."""
    text = "abc abc abc abc abc abc"
    res = llama_engine.complete(
        ask(llama_engine, f"Repeat: {text}"),
        sampling=SamplingParams(temperature=0),
        max_tokens=20,
        grammar=Grammar.from_regex(r"[xyz ]{5,15}\."),
    )
    assert re.fullmatch(r"[xyz ]{5,15}\.", res.text), res.text


def test_cli_json_schema_and_bad_grammar(smollm2_gguf, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    run = [sys.executable, "-m", "localrun", "run", str(smollm2_gguf), "A person as JSON.", "--temperature", "0"]
    ok = subprocess.run(run + ["--json-schema", str(schema)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    jsonschema.validate(json.loads(ok.stdout), SCHEMA)
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a" item\n')
    err = subprocess.run(run + ["--grammar", str(bad)], capture_output=True, text=True, timeout=300)
    assert err.returncode != 0 and "Traceback" not in err.stderr
    assert err.stderr.strip() == "error: bad GBNF grammar at line 1, column 14: undefined rule 'item'"


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
                                    dict(temperature=0.7, top_k=5, repeat_penalty=1.3, xtc_probability=0.5)])
def test_skipping_the_mask_never_changes_the_output(monkeypatch, params):
    """The engine computes the full grammar mask only when the unmasked draw could
    differ; forcing the mask on every step must give the same tokens."""
    import numpy as np

    from fakes import EOS, N_VOCAB, ScriptedBackend
    from localrun.engine import Engine

    table = np.random.default_rng(3).normal(size=N_VOCAB).astype(np.float32)
    boost = np.zeros(N_VOCAB, np.float32)
    boost[[ord(c) for c in "abcdefxyz"]] = 4.0  # the grammar's letters usually lead

    def logits(hist):
        return np.roll(table, 7 * len(hist)) + boost

    grammar = Grammar.from_regex(r"[a-f]{2,6}(x|yz)")
    lazy = Engine._constrain
    skipped = []

    def counting(self, g, row):
        out = lazy(self, g, row)
        kept = int(np.isfinite(out).sum())
        skipped.append("as is" if out is row else "head" if kept <= 4 * max(1, params.get("top_k", 1)) else "full")
        return out

    def run(force):
        def forced(self, g, row):
            return g.matcher.apply(row)

        monkeypatch.setattr(Engine, "_constrain", forced if force else counting)
        out = []
        for seed in range(15):
            eng = Engine(ScriptedBackend(logits_fn=logits, n_ctx=64))
            res = eng.complete("go", sampling=SamplingParams(seed=seed, **params), max_tokens=20, grammar=grammar)
            assert re.fullmatch(r"[a-f]{2,6}(x|yz)", res.text), res.text
            out.append(res.tokens)
        return out

    lazy_out = run(False)
    assert {"as is", "head"} <= set(skipped)  # the unmasked row, and a row of the best allowed ids
    assert lazy_out == run(True)
    assert EOS not in {t for toks in lazy_out for t in toks}
