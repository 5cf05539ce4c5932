"""Parity with llama.cpp's own samplers, called through llama-cpp-python's low-level API.

For the same logits, each llama.cpp stage (and a whole default chain) must keep the same
token set as localrun's chain with the same probabilities (softmax of the kept logits,
to 1e-5). DRY needs a vocabulary for its string breakers: it uses SmolLM2's, loaded
vocab-only, and compares the penalties llama.cpp subtracts with ours, token by token.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from localrun.cluster import rpc
from localrun.sampling import Sampler, SamplingParams, TokenText

lc = pytest.importorskip("llama_cpp")

# llama_token_data as a numpy record, so a row moves to C without a Python loop
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert TOKEN_DATA.itemsize == ctypes.sizeof(lc.llama_token_data)


class Cur:
    """A llama_token_data_array over a numpy buffer; `kept()` reads what the samplers left
    (they may move `data` forward, as XTC does, and shrink `size`)."""

    def __init__(self, logits: np.ndarray) -> None:
        self.buf = np.zeros(logits.shape[0], TOKEN_DATA)
        self.buf["id"] = np.arange(logits.shape[0])
        self.buf["logit"] = logits
        ptr = ctypes.cast(self.buf.ctypes.data, ctypes.POINTER(lc.llama_token_data))
        self.arr = lc.llama_token_data_array(data=ptr, size=logits.shape[0], selected=-1, sorted=False)

    def apply(self, smpl) -> "Cur":
        lc.llama_sampler_apply(smpl, ctypes.byref(self.arr))
        return self

    def kept(self) -> np.ndarray:
        addr = ctypes.cast(self.arr.data, ctypes.c_void_p).value
        raw = (ctypes.c_char * (self.arr.size * TOKEN_DATA.itemsize)).from_address(addr)
        return np.frombuffer(raw, TOKEN_DATA).copy()


def llama_dist(samplers, logits: np.ndarray, history=()) -> dict[int, float]:
    """Run llama.cpp samplers (a chain, with `history` accepted first); {id: p} from the
    softmax of the kept logits."""
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for s in samplers:
        lc.llama_sampler_chain_add(chain, s)
    try:
        for t in history:
            lc.llama_sampler_accept(chain, int(t))
        kept = Cur(logits).apply(chain).kept()
    finally:
        lc.llama_sampler_free(chain)
    lg = kept["logit"].astype(np.float64)
    finite = np.isfinite(lg)  # temperature <= 0 leaves -inf behind rather than dropping
    p = np.exp(lg[finite] - lg[finite].max())
    return dict(zip(kept["id"][finite].tolist(), (p / p.sum()).tolist()))


def ours(logits: np.ndarray, history=(), **kw) -> dict[int, float]:
    ids, probs = Sampler(SamplingParams(**kw)).distribution(logits, list(history))
    return dict(zip(ids.tolist(), probs.tolist()))


def assert_same(a: dict[int, float], b: dict[int, float]) -> None:
    a, b = ({i: q for i, q in d.items() if q > 0} for d in (a, b))  # a -inf token may stay at p = 0
    assert set(a) == set(b), f"kept sets differ: only llama.cpp {set(a) - set(b)}, only ours {set(b) - set(a)}"
    ids = sorted(a)
    np.testing.assert_allclose([a[i] for i in ids], [b[i] for i in ids], rtol=0, atol=1e-5)


def row(seed: int, n: int = 2000, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


# only the stage under test: everything else off, temperature 1
OFF = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 5, 40, 1999])
def test_top_k(seed, k):
    x = row(seed)
    assert_same(llama_dist([lc.llama_sampler_init_top_k(k)], x), ours(x, **{**OFF, "top_k": k, "samplers": ["top_k"]}))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p,min_keep", [(0.5, 0), (0.9, 0), (0.95, 3), (0.1, 5), (0.999, 0)])
def test_top_p(seed, p, min_keep):
    x = row(seed, scale=1.5)
    want = llama_dist([lc.llama_sampler_init_top_p(p, min_keep)], x)
    assert_same(want, ours(x, **{**OFF, "top_p": p, "min_keep": min_keep, "samplers": ["top_p"]}))


def test_top_p_on_a_large_unsorted_vocabulary():
    # top-k off: the head-first path (no full sort) must match as well
    for seed in range(3):
        x = row(seed, n=20000, scale=4.0)
        for p in (0.5, 0.9):
            assert_same(llama_dist([lc.llama_sampler_init_top_p(p, 0)], x), ours(x, **{**OFF, "top_p": p, "samplers": ["top_p"]}))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p,min_keep", [(0.05, 0), (0.2, 0), (0.5, 10), (1.0, 0)])
def test_min_p(seed, p, min_keep):
    x = row(seed)
    want = llama_dist([lc.llama_sampler_init_min_p(p, min_keep)], x)
    assert_same(want, ours(x, **{**OFF, "min_p": p, "min_keep": min_keep, "samplers": ["min_p"]}))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p,min_keep", [(0.2, 0), (0.5, 0), (0.9, 0), (0.5, 20)])
def test_typical(seed, p, min_keep):
    x = row(seed, n=300, scale=2.0)
    want = llama_dist([lc.llama_sampler_init_typical(p, min_keep)], x)
    assert_same(want, ours(x, **{**OFF, "typical_p": p, "min_keep": min_keep, "samplers": ["typ_p"]}))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold,min_keep", [(0.1, 0), (0.05, 0), (0.02, 0), (0.3, 0), (0.05, 30), (0.6, 0)])
def test_xtc_with_a_certain_coin(seed, threshold, min_keep):
    # probability 1: the coin always says "apply", so both sides do the same thing
    x = row(seed, n=50, scale=2.5)
    want = llama_dist([lc.llama_sampler_init_xtc(1.0, threshold, min_keep, 1234)], x)
    got = ours(x, **{**OFF, "xtc_probability": 1.0, "xtc_threshold": threshold, "min_keep": min_keep, "samplers": ["xtc"]})
    assert_same(want, got)


@pytest.mark.parametrize("t", [0.3, 0.8, 1.0, 1.7])
def test_temperature(t):
    x = row(7)
    assert_same(llama_dist([lc.llama_sampler_init_temp(t)], x), ours(x, **{**OFF, "temperature": t, "samplers": ["temperature"]}))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("t,rng,exp", [(0.8, 0.5, 1.0), (1.0, 0.9, 2.0), (0.5, 0.7, 0.5), (1.2, 0.3, 0.0)])
def test_dynamic_temperature(seed, t, rng, exp):
    x = row(seed, n=500, scale=2.0)
    want = llama_dist([lc.llama_sampler_init_temp_ext(t, rng, exp)], x)
    got = ours(x, **{**OFF, "temperature": t, "dynatemp_range": rng, "dynatemp_exponent": exp, "samplers": ["temperature"]})
    assert_same(want, got)


@pytest.mark.parametrize(
    "last_n,repeat,freq,present",
    [(64, 1.1, 0.0, 0.0), (8, 1.5, 0.0, 0.0), (64, 1.0, 0.3, 0.0), (64, 1.0, 0.0, 0.7), (20, 1.3, 0.2, 0.4)],
)
def test_penalties(last_n, repeat, freq, present):
    x = row(3, n=300)
    hist = np.random.default_rng(4).integers(0, 300, 120).tolist()
    # the binding's first argument is n_vocab; this llama.cpp takes it and ignores it
    want = llama_dist([lc.llama_sampler_init_penalties(300, last_n, repeat, freq, present)], x, hist)
    got = ours(x, hist, **OFF, repeat_last_n=last_n, repeat_penalty=repeat, frequency_penalty=freq, presence_penalty=present, samplers=["penalties"])
    assert_same(want, got)


def test_logit_bias():
    x = row(5, n=300)
    bias = {3: 5.0, 17: -2.5, 250: 10.0, 0: -np.inf}
    arr = (lc.llama_logit_bias * len(bias))(*[lc.llama_logit_bias(t, b) for t, b in bias.items()])
    want = llama_dist([lc.llama_sampler_init_logit_bias(300, len(bias), arr)], x)
    assert_same(want, ours(x, **OFF, logit_bias=bias, samplers=["logit_bias"]))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n", [0.5, 1.0, 2.0, 3.5, 0.0, -1.0])
def test_top_n_sigma(seed, n):
    x = row(seed)
    want = llama_dist([lc.llama_sampler_init_top_n_sigma(n)], x)
    got = ours(x, **{**OFF, "top_n_sigma": n, "samplers": ["top_n_sigma"]})
    assert_same(want, got)
    if n > 0:
        assert len(got) < x.size  # the case cuts something


def test_top_n_sigma_on_a_masked_row():
    """-inf logits (a grammar mask, a ban) stay out of the mean and deviation on both sides."""
    x = row(11, n=3000)
    x[np.random.default_rng(12).choice(3000, 2000, replace=False)] = -np.inf
    for n in (0.7, 1.5):
        want = llama_dist([lc.llama_sampler_init_top_n_sigma(n)], x)
        assert_same(want, ours(x, **{**OFF, "top_n_sigma": n, "samplers": ["top_n_sigma"]}))


@pytest.mark.parametrize("seed", range(3))
def test_the_default_chain_with_top_n_sigma(seed):
    """llama.cpp's default order places top-n-sigma after penalties (and DRY), before top-k."""
    x = row(seed, n=5000, scale=2.5)
    hist = np.random.default_rng(seed + 200).integers(0, 5000, 100).tolist() + np.argsort(-x)[:4].tolist()
    want = llama_dist(
        [
            lc.llama_sampler_init_penalties(5000, 64, 1.3, 0.0, 0.0),
            lc.llama_sampler_init_top_n_sigma(0.5),
            lc.llama_sampler_init_top_k(40),
            lc.llama_sampler_init_top_p(0.95, 0),
            lc.llama_sampler_init_min_p(0.02, 0),
            lc.llama_sampler_init_temp(0.7),
        ],
        x,
        hist,
    )
    kw = dict(repeat_penalty=1.3, repeat_last_n=64, top_k=40, top_p=0.95, min_p=0.02, temperature=0.7)
    got = ours(x, hist, top_n_sigma=0.5, **kw)
    assert_same(want, got)
    assert set(got) < set(ours(x, hist, **kw))  # top-n-sigma cut tokens the rest of the chain keeps


