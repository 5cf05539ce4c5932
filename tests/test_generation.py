"""End-to-end generation on real models, against real peers."""

from __future__ import annotations

import numpy as np
import pytest

from localrun.backends.attention import FLASH_ATTN_ENV
from localrun.backends.base import BatchEntry
from localrun.engine import Engine
from localrun.errors import ContextExceededError
from localrun.sampling import SamplingParams
from localrun.textstream import Utf8Stream

from fakes import step_all

GREEDY = SamplingParams(temperature=0)
PROMPTS = [
    "Name three colors.",
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Explain in one sentence why the sky is blue.",
    "List the days of the week.",
]
COLORS = ("red", "blue", "green", "yellow", "orange", "purple", "black", "white", "pink")


def chat(engine, text):
    return engine.chat_prompt([{"role": "user", "content": text}])


def fresh_greedy(eng, tokens, n):
    """localrun's greedy answer read as the Llama class reads it: from an empty cache, one
    token a step. With flash attention off a row depends on the batch it was computed in,
    so a prefix left in the cache by an earlier prompt (a BOS, a chat header) or a kept
    lookup draft may change a close call (lookup's identity has tests of its own)."""
    for seq in range(eng.backend.n_seq):
        eng.backend.kv_clear(seq)
    return eng.complete(tokens, sampling=GREEDY, max_tokens=n, lookup=False).tokens


def llama_class_greedy(llm, tokens, n, stop_ids):
    # localrun reads a prompt's last token in a step of its own, so that an answer does not
    # depend on how much of the prompt was cached (with flash attention off a row depends on
    # the batch it was computed in); the Llama class is fed the same way: the prompt but its
    # last token, then generate() reuses that prefix and decodes the last token alone.
    llm.reset()
    llm.eval(tokens[:-1])
    out = []
    for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if tok in stop_ids or len(out) == n:
            break
        out.append(tok)
    return out


def test_greedy_equals_llama_cpp_python_llama_class(llama_engine, smollm2_gguf):
    """Token for token on 5 prompts against llama-cpp-python's own high-level Llama."""
    from llama_cpp import Llama

    llm = Llama(
        str(smollm2_gguf), n_ctx=1024, n_threads=llama_engine.backend.threads,
        flash_attn=llama_engine.backend.flash_attn != "off", verbose=False
    )
    try:
        for text in PROMPTS:
            toks = chat(llama_engine, text)
            ours = fresh_greedy(llama_engine, toks, 32)
            assert ours == llama_class_greedy(llm, toks, 32, llama_engine.info.stop_ids), text
    finally:
        llm.close()


def test_mlx_and_llama_cpp_agree_on_greedy_tokens(llama_engine, mlx_engine):
    """The converted f16 MLX model predicts the llama.cpp greedy continuation.

    Teacher-forced: MLX scores prompt + llama.cpp's 32 greedy tokens in one pass and
    its argmax at each of those positions is compared with the llama.cpp token.
    """
    agree = total = 0
    for text in PROMPTS:
        toks = chat(llama_engine, text)
        ref = llama_engine.complete(toks, sampling=GREEDY, max_tokens=32).tokens
        be = mlx_engine.backend
        be.kv_clear(0)
        seq = toks + ref
        rows = be.decode([BatchEntry(0, seq[:-1], 0, len(ref))])[0]
        pred = np.argmax(rows, axis=-1)
        agree += int((pred == np.array(ref)).sum())
        total += len(ref)
    assert agree / total >= 0.90, f"{agree}/{total}"


def test_name_three_colors_is_answered(engine):
    res = engine.complete(chat(engine, "Name three colors."), sampling=GREEDY, max_tokens=40)
    found = [c for c in COLORS if c in res.text.lower()]
    assert len(found) >= 2, res.text
    assert res.timings.prompt_tokens > 5 and res.timings.ttft_ms > 0


