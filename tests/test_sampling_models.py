"""The sampler stack's behaviour on real models, both backends."""

from __future__ import annotations

import math

import numpy as np
import pytest

import localrun.sampling.sampler as sampler_module
import localrun.sampling.stages as stages_module
from localrun.sampling import DEFAULT_SAMPLERS, Sampler, SamplingParams

# dry_allowed_length=1: a 10-token answer seldom repeats two tokens of its context, and DRY
# must fire for the test below to see it act
EVERY_STAGE = dict(
    temperature=0.9, dynatemp_range=0.3, top_k=50, typical_p=0.95, top_p=0.95, min_p=0.02,
    xtc_probability=0.5, xtc_threshold=0.1, repeat_penalty=1.1, presence_penalty=0.2,
    frequency_penalty=0.1, dry_multiplier=0.8, dry_allowed_length=1, logit_bias={13: -2.0}, top_n_sigma=2.0,
    # no breakers: the chat prompt's last token (a newline) then repeats earlier ones, so DRY
    # acts from the first token on, whatever the sampled tokens (the kernels' last bits move them)
    dry_sequence_breakers=[],
)


def chat(engine, text):
    return engine.chat_prompt([{"role": "user", "content": text}])


def longest_repeat(tokens: list[int]) -> int:
    """Length of the longest token n-gram that occurs twice (overlaps allowed)."""
    best = 0
    for n in range(1, len(tokens)):
        seen = {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}
        if len(seen) == len(tokens) - n + 1:
            break
        best = n
    return best


def test_mirostat_v2_holds_the_target_surprise(llama_engine):
    tau = 3.0  # reachable: with a higher target than the text's entropy mu can only grow
    gen = llama_engine.start(
        chat(llama_engine, "Write a long story about a journey across the mountains."),
        sampling=SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=0.1, temperature=1.0, seed=11),
        max_tokens=400,
        ignore_eos=True,
    )
    surprises: list[float] = []
    commit = gen.sampler.commit

    def recording_commit(token, ids, probs):
        surprises.append(-math.log2(float(probs[np.flatnonzero(ids == token)[0]])))
        commit(token, ids, probs)

    gen.sampler.commit = recording_commit
    try:
        while not gen.done:
            llama_engine.step([gen])
    finally:
        llama_engine.release(gen)
    assert len(surprises) == 400
    mean = float(np.mean(surprises))
    assert abs(mean - tau) <= 0.15 * tau, mean


def test_dry_cuts_verbatim_repeats_of_a_loop(llama_engine):
    loop = "The cat sat on the mat. " * 6
    prompt = chat(llama_engine, f"Continue this text: {loop}")
    base = dict(temperature=0, repeat_last_n=0)
    plain = llama_engine.complete(prompt, sampling=SamplingParams(**base), max_tokens=120, ignore_eos=True, lookup=False)
    dry = llama_engine.complete(
        prompt, sampling=SamplingParams(dry_multiplier=0.8, dry_allowed_length=2, **base), max_tokens=120,
        ignore_eos=True, lookup=False,
    )
    assert longest_repeat(dry.tokens) < longest_repeat(plain.tokens) / 2, (plain.text, dry.text)


def stage_effects(monkeypatch) -> set[str]:
    """The names of the chain's stages that changed the candidates (ids or logits) at least
    once while the patch is on: each stage still runs, between a before and after look."""
    changed: set[str] = set()

    def snapshot(c) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(c.id_array(), kind="stable")
        return c.id_array()[order].copy(), np.asarray(c.logits)[order].copy()

    def watched(name, run):
        def wrapper(c, *args):
            before = snapshot(c)
            run(c, *args)
            if not all(np.array_equal(b, a) for b, a in zip(before, snapshot(c))):
                changed.add(name)
        return wrapper

    stage = Sampler._stage

    def watched_stage(self, name, c, history):
        watched(name, lambda c: stage(self, name, c, history))(c)

    monkeypatch.setattr(Sampler, "_stage", watched_stage)
    # mirostat's path calls temperature and its truncation directly, not through _stage
    for name, module, attr in (("temperature", stages_module, "temperature"), ("mirostat", sampler_module, "mirostat_v1"),
                               ("mirostat", sampler_module, "mirostat_v2")):
        monkeypatch.setattr(module, attr, watched(name, getattr(module, attr)))
    return changed


@pytest.mark.parametrize("stages", ["every", "mirostat1", "mirostat2"])
def test_every_stage_runs_and_reproduces_on_both_backends(engine, stages, monkeypatch):
    if stages == "every":
        params, expected = EVERY_STAGE, set(DEFAULT_SAMPLERS)
    else:
        params = dict(mirostat=int(stages[-1]), mirostat_tau=4.0, temperature=0.9, dry_multiplier=0.5,
                      dry_allowed_length=1, dry_sequence_breakers=[])
        expected = {"dry", "temperature", "mirostat"}  # penalties and logit bias are off: they change nothing
    prompt = chat(engine, "Describe your favourite city.")
    changed = stage_effects(monkeypatch)
    runs = [
        engine.complete(prompt, sampling=SamplingParams(seed=5, **params), max_tokens=10, ignore_eos=True)
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 10
    assert changed == expected


def test_text_keyed_logit_bias_bans_every_token_of_the_text(llama_engine):
    """llama-server's string form: the bias reaches each token of the text."""
    prompt = "The capital of France is"
    free = llama_engine.complete(prompt, sampling=SamplingParams(temperature=0), max_tokens=12, lookup=False)
    assert "Paris" in free.text
    banned = set(llama_engine.backend.tokenize(" Paris", add_special=False, parse_special=False))
    assert len(banned) >= 1
    res = llama_engine.complete(prompt, sampling=SamplingParams(temperature=0, logit_bias={" Paris": False}),
                                max_tokens=12, lookup=False)
    assert not banned & set(res.tokens) and res.text != free.text


def test_a_tight_top_n_sigma_leaves_only_the_top_token_on_both_backends(engine):
    """n = 1e-4 deviations keeps only the largest logit, so a hot sampler writes the
    greedy answer token for token; an n that keeps a few tokens lets other answers through."""
    prompt = chat(engine, "Name a colour.")
    greedy = engine.complete(prompt, sampling=SamplingParams(temperature=0), max_tokens=6, ignore_eos=True, lookup=False)
    hot = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    tight = [
        engine.complete(prompt, sampling=SamplingParams(top_n_sigma=1e-4, seed=s, **hot), max_tokens=6,
                        ignore_eos=True, lookup=False).tokens
        for s in range(2)
    ]
    assert tight == [greedy.tokens] * 2
    loose = {
        tuple(engine.complete(prompt, sampling=SamplingParams(top_n_sigma=3.0, seed=s, **hot), max_tokens=6,
                              ignore_eos=True, lookup=False).tokens)
        for s in range(3)
    }
    assert loose != {tuple(greedy.tokens)}
