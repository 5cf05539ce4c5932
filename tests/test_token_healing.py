"""Token healing (GenerationRequest.token_healing): the prompt's end is backed up over the
tokens the cursor may have cut (prompt/healing.py), and the answer's first tokens must write
that text again, which its text does not repeat. On a scripted vocabulary with a few
multi-byte tokens; the real model's cases (Qwen2.5-Coder behind a FIM prompt) are in
test_fim_cache.py."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import EOS, ScriptedBackend, make_info

from localrun.engine import Engine
from localrun.errors import BadRequestError
from localrun.grammar.core import Grammar
from localrun.prompt import healing
from localrun.request import GenerationRequest
from localrun.sampling import SamplingParams

DOT_S, DOT_SQRT, SPACE_NA = 257, 258, 259
PIECES = {DOT_S: b".s", DOT_SQRT: b".sqrt", SPACE_NA: b" na"}
N_VOCAB = 260
GREEDY = SamplingParams(temperature=0)
PROMPT = list(b"x = math") + [DOT_S, ord("q")]  # "x = math.sq" as a tokenizer may cut it


class WordBackend(ScriptedBackend):
    """Bytes, EOS, and a few multi-byte tokens; `prefer(history)` gives the row's logits."""

    n_vocab = N_VOCAB

    def __init__(self, prefer) -> None:
        super().__init__(n_ctx=64, n_seq=1)
        self.info = make_info(n_vocab=N_VOCAB)
        self.prefer = prefer

    def token_bytes(self, token: int) -> bytes:
        return PIECES.get(token, bytes([token]) if token < 256 else b"")

    def is_control(self, token: int) -> bool:
        return token == EOS

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("latin-1")

    def _row(self, hist: list[int]) -> np.ndarray:
        row = np.zeros(N_VOCAB, np.float32)
        for token, logit in self.prefer(hist).items():
            row[token] = logit
        return row


def back(eng: Engine, tokens: list[int]) -> tuple[list[int], bytes]:
    return healing.heal_back(eng.backend, eng.token_text.index(N_VOCAB), tokens)


def engine(prefer=lambda hist: {EOS: 1.0}) -> Engine:
    return Engine(WordBackend(prefer))


def test_heal_back_takes_the_tokens_a_longer_token_could_have_written():
    eng = engine()
    # "q", then ".s" (".sq" begins ".sqrt"), not "h" (no token begins "h.sq")
    assert back(eng, PROMPT) == (list(b"x = math"), b".sq")
    assert back(eng, list(b"for n in") + [SPACE_NA]) == (list(b"for n in"), b" na")
    assert back(eng, list(b"ab")) == ([ord("a")], b"b")  # the last text token always goes
    assert back(eng, [ord("q")]) == ([ord("q")], b"")  # the first never
    assert back(eng, list(b"ab") + [EOS]) == (list(b"ab") + [EOS], b"")  # nor a control token


def test_heal_back_stops_at_heal_most(monkeypatch):
    monkeypatch.setattr(healing, "HEAL_MOST", 1)
    assert back(engine(), PROMPT) == (PROMPT[:-1], b"q")


def test_the_first_token_writes_the_healed_text_again_and_the_text_goes_on_after_it():
    # the model would rather write "r" (it cannot: "r" does not write ".sq") than ".sqrt"
    prefer = {len(PROMPT) - 2: {ord("r"): 9.0, DOT_SQRT: 5.0, ord("."): 1.0}}
    eng = engine(lambda hist: prefer.get(len(hist), {EOS: 1.0}))
    done = eng.complete(PROMPT, sampling=GREEDY, max_tokens=4, token_healing=True)
    assert done.tokens == [DOT_SQRT] and done.text == "rt"
    assert done.timings.prompt_tokens == len(PROMPT) - 2


def test_the_healed_text_may_be_written_in_several_tokens():
    """".s" then "q" write ".sq" again (no text), then the answer goes on; the streamed
    events' text is the whole text."""
    n = len(PROMPT) - 2
    prefer = {n: {ord("z"): 9.0, DOT_S: 5.0}, n + 1: {ord("z"): 9.0, ord("q"): 4.0}, n + 2: {ord("r"): 3.0}}
    eng = engine(lambda hist: prefer.get(len(hist), {EOS: 1.0}))
    request = GenerationRequest(sampling=GREEDY, max_tokens=6, token_healing=True)
    events = list(eng.generate(PROMPT, request))
    assert [t for ev in events for t in ev.tokens] == [DOT_S, ord("q"), ord("r")]
    assert "".join(ev.text for ev in events) == "r"


def test_without_healing_the_prompt_is_read_whole():
    eng = engine(lambda hist: {ord("r"): 9.0} if len(hist) == len(PROMPT) else {EOS: 1.0})
    done = eng.complete(PROMPT, sampling=GREEDY, max_tokens=4)
    assert done.tokens == [ord("r")] and done.text == "r" and done.timings.prompt_tokens == len(PROMPT)


def test_a_grammar_turns_healing_off():
    eng = engine(lambda hist: {ord("r"): 9.0} if len(hist) == len(PROMPT) else {EOS: 1.0})
    done = eng.complete(PROMPT, sampling=GREEDY, max_tokens=4, token_healing=True,
                        grammar=Grammar.from_regex("r"))
    assert done.text == "r" and done.timings.prompt_tokens == len(PROMPT)


def test_token_healing_must_be_a_bool():
    with pytest.raises(BadRequestError, match="token_healing must be true or false"):
        GenerationRequest(token_healing="yes")