def test_gemma3_greedy_equals_llama_class(gemma3_gguf):
    """Gemma-3-270M (a base model: raw prompts; 262k vocab, sliding-window layers)."""
    from llama_cpp import Llama

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    with Engine.open(gemma3_gguf, n_ctx=512) as eng:
        llm = Llama(str(gemma3_gguf), n_ctx=512, n_threads=eng.backend.threads,
                    flash_attn=eng.backend.flash_attn != "off", verbose=False)
        try:
            for text in prompts:
                toks = eng.tokenize(text)
                ours = fresh_greedy(eng, toks, 24)
                assert ours == llama_class_greedy(llm, toks, 24, eng.info.stop_ids), text
        finally:
            llm.close()


def test_seeded_sampling_reproduces_on_both_backends(engine):
    p = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05)
    toks = chat(engine, "Tell me a short story about a cat.")
    a = engine.complete(toks, sampling=SamplingParams(seed=42, **p), max_tokens=12).tokens
    b = engine.complete(toks, sampling=SamplingParams(seed=42, **p), max_tokens=12).tokens
    assert a == b and len(a) == 12


@pytest.mark.parametrize("text", ["👋🌍🎉 emoji", "你好，世界。日本語のテキスト", "Ünïcödé ß ø"])
def test_token_by_token_stream_never_splits_a_character(engine, text):
    be = engine.backend
    stream = Utf8Stream()
    pieces = [stream.feed(be.token_bytes(t)) for t in be.tokenize(text)] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_prompt_over_the_context_is_an_error(engine):
    long = engine.tokenize("word " * 1100)
    with pytest.raises(ContextExceededError, match="raise --ctx"):
        engine.start(long)
    assert engine.complete(chat(engine, "Hi"), sampling=GREEDY, max_tokens=2).finish_reason == "length"


@pytest.fixture
def batch_invariant(monkeypatch):
    """Flash attention on, under which SmolLM2's rows are bit-identical in every batch
    shape on this CPU (a batch drift of 0 over 568 rows; off, the CPU default, they move by
    up to 0.3 logits): a batched answer that differs from the solo one is then cross-talk
    between sequences, not rounding."""
    monkeypatch.setenv(FLASH_ATTN_ENV, "on")


def test_two_generations_stepped_together_match_solo(smollm2_gguf, batch_invariant):
    with Engine.open(smollm2_gguf, n_ctx=512, n_seq=2) as eng:
        a, b = chat(eng, PROMPTS[0]), chat(eng, PROMPTS[1])
        solo_a = eng.complete(a, sampling=GREEDY, max_tokens=12).tokens
        solo_b = eng.complete(b, sampling=GREEDY, max_tokens=12).tokens
        ga = eng.start(a, sampling=GREEDY, max_tokens=12)
        gb = eng.start(b, sampling=GREEDY, max_tokens=12)
        try:
            while not (ga.done and gb.done):
                eng.step([ga, gb])
        finally:
            eng.release(ga)
            eng.release(gb)
        assert ga.output == solo_a and gb.output == solo_b


def test_a_generation_moved_to_a_neighbouring_slot_matches_solo(smollm2_gguf, batch_invariant):
    """llama.cpp batches only neighbouring slots, so when the middle one of three
    generations ends, the engine copies the last one's KV into the gap mid-answer; its
    greedy tokens stay those of a solo run. (SmolLM2 with flash attention on: its rows do
    not depend on how tokens are batched. Gemma-3's do, by up to ~1 logit on this CPU's kernels, so a
    batched Gemma answer may differ from a solo one whether or not anything moves;
    its KV copy is checked row for row in test_backend_contract.py.)"""
    with Engine.open(smollm2_gguf, n_ctx=256, n_seq=3) as eng:
        prompts = [chat(eng, p) for p in PROMPTS[:3]]
        limits = [16, 3, 16]
        solo = [eng.complete(p, sampling=GREEDY, max_tokens=n, lookup=False).tokens for p, n in zip(prompts, limits)]
        for s in range(eng.backend.n_seq):
            eng.backend.kv_clear(s)  # no cached prompts: each starts in its own slot, 0, 1, 2
        gens = [eng.start(p, sampling=GREEDY, max_tokens=n, lookup=False) for p, n in zip(prompts, limits)]
        assert [g.seq for g in gens] == [0, 1, 2]
        step_all(eng, gens)
        assert gens[2].seq == 1  # moved into the gap the second one left
        assert [g.output for g in gens] == solo
