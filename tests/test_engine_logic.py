"""Engine logic on the scripted backend: exact logits, no model needed."""

from __future__ import annotations

import numpy as np
import pytest

from localrun.engine import Engine
from localrun.errors import BadRequestError, ContextExceededError
from localrun.sampling import SamplingParams

from fakes import EOS, N_VOCAB, ScriptedBackend, text_script

GREEDY = SamplingParams(temperature=0)


def collect(engine: Engine, prompt, **kw):
    events = list(engine.generate(prompt, sampling=kw.pop("sampling", GREEDY), **kw))
    return "".join(e.text for e in events), events


def test_stops_at_eos_and_reports_stop():
    eng = Engine(ScriptedBackend(text_script(b"hi there")))
    text, events = collect(eng, "Q:")
    assert text == "hi there"
    assert events[-1].finish_reason == "stop"
    assert EOS not in [t for e in events for t in e.tokens]


def test_max_tokens_ends_with_length():
    eng = Engine(ScriptedBackend(text_script(b"abcdefgh")))
    text, events = collect(eng, "Q:", max_tokens=3)
    assert text == "abc"
    assert events[-1].finish_reason == "length"
    assert events[-1].timings.generated_tokens == 3


def test_max_tokens_zero_reads_the_prompt_and_generates_nothing():
    """An editor's cache warm-up (llama.vim sends n_predict 0): the prompt lands in the
    slot's KV, no logits are asked for, no token comes out."""
    eng = Engine(ScriptedBackend(text_script(b"abc")))
    text, events = collect(eng, "Q:", max_tokens=0)
    assert text == "" and events[-1].finish_reason == "length"
    assert [[(e.tokens, e.n_logits) for e in call] for call in eng.backend.calls] == [[([81, 58], 0)]]
    assert eng.backend.kv_tokens(0) == [81, 58]
    # the next request on the same prompt finds it cached and feeds only the last token
    gen = eng.start("Q:", max_tokens=1)
    assert gen.timings.cached_tokens == 1


def test_multibyte_characters_never_split():
    answer = "👋 你好 ok".encode()
    eng = Engine(ScriptedBackend(text_script(answer), n_ctx=64))
    text, events = collect(eng, "Q:")
    assert text == "👋 你好 ok"
    for e in events:
        assert "\ufffd" not in e.text
    # the four bytes of the emoji arrive as four tokens but as one piece of text
    assert events[0].text == "" and events[3].text == "👋"


@pytest.mark.parametrize(
    "stop, want",
    [(["\nUser:"], "Sure.\n"), (["xyz"], "Sure.\n\nUser: more"), (["."], "Sure"), (["e."], "Sur")],
)
def test_stop_strings_cut_exactly(stop, want):
    eng = Engine(ScriptedBackend(text_script(b"Sure.\n\nUser: more"), n_ctx=64))
    text, events = collect(eng, "Q:", stop=stop)
    assert text == want
    assert events[-1].finish_reason == "stop"


def test_held_back_partial_stop_is_released_at_the_end():
    # "Use" could be the start of "User:"; when generation ends it must still appear
    eng = Engine(ScriptedBackend(text_script(b"ok Use"), n_ctx=64))
    text, _ = collect(eng, "Q:", stop=["User:"])
    assert text == "ok Use"


def test_prompt_longer_than_context_fails_before_any_decode():
    be = ScriptedBackend(n_ctx=32)
    eng = Engine(be)
    with pytest.raises(ContextExceededError, match="32"):
        list(eng.generate("x" * 40, sampling=GREEDY))
    assert be.calls == []
    # and the engine still works afterwards
    assert collect(eng, "ok")[1][-1].finish_reason == "stop"


def test_generation_is_capped_by_the_context():
    eng = Engine(ScriptedBackend(lambda h: ord("a"), n_ctx=20))
    text, events = collect(eng, "0123456789", max_tokens=1000)
    assert len(text) == 10 and events[-1].finish_reason == "length"


def test_long_prompt_is_prefilled_in_chunks_of_n_batch():
    be = ScriptedBackend(text_script(b"k"), n_ctx=128, n_batch=16)
    eng = Engine(be)
    collect(eng, "p" * 40, lookup=False)
    sizes = [sum(len(e.tokens) for e in call) for call in be.calls]
    # the prompt's last token is read alone (its row then never depends on the batch shape)
    assert sizes[:4] == [16, 16, 7, 1]
    assert [e.n_logits for call in be.calls[:4] for e in call] == [0, 0, 0, 1]