@pytest.mark.parametrize("seed", range(4))
def test_the_default_chain(seed):
    """llama-server's default order, every stage on: penalties, top-k, typical, top-p,
    min-p, XTC (certain coin), dynamic temperature."""
    x = row(seed, n=5000, scale=2.5)
    hist = np.random.default_rng(seed + 100).integers(0, 5000, 200).tolist()
    hist += np.argsort(-x)[:6].tolist()  # penalise some of the top tokens
    kw = dict(
        repeat_penalty=1.3, repeat_last_n=64, frequency_penalty=0.1, presence_penalty=0.2,
        top_k=40, typical_p=0.95, top_p=0.9, min_p=0.02, xtc_probability=1.0, xtc_threshold=0.08,
        temperature=0.8, dynatemp_range=0.3, dynatemp_exponent=1.5,
    )
    want = llama_dist(
        [
            lc.llama_sampler_init_penalties(5000, 64, 1.3, 0.1, 0.2),
            lc.llama_sampler_init_top_k(40),
            lc.llama_sampler_init_typical(0.95, 0),
            lc.llama_sampler_init_top_p(0.9, 0),
            lc.llama_sampler_init_min_p(0.02, 0),
            lc.llama_sampler_init_xtc(1.0, 0.08, 0, 1),
            lc.llama_sampler_init_temp_ext(0.8, 0.3, 1.5),
        ],
        x,
        hist,
    )
    assert_same(want, ours(x, hist, **kw))


