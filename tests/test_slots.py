"""Slot placement for backends that batch only neighbouring slots (llama.cpp's KV stream
per sequence): the rules in localrun/slots.py, and the engine following them on the
scripted backend, where every decode call's slots can be read back."""

from __future__ import annotations

import pytest

from localrun import slots
from localrun.engine import Engine
from localrun.sampling import SamplingParams

from fakes import EOS, ScriptedBackend, step_all

GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(("seqs", "want"), [([], 0), ([2], 1), ([0, 1, 2], 1), ([0, 2], 2), ([3, 1, 0], 2), ([0, 2, 4], 3)])
def test_runs_counts_groups_of_consecutive_ids(seqs, want):
    assert slots.runs(seqs) == want


def test_place_keeps_busy_slots_together_and_copies_a_long_prefix():
    far = slots.COPY_WORTH + 10
    # slot 3 holds the prompt, but a request there would split {0, 3}: copy it into 1
    assert slots.place([1, 2, 3], [0], {1: 0, 2: 0, 3: far}) == (1, 3)
    # a short prefix is not worth a copy: read it again next to the busy slot
    assert slots.place([1, 2, 3], [0], {1: 0, 2: 0, 3: slots.COPY_WORTH - 1}) == (1, None)
    # among slots that keep one run, the one with the longest own prefix
    assert slots.place([0, 2, 3], [1], {0: 5, 2: 20, 3: 0}) == (2, None)
    # an idle backend: the longest prefix, wherever it is, then the lowest id
    assert slots.place([0, 1, 2, 3], [], {0: 0, 1: 0, 2: far, 3: far}) == (2, None)
    assert slots.place([0, 1, 2, 3], [], dict.fromkeys(range(4), 0)) == (0, None)


def test_move_joins_runs_unless_the_generation_ends_soon():
    many, few = slots.MOVE_WORTH + 50, slots.MOVE_WORTH - 1
    assert slots.move({0: many, 2: many}, [1, 3]) == (2, 1)
    assert slots.move({0: many, 2: few}, [1, 3]) == (0, 1)  # 2 stays; 0 joins it
    assert slots.move({0: few, 2: few}, [1, 3]) is None
    assert slots.move({0: many, 1: many}, [2, 3]) is None  # already one run
    assert slots.move({0: many, 3: many}, []) is None
    assert slots.move({0: many, 2: many, 4: many}, [1, 3]) == (4, 1)  # 3 runs -> 2


def history_script(hist: list[int]) -> int:
    """A next token that depends on the whole history, so a wrong KV shows in the output."""
    return 40 + (sum(hist) * 31 + len(hist)) % 80


def run_together(engine: Engine, prompts: list[list[int]], limits: list[int]) -> tuple[list, list[list[int]]]:
    """Step generations together, releasing each as it finishes (as the server does);
    returns their outputs and the slots of every decode call."""
    # one token a step (no lookup), so that generations of equal length end together
    gens = [engine.start(p, sampling=GREEDY, max_tokens=n, ignore_eos=True, lookup=False)
            for p, n in zip(prompts, limits)]
    first = len(engine.backend.calls)
    step_all(engine, gens)
    return [g.output for g in gens], [[e.seq for e in call] for call in engine.backend.calls[first:]]


def test_a_generation_moves_into_the_gap_a_finished_one_leaves():
    prompts, limits = [[65, 66, 67], [70, 71], [80, 81, 82, 83]], [30, 2, 30]
    solo = [run_together(Engine(ScriptedBackend(history_script, n_seq=4)), [p], [n])[0][0]
            for p, n in zip(prompts, limits)]
    eng = Engine(ScriptedBackend(history_script, n_seq=4, batches_neighbours_only=True))
    outputs, calls = run_together(eng, prompts, limits)
    assert outputs == solo  # the moved generation's KV came along whole
    assert [0, 1, 2] in calls and [0, 1] in calls  # slot 2's generation went to the gap at 1
    assert all(slots.runs(c) == 1 for c in calls)
    # where neighbours do not matter (MLX), nothing moves
    eng = Engine(ScriptedBackend(history_script, n_seq=4))
    outputs, calls = run_together(eng, prompts, limits)
    assert outputs == solo and calls[-1] == [0, 2]


def test_a_cached_prompt_is_copied_next_to_the_busy_slot():
    prompt = list(range(40, 40 + slots.COPY_WORTH + 20))
    backend = ScriptedBackend(history_script, n_seq=4, n_ctx=128, batches_neighbours_only=True)
    eng = Engine(backend)
    busy = eng.start([65, 66], sampling=GREEDY, max_tokens=50)
    backend.kv[3] = list(prompt)  # a finished request left this prompt in slot 3
    gen = eng.start(prompt, sampling=GREEDY, max_tokens=4)
    assert gen.seq == 1 and gen.timings.cached_tokens == len(prompt) - 1
    assert backend.kv[3] == prompt  # the copy leaves the source for a later prompt
    eng.step([busy, gen])
    assert sorted((e.seq, e.pos, len(e.tokens)) for e in backend.calls[-1]) == [(0, 0, 1), (1, len(prompt) - 1, 1)]
    # without the neighbour rule the request takes slot 3 itself
    eng = Engine(ScriptedBackend(history_script, n_seq=4, n_ctx=128))
    eng.start([65, 66], sampling=GREEDY, max_tokens=50)
    eng.backend.kv[3] = list(prompt)
    assert eng.start(prompt, sampling=GREEDY, max_tokens=4).seq == 3


def test_scripted_eos_still_ends_a_moved_generation():
    """A generation that moves keeps its stop rules: EOS after the move ends it."""
    def script(hist):
        return EOS if len(hist) >= 14 else history_script(hist)

    eng = Engine(ScriptedBackend(script, n_seq=4, batches_neighbours_only=True))
    a = eng.start([65, 66, 67], sampling=GREEDY, max_tokens=40)
    b = eng.start([70, 71], sampling=GREEDY, max_tokens=1)
    c = eng.start([80, 81, 82], sampling=GREEDY, max_tokens=40)
    eng.step([a, b, c])  # the prompts but their last tokens
    eng.step([a, b, c])  # those, and the first tokens
    assert b.done
    eng.release(b)
    while not (a.done and c.done):
        eng.step([g for g in (a, c) if not g.done])
    assert c.seq == 1 and c.finish_reason == "stop" and len(c.history) == 14
