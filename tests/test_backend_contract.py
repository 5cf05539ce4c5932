"""The backend contract, run once per backend on the same SmolLM2 weights."""

from __future__ import annotations

import numpy as np
import pytest

from localrun.backends.base import BatchEntry

PROMPT = "The capital of France is Paris. The capital of Italy is"


def fresh(engine, *seqs):
    for s in seqs:
        engine.backend.kv_clear(s)
    return engine.backend


def last_row(be, seq, tokens, pos):
    return np.array(be.decode([BatchEntry(seq, tokens, pos, 1)])[0][-1])


def test_model_info(engine):
    info = engine.info
    assert info.architecture == "llama"
    assert info.n_vocab == 49152 and info.n_layer == 30
    assert (info.n_head, info.n_head_kv, info.head_dim) == (9, 3, 64)
    assert info.n_ctx_train == 8192
    assert "<|im_start|>" in info.chat_template
    assert info.eos_text == "<|im_end|>" and info.eos_id == 2
    assert 2 in info.stop_ids and info.quant


@pytest.mark.parametrize("text", ["Hello, world!", "  indented\n\tcode()", "👋🌍 emoji", "你好世界 CJK", "12345 + 678"])
def test_tokens_round_trip_to_the_same_bytes(engine, text):
    be = engine.backend
    ids = be.tokenize(text, add_special=False)
    assert ids and all(0 <= t < engine.info.n_vocab for t in ids)
    assert b"".join(be.token_bytes(t) for t in ids) == text.encode()


def test_special_tokens_parse_and_render_empty(engine):
    be = engine.backend
    assert be.tokenize("<|im_start|>user", add_special=False)[0] == 1
    assert be.is_control(2) and not be.is_control(be.tokenize("hi")[0])
    assert be.token_bytes(2) == b""


def test_backends_tokenize_alike(llama_engine, mlx_engine):
    for text in [PROMPT, "<|im_start|>user\nWrite def f(x): return x*2<|im_end|>\n", "Numbers 2024 and 3.14159"]:
        assert llama_engine.tokenize(text, add_special=False) == mlx_engine.tokenize(text, add_special=False)


def test_decode_returns_finite_rows(engine):
    be = fresh(engine, 0)
    toks = be.tokenize(PROMPT)
    rows = be.decode([BatchEntry(0, toks, 0, 3)])
    assert len(rows) == 1 and rows[0].shape == (3, engine.info.n_vocab)
    assert rows[0].dtype == np.float32 and np.isfinite(rows[0]).all()
    assert be.token_bytes(int(np.argmax(rows[0][-1]))).strip() == b"Rome"


def test_all_rows_of_a_verify_step_match_one_token_steps(engine):
    """What speculation needs: k+1 rows from one call equal k+1 single steps."""
    be = fresh(engine, 0, 1)
    toks = be.tokenize(PROMPT)
    head, tail = toks[:-4], toks[-4:]
    be.decode([BatchEntry(0, head, 0, 0)])
    multi = np.array(be.decode([BatchEntry(0, tail, len(head), 4)])[0])
    be.decode([BatchEntry(1, head, 0, 0)])
    singles = np.stack([last_row(be, 1, [t], len(head) + i) for i, t in enumerate(tail)])
    assert (multi.argmax(-1) == singles.argmax(-1)).all()
    # llama.cpp's CPU kernels differ by ~1 logit between batch shapes; MLX far less
    assert np.abs(multi - singles).max() < 2.0


def test_kv_trim_then_redecode_is_identical(engine):
    be = fresh(engine, 0)
    toks = be.tokenize(PROMPT)
    first = last_row(be, 0, toks, 0)
    be.kv_trim(0, len(toks) - 3)
    again = last_row(be, 0, toks[-3:], len(toks) - 3)
    # the same prefix from the cache plus the same 3 tokens: same logits
    np.testing.assert_allclose(first, again, atol=2.0)
    assert int(first.argmax()) == int(again.argmax())


def test_kv_copy_shares_a_prefix(engine):
    be = fresh(engine, 0, 1)
    toks = be.tokenize(PROMPT)
    ref = last_row(be, 0, toks, 0)
    be.kv_copy(0, 1, len(toks) - 2)
    got = last_row(be, 1, toks[-2:], len(toks) - 2)
    assert int(ref.argmax()) == int(got.argmax())
    # copying did not disturb the source
    be.kv_trim(0, len(toks) - 1)
    assert int(last_row(be, 0, toks[-1:], len(toks) - 1).argmax()) == int(ref.argmax())


