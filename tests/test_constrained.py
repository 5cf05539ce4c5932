"""Constrained decoding through the engine (grammar mask + sampler + prompt lookup), on
both backends and from the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from localrun.grammar import Grammar
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
