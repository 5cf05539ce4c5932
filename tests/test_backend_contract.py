"""The backend contract, run once per backend on the same SmolLM2 weights."""

from __future__ import annotations

import inspect
import typing

import numpy as np
import pytest

from localrun.backends.base import Backend, BatchEntry
from localrun.errors import CacheNotTrimmableError, DecodeError, LocalrunError
from localrun.sampling import SamplingParams

from fakes import ScriptedBackend, text_script

PROMPT = "The capital of France is Paris. The capital of Italy is"
GREEDY = SamplingParams(temperature=0)


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
    import ctypes

    import llama_cpp

    from localrun.backends.base import DecodeInterrupted

    be = llama_engine.backend
    assert be.can_interrupt
    head = llama_engine.tokenize("The capital of France is")
    be.kv_clear(0)
    nxt = [int(np.argmax(be.decode([BatchEntry(0, head, 0, 1)])[0][-1]))]
    after_head = last_row(be, 0, nxt, len(head))  # what the token after the prompt sees
    be.kv_trim(0, len(head))
    long = llama_engine.tokenize("The quick brown fox jumps over the lazy dog. " * 40)[: be.n_batch]
    be.interrupt()  # an interrupt that comes before the decode stops that decode
    with pytest.raises(DecodeInterrupted):
        be.decode([BatchEntry(0, long, len(head), 0)])

    # ggml asks the abort callback after each graph node; wrapped in a hook that calls
    # interrupt() at the 50th, the interrupt lands once the pass is under way (it has hundreds)
    asked = 0

    def hook(data):
        nonlocal asked
        asked += 1
        if asked == 50:
            be.interrupt()
        return be._abort_fn(data)  # the backend's own callback answers

    hook_fn, flag = llama_cpp.ggml_abort_callback(hook), ctypes.cast(be._abort_flag, ctypes.c_void_p)
    llama_cpp.llama_set_abort_callback(be._ctx, hook_fn, flag)
    try:
        with pytest.raises(DecodeInterrupted):
            be.decode([BatchEntry(0, long, len(head), 0)])
    finally:
        llama_cpp.llama_set_abort_callback(be._ctx, be._abort_fn, flag)
    assert asked == 50  # it stopped at the node the interrupt came at, not at the end of the pass
    assert list(be.kv_tokens(0)) == head
    # a cell of the stopped batch left in the cache would be refused or attended to here
    assert np.allclose(last_row(be, 0, nxt, len(head)), after_head, atol=1e-3)


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


# -- the declared contract: every member of base.Backend, with its type ---------------


