"""Prompt lookup learns the edits an answer makes to the text it copies (a rename, a
fixed word) and drafts them at the next occurrence: on literal token lists, through the
draft controller, and through the engine with a scripted model that renames."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest.mock import patch

from localrun.engine import Engine
from localrun.speculation.edits import LearnedEdits
from localrun.sampling import SamplingParams, TokenText
from localrun.speculation.drift import BatchDrift
from localrun.speculation.lookup import LookupConfig, LookupProposer, NgramIndex

from fakes import EOS, ScriptedBackend

CHEAP = LookupConfig(measure_cost=False, cost_per_draft=0.1)  # drafts readily: the tests are about what


def write(controller: LookupProposer, prompt: list[int], answer: list[int], room: int = 16):
    """Let `answer` be written after `prompt` as the engine would with lookup: each step
    verifies the controller's draft against the answer and keeps the agreeing part plus
    the answer's next token. Returns (steps, where in the answer drafts failed, every
    draft)."""
    h = list(prompt) + answer[:1]  # the first token is pending
    steps = 0
    failed, drafts = [], []
    while len(h) - len(prompt) < len(answer):
        draft = controller.draft(h, room)
        at = len(h) - len(prompt)  # where the draft's first token goes in the answer
        kept = 0
        while kept < len(draft) and at + kept < len(answer) and draft[kept] == answer[at + kept]:
            kept += 1
        if draft:
            controller.record(len(draft), kept)
            drafts.append(draft)
        if kept < len(draft):
            failed.append(at + kept)
        h += answer[at : at + kept + 1]
        steps += 1
    return steps, failed, drafts


# a "function" of 80 tokens in which the name 7 occurs four times, 20 tokens apart
SOURCE = [t for i in range(4) for t in (7, *range(100 + 15 * i, 115 + 15 * i), 50, 51, 52, 53)]
RENAMED = [8 if t == 7 else t for t in SOURCE]
NAMES = [i for i, t in enumerate(SOURCE) if t == 7]  # 0, 20, 40, 60


def at_names(failed: list[int]) -> list[int]:
    """The failures at an occurrence of the name (a draft also fails at the answer's end,
    where the copy goes on past it)."""
    return [i for i in failed if i in NAMES]


def test_a_rename_made_once_is_drafted_at_every_later_occurrence():
    c = LookupProposer(CHEAP)
    steps, failed, drafts = write(c, [1, 2, *SOURCE, 3, 4], [*RENAMED, EOS])
    assert len(c.edits) == 1
    # the first occurrence is the answer's first token (no draft there); a draft failed at
    # the second, where the rename was still unknown, and no draft failed at the others
    assert at_names(failed) == [20]
    assert sum(d.count(8) for d in drafts) >= 2  # later occurrences came drafted, renamed

    baseline = LookupProposer(dataclasses.replace(CHEAP, learn_edits=False))  # each occurrence ends a draft
    base_steps, base_failed, _ = write(baseline, [1, 2, *SOURCE, 3, 4], [*RENAMED, EOS])
    assert len(at_names(base_failed)) >= 3
    assert steps < base_steps


def test_an_edit_learns_an_insertion_and_a_deletion():
    edits = LearnedEdits()
    #       source: 1 5 2 3 | answer: 1 5 9 2 3  (9 written after 5)
    h = [1, 5, 2, 3, 6, 1, 5, 9, 2, 3]
    edits.missed(source=2, answer=7)
    edits.resync(h)
    assert edits.copy(h, 0, 5)[0] == [1, 5, 9, 2, 3]
    assert edits.copy(h, 5, 5)[0] == [1, 5, 9, 2, 3]  # the answer's own copy already has it: not twice

    edits = LearnedEdits()
    #       source: 1 5 4 2 3 | answer: 1 5 2 3  (4 left out)
    h = [1, 5, 4, 2, 3, 6, 1, 5, 2, 3]
    edits.missed(source=2, answer=8)
    edits.resync(h)
    assert edits.copy(h, 0, 4)[0] == [1, 5, 2, 3]


def test_a_deletion_is_made_only_after_the_token_it_followed():
    """`append((x))` written as `append(x)` drops the second `(`, not every `(`."""
    edits = LearnedEdits()
    #       source: 7 5 5 2 3 8 5 4 | answer: 7 5 2 3  (one 5 of two left out)
    h = [7, 5, 5, 2, 3, 8, 5, 4, 6, 7, 5, 2, 3]
    edits.missed(source=2, answer=11)
    edits.resync(h)
    assert edits.copy(h, 0, 8)[0] == [7, 5, 2, 3, 8, 5, 4, 6]  # the 5 after 8 is copied as it is


def test_a_miss_the_answer_does_not_come_back_from_teaches_nothing():
    edits = LearnedEdits()
    h = [1, 5, 2, 3, 4, 6, 1, 5, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]  # the answer left the copy
    edits.missed(source=2, answer=8)
    edits.resync(h)
    assert len(edits) == 0
    assert edits._miss is None  # given up: too far past the miss


def test_an_edit_the_answer_stops_making_is_forgotten():
    c = LookupProposer(CHEAP)
    # renamed at the first two occurrences, kept at the last two
    answer = [8 if t == 7 and i < 40 else t for i, t in enumerate(SOURCE)]
    _, failed, _ = write(c, [1, 2, *SOURCE, 3, 4], [*answer, EOS])
    assert at_names(failed) == [20, 40]  # where the rename was new, and where it first was not made
    assert len(c.edits) == 0


def test_a_match_goes_on_behind_a_learned_edit():
    # the tail after the rename matches the source for 2 tokens exactly, and for the whole
    # line when the rename counts as agreement
    h = [*SOURCE, 3, *RENAMED[:18]]
    index = NgramIndex()
    assert index.locate(h) == (17, 17)  # back to the renamed name, where the exact match stops
    edits = LearnedEdits()
    edits.missed(source=0, answer=len(SOURCE) + 1)
    edits.resync(h[: len(SOURCE) + 5])  # a few tokens after the rename: 7 -> 8 is learned
    assert len(edits) == 1
    assert index.locate(h, edits) == (17, 18)


def scripted_run(prompt: list[int], answer: list[int], lookup, spelled: bool = True) -> tuple[list[int], int]:
    """What an engine writes, greedy, over a backend that writes `answer` after `prompt`,
    and how many decode calls it took; `spelled=False`: the engine drafts without the
    vocabulary's spelling (no bracket is mirrored)."""

    def model(hist: list[int]) -> int:
        i = len(hist) - len(prompt)
        return answer[i] if 0 <= i < len(answer) else EOS

    be = ScriptedBackend(script=model, n_ctx=512, n_batch=64)
    eng = Engine(be)
    eng.speculator.drift = BatchDrift.known(0.0)
    # unspelled: no edit is taken for one that drops a bracket
    unspelled = patch.object(LearnedEdits, "_dropped_bracket", return_value=None)
    with unspelled if not spelled else contextlib.nullcontext():
        events = list(eng.generate(prompt, sampling=SamplingParams(temperature=0), max_tokens=200, lookup=lookup))
    return [t for e in events for t in e.tokens], len(be.calls)