def _kept_and_choice(smpl, logits: np.ndarray) -> tuple[dict[int, float], int]:
    """Apply a selecting sampler (mirostat): the set it kept, as probabilities, and its pick."""
    cur = Cur(logits).apply(smpl)
    kept = cur.kept()
    lg = kept["logit"].astype(np.float64)
    p = np.exp(lg - lg.max())
    return dict(zip(kept["id"].tolist(), (p / p.sum()).tolist())), int(kept["id"][cur.arr.selected])


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_truncation_and_mu_track_llama_cpp(version):
    """Same kept set at every step when both sides commit the token llama.cpp picked:
    the truncation and the mu update (mu = 2 tau, then mu -= eta (surprise - tau)) agree."""
    n, tau, eta = 3000, 3.0, 0.3
    smpl = (
        lc.llama_sampler_init_mirostat(n, 42, tau, eta, 100) if version == 1 else lc.llama_sampler_init_mirostat_v2(42, tau, eta)
    )
    s = Sampler(SamplingParams(mirostat=version, mirostat_tau=tau, mirostat_eta=eta, temperature=1.0, seed=0))
    try:
        for step in range(12):
            x = row(50 + step, n=n, scale=2.0)
            want, pick = _kept_and_choice(smpl, x)
            ids, probs = s.distribution(x, [])
            assert_same(want, dict(zip(ids.tolist(), probs.tolist())))
            s.commit(pick, ids, probs)
    finally:
        lc.llama_sampler_free(smpl)


# -- DRY, on SmolLM2's vocabulary ---------------------------------------------------------


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    if rpc.any_registered():
        # an earlier test registered RPC workers in this process (registration is
        # process-wide, and they are gone now): name this machine's devices, as localrun's
        # own backend does, or llama.cpp would reach for the dead workers and abort
        devices = rpc.device_array(rpc.local_gpus())
        mp.devices = ctypes.cast(devices, ctypes.c_void_p)
    model = lc.llama_model_load_from_file(str(smollm2_gguf).encode(), mp)
    assert model, "llama.cpp could not load SmolLM2's vocabulary"  # present but unloadable is a failure
    v = lc.llama_model_get_vocab(model)
    n = lc.llama_vocab_n_tokens(v)
    buf = ctypes.create_string_buffer(256)

    def piece(t: int) -> bytes:
        k = lc.llama_token_to_piece(v, t, buf, len(buf), 0, True)  # special=True, as DRY does
        return buf.raw[:k]

    def tokenize(text: str) -> list[int]:
        data = text.encode()
        out = (lc.llama_token * (len(data) + 8))()
        k = lc.llama_tokenize(v, data, len(data), out, len(out), False, False)
        return list(out[:k])

    yield v, n, TokenText([piece(t) for t in range(n)], n, tokenize), tokenize
    lc.llama_model_free(model)


