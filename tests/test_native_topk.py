"""The fused sampler's top-k in C (localrun/sampling/_topk.c) against the reference order
(logit descending, then id ascending), on the rows that stress a one-pass heap: ties by
the thousand, rising and falling rows, grammar-masked rows, NaN, lengths that are not a
multiple of its block, every k the fused path takes."""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest

from localrun.sampling import stages

native = stages._native_top_k


def test_the_module_is_built_where_a_c_compiler_is():
    """The extension is optional (a machine without a compiler still installs), so a
    build that silently dropped it would only show as a slower sampler: say so here."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) on this machine: localrun samples through numpy here")
    assert native is not None, "localrun/sampling/_topk.c was not built: run `pip install -e .` again and read its output"


needs_native = pytest.mark.skipif(native is None, reason="the C top-k is not built here (no C compiler at install)")


def reference(x: np.ndarray, k: int) -> tuple[list[int], list[float]] | None:
    if np.isnan(x).any() or np.count_nonzero(x > -np.inf) < k:
        return None
    ids = np.lexsort((np.arange(x.size), -x))[:k]
    return ids.tolist(), x[ids].tolist()


def rows(rng: np.random.Generator):
    for n in (1, 31, 33, 1000, 49_153, 262_144):
        yield rng.standard_normal(n).astype(np.float32)
        yield np.sort(rng.standard_normal(n)).astype(np.float32)  # every element a new best
        yield np.sort(rng.standard_normal(n))[::-1].astype(np.float32).copy()  # the best come first
        yield rng.integers(0, 3, n).astype(np.float32)  # ties everywhere
        yield np.zeros(n, np.float32)
        masked = np.full(n, -np.inf, np.float32)
        allowed = rng.choice(n, min(n, 50), replace=False)
        masked[allowed] = rng.standard_normal(allowed.size)
        yield masked
        spiked = rng.standard_normal(n).astype(np.float32)
        spiked[rng.integers(n)] = np.inf
        yield spiked


@needs_native
def test_the_k_largest_by_logit_then_id_on_every_kind_of_row():
    rng = np.random.default_rng(5)
    checked = 0
    for x in rows(rng):
        for k in (1, 2, 40, 64, 1024):
            if k > x.size:
                continue
            assert native(x, k) == reference(x, k), (x.size, k)
            checked += 1
    assert checked == 133  # 6 lengths x 7 rows, each k up to its length


@needs_native
def test_a_nan_anywhere_or_too_few_allowed_ids_hands_the_row_back():
    x = np.random.default_rng(1).standard_normal(262_144).astype(np.float32)
    for at in (0, 39, 40, 1000, 262_143):  # in the heap's first fill, in a block, in the tail
        y = x.copy()
        y[at] = np.nan
        assert native(y, 40) is None
    masked = np.full(262_144, -np.inf, np.float32)
    masked[[5, 70_000]] = [1.0, 2.0]
    assert native(masked, 2) == ([70_000, 5], [2.0, 1.0])
    assert native(masked, 3) is None


@needs_native
def test_it_reads_the_buffers_the_engine_hands_it_and_refuses_others():
    import ctypes

    x = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    want = reference(x, 40)
    as_ctypes = (ctypes.c_float * x.size).from_buffer_copy(x.tobytes())  # llama.cpp's logits: '<f'
    assert native(np.ctypeslib.as_array(as_ctypes), 40) == want
    assert native(memoryview(as_ctypes), 40) == want
    assert native(x.view(np.uint32).view(np.float32), 40) == want
    with pytest.raises(TypeError, match="float32"):
        native(x.astype(np.float64), 40)
    with pytest.raises(TypeError, match="float32"):
        native(x.astype(">f4"), 40)
    with pytest.raises((TypeError, ValueError, BufferError)):
        native(x[::2], 40)  # not contiguous
    for k in (0, -1, x.size + 1):
        with pytest.raises(ValueError, match="0 < k"):
            native(x, k)


@needs_native
@pytest.mark.parametrize("kw", [dict(), dict(repeat_penalty=1.1), dict(typical_p=0.9), dict(top_k=300, top_p=0.99)])
def test_samplers_without_the_c_pass_give_the_same_distributions(kw, monkeypatch):
    """numpy's top-k (a machine without a C compiler) and the C pass keep the same tokens
    with the same probabilities, on the fused path and the staged one (typical_p)."""
    from localrun.sampling import Sampler, SamplingParams, fused

    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(262_144).astype(np.float32) * 4, rng.integers(0, 4, 49_152).astype(np.float32),
          np.sort(rng.standard_normal(151_936)).astype(np.float32)]
    history = rng.integers(0, 49_152, 64).tolist()

    def distributions():
        s = Sampler(SamplingParams(seed=0, **kw))
        return [s.distribution(x, history) for x in xs]

    with_c = distributions()
    monkeypatch.setattr(stages, "_native_top_k", None)
    monkeypatch.setattr(fused, "_native_top_k", None)
    for (ids, probs), (want_ids, want_probs) in zip(distributions(), with_c):
        assert ids.tolist() == want_ids.tolist()
        np.testing.assert_array_equal(probs, want_probs)