def test_an_engine_drafts_a_rename_and_writes_what_it_writes_without_lookup():
    prompt, answer = [1, 2, *SOURCE, 3, 4], [*RENAMED, EOS]
    plain, plain_calls = scripted_run(prompt, answer, False)
    learned, learned_calls = scripted_run(prompt, answer, CHEAP)
    unlearned, unlearned_calls = scripted_run(prompt, answer, dataclasses.replace(CHEAP, learn_edits=False))
    assert plain[: len(RENAMED)] == RENAMED
    assert learned == unlearned == plain
    assert learned_calls < unlearned_calls < plain_calls


# one token per byte, as the scripted backend spells them
BYTES = TokenText(lambda t: bytes([t]), tokenize=lambda text: list(text.encode()))
# SmolLM2 on the rename task: a redundant pair of brackets dropped
PAREN_SOURCE = list(b'        errors.append(("short", raw))\n        continue\n        entry = {"ts": float(parts[0])}\n')
PAREN_ANSWER = list(b'        errors.append("short", raw)\n        continue\n        entry = {"ts": float(parts[0])}\n')


def past_indent(failed: list[int], answer: list[int]) -> list[int]:
    """The failures past the first line's indent (runs of spaces match anywhere) and
    before the answer's end (where the copy goes on past it)."""
    return [i for i in failed if answer.index(ord("e")) <= i < len(answer)]


