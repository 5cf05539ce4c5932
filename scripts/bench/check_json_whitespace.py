"""Sampled JSON-schema answers on the small test models: how many are valid JSON.

    .venv/bin/python -m scripts.bench.check_json_whitespace            # 100 seeds per model
    .venv/bin/python -m scripts.bench.check_json_whitespace --seeds 20 --temperature 0.9

Issue 49: llguidance's default JSON grammar takes any whitespace between tokens, and a
sampled answer could wander into blank lines until max_tokens cut it as invalid JSON
(SmolLM2, temperature 0.9, one seed in three). localrun's JSON grammars now allow one
newline and at most 20 spaces or tabs there (localrun.grammar.core.JSON_WHITESPACE), and an
answer that loops in an array until max_tokens is closed in its last tokens
(localrun.grammar.json_budget). For each model this samples one answer per seed (all seeds of a
model decode together, one slot each) and prints how many stopped on their own, how many
are valid JSON that validates against the schema, and how many hold a blank line
("\\n\\n", which the grammar forbids).
tests/test_grammar_options.py runs the same on 20 seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema

from localrun.engine import Engine
from localrun.grammar.core import Grammar
from localrun.request import GenerationRequest, prepare
from localrun.sampling import SamplingParams

MODELS = Path.home() / ".cache" / "localrun" / "test-models"
MODEL_FILES = {
    "smollm2": "smollm2-135m-instruct-q4_1.gguf",
    "qwen2.5-coder": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
# the shape: a string, an integer, an enum and an array of strings
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["student", "teacher", "engineer", "artist"]},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "hobbies"],
    "additionalProperties": False,
}
QUESTION = "Describe a person as JSON with a name, an age, a role and a list of hobbies."


@dataclass
class Answer:
    seed: int
    text: str
    finish_reason: str

    @property
    def blank_line(self) -> bool:
        return "\n\n" in self.text

    def valid(self, schema: dict) -> bool:
        try:
            jsonschema.validate(json.loads(self.text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True


def sample_answers(engine: Engine, seeds, temperature: float = 1.0, max_tokens: int = 120,
                   schema: dict = SCHEMA, question: str = QUESTION, layout: dict | None = None) -> list[Answer]:
    """One sampled answer per seed, decoded together in groups of the engine's free
    slots. `layout`: llguidance's JSON layout (None: localrun's bounded whitespace)."""
    prompt = engine.chat_prompt([{"role": "user", "content": question}])
    grammar = Grammar.from_json_schema(schema, layout=layout)
    out: list[Answer] = []
    seeds = list(seeds)
    while seeds:
        group, seeds = seeds[:engine.free_slots], seeds[engine.free_slots:]
        gens = []
        for seed in group:
            req = prepare(engine, GenerationRequest(
                sampling=SamplingParams(temperature=temperature, seed=seed), max_tokens=max_tokens, grammar=grammar,
            ))
            gens.append(engine.start(prompt, req))
        texts: list[list[str]] = [[] for _ in gens]
        try:
            while not all(g.done for g in gens):
                live = [i for i, g in enumerate(gens) if not g.done]
                events = engine.step(gens)
                # keyed by each generation's slot as the step left it (a step may move a
                # generation to another slot, one an ended generation held, to keep the
                # busy ones together): read only those that were still running
                for i in live:
                    g = gens[i]
                    if g.error is not None:
                        raise g.error
                    if (ev := events.get(g.seq)) is not None:
                        texts[i].append(ev.text)
        finally:
            for g in gens:
                engine.release(g)
        out += [Answer(seed, "".join(t), g.finish_reason or "length") for seed, g, t in zip(group, gens, texts)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--slots", type=int, default=20, help="answers decoded together")
    ap.add_argument("--models", nargs="*", default=list(MODEL_FILES), choices=list(MODEL_FILES))
    ap.add_argument("--show", action="store_true", help="print every answer that is not valid")
    ap.add_argument("--unbounded", action="store_true",
                    help="llguidance's default layout (any whitespace), as before issue 49, to compare")
    args = ap.parse_args()
    failed = False
    for name in args.models:
        path = MODELS / MODEL_FILES[name]
        t0 = time.perf_counter()
        with Engine.open(path, n_ctx=args.max_tokens + 256, n_seq=args.slots) as eng:
            answers = sample_answers(eng, range(args.seeds), args.temperature, args.max_tokens,
                                     layout={"whitespace_flexible": True} if args.unbounded else None)
        stopped = [a for a in answers if a.finish_reason == "stop"]
        valid = [a for a in answers if a.valid(SCHEMA)]
        blank = [a for a in answers if a.blank_line]
        bad_stopped = [a for a in stopped if not a.valid(SCHEMA)]
        print(f"{name}: {len(valid)}/{len(answers)} valid JSON that validates; {len(stopped)} stopped on their own"
              f" ({len(bad_stopped)} of them invalid), {len(answers) - len(stopped)} cut at max_tokens={args.max_tokens};"
              f" {len(blank)} with a blank line; temperature {args.temperature},"
              f" {'unbounded' if args.unbounded else 'bounded'} whitespace, {time.perf_counter() - t0:.0f} s")
        if args.show:
            for a in answers:
                if not a.valid(SCHEMA):
                    print(f"  seed {a.seed} ({a.finish_reason}): {a.text!r}")
        failed |= bool(bad_stopped or blank)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