def test_the_first_token_comes_from_a_one_row_step_cached_prefix_or_not():
    be = ScriptedBackend(text_script(b"k"), n_ctx=128, n_batch=64)
    eng = Engine(be)
    for _ in range(2):  # the second run finds the prompt cached
        be.calls.clear()
        collect(eng, "q" * 30, max_tokens=2, lookup=False)
        first_logits = next(e for call in be.calls for e in call if e.n_logits)
        assert len(first_logits.tokens) == 1 and first_logits.n_logits == 1


def test_two_generations_share_one_decode_per_step():
    be = ScriptedBackend(text_script(b"abc"), n_ctx=64, n_seq=2)
    eng = Engine(be)
    g1 = eng.start("one!", sampling=GREEDY)  # same length: the script counts from it
    g2 = eng.start("two!", sampling=GREEDY)
    assert {g1.seq, g2.seq} == {0, 1}
    steps = 0
    while not (g1.done and g2.done):
        eng.step([g1, g2])
        steps += 1
    assert steps == 5  # prefill, the prompt's last token+a, b, c, eos: both in every call
    assert all(len(call) == 2 for call in be.calls)
    assert eng.detokenize(g1.output) == "abc"


def test_decoding_sequences_go_first_when_a_prefill_is_too_big():
    be = ScriptedBackend(lambda h: ord("z"), n_ctx=128, n_seq=2, n_batch=8)
    eng = Engine(be)
    g1 = eng.start("a", sampling=GREEDY, max_tokens=50)
    eng.step([g1])
    g2 = eng.start("b" * 30, sampling=GREEDY)
    eng.step([g1, g2])
    first, second = be.calls[-1]
    assert first.seq == g1.seq and len(first.tokens) == 1
    assert second.seq == g2.seq and len(second.tokens) == 7


def test_slots_are_released_and_full_engine_refuses():
    eng = Engine(ScriptedBackend(n_seq=1))
    g = eng.start("x")
    with pytest.raises(RuntimeError):
        eng.start("y")
    eng.release(g)
    eng.start("y")


def test_seeded_sampling_reproduces_and_seeds_differ():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(N_VOCAB,)).astype(np.float32) * 3
    table[EOS] = -100

    def logits(hist):
        return np.roll(table, len(hist))

    def run(seed):
        eng = Engine(ScriptedBackend(logits_fn=logits, n_ctx=64))
        p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        return [t for e in eng.generate("ab", sampling=p, max_tokens=20) for t in e.tokens]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("bad", [[-1], [N_VOCAB], []])
def test_bad_token_ids_are_a_clear_error(bad):
    eng = Engine(ScriptedBackend())
    with pytest.raises(BadRequestError):
        eng.start(bad)


def test_n_probs_reports_alternatives_per_token():
    eng = Engine(ScriptedBackend(text_script(b"ok")))
    events = list(eng.generate("Q:", sampling=SamplingParams(temperature=0, n_probs=3)))
    with_tokens = [e for e in events if e.tokens]
    assert [len(e.top_probs) for e in with_tokens] == [1, 1]
    best_id, best_p = with_tokens[0].top_probs[0][0]
    assert best_id == ord("o") and best_p > 0.9 and len(with_tokens[0].top_probs[0]) == 3


@pytest.mark.parametrize("lookup", [False, True])
def test_only_a_generation_that_may_draft_ages_the_measured_step_costs(lookup):
    """Every decode step is timed into StepCost, marked as a drafting generation's only
    when lookup is on: a lookup-off answer's steps follow the machine's speed and leave
    the widths' estimates as they were (StepCost's own tests pin what each kind does)."""
    answer = np.random.default_rng(7).integers(65, 91, 400).astype(np.uint8).tobytes()  # few drafts pass
    eng = Engine(ScriptedBackend(text_script(answer), n_ctx=1024))
    timed: list[tuple[int, bool]] = []
    observe = eng.speculator.step_cost.observe
    eng.speculator.step_cost.observe = lambda rows, ms, drafting=True: (timed.append((rows, drafting)), observe(rows, ms, drafting))
    text, events = collect(eng, "Q:", lookup=lookup)
    assert len(text) == 400 and len(timed) == events[-1].timings.steps
    assert {drafting for _, drafting in timed} == {lookup}
    assert any(rows > 1 for rows, _ in timed) == lookup