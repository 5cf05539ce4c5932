"""Speculative decoding with a draft model (issue 53): a second, smaller model of the
same vocabulary drafts greedily and the target verifies (localrun/speculation/draft_model.py).

What is checked: the output is the target's own (identical tokens at temperature 0 and,
under sampling, identical tokens for the same seed plus the law of the first tokens), the
draft slot's KV follows the history and is reused, draft slots are handed out and given
back, a grammar still holds, a draft model of another vocabulary is refused in one line,
FirstOf and the pricing. Real pairs on llama.cpp and MLX and a server:
test_draft_model_models.py.

**Forcing drafts to pay.** A draft model drafts only where its price says it pays (the
target's StepCost c(r) for a step of r rows, and `DraftModel.step_delta` for its own
step). On this 2-core CPU a real target's 2-row step costs ~1.5-2 one-row steps, so with
measured prices drafting is (rightly) declined. Tests that need drafts set, on the
instances, `engine.speculator.step_cost.ratios` to `paying_ratios` (a row costs 0.05 of a
one-row step) and `engine.draft_model.step_delta` to 0.05 (`force_paying_prices`); the
fakes' draft model is a `DraftModel` built directly around a ScriptedBackend and set as
`engine.speculator.draft_model`. Every draft is still verified by the target, so forced
prices change the speed only, never the tokens: that is what these tests assert.

**Batch drift.** A real target scores the pending token and the draft in one wide step,
whose rows may differ in their last bits from one-row steps'. Measured on this CPU:
SmolLM2 (Q4_1) with flash attention on, none in any batch shape (off: 0.4-0.85 logits
from 6 rows on); Qwen2.5-Coder-0.5B (Q4_K_M), 0.2-0.35 logits at any width with its
repacked weights, and with repack=False and flash attention on none below 8 rows in a
step (~0.4 from 8 on). Tests that compare real answers with and without drafts use those
settings, or the engine's guard for greedy (`LookupConfig(exact_greedy=True)`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fakes import ScriptedBackend, step_all
from localrun.backends import attention_timing
from localrun.backends.attention import FLASH_ATTN_ENV
from localrun.backends.base import common_prefix
from localrun.datafiles import cache_dir
from localrun.engine import Engine
from localrun.errors import LocalrunError
from localrun.grammar.core import Grammar
from localrun.sampling import SamplingParams
from localrun.speculation import draft_model as draft_model_module
from localrun.speculation.draft_model import (
    DraftModel, DraftModelProposer, DraftPairError, predicted_speedup,
)
from localrun.speculation.drift import BatchDrift
from localrun.speculation.lookup import LookupConfig
from localrun.speculation.proposer import ALONE, FirstOf, Proposer, StepShare
from localrun.speculation.step_cost import StepCost
from test_speculative import GREEDY, PATTERN, chi_square, markov_logits, run

NO_LOOKUP = LookupConfig(enabled=False)  # the draft model alone proposes
EXACT_GREEDY = LookupConfig(enabled=False, exact_greedy=True)
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """The batch drift that exact_greedy measures is remembered per model file in the cache
    folder: each test starts from none and leaves the user's alone. The flash-attention
    choices already measured come along (no test here is about them): without them each
    model opened here timed both settings again, ~5 s a model."""
    folder = tmp_path / "data"
    folder.mkdir()
    measured = cache_dir() / attention_timing.FILE_NAME
    if measured.is_file():
        shutil.copy(measured, folder / attention_timing.FILE_NAME)
    monkeypatch.setenv("LOCALRUN_CACHE", str(folder))


# -- helpers --------------------------------------------------------------------------


def paying_ratios(most: int, prior_per_row: float = 0.25) -> list[float]:
    """StepCost.ratios where a row costs 0.05 one-row steps: every likely draft pays."""
    return [1.0] + [1.0 + 0.05 * (r - 1) for r in range(1, most + 1)]


def force_paying_prices(engine: Engine) -> None:
    engine.speculator.step_cost.ratios = paying_ratios
    engine.draft_model.step_delta = lambda cost: 0.05
    engine.draft_model.read_delta = lambda cost: 0.0  # catching the draft slot up costs nothing


def draft_logits(hist: list[int]) -> np.ndarray:
    """The fake draft model: markov_logits' choice (the target's greedy path), except after
    'c', where it prefers 'x' (the target's runner-up): drafts partly kept, partly not."""
    row = markov_logits(hist)
    if hist[-1] == ord("c"):
        row[ord("x")] = 4.0
    return row


def fake_pair(n_seq: int = 1, draft_seqs: int | None = None, draft_max: int = 4, n_ctx: int = 128):
    """A scripted target (markov_logits) with a scripted draft model (draft_logits) at
    paying prices; (engine, target backend, draft backend)."""
    target = ScriptedBackend(logits_fn=markov_logits, n_ctx=n_ctx, n_seq=n_seq)
    engine = Engine(target)
    engine.speculator.drift = BatchDrift.known(0.0)  # a scripted row never depends on its batch
    drafter = ScriptedBackend(logits_fn=draft_logits, n_ctx=n_ctx, n_seq=draft_seqs or n_seq)
    engine.speculator.draft_model = DraftModel(drafter, draft_max)
    force_paying_prices(engine)
    return engine, target, drafter


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def alone(engine: Engine, prompt, **options):
    """The engine's answer without its draft model (prompt lookup off too)."""
    model, engine.speculator.draft_model = engine.speculator.draft_model, None
    try:
        return engine.complete(prompt, lookup=False, **options)
    finally:
        engine.speculator.draft_model = model


def chat(engine: Engine, text: str) -> list[int]:
    return engine.chat_prompt([{"role": "user", "content": text}])


# -- 1. exactness on the scripted fake ------------------------------------------------------


def test_greedy_output_is_identical_with_a_draft_model():
    off, _ = run(False, GREEDY, max_tokens=30)
    engine, target, drafter = fake_pair()
    on = list(engine.generate("abcabcab", sampling=GREEDY, max_tokens=30, lookup=NO_LOOKUP))
    assert tokens_of(on) == tokens_of(off)
    t = on[-1].timings
    assert t.drafted > t.accepted > 0  # drafts made, some kept, some rejected (the 'x' after 'c')
    assert len(target.calls) < 30  # fewer target steps than tokens: the kept drafts paid
    assert any(e.n_logits == 1 for call in drafter.calls for e in call)  # the draft model did decode


@pytest.mark.parametrize("params", [
    SAMPLED,
    dict(temperature=0.8, top_k=2, xtc_probability=0.5, xtc_threshold=0.05),
    dict(mirostat=2, mirostat_tau=1.0, temperature=1.0),
    dict(temperature=0.9, repeat_penalty=1.3, dry_multiplier=0.5),
])
def test_sampled_output_is_the_same_tokens_for_the_same_seed(params):
    """Verification samples each row as a plain step would (same chain, same RNG draw), so
    a seed gives the same tokens with and without a draft model."""
    drafted = accepted = 0
    for seed in range(12):
        off, _ = run(False, SamplingParams(seed=seed, **params), max_tokens=24)
        engine, _, _ = fake_pair()
        on = list(engine.generate("abcabcab", sampling=SamplingParams(seed=seed, **params), max_tokens=24,
                                  lookup=NO_LOOKUP))
        assert tokens_of(on) == tokens_of(off), f"seed {seed}"
        drafted, accepted = drafted + on[-1].timings.drafted, accepted + on[-1].timings.accepted
    assert drafted > accepted > 0


def test_sampled_distribution_of_the_first_tokens_is_the_models():
    """Chi-square over many seeds on the first four tokens, against the law without drafts.

    markov_logits draws each token from softmax([3, 2, 1]) over {the pattern's next
    letter after the previous token, 'x', 'y'}, whatever came before: so whether each of
    the first four tokens is the pattern's next letter is four independent coin flips of
    p = softmax[0]. Token 1 comes from the prompt's step; tokens 2-4 from steps that verify
    drafts (at most tokens_left - 1 = 2 drafted behind token 1)."""
    probs = np.exp([3.0, 2.0, 1.0]) / np.exp([3.0, 2.0, 1.0]).sum()
    p = probs[0]

    def pattern_next(prev: int) -> int:
        return PATTERN[(PATTERN.index(prev) + 1) % len(PATTERN)] if prev in PATTERN else PATTERN[0]

    draws, counts, drafted, accepted = 2000, np.zeros(16), 0, 0
    for seed in range(draws):
        engine, _, _ = fake_pair()
        events = list(engine.generate("abcabcab", sampling=SamplingParams(seed=seed, **SAMPLED), max_tokens=4,
                                      lookup=NO_LOOKUP))
        toks = tokens_of(events)
        prev = [ord("b")] + toks[:3]
        cell = sum((t == pattern_next(q)) << i for i, (t, q) in enumerate(zip(toks, prev)))
        counts[cell] += 1
        drafted, accepted = drafted + events[-1].timings.drafted, accepted + events[-1].timings.accepted
    law = np.array([np.prod([p if cell >> i & 1 else 1 - p for i in range(4)]) for cell in range(16)])
    assert drafted > accepted > 0.2 * drafted  # verdicts of both kinds inside these four tokens
    assert chi_square(counts, law) < 37.70  # df=15, 99.9%


# -- 2. the draft slot's KV and the slots ----------------------------------------------------


def test_the_draft_slots_kv_follows_the_history_and_is_reused(monkeypatch):
    """Before each draft the draft slot is made to hold the history (rejected drafts cut),
    and a later prompt that extends an earlier answer reads only what the slot lacks."""
    synced = []  # (draft slot, history at the draft, the slot's KV right after, the draft)
    real_draft = DraftModelProposer.draft

    def watched(self, history, room, share=ALONE):
        out = real_draft(self, history, room, share)
        synced.append((self.seq, list(history), list(self.model.backend.kv_tokens(self.seq)), out))
        return out

    monkeypatch.setattr(DraftModelProposer, "draft", watched)
    engine, _, drafter = fake_pair(n_seq=2)
    prompt = [ord(c) for c in "abcabcab"]
    first = engine.complete(prompt, sampling=SamplingParams(seed=4, **SAMPLED), max_tokens=30, lookup=NO_LOOKUP)
    assert first.timings.drafted > first.timings.accepted > 0
    history = prompt + first.tokens
    drafted = [(h, kv, out) for _, h, kv, out in synced if out]  # (a declined step reads nothing)
    seq = synced[0][0]
    assert len(drafted) >= 3 and {s for s, *_ in synced} == {seq}
    for h, kv, out in drafted:  # the history, then the drafts but the last (and maybe more, not offered)
        assert kv[: len(h) + len(out) - 1] == h + out[:-1] and len(kv) - len(h) < 4
        assert history[: len(h)] == h
    kv = drafter.kv_tokens(seq)
    shared = common_prefix(kv, history)
    assert shared >= len(history) - 1 - 4  # caught up to the last draft (draft_max 4)...
    assert len(kv) - shared <= 4 - 1  # ...beyond it at most a rejected draft's tail, cut next time

    prompt2 = history + [ord(c) for c in "cab"]  # a follow-up: the earlier answer and more
    # the first draft comes with the prompt's last token (read alone): the slot must hold the rest
    reuse = common_prefix(kv, prompt2[:-1])
    calls = len(drafter.calls)
    second = engine.complete(prompt2, sampling=SamplingParams(seed=5, **SAMPLED), max_tokens=20, lookup=NO_LOOKUP)
    assert second.timings.drafted > 0
    entries = [e for call in drafter.calls[calls:] for e in call]
    first_sync = []
    for e in entries:
        if e.n_logits:
            break
        first_sync.append(e)
    assert {e.seq for e in entries} == {seq}  # the slot holding the earlier answer was chosen
    assert sum(len(e.tokens) for e in first_sync) == len(prompt2) - 1 - reuse  # only what it lacked
    assert len(prompt2) - 1 - reuse <= 3 + 4  # the new tokens and at most a stale draft's tail
    off = Engine(ScriptedBackend(logits_fn=markov_logits, n_ctx=128)).complete(
        prompt2, sampling=SamplingParams(seed=5, **SAMPLED), max_tokens=20, lookup=False)
    assert second.tokens == off.tokens


def test_each_generation_gets_its_own_draft_slot_and_gives_it_back():
    """Two draft slots for three target slots: the first two generations draft, each on
    its own slot; the third gets none and runs without drafts; a slot a released
    generation gave back goes to the next one. Every answer is the one without drafts."""
    engine, _, drafter = fake_pair(n_seq=3, draft_seqs=2)
    prompts = ["abcabcab", "bcabca", "cabcabc", "ab"]
    params = [SamplingParams(seed=s, **SAMPLED) for s in (1, 2, 3, 4)]
    solo = [Engine(ScriptedBackend(logits_fn=markov_logits, n_ctx=128)).complete(
        p, sampling=s, max_tokens=16, lookup=False).tokens for p, s in zip(prompts, params)]
    gens = [engine.start(p, sampling=s, max_tokens=16, lookup=NO_LOOKUP) for p, s in zip(prompts[:3], params)]
    assert all(isinstance(g.proposer, DraftModelProposer) for g in gens[:2])
    assert {g.proposer.seq for g in gens[:2]} == {0, 1}
    assert gens[2].proposer is None  # no free draft slot: it decodes without one
    assert engine.draft_model._free == []
    for _ in range(3):
        engine.step(gens)
    assert not any(g.done for g in gens)
    released = gens[0].proposer.seq
    engine.release(gens[0])  # cancelled mid-answer: its draft slot goes back
    assert engine.draft_model._free == [released]
    late = engine.start(prompts[3], sampling=params[3], max_tokens=16, lookup=NO_LOOKUP)
    assert isinstance(late.proposer, DraftModelProposer) and late.proposer.seq == released
    step_all(engine, [gens[1], gens[2], late])
    assert [gens[1].output, gens[2].output, late.output] == solo[1:]
    assert gens[0].output == solo[0][: len(gens[0].output)]
    assert gens[1].timings.drafted > 0 and late.timings.drafted > 0 and gens[2].timings.drafted == 0
    assert sorted(engine.draft_model._free) == [0, 1]  # every slot back once all ended
    assert all(len(drafter.kv_tokens(s)) > 0 for s in (0, 1))


# -- 3. grammar ---------------------------------------------------------------------------

REGEX = r"[abxy]{6,20}\."  # forbids 'c': after 'b' the target writes 'x' where the draft says 'c'


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(seed=7, temperature=0.9)])
def test_a_grammar_holds_and_the_output_is_unchanged_with_a_draft_model(sampling):
    grammar = Grammar.from_regex(REGEX)
    off = Engine(ScriptedBackend(logits_fn=markov_logits, n_ctx=128)).complete(
        "abcabcab", sampling=sampling, max_tokens=30, lookup=False, grammar=grammar)
    engine, _, _ = fake_pair()
    on = engine.complete("abcabcab", sampling=sampling, max_tokens=30, lookup=NO_LOOKUP, grammar=grammar)
    assert re.fullmatch(REGEX, on.text), on.text
    assert on.tokens == off.tokens and on.finish_reason == off.finish_reason == "stop"
    assert on.timings.drafted > on.timings.accepted > 0  # the grammar overruled drafts, others kept


