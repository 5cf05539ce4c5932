"""The sampler chain on literal arrays: each stage names a token that must survive and
one that must not; order; mirostat; DRY and its breakers; state; the draw's
frequencies. (Validation and bounds: test_sampling_params.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from localrun.errors import BadRequestError
from localrun.sampling import DEFAULT_SAMPLERS, Sampler, SamplingParams, TokenText

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)  # every truncation off


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def dist(logits, history=(), vocab=None, **kw) -> dict[int, float]:
    s = Sampler(SamplingParams(**{**OFF, **kw}), vocab)
    ids, probs = s.distribution(np.asarray(logits, dtype=np.float32), list(history))
    return {int(i): float(p) for i, p in zip(ids, probs) if p > 0}


# -- stages --------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest():
    d = dist([1, 5, 3, 4, 2], top_k=2)
    assert set(d) == {1, 3} and 2 not in d
    assert d[1] == pytest.approx(math.e / (math.e + 1))


def test_top_k_on_a_big_row_finds_exactly_the_top():
    x = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    assert set(dist(x, top_k=40)) == set(np.argsort(-x)[:40].tolist())


def test_top_k_finds_the_top_wherever_it_sits_in_the_row():
    """The one-pass top-k reads again only the columns (ids i mod groups) whose maximum
    reaches the k-th largest column maximum, plus the ids past the last whole row."""
    x = np.random.default_rng(2).standard_normal(262_147).astype(np.float32)
    x[0:50 * 4096:4096] += 50  # the top 50 share one column
    assert set(dist(x, top_k=40)) <= set(range(0, 50 * 4096, 4096))
    assert len(dist(x, top_k=40)) == 40
    x[-3:] += 100  # the last ids, past the last whole row of columns
    top = dist(x, top_k=5)
    assert {262_144, 262_145, 262_146} <= set(top) and 1 not in top


def test_top_p_keeps_the_shortest_prefix_reaching_p():
    d = dist(logits_of([0.5, 0.3, 0.15, 0.05]), top_p=0.75)
    assert set(d) == {0, 1} and 2 not in d
    assert d[0] == pytest.approx(0.5 / 0.8)
    assert set(dist(logits_of([0.5, 0.3, 0.15, 0.05]), top_p=0.75, min_keep=3)) == {0, 1, 2}


def test_min_p_cuts_below_a_fraction_of_the_top():
    d = dist(logits_of([0.5, 0.3, 0.15, 0.05]), min_p=0.2)  # cut: p < 0.1
    assert set(d) == {0, 1, 2} and 3 not in d


def test_typical_can_drop_the_most_likely_token():
    # entropy 1.50 nats; the 0.4 token's surprise is 0.92, the 0.15s' 1.90: these are typical
    d = dist(logits_of([0.4, 0.15, 0.15, 0.15, 0.15]), typical_p=0.5)
    assert set(d) == {1, 2, 3, 4} and 0 not in d


def test_xtc_removes_the_top_choices_but_the_least_likely_of_them():
    d = dist(logits_of([0.4, 0.3, 0.2, 0.1]), xtc_probability=1.0, xtc_threshold=0.15)
    assert set(d) == {2, 3} and 0 not in d and 1 not in d
    # only one token over the threshold: nothing to exclude
    assert set(dist(logits_of([0.4, 0.3, 0.2, 0.1]), xtc_probability=1.0, xtc_threshold=0.35)) == {0, 1, 2, 3}


def test_xtc_coin_is_the_only_randomness_distribution_uses():
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    off = Sampler(SamplingParams(**OFF, seed=3))
    before = off.snapshot()
    off.distribution(x, [])
    assert off.snapshot() == before
    on = Sampler(SamplingParams(**OFF, xtc_probability=0.5, xtc_threshold=0.15, seed=3))
    ref = np.random.Generator(np.random.PCG64(3))
    on.distribution(x, [])
    ref.random()
    assert on.rng.bit_generator.state == ref.bit_generator.state  # exactly one draw


def test_xtc_probability_zero_is_off():
    assert set(dist(logits_of([0.4, 0.3, 0.2, 0.1]), xtc_probability=0.0, xtc_threshold=0.15)) == {0, 1, 2, 3}


def test_top_n_sigma_keeps_logits_within_n_deviations_of_the_max():
    # mean 3.25, population sigma sqrt(15.6875) = 3.96
    x = [0.0, 1.0, 2.0, 10.0]
    assert set(dist(x, top_n_sigma=1.0)) == {3}  # cut at 10 - 3.96 = 6.04
    kept = dist(x, top_n_sigma=2.5)  # cut at 10 - 9.90 = 0.10
    assert set(kept) == {1, 2, 3} and 0 not in kept
    assert kept[3] == pytest.approx(math.exp(10) / (math.exp(1) + math.exp(2) + math.exp(10)))
    assert set(dist(x, top_n_sigma=3.0)) == {0, 1, 2, 3}


def test_top_n_sigma_zero_or_negative_is_off():
    assert set(dist([0.0, 1.0, 2.0, 10.0], top_n_sigma=0)) == {0, 1, 2, 3}
    assert set(dist([0.0, 1.0, 2.0, 10.0], top_n_sigma=-1)) == {0, 1, 2, 3}
    assert SamplingParams().top_n_sigma == -1.0


def test_top_n_sigma_leaves_banned_tokens_out_of_its_statistics():
    # with the -inf counted, sigma would be inf and every finite token would stay
    kept = dist([0.0, 1.0, 2.0, 10.0, 0.0], top_n_sigma=2.5, logit_bias={4: False})
    assert set(kept) == {1, 2, 3} and 0 not in kept and 4 not in kept


def test_top_n_sigma_sees_only_what_earlier_stages_kept():
    x = [0.0, 1.0, 2.0, 9.0, 10.0]
    # over all five (sigma 4.22) a cut at 10 - 4.22 keeps 9 and 10; after top-k 2 the
    # two left have sigma 0.5, so the same n keeps only the top one
    assert set(dist(x, top_n_sigma=1.0)) == {3, 4}
    after_top_k = dist(x, top_n_sigma=1.0, top_k=2, samplers=["top_k", "top_n_sigma"])
    assert set(after_top_k) == {4} and 3 not in after_top_k


def test_top_n_sigma_is_skipped_by_greedy_and_needs_the_full_grammar_mask():
    x = np.array([0.0, 1.0, 2.0, 10.0], np.float32)
    assert Sampler(SamplingParams(temperature=0, top_n_sigma=0.1)).sample(x, []) == 3
    row = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    assert Sampler(SamplingParams(top_k=10)).grammar_head(row, []) is not None  # top-n-sigma off: ignored
    assert Sampler(SamplingParams(top_k=10, top_n_sigma=2.0)).grammar_head(row, []) is None
    # after top-k it only reads the k survivors: the head is enough again
    assert Sampler(SamplingParams(top_k=10, top_n_sigma=2.0, samplers=["top_k", "top_n_sigma"])).grammar_head(row, [])


def test_temperature_scales_logits():
    d = dist([0.0, math.log(2)], temperature=0.5)  # ratio 2 becomes 4
    assert d[1] == pytest.approx(0.8) and d[0] == pytest.approx(0.2)


def test_dynamic_temperature_follows_entropy():
    flat = np.zeros(8, np.float32)
    flat[0] = 1.0  # high entropy: close to t + range
    t, r = 1.0, 0.5
    probs = dist(flat, temperature=t, dynatemp_range=r)
    ent = -sum(p * math.log(p) for p in dist(flat).values())
    t_dyn = (t - r) + 2 * r * ent / math.log(8)
    assert probs[0] == pytest.approx(math.exp(1 / t_dyn) / (math.exp(1 / t_dyn) + 7))
    assert probs[0] != pytest.approx(dist(flat, temperature=t)[0])


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=64))
    out = s.adjusted(np.array([2.0, -1.0, 1.0], np.float32), [0, 1])
    np.testing.assert_allclose(out, [1.0, -2.0, 1.0])


def test_presence_and_frequency_penalties():
    s = Sampler(SamplingParams(presence_penalty=0.25, frequency_penalty=0.5))
    out = s.adjusted(np.zeros(4, np.float32), [0, 0, 2])
    np.testing.assert_allclose(out, [-1.25, 0.0, -0.75, 0.0])


def test_repeat_last_n_bounds_the_window():
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=1))
    np.testing.assert_allclose(s.adjusted(np.full(3, 2.0, np.float32), [0, 1, 2]), [2.0, 2.0, 1.0])
    whole = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=-1))
    np.testing.assert_allclose(whole.adjusted(np.full(3, 2.0, np.float32), [0, 1, 2]), [1.0, 1.0, 1.0])


def test_the_backend_row_is_never_written():
    x = np.array([2.0, -1.0, 1.0], np.float32)
    s = Sampler(SamplingParams(repeat_penalty=2.0, logit_bias={1: 3.0}, dry_multiplier=1.0, seed=0))
    s.sample(x, [0, 1, 0, 1, 0])
    np.testing.assert_array_equal(x, [2.0, -1.0, 1.0])


def test_text_keys_of_logit_bias_are_kept_for_the_engine():
    p = SamplingParams(logit_bias=[["Hello", -2], [5, 1.0], ["Hello", False]])
    assert p.logit_bias == {5: 1.0} and p.logit_bias_text == {"Hello": -math.inf}
    with pytest.raises(BadRequestError, match="logit_bias keys"):
        SamplingParams(logit_bias={"": 1.0})


def test_logit_bias_moves_the_argmax_and_false_bans():
    x = np.array([3.0, 2.0, 1.0], np.float32)
    assert Sampler(SamplingParams(temperature=0, logit_bias={2: 5.0})).sample(x, []) == 2
    assert Sampler(SamplingParams(temperature=0, logit_bias=[[0, False]])).sample(x, []) == 1
    assert 0 not in dist(x, logit_bias={"0": -math.inf})


def test_greedy_is_an_argmax_after_penalties_without_softmax(monkeypatch):
    x = np.array([3.0, 2.5, 1.0], np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0, typical_p=0.2, xtc_probability=1.0))
    monkeypatch.setattr(np, "exp", lambda *a, **k: pytest.fail("greedy computed a softmax"))
    assert s.sample(x, [0]) == 1  # 3 / 2 = 1.5 < 2.5
    assert s.sample(x, []) == 0
    plain = Sampler(SamplingParams(temperature=0))
    assert plain.adjusted(x, [0]) is x  # nothing to penalise: no copy


def test_penalties_dry_and_bias_on_a_big_row_never_copy_it_and_change_nothing():
    """On a whole vocabulary, penalties, DRY and logit bias keep their new logits aside
    for top-k and greedy (no row copy); the result equals sampling the adjusted row."""
    x = np.random.default_rng(4).standard_normal(100_000).astype(np.float32)
    x[:50] += np.linspace(8, 6, 50, dtype=np.float32)  # the top 50, all in the history
    history = list(range(50)) * 2 + [7, 8, 7, 8, 7]
    adjust = dict(repeat_penalty=3.0, presence_penalty=0.5, repeat_last_n=-1, dry_multiplier=0.8,
                  logit_bias={60: 9.0, 3: 1.0, 61: -math.inf})
    adjusted = Sampler(SamplingParams(**adjust)).adjusted(x, history)
    assert adjusted[60] == np.float32(x[60] + 9.0) and adjusted[61] == -np.inf
    for chain in (dict(top_k=40), dict(top_k=40, top_p=0.9, min_p=0.05, temperature=0.7)):
        got = dist(x, history, **adjust, **chain)
        want = dist(adjusted, **chain)
        assert got.keys() == want.keys() and 61 not in got
        assert all(got[t] == pytest.approx(want[t], abs=1e-7) for t in want)
    greedy = Sampler(SamplingParams(temperature=0, **adjust))
    assert greedy.sample(x, history) == int(np.argmax(adjusted)) == 60
    no_bias = {**adjust, "logit_bias": {}}  # the penalised top 50 lose to an unpenalised id
    best = int(np.argmax(Sampler(SamplingParams(**no_bias)).adjusted(x, history)))
    assert Sampler(SamplingParams(temperature=0, **no_bias)).sample(x, history) == best and best >= 50
    top = int(np.argmax(x))  # unpatched: only a patched id that now beats it can win
    assert Sampler(SamplingParams(temperature=0, logit_bias={60: 1.0})).sample(x, []) == top
    assert Sampler(SamplingParams(temperature=0, logit_bias={60: 20.0, 61: 1.0})).sample(x, []) == 60


def test_default_chain_never_sorts_or_softmaxes_the_whole_row(monkeypatch):
    x = np.random.default_rng(0).standard_normal(262_144).astype(np.float32)
    s = Sampler(SamplingParams(repeat_penalty=1.1, seed=0))
    for name in ("argsort", "exp", "sort"):
        real = getattr(np, name)

        def guarded(a, *args, _real=real, _name=name, **kw):
            assert np.size(a) < 10_000, f"np.{_name} over {np.size(a)} values"
            return _real(a, *args, **kw)

        monkeypatch.setattr(np, name, guarded)
    real_argpartition = np.argpartition
    monkeypatch.setattr(np, "argpartition", lambda a, *r, **k: pytest.fail("full argpartition") if np.size(a) > 10_000 else real_argpartition(a, *r, **k))
    assert 0 <= s.sample(x, list(range(64))) < x.size


# -- mirostat ------------------------------------------------------------------------


def test_mirostat_v2_truncates_by_surprise_and_updates_mu():
    probs = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]
    tau, eta = 2.75, 0.5
    s = Sampler(SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, temperature=1.0, top_k=1, seed=0))
    assert s.mu == 5.5  # 2 tau
    ids, p = s.distribution(logits_of(probs), [])
    # surprise <= 5.5 bits means p >= 1/45: all six; top_k=1 is not applied under mirostat
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 4, 5]
    s.commit(1, ids, p)
    assert s.mu == pytest.approx(5.5 - eta * (2.0 - tau))  # token 1: surprise 2 bits
    s.mu = 3.5  # now only p >= 1/11.3 survives
    ids, p = s.distribution(logits_of(probs), [])
    assert sorted(ids.tolist()) == [0, 1, 2] and 3 not in ids.tolist()
    np.testing.assert_allclose(p, np.array([0.5, 0.25, 0.125]) / 0.875)


def test_mirostat_v1_picks_k_from_a_zipf_fit():
    s_true, n = 1.2, 1000
    zipf = 1.0 / np.arange(1, n + 1) ** s_true
    tau = 4.0
    sampler = Sampler(SamplingParams(mirostat=1, mirostat_tau=tau, temperature=1.0, seed=0))
    ids, _ = sampler.distribution(logits_of(zipf / zipf.sum()), [])
    eps = s_true - 1
    k = ((eps * 2 ** (2 * tau)) / (1 - n**-eps)) ** (1 / s_true)
    assert ids.size == int(k)
    assert ids.tolist() == list(range(int(k)))


def test_commit_ignores_tokens_outside_the_distribution_and_non_mirostat():
    s = Sampler(SamplingParams(mirostat=2, temperature=1.0))
    s.commit(99, np.array([0, 1]), np.array([0.5, 0.5]))
    assert s.mu == 10.0
    plain = Sampler(SamplingParams())
    plain.commit(0, np.array([0]), np.array([1.0]))  # no mirostat: nothing to do


# -- DRY -----------------------------------------------------------------------------

PIECES = ["a", "b", "c", "d", "\n", ":", "e", "x", "he", "llo", "y"]
A, B, C, D, NL, COLON, E, X, HE, LLO, Y = range(len(PIECES))


def toy_tokenize(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):  # longest match first, enough for this vocabulary
        j = max((k for k in range(len(PIECES)) if text.startswith(PIECES[k], i)), key=lambda k: len(PIECES[k]))
        out.append(j)
        i += len(PIECES[j])
    return out


def dry(history, breakers=("\n", ":"), vocab="toy", **kw) -> dict[int, float]:
    kw = {"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 2, **kw}
    p = SamplingParams(temperature=0, dry_sequence_breakers=list(breakers), **kw)
    text = TokenText(PIECES, tokenize=toy_tokenize) if vocab == "toy" else vocab
    out = -Sampler(p, text).adjusted(np.zeros(len(PIECES), np.float32), history)
    return {i: float(out[i]) for i in np.flatnonzero(out)}


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    assert dry([A, B, C, D, A, B, C]) == {D: 2.0}  # repeat of 3, allowed 2: base^1
    assert dry([A, B, C, D, E, A, B, C, D]) == {E: 4.0}
    assert dry([A, B, C, D, A, B, C], dry_allowed_length=4) == {}  # 3 < 4: allowed


def test_dry_uses_the_longest_repeat_per_token():
    # "b c" is followed by d once after a repeat of 2 and once after a repeat of 3
    assert dry([X, B, C, D, A, B, C, D, Y, A, B, C]) == {D: 2.0}


def test_dry_breaker_caps_the_repeat_length():
    hist = [A, B, COLON, C, D, E, A, B, COLON, C, D]
    assert dry(hist, breakers=()) == {E: 8.0}  # "a b : c d" again: 5 - 2 = 3
    assert dry(hist) == {E: 1.0}  # only "c d" since the colon counts: 2 - 2 = 0


def test_dry_never_penalises_a_breaker_token():
    assert dry([A, B, C, NL, A, B, C]) == {}
    assert dry([A, B, C, NL, A, B, C], breakers=()) == {NL: 2.0}


def test_dry_multi_token_breaker_from_the_text():
    # "hello" is no single token: "he" + "llo" together break sequences
    hist = [A, B, C, D, HE, LLO, Y, A, B, C, D, HE, LLO]
    assert dry(hist, breakers=()) == {Y: 16.0}  # "a b c d he llo" again: 6 - 2 = 4
    assert dry(hist, breakers=("hello",)) == {}  # a repeat of 0 since the breaker
    assert dry(hist, breakers=("hello",), vocab=None) == {Y: 16.0}  # no vocab: no breakers


def test_dry_window_and_switches():
    hist = [A, B, C, D, A, B, C]
    assert dry(hist, dry_penalty_last_n=4) == {}  # the window holds "d a b c" only
    assert dry(hist, dry_penalty_last_n=0) == {}
    assert dry(hist, dry_base=0.5) == {}  # base < 1 is off, as in llama.cpp
    p = SamplingParams(temperature=0, dry_multiplier=0.0)
    assert Sampler(p).adjusted(np.zeros(4, np.float32), hist).tolist() == [0.0] * 4


def test_token_text_accepts_a_piece_function_and_caches():
    calls = []

    def piece(i: int) -> str:
        calls.append(i)
        return PIECES[i]

    text = TokenText(piece, len(PIECES))
    s1 = Sampler(SamplingParams(temperature=0, dry_multiplier=1.0), text)
    s2 = Sampler(SamplingParams(temperature=0, dry_multiplier=1.0), text)
    for s in (s1, s2):
        s.adjusted(np.zeros(len(PIECES), np.float32), [A, B, C, NL, A, B, C])
    assert len(calls) == len(PIECES)  # enumerated once for both samplers


def brute_force_breakers(pieces: list[bytes], breaker: str, tokenize) -> tuple[set[int], dict[int, set]]:
    """llama.cpp's rule, spelt out token by token: holders of the whole breaker, and heads
    (a piece ending with a proper prefix) with the tokenized rest."""
    b = breaker.encode()
    single = {t for t, w in enumerate(pieces) if b in w}
    tails: dict[int, set] = {}
    for j in range(1, len(b)):
        for t, w in enumerate(pieces):
            if t not in single and w.endswith(b[:j]):
                tails.setdefault(t, set()).add(tuple(tokenize(b[j:].decode())))
    return single, tails


def test_breaker_index_matches_the_rule_token_by_token():
    words = ["ab", "ba", "aab", "he", "llo", "hel", "lo", "o w", " wor", "ld", "x\ny", "", "abab", *"abhelo wrd\nxy"]
    pieces = [w.encode() for w in words]

    def tokenize(text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):  # longest piece first
            j = max((k for k in range(len(words)) if words[k] and text.startswith(words[k], i)), key=lambda k: len(words[k]))
            out.append(j)
            i += len(words[j])
        return out

    text = TokenText(pieces, tokenize=tokenize)
    for breaker in ("ab", "aba", "hello world", "\n", "b", "lo w"):
        single, tails = brute_force_breakers(pieces, breaker, tokenize)
        got = text.breakers([breaker])
        assert set(np.flatnonzero(got.is_single(np.arange(len(pieces))))) == single, breaker
        assert {t: set(ts) for t, ts in got.tails.items()} == tails, breaker


def test_a_breaker_list_is_the_union_of_cached_single_breakers(monkeypatch):
    import localrun.sampling.breakers as breakers

    resolved = []
    real = breakers._resolve
    monkeypatch.setattr(breakers, "_resolve", lambda index, b, tok: resolved.append(b) or real(index, b, tok))
    text = TokenText(PIECES, tokenize=toy_tokenize)
    both = text.breakers(["\n", "hello"])
    assert sorted(resolved) == ["\n", "hello"]
    again = text.breakers(["hello", ":", "\n"])  # a new list: only ":" is new
    assert sorted(resolved) == ["\n", ":", "hello"]
    assert text.breakers(["\n", "hello"]) is both  # the same list: one look-up
    assert again.is_single(np.array([NL, COLON, A])).tolist() == [True, True, False]
    assert again.tails == both.tails == {HE: {(LLO,)}}


def test_token_text_is_shared_safely_between_threads():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(0)
    pieces = [bytes(rng.integers(97, 102, rng.integers(1, 5)).tolist()) for _ in range(20_000)]
    lists = [["ab", "c"], ["abc", "de"], ["c", "abc"], ["ea"]] * 4
    want = [TokenText(pieces).breakers(b) for b in lists]  # each on its own TokenText
    shared = TokenText(pieces)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(shared.breakers, lists))
    ids = np.arange(len(pieces))
    for w, g in zip(want, got):
        assert g.is_single(ids).tolist() == w.is_single(ids).tolist() and g.tails == w.tails


# -- order ---------------------------------------------------------------------------


def test_default_order_and_logit_bias_placement():
    assert SamplingParams().order == DEFAULT_SAMPLERS
    assert SamplingParams(samplers=["dry", "typical_p", "temp"]).order == ("dry", "logit_bias", "typ_p", "temperature")
    assert SamplingParams(samplers="top_k;top-p").order == ("logit_bias", "top_k", "top_p")


def test_order_override_changes_the_result():
    x = [2.0, 1.0, 0.0]
    # top-p at t=1 keeps one token; after a hot temperature the same p needs two
    assert set(dist(x, top_p=0.6, temperature=3.0)) == {0}
    assert set(dist(x, top_p=0.6, temperature=3.0, samplers=["temperature", "top_p"])) == {0, 1}


def test_a_stage_left_out_of_samplers_is_off():
    x = np.array([2.0, 1.0, 0.0], np.float32)
    s = Sampler(SamplingParams(**OFF, repeat_penalty=4.0, samplers=["top_k"]))
    np.testing.assert_array_equal(s.adjusted(x, [0]), x)


# -- draws, seeds, state -------------------------------------------------------------


def test_seeded_runs_reproduce_and_seeds_differ():
    x = np.random.default_rng(0).standard_normal(500).astype(np.float32) * 2

    def run(seed):
        s = Sampler(SamplingParams(**OFF, seed=seed))
        return [s.sample(x, []) for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(None) != run(None)  # None and -1 draw a fresh seed
    assert run(-1) != run(-1)


def test_snapshot_restore_round_trip_covers_rng_and_mu():
    x = np.random.default_rng(1).standard_normal(200).astype(np.float32) * 2
    s = Sampler(SamplingParams(mirostat=2, mirostat_tau=3.0, temperature=1.0, seed=5))
    for _ in range(5):
        s.sample(x, [])
    state = s.snapshot()
    mu = s.mu
    first = [s.sample(x, []) for _ in range(10)]
    assert s.mu != mu
    s.restore(state)
    assert s.mu == mu
    assert [s.sample(x, []) for _ in range(10)] == first
    s.reset()
    assert s.mu == 6.0


def test_sample_is_distribution_draw_commit():
    x = np.random.default_rng(2).standard_normal(300).astype(np.float32) * 2
    a = Sampler(SamplingParams(mirostat=2, temperature=0.9, seed=11))
    b = Sampler(SamplingParams(mirostat=2, temperature=0.9, seed=11))
    for _ in range(10):
        ids, probs = b.distribution(x, [])
        tok = b.draw(ids, probs)
        b.commit(tok, ids, probs)
        assert a.sample(x, []) == tok and a.mu == b.mu


def test_sample_frequencies_match_distribution():
    x = np.array([2.0, 1.6, 1.0, 0.4, 0.0, -3.0], np.float32)
    s = Sampler(SamplingParams(top_k=5, top_p=0.97, min_p=0.05, temperature=0.9, seed=2024))
    ids, probs = s.distribution(x, [])
    assert 5 not in ids.tolist()  # cut by top-k
    n = 20_000
    counts = np.bincount([s.sample(x, []) for _ in range(n)], minlength=6)
    assert counts[5] == 0 and counts[ids[probs == 0]].sum() == 0
    expected = np.zeros(6)
    expected[ids] = probs * n
    live = expected > 0
    chi2 = float((((counts - expected) ** 2)[live] / expected[live]).sum())
    assert chi2 < 25.0  # df <= 4: p < 1e-4 of failing by chance with a correct draw


def test_draw_never_picks_a_zero_probability_token():
    s = Sampler(SamplingParams(seed=0))
    ids, probs = np.array([7, 8, 9]), np.array([0.0, 1.0, 0.0])
    assert {s.draw(ids, probs) for _ in range(200)} == {8}


def test_candidates_is_distribution():
    x = np.array([1.0, 3.0, 2.0], np.float32)
    ids, probs = Sampler(SamplingParams(seed=0)).candidates(x, [])
    assert ids.tolist() == [1, 2, 0] and probs[0] > probs[1] > probs[2]


# -- n_probs -------------------------------------------------------------------------


def test_top_probs_raw_adjusted_and_final():
    x = np.array([3.0, 2.0, 1.5, 0.0], np.float32)
    s = Sampler(SamplingParams(top_k=2, temperature=1.0, repeat_penalty=3.0, seed=0))
    full = np.exp(x) / np.exp(x).sum()
    raw = s.top_probs(x, [0], 3)
    assert [t for t, _ in raw] == [0, 1, 2]
    np.testing.assert_allclose([p for _, p in raw], full[:3], rtol=1e-6)
    adj = s.top_probs(x, [0], 3, which="adjusted")  # token 0 -> 1.0: now third
    assert [t for t, _ in adj] == [1, 2, 0]
    y = np.array([1.0, 2.0, 1.5, 0.0])
    np.testing.assert_allclose([p for _, p in adj], (np.exp(y) / np.exp(y).sum())[[1, 2, 0]], rtol=1e-6)
    final = s.top_probs(x, [0], 5, which="final")  # top-k 2 after the penalty
    assert [t for t, _ in final][:1] == [1] and len(final) == 2
    assert s.top_probs(x, [], 0) == []
    with pytest.raises(BadRequestError):
        s.top_probs(x, [], 2, which="logits")