def test_a_dropped_opening_bracket_drops_the_bracket_that_closed_it():
    prompt = [*PAREN_SOURCE, 3, 4]
    dropped = PAREN_ANSWER.index(ord('"'))  # where the answer leaves the source: `((` -> `(`
    closer = PAREN_ANSWER.index(ord(")")) + 1  # and where it writes `)` for `))`
    _, failed, _ = write(LookupProposer(CHEAP, spelling=BYTES), prompt, [*PAREN_ANSWER, EOS], room=48)
    _, failed_unspelled, _ = write(LookupProposer(CHEAP), prompt, [*PAREN_ANSWER, EOS], room=48)
    assert past_indent(failed_unspelled, PAREN_ANSWER) == [dropped, closer]
    assert past_indent(failed, PAREN_ANSWER) == [dropped]


def test_a_mirrored_closer_is_the_one_that_matches_and_only_that_one():
    edits = LearnedEdits(spelling=BYTES)
    source = list(b"f((a[1], (b)), c))")
    h = source + list(b";f(a[")  # the answer copies `f((a[` as `f(a[`
    edits.missed(source=2, answer=len(source) + 3)
    edits.resync(h)
    # the `(` dropped closes at the `)` before `, c`: that one is dropped, the others stay
    assert bytes(edits.copy(h, 0, len(source) - 2)[0]) == b"f(a[1], (b), c))"

    edits = LearnedEdits(spelling=BYTES)
    h = list(b"g([x)]") + list(b";g(x)")  # brackets that do not pair: nothing is mirrored
    edits.missed(source=2, answer=9)
    edits.resync(h)
    assert bytes(edits.copy(h, 0, 5)[0]) == b"g(x)]"


def test_a_mirror_the_answer_does_not_make_is_forgotten():
    prompt = [*PAREN_SOURCE, 3, 4]
    answer = list(b'        errors.append("short", raw))\n        continue\n        entry = {"ts": float(parts[0])}\n')
    c = LookupProposer(CHEAP, spelling=BYTES)
    _, failed, _ = write(c, prompt, [*answer, EOS], room=48)
    kept = answer.index(ord(")")) + 1  # the mirror left this `)` out
    assert past_indent(failed, answer) == [answer.index(ord('"')), kept]
    assert not c.edits._mirrors


def test_an_engine_mirrors_a_dropped_bracket_and_writes_what_it_writes_without_lookup():
    prompt, answer = [1, 2, *PAREN_SOURCE, 3, 4], [*PAREN_ANSWER, EOS]
    long_drafts = dataclasses.replace(CHEAP, max_draft=48)
    plain, plain_calls = scripted_run(prompt, answer, False)
    mirrored, mirrored_calls = scripted_run(prompt, answer, long_drafts)
    unmirrored, unmirrored_calls = scripted_run(prompt, answer, long_drafts, spelled=False)
    assert plain[: len(PAREN_ANSWER)] == PAREN_ANSWER
    assert mirrored == unmirrored == plain
    assert mirrored_calls < unmirrored_calls < plain_calls