def test_json_schema_answer_of_a_real_pair_is_the_targets(smollm2_gguf, monkeypatch):
    """SmolLM2 drafting for itself (its rows do not depend on the batch here, flash
    attention on), a JSON schema, temperature 0: the answer of the target alone."""
    monkeypatch.setenv(FLASH_ATTN_ENV, "on")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    with Engine.open(smollm2_gguf, n_ctx=512, draft=smollm2_gguf) as engine:
        prompt = chat(engine, "Describe a person as JSON with name and age.")
        off = alone(engine, prompt, sampling=GREEDY, max_tokens=40, grammar=Grammar.from_json_schema(schema))
        force_paying_prices(engine)
        on = engine.complete(prompt, sampling=GREEDY, max_tokens=40, lookup=NO_LOOKUP,
                             grammar=Grammar.from_json_schema(schema))
    assert on.tokens == off.tokens, (on.text, off.text)
    assert set(json.loads(on.text)) == {"name", "age"}
    assert on.timings.accepted > 0


# -- 4. a draft model of another vocabulary ---------------------------------------------------


def test_a_draft_model_of_another_vocabulary_is_refused_in_one_line(qwen_coder_gguf, smollm2_gguf, monkeypatch):
    import localrun.engine as engine_module

    opened, closed = [], []
    real_open = engine_module.open_backend

    def watched(*args, **kwargs):
        backend = real_open(*args, **kwargs)
        real_close = backend.close
        opened.append(backend)

        def close():
            closed.append(backend)
            real_close()

        backend.close = close
        return backend

    monkeypatch.setattr(engine_module, "open_backend", watched)
    with pytest.raises(DraftPairError) as err:
        Engine.open(qwen_coder_gguf, n_ctx=256, draft=smollm2_gguf)
    msg = str(err.value)
    assert "\n" not in msg
    assert qwen_coder_gguf.name in msg and smollm2_gguf.name in msg
    assert "49152" in msg and "151936" in msg
    assert len(opened) == 2 and sorted(map(id, closed)) == sorted(map(id, opened))  # neither is leaked