def protocol_methods() -> list[str]:
    return [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")]


def contract_gaps(backend) -> list[str]:
    """Each member of the Backend protocol that `backend` lacks, holds with another type,
    or takes with other parameter names (empty when it keeps the whole contract)."""
    gaps = []
    for name, kind in typing.get_type_hints(Backend).items():
        if not hasattr(backend, name):
            gaps.append(f"{name}: missing")
            continue
        value = getattr(backend, name)
        # bool is an int in Python: a count must not be a flag, nor a flag a count
        fits = type(value) is bool if kind is bool else isinstance(value, kind) and not isinstance(value, bool)
        if not fits:
            gaps.append(f"{name}: {type(value).__name__}, declared {kind.__name__}")
    for name in protocol_methods():
        method = getattr(backend, name, None)
        if not callable(method):
            gaps.append(f"{name}(): missing")
            continue
        declared = list(inspect.signature(getattr(Backend, name)).parameters)[1:]  # without self
        if list(inspect.signature(method).parameters) != declared:
            gaps.append(f"{name}(): takes {list(inspect.signature(method).parameters)}, declared {declared}")
    return gaps


def test_the_protocol_names_every_capability_the_engine_reads():
    """The capabilities the engine, scheduler and server read, spelled out (a member
    dropped from the Protocol, or one the fakes lack, fails here or below)."""
    declared = set(typing.get_type_hints(Backend)) | set(protocol_methods())
    assert {"can_interrupt", "batches_neighbours_only", "kv_state_bytes", "n_seq", "n_ctx", "n_batch", "n_vocab",
            "kv_cache_type", "info", "clear_interrupt", "interrupt", "embed", "decode", "kv_trim", "kv_copy",
            "kv_clear", "kv_tokens", "tokenize", "token_bytes", "token_text", "is_control", "close", "passes"} <= declared


def test_each_backend_keeps_the_whole_contract(engine):
    be = engine.backend
    assert contract_gaps(be) == [] and isinstance(be, Backend)
    assert be.n_vocab == engine.info.n_vocab and be.kv_cache_type == "f16"


def test_the_scripted_fake_keeps_the_same_contract():
    assert contract_gaps(ScriptedBackend()) == []


def test_contract_gaps_names_what_is_wrong():
    """The checker itself: a member missing, a count that is a flag, a renamed parameter."""

    class Drifted(ScriptedBackend):
        def kv_trim(self, seq: int, keep: int) -> None: ...

    be = Drifted()
    be.n_batch = True
    gaps = contract_gaps(be)
    assert "n_batch: bool, declared int" in gaps
    assert any(g.startswith("kv_trim(): takes ['seq', 'keep']") for g in gaps)
    assert {"info: missing", "decode(): missing"} <= set(contract_gaps(object()))


def test_embed_is_a_unit_vector_that_tells_texts_apart(engine):
    be = engine.backend
    a, a_again = be.embed(be.tokenize("The cat sat on the mat.")), be.embed(be.tokenize("The cat sat on the mat."))
    b = be.embed(be.tokenize("Quarterly revenue grew by four percent."))
    assert a.ndim == 1 and a.dtype == np.float32 and abs(float(np.linalg.norm(a)) - 1) < 1e-4
    np.testing.assert_allclose(a, a_again, atol=1e-5)
    assert float(a @ b) < 0.999


def test_kv_state_bytes_grows_with_the_cached_tokens(engine):
    be = fresh(engine, 0)
    toks = be.tokenize(PROMPT)
    be.decode([BatchEntry(0, toks[:4], 0, 0)])
    four = be.kv_state_bytes(0)
    be.decode([BatchEntry(0, toks[4:8], 4, 0)])
    eight = be.kv_state_bytes(0)
    be.kv_clear(0)
    assert 0 < four < eight


# -- distinct errors: decode failed, cache cannot be cut --------------------------------


def test_a_failed_llama_decode_is_a_decode_error_and_keeps_the_cache(llama_engine):
    """llama_decode refuses a token outside the vocabulary (code -1): DecodeError, one
    line, nothing of the batch kept, the next decode exact."""
    be = fresh(llama_engine, 0)
    head = be.tokenize(PROMPT)
    # the last row is read in a one-row step, as `again` below is: a prefill's row may
    # differ from it by the batch drift of the CPU's kernels (~0.3 on an AVX2 EPYC)
    be.decode([BatchEntry(0, head[:-1], 0, 0)])
    before = np.array(be.decode([BatchEntry(0, head[-1:], len(head) - 1, 1)])[0])
    with pytest.raises(DecodeError) as exc:
        be.decode([BatchEntry(0, [be.n_vocab + 7], len(head), 1)])
    assert "code -1" in str(exc.value) and "\n" not in str(exc.value)
    assert not isinstance(exc.value, CacheNotTrimmableError) and exc.value.http_status == 500
    assert list(be.kv_tokens(0)) == head
    be.kv_trim(0, len(head) - 1)
    again = np.array(be.decode([BatchEntry(0, head[-1:], len(head) - 1, 1)])[0])
    assert np.allclose(again, before, atol=1e-3)


def _engine_with_a_cached_prompt(trim_error: Exception):
    """A fake engine whose slot 0 holds "Q:abcd", and whose kv_trim raises `trim_error`."""
    from localrun.engine import Engine

    be = ScriptedBackend(text_script(b"ok"), n_seq=1)
    be.kv[0] = list(b"Q:abcd")
    be.trim_error = trim_error
    return Engine(be)


def test_a_cache_that_cannot_be_cut_is_read_afresh():
    eng = _engine_with_a_cached_prompt(CacheNotTrimmableError("a rotating window is full"))
    out = eng.complete("Q:xy", max_tokens=4, sampling=GREEDY)
    assert out.text == "ok" and out.timings.cached_tokens == 0


@pytest.mark.parametrize("error", [DecodeError("llama_decode failed"), LocalrunError("the disk is gone")])
def test_any_other_trim_failure_reaches_the_caller_and_frees_the_slot(error):
    """Once, any error from kv_trim read as "cannot be cut": a real failure went unseen."""
    eng = _engine_with_a_cached_prompt(error)
    with pytest.raises(type(error)):
        eng.start("Q:xy", max_tokens=4)
    assert eng.free_slots == 1
    eng.backend.trim_error = None
    assert eng.complete("Q:xy", max_tokens=4, sampling=GREEDY).text == "ok"


# -- one set of load options ----------------------------------------------------------


def test_both_backends_take_one_set_of_load_options():
    """One BackendOptions value opens a model on either backend: each constructor takes it
    (or its fields as keywords), and nothing else but the path."""
    from localrun.backends.base import BackendOptions
    from localrun.backends.llamacpp import LlamaCppBackend
    from localrun.backends.mlx import MLXBackend

    for cls in (LlamaCppBackend, MLXBackend):
        params = list(inspect.signature(cls.__init__).parameters)
        assert params == ["self", "path", "options", "fields"], cls.__name__
    with pytest.raises(TypeError, match="not both"):
        BackendOptions.of(BackendOptions(), n_ctx=64)
    assert BackendOptions.of(None, n_ctx=64, kv_cache_type=None) == BackendOptions(n_ctx=64)  # None means f16
    assert BackendOptions(n_seq=2, threads=3).changed() == {"n_seq": 2, "threads": 3}


@pytest.mark.parametrize(
    "option, shown", [({"threads": 4}, "--threads 4"), ({"n_gpu_layers": 0}, "n_gpu_layers 0"),
                      ({"cluster": object()}, "--rpc"), ({"repack": False}, "repack False"),
                      ({"flash_attn": "on"}, "flash_attn on")]
)
def test_mlx_refuses_llama_cpp_options_before_reading_anything(tmp_path, option, shown):
    """The folder is empty: only a refusal that comes first can answer with this error."""
    from localrun.backends.mlx import MLXBackend
    from localrun.errors import BadRequestError

    with pytest.raises(BadRequestError) as exc:
        MLXBackend(tmp_path, **option)
    msg = str(exc.value)
    assert msg.startswith(shown) and "llama.cpp models only" in msg and "\n" not in msg
    with pytest.raises(TypeError, match="unexpected keyword argument 'offload_kqv'"):  # BackendOptions' own TypeError
        MLXBackend(tmp_path, offload_kqv=True)


def test_flash_attn_is_on_off_or_chosen_and_a_quantized_cache_needs_it_on():
    from localrun.backends.base import BackendOptions

    assert BackendOptions(flash_attn="off").changed() == {"flash_attn": "off"}
    with pytest.raises(ValueError, match="'on', 'off' or None"):
        BackendOptions(flash_attn=True)
    with pytest.raises(ValueError, match="q8_0 KV cache needs flash attention on"):
        BackendOptions(flash_attn="off", kv_cache_type="q8_0")