def _llama_dry_penalties(v, n, history, mult, base, allowed, last_n, breakers) -> np.ndarray:
    arr = (ctypes.c_char_p * len(breakers))(*[b.encode() for b in breakers])
    smpl = lc.llama_sampler_init_dry(v, mult, base, allowed, last_n, arr, len(breakers))
    try:
        for t in history:
            lc.llama_sampler_accept(smpl, int(t))
        kept = Cur(np.zeros(n, np.float32)).apply(smpl).kept()
    finally:
        lc.llama_sampler_free(smpl)
    out = np.zeros(n)
    out[kept["id"]] = -kept["logit"]
    return out


def _our_dry_penalties(text, n, history, mult, base, allowed, last_n, breakers) -> np.ndarray:
    p = SamplingParams(
        dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n,
        dry_sequence_breakers=list(breakers), temperature=0,
    )
    return -Sampler(p, text).adjusted(np.zeros(n, np.float32), history).astype(np.float64)


DEFAULT_BREAKERS = ["\n", ":", '"', "*"]
LONG = None  # marks the long-repeat case, built from breaker-free token ids
DRY_CASES = [
    # (history text, multiplier, base, allowed, last_n, breakers, penalises something)
    ("the cat sat on the mat. the cat sat on the", 0.8, 1.75, 2, 256, DEFAULT_BREAKERS, True),
    ("x one two three four one two three", 1.0, 1.75, 2, 256, DEFAULT_BREAKERS, True),
    ("x one two three four one two three", 1.0, 1.75, 3, 256, DEFAULT_BREAKERS, True),  # repeat 3 = allowed: base^0
    ("x one two three four one two three", 1.0, 1.75, 4, 256, DEFAULT_BREAKERS, False),  # repeat 3 < allowed
    ("x one two three four one two three", 1.0, 1.75, 0, 256, DEFAULT_BREAKERS, True),
    ("x one two three four one two three", 1.0, 2.0, 1, 5, DEFAULT_BREAKERS, True),  # window cuts the first copy short
    ("x one two three four one two three", 1.0, 2.0, 1, 3, DEFAULT_BREAKERS, False),  # ... or out
    # a breaker inside the repeat caps its length at the tokens since the breaker
    ("alpha beta: gamma delta epsilon alpha beta: gamma delta", 1.0, 1.75, 1, 256, DEFAULT_BREAKERS, True),
    ("alpha beta: gamma delta epsilon alpha beta: gamma delta", 1.0, 1.75, 1, 256, ["zzz"], True),
    # the token that would continue the repeat is itself a breaker: never penalised
    ('say "hi" now say "hi', 1.0, 1.75, 1, 256, DEFAULT_BREAKERS, False),
    ("line one\nline two\nline one\nline", 1.0, 1.75, 1, 256, DEFAULT_BREAKERS, True),
    # multi-token breakers: a token ending with a breaker's prefix, then the tokenized rest
    ("red green blue hello world red green blue hello world red green", 1.0, 1.75, 1, 256, ["hello world"], True),
    ("red green blue hello world red green blue", 1.0, 1.75, 1, 256, ["lo wor", "ue he"], True),
    # a long repeat: the exponent is clamped (88.72 / ln 3 = 80)
    (LONG, 1.0, 3.0, 2, 1024, DEFAULT_BREAKERS, True),
]


@pytest.mark.parametrize("case", range(len(DRY_CASES)))
def test_dry_penalties_match_llama_cpp(vocab, case):
    v, n, text, tokenize = vocab
    words, mult, base, allowed, last_n, breakers, penalises = DRY_CASES[case]
    if words is LONG:  # 100 distinct breaker-free tokens, then the first 95 again
        plain = [t for t in range(1000, 3000) if not any(c in text.pieces()[t] for c in (b"\n", b":", b'"', b"*"))]
        history = plain[:100] + plain[:95]
    else:
        history = tokenize(words)
    want = _llama_dry_penalties(v, n, history, mult, base, allowed, last_n, breakers)
    got = _our_dry_penalties(text, n, history, mult, base, allowed, last_n, breakers)
    assert (np.count_nonzero(want) > 0) == penalises, "the case does not test what it says"
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