@pytest.mark.parametrize("flags", [["--draft", "SMOLLM2"], ["--draft", "QWEN", "--draft-max", "0"]])
def test_cli_refuses_a_bad_draft_in_one_error_line(qwen_coder_gguf, smollm2_gguf, flags):
    names = {"SMOLLM2": str(smollm2_gguf), "QWEN": str(qwen_coder_gguf)}
    cmd = [sys.executable, "-m", "localrun", "run", str(qwen_coder_gguf), "hi", "--max-tokens", "3",
           *(names.get(f, f) for f in flags)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr and res.stdout == ""
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    if "--draft-max" in flags:
        assert errors[0] == "error: --draft-max must be at least 1, got 0"
    else:
        assert smollm2_gguf.name in errors[0] and qwen_coder_gguf.name in errors[0]


@pytest.mark.parametrize("n_ctx, n_batch", [(32, 512), (256, 16)])
def test_a_draft_model_loads_beside_a_small_context_or_batch(n_ctx, n_batch, monkeypatch):
    """`localrun run M "hi" --draft M --ctx 32` printed a traceback (the load-time
    measurement decoded a fixed 32-token context and 8 rows). Loading must either work or
    be refused in one line (a LocalrunError), never a ValueError."""
    import localrun.engine as engine_module

    engine = Engine(ScriptedBackend(logits_fn=markov_logits, n_ctx=n_ctx, n_batch=n_batch))
    monkeypatch.setattr(engine_module, "resolve_model", lambda path: path)
    monkeypatch.setattr(engine_module, "open_backend", lambda path, o: ScriptedBackend(
        logits_fn=draft_logits, n_ctx=o.n_ctx, n_seq=o.n_seq, n_batch=o.n_batch))
    try:
        engine.load_draft("draft.gguf")
    except LocalrunError:
        return
    assert engine.complete("abcab", sampling=GREEDY, max_tokens=4).tokens == [ord(c) for c in "cabc"]



@pytest.mark.parametrize("slow_round_s, timed_rounds", [(3600.0, 2), (0.0, 1)])
def test_a_slow_pair_is_timed_in_one_round_at_load(slow_round_s, timed_rounds, monkeypatch):
    """DraftModel.measure: an untimed round, then two timed ones, or one where the untimed
    round took over SLOW_ROUND_S (MLX on a CPU, where a round takes seconds)."""
    monkeypatch.setattr(draft_model_module, "SLOW_ROUND_S", slow_round_s)
    target = ScriptedBackend(logits_fn=markov_logits, n_ctx=128)
    drafter = ScriptedBackend(logits_fn=draft_logits, n_ctx=128)
    reads = []  # the draft model's context reads: one a round
    real_decode = drafter.decode
    drafter.decode = lambda batch: (reads.extend(e for e in batch if len(e.tokens) > 1), real_decode(batch))[1]
    model, cost = DraftModel(drafter), StepCost()
    model.measure(target, cost)
    assert len(reads) == 1 + timed_rounds
    assert model._step_ms is not None and model._read_ms is not None and cost.one_row_ms() is not None
    assert drafter.kv_tokens(0) == [] and target.kv_tokens(0) == []  # slot 0 left empty

# -- 6. FirstOf ----------------------------------------------------------------------------


class Recorder(Proposer):
    def __init__(self, draft: list[int]) -> None:
        self.out, self.asked, self.verdicts, self.released = draft, 0, [], 0

    def draft(self, history, room, share=ALONE):
        self.asked += 1
        return self.out

    def record(self, judged, accepted):
        self.verdicts.append((judged, accepted))

    def release(self):
        self.released += 1


def test_first_of_takes_the_first_draft_that_is_not_empty():
    empty, first, second = Recorder([]), Recorder([5, 6]), Recorder([7])
    both = FirstOf(empty, first, second)
    assert both.draft([1, 2], 4) == [5, 6]
    assert (empty.asked, first.asked, second.asked) == (1, 1, 0)  # the later one is not asked
    both.record(2, 1)
    assert first.verdicts == [(2, 1)]  # only the one that drafted hears the verdict
    assert empty.verdicts == [(0, 0)] and second.verdicts == [(0, 0)]
    first.out = []
    assert both.draft([1, 2], 4) == [7]
    both.record(1, 0)
    assert second.verdicts[-1] == (1, 0) and first.verdicts[-1] == (0, 0) and empty.verdicts[-1] == (0, 0)
    second.out = []
    assert both.draft([1, 2], 4) == []  # a plain step: everyone hears that nothing was drafted
    both.record(0, 0)
    assert [p.verdicts[-1] for p in (empty, first, second)] == [(0, 0)] * 3
    both.release()
    assert (empty.released, first.released, second.released) == (1, 1, 1)


# -- 7. pricing ----------------------------------------------------------------------------


def test_predicted_speedup():
    dear = [1.0] + [1.0 + 0.92 * (r - 1) for r in range(1, 18)]  # a 2-row step costs 1.92 one-row steps
    assert dear[2] == pytest.approx(1.92)
    assert predicted_speedup(0.96, dear, 0.65) == (0, 1.0)  # even a 96% draft cannot pay
    cheap = [1.0] + [1.0 + 0.02 * (r - 1) for r in range(1, 18)]
    k, gain = predicted_speedup(0.8, cheap, 0.1)
    assert gain > 2
    by_k = [sum(0.8 ** i for i in range(j + 1)) / (cheap[1 + j] + j * 0.1) for j in range(1, 17)]
    assert gain == pytest.approx(max(by_k)) and k == 1 + int(np.argmax(by_k))
    assert predicted_speedup(0.8, cheap, 0.1, most=1) == (1, pytest.approx(1.8 / 1.12))


def test_the_proposer_declines_at_this_cpus_prices_without_touching_the_draft_model():
    """c(2) = 1.92 and a draft step 0.65 of a target step (Qwen2.5-Coder 1.5B / 0.5B here):
    nothing is drafted and the draft model does not decode (nor read the prompt). At
    paying prices the same proposer drafts the target's likely tokens."""

    class Prices(StepCost):
        def __init__(self, ratios):
            super().__init__()
            self.table = ratios

        def ratios(self, most, prior_per_row):
            return self.table[: most + 1]

    drafter = ScriptedBackend(logits_fn=draft_logits, n_ctx=128)
    model = DraftModel(drafter, 4)
    model.step_delta = lambda cost: 0.65
    dear = DraftModelProposer(model, 0, Prices([1.0] + [1.0 + 0.92 * (r - 1) for r in range(1, 40)]), greedy=True)
    history = [ord(c) for c in "abcabcab"]
    for _ in range(5):
        assert dear.draft(history, 8) == []
    assert drafter.calls == []
    model.step_delta = lambda cost: 0.05
    cheap = DraftModelProposer(model, 0, Prices(paying_ratios(40)), greedy=True)
    out = cheap.draft(history, 8)
    assert out and out[0] == ord("c")  # markov's next after 'b'
    assert drafter.kv_tokens(0) == history + out[:-1]
    assert cheap.draft(history, 8, StepShare(rows=2, tokens=2))  # two streams: still pays here


def test_a_declining_draft_model_times_its_step_again(monkeypatch):
    """A draft step priced while the machine was busy must not keep drafting off for the
    rest of the session: every RETIME_AFTER declined steps the draft step is timed again
    (one decode past the slot's end, cut back), and the slot's KV is left as it was."""
    from localrun.speculation import draft_model

    monkeypatch.setattr(draft_model, "RETIME_AFTER", 4)
    engine, _, drafter = fake_pair()
    engine.speculator.step_cost.ratios = lambda most, prior=0.25: [1.0] + [2.0 * r for r in range(1, most + 1)]
    model = engine.draft_model
    model._step_ms = 1e6  # "measured" under a load spike
    before = len(drafter.calls)
    completion = engine.complete("abcab", sampling=GREEDY, max_tokens=9, lookup=False)
    assert completion.timings.drafted == 0  # a 2-row step at 4 one-row steps: never pays
    assert model._step_ms < 1e6 * 0.9 ** 2 + 1  # timed twice (8 declines), each pulling the mean down
    assert len(drafter.calls) - before == 2  # one draft decode per retiming, nothing else
    assert drafter.kv_tokens(0) == []  # what the slot held (nothing) is what it holds


def test_catching_the_draft_slot_up_is_priced_over_the_steps_left():
    """Before it drafts, the draft slot reads what it lacks of the history: with paying
    step prices, a proposer 600 tokens behind whose reading costs a third of a step a
    token declines when 8 steps are left (75 steps' reading for 8), and drafts when 250
    are (0.8 a step); once caught up, it drafts with little room left."""
    drafter = ScriptedBackend(logits_fn=draft_logits, n_ctx=1024)
    model = DraftModel(drafter, 4)
    model.step_delta = lambda cost: 0.05
    model.read_delta = lambda cost: 0.125
    cost = StepCost()
    cost.ratios = lambda most, prior=0.25: paying_ratios(most)
    history = [ord(c) for c in "abc" * 200] + [ord("a")]
    p = DraftModelProposer(model, 0, cost, greedy=True)
    assert p.draft(history, 8) == [] and drafter.kv_tokens(0) == []  # declined without reading
    assert p.draft(history, 250)  # the same reading spread over 250 steps pays
    assert drafter.kv_tokens(0)[: len(history) - 1] == history[:-1]
    p.record(1, 1)
    assert p.draft(history + [ord("b")], 8)  # caught up: a short answer's end drafts too