def test_kv_clear_forgets(engine):
    be = fresh(engine, 0)
    a = last_row(be, 0, be.tokenize("Apples are"), 0)
    be.kv_clear(0)
    b_toks = be.tokenize("Dogs like to")
    b = last_row(be, 0, b_toks, 0)
    be.kv_clear(0)
    b_again = last_row(be, 0, b_toks, 0)
    np.testing.assert_allclose(b, b_again, atol=1e-3)
    assert not np.allclose(a, b)


def test_two_sequences_in_one_decode(engine):
    be = fresh(engine, 0, 1)
    p0 = be.tokenize("<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n")
    p1 = be.tokenize("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    solo0 = last_row(be, 0, p0, 0)
    solo1 = last_row(be, 1, p1, 0)
    fresh(engine, 0, 1)
    r0, r1 = be.decode([BatchEntry(0, p0, 0, 1), BatchEntry(1, p1, 0, 1)])
    assert int(r0[-1].argmax()) == int(solo0.argmax())
    assert int(r1[-1].argmax()) == int(solo1.argmax())
    # entries in any order: each gets its own rows back (llama.cpp is fed them in seq order)
    fresh(engine, 0, 1)
    q1, q0 = be.decode([BatchEntry(1, p1, 0, 1), BatchEntry(0, p0, 0, 1)])
    np.testing.assert_allclose(q0, r0, atol=1e-3)
    np.testing.assert_allclose(q1, r1, atol=1e-3)


def test_batch_limits_are_checked(engine):
    be = engine.backend
    with pytest.raises(ValueError):
        be.decode([BatchEntry(5, [1], 0, 1)])
    with pytest.raises(ValueError):
        be.decode([BatchEntry(0, [1], engine.n_ctx, 1)])
    with pytest.raises(ValueError):
        be.decode([BatchEntry(0, [1] * (be.n_batch + 1), 0, 1)])


def test_interrupt_stops_a_decode_and_keeps_the_cache_as_it_was(llama_engine):
    """A hung-up client stops a long prompt chunk mid-pass (llama.cpp's abort callback):
    the decode raises, nothing of the batch stays in the KV, the next decode is exact."""
    import threading

    from localrun.backends.base import DecodeInterrupted

    be = llama_engine.backend
    assert be.can_interrupt
    head = llama_engine.tokenize("The capital of France is")
    be.kv_clear(0)
    before = np.array(be.decode([BatchEntry(0, head, 0, 1)])[0])
    long = llama_engine.tokenize("The quick brown fox jumps over the lazy dog. " * 40)[: be.n_batch]
    be.interrupt()  # an interrupt that comes before the decode stops that decode
    with pytest.raises(DecodeInterrupted):
        be.decode([BatchEntry(0, long, len(head), 0)])
    timer = threading.Timer(0.005, be.interrupt)
    timer.start()
    try:
        be.decode([BatchEntry(0, long, len(head), 0)])
        interrupted = False
    except DecodeInterrupted:
        interrupted = True
    timer.join()
    if not interrupted:  # the decode beat the timer: take it back to compare as before
        be.kv_trim(0, len(head))
    assert list(be.kv_tokens(0)) == head
    be.kv_trim(0, len(head) - 1)
    again = np.array(be.decode([BatchEntry(0, head[-1:], len(head) - 1, 1)])[0])
    assert np.allclose(again, before, atol=1e-3)


def test_kv_copy_mid_answer_is_exact_with_a_sliding_window_cache(gemma3_gguf):
    """The engine moves a running generation to a neighbouring slot by copying its KV
    (localrun/slots.py). Gemma-3 keeps a sliding-window cache beside the full one; after
    the copy, the next step in the new slot gives the very row the old slot gives."""
    from localrun.engine import Engine

    with Engine.open(gemma3_gguf, n_ctx=256, n_seq=3) as eng:
        be = eng.backend
        toks = eng.chat_prompt([{"role": "user", "content": "Name three colors."}])
        row = last_row(be, 2, toks, 0)
        for _ in range(4):  # a few answer tokens, one step each, as the engine feeds them
            toks.append(int(row.argmax()))
            row = last_row(be, 2, toks[-1:], len(toks) - 1)
        n = len(toks)
        be.kv_copy(2, 1, n)
        assert be.kv_tokens(1) == toks
        nxt = [int(row.argmax())]
        moved = np.array(last_row(be, 1, nxt, n))
        stayed = np.array(last_row(be, 2, nxt, n))
        np.testing.assert_array_equal(moved, stayed)
