"""SamplingParams as declared: each parameter's kind and range (checked on construction,
a BadRequestError naming it), the caps that bound what one request can make the shared
scheduler step do, the one logit-bias parser, and the walk over the declarations that
checks the CLI, the server's field map and the chat panel each know every parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localrun.errors import BadRequestError
from localrun.sampling import PARAMETERS, Sampler, SamplingParams, parse_logit_bias, temperature
from localrun.sampling.stages import _Cands

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)  # every truncation off


# -- validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(typical_p=0.0), "typical_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(dynatemp_range=-0.1), "dynatemp_range"),
        (dict(xtc_probability=1.5), "xtc_probability"),
        (dict(xtc_threshold=-0.1), "xtc_threshold"),
        (dict(mirostat=3), "mirostat"),
        (dict(mirostat_tau=-1.0), "mirostat_tau"),
        (dict(dry_multiplier=-1.0), "dry_multiplier"),
        (dict(dry_base=-1.0), "dry_base"),
        (dict(dry_allowed_length=-1), "dry_allowed_length"),
        (dict(dry_penalty_last_n=-2), "dry_penalty_last_n"),
        (dict(dry_sequence_breakers="\n"), "dry_sequence_breakers"),
        (dict(repeat_penalty=0.0), "repeat_penalty"),
        (dict(repeat_last_n=-5), "repeat_last_n"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(logit_bias={1: float("nan")}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={1: float("inf")}), "logit_bias"),
        (dict(samplers=["top_k", "beam_search"]), "samplers"),
        (dict(min_keep=-1), "min_keep"),
        (dict(n_probs=-1), "n_probs"),
        (dict(seed=-7), "seed"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p="high"), "top_p"),
    ],
)
def test_invalid_values_are_a_bad_request_naming_the_parameter(kw, name):
    with pytest.raises(BadRequestError, match=name):
        SamplingParams(**kw)


def test_valid_edge_values_pass():
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, temperature=0, xtc_threshold=1.0, mirostat=2, seed=-1)
    assert SamplingParams(top_k=40.0).top_k == 40


def test_every_declared_parameter_validates_its_kind():
    """Walks the declarations: each default is valid, and each kind refuses what it must,
    naming the parameter."""
    for p in PARAMETERS:
        assert p.check(p.default) == p.default or p.kind in ("strings", "bias")
        wrong = {"int": "7", "float": "high", "strings": "\n", "order": 7, "bias": 3}[p.kind]
        with pytest.raises(BadRequestError, match=p.name):
            SamplingParams(**{p.name: wrong})
        if p.kind == "int":
            with pytest.raises(BadRequestError, match=p.name):
                SamplingParams(**{p.name: 2**64})  # past int64 (and past the seed's uint64)
            with pytest.raises(BadRequestError, match=p.name):
                SamplingParams(**{p.name: -(2**63) - 1})
        if p.kind == "float":
            for bad in (math.inf, -math.inf, math.nan, True):
                with pytest.raises(BadRequestError, match=p.name):
                    SamplingParams(**{p.name: bad})


@pytest.mark.parametrize(
    "name,ok,bad",
    [
        ("n_probs", 20, 21),  # OpenAI's top_logprobs cap
        ("top_k", 2**31 - 1, 2**31),
        ("repeat_last_n", 1 << 20, (1 << 20) + 1),
        ("dry_penalty_last_n", 1 << 20, (1 << 20) + 1),
        ("dry_allowed_length", 1 << 20, (1 << 20) + 1),
        ("min_keep", 1 << 20, (1 << 20) + 1),
        ("seed", 2**64 - 1, 2**64),
        ("temperature", 1e6, 1.5e6),
        ("repeat_penalty", 1e-6, 1e-7),
        ("presence_penalty", -1e6, -2e6),
        ("mirostat_tau", 1e6, 2e6),
        ("top_n_sigma", 1e6, 2e6),
    ],
)
def test_numbers_are_capped(name, ok, bad):
    assert getattr(SamplingParams(**{name: ok}), name) == ok
    with pytest.raises(BadRequestError, match=name):
        SamplingParams(**{name: bad})


def test_dry_sequence_breakers_are_capped_in_count_and_bytes():
    SamplingParams(dry_sequence_breakers=["b"] * 32)
    with pytest.raises(BadRequestError, match="dry_sequence_breakers may hold at most 32"):
        SamplingParams(dry_sequence_breakers=["b"] * 33)
    SamplingParams(dry_sequence_breakers=["x" * 40, "€" * 13])  # 40 and 39 bytes
    for long in ("x" * 41, "€" * 14):  # 14 euro signs: 14 characters, 42 bytes
        with pytest.raises(BadRequestError, match=r"dry_sequence_breakers\[1\] must be at most 40 bytes"):
            SamplingParams(dry_sequence_breakers=["ok", long])


def test_samplers_are_capped():
    SamplingParams(samplers=["top_k"] * 32)
    with pytest.raises(BadRequestError, match="samplers may hold at most 32"):
        SamplingParams(samplers=["top_k"] * 33)
    with pytest.raises(BadRequestError, match="samplers may hold at most 32"):
        SamplingParams(samplers=";".join(["top_k"] * 33))


def test_logit_bias_is_capped_in_entries_text_and_ids():
    ids = {i: -1.0 for i in range(1000)}
    SamplingParams(logit_bias={**ids, **{f"w{i}": 1.0 for i in range(24)}})  # 1024 together
    with pytest.raises(BadRequestError, match="logit_bias may hold at most 1024 entries"):
        SamplingParams(logit_bias={**ids, **{f"w{i}": 1.0 for i in range(25)}})
    with pytest.raises(BadRequestError, match="logit_bias may hold at most 1024 entries"):
        SamplingParams(logit_bias=[[1, 1.0]] * 1025)  # counted as sent, before any work
    SamplingParams(logit_bias={"x" * 256: 1.0})
    with pytest.raises(BadRequestError, match="logit_bias: a text key may be at most 256"):
        SamplingParams(logit_bias={"x" * 257: 1.0})
    # the id: a JSON key past int64 that once overflowed in the scheduler thread
    for huge in ("99999999999999999999", 2**31, "9" * 5000, -1, "-3"):
        with pytest.raises(BadRequestError, match="logit_bias keys must be token ids"):
            SamplingParams(logit_bias={huge: 1.0})


def test_logit_bias_values_are_finite_or_never():
    p = SamplingParams(logit_bias=[[1, False], [2, -math.inf], [3, 1e300], [3, 1e300], [4, -1e300]])
    assert p.logit_bias == {1: -math.inf, 2: -math.inf, 3: 1e30, 4: -1e30}  # clamped: float32-safe
    for bad in (math.inf, math.nan, True, "5", None):
        with pytest.raises(BadRequestError, match="logit_bias"):
            SamplingParams(logit_bias={1: bad})


def test_one_parser_reads_every_logit_bias_form():
    want = ({5: -2.0, 7: 1.5}, {"Hello": -math.inf, "²": 1.0})
    assert parse_logit_bias({"5": -2, 7: 1.5, "Hello": False, "²": 1}) == want  # '²' is text, not a digit
    assert parse_logit_bias([[5, -1], [5, -1], [np.int64(7), 1.5], ["Hello", False], ["²", 1]]) == want
    with pytest.raises(BadRequestError, match="pairs"):
        parse_logit_bias([[5, 1, 2]])
    with pytest.raises(BadRequestError, match="logit_bias must map"):
        parse_logit_bias("5=1")


def test_check_vocab_refuses_ids_the_model_lacks():
    p = SamplingParams(logit_bias={10: 1.0, 99: -1.0, "text": 2.0})
    p.check_vocab(100)
    with pytest.raises(BadRequestError, match=r"logit_bias: token id 99 is outside this model's vocabulary \(0..98\)"):
        p.check_vocab(99)
    SamplingParams().check_vocab(1)


def test_with_text_bias_gives_every_token_of_the_text_the_bias():
    p = SamplingParams(logit_bias={5: -1.0, "ab": -2.0})
    out = p.with_text_bias(lambda text: [5, 6, 6] if text == "ab" else [])
    assert out.logit_bias == {5: -3.0, 6: -2.0} and out.logit_bias_text == {}
    assert p.logit_bias_text == {"ab": -2.0}  # the original is unchanged
    assert SamplingParams().with_text_bias(lambda t: [1]) == SamplingParams()


def test_extreme_mirostat_and_dynatemp_values_do_not_overflow():
    x = np.random.default_rng(5).standard_normal(300).astype(np.float32)
    v1 = Sampler(SamplingParams(mirostat=1, mirostat_tau=1e6, mirostat_eta=1e6, seed=1))
    for _ in range(3):  # 2.0 ** mu once raised OverflowError here (mu = 2e6)
        assert 0 <= v1.sample(x, []) < 300
    # five equal logits: entropy / log(5) rounds to 1.0000000000000002, and that to a
    # huge power overflowed a Python float (the stage is public, its exponent unbounded)
    c = _Cands(np.zeros(5, np.float32))
    temperature(c, 1.0, 0.5, 1e300)
    np.testing.assert_array_equal(c.logits, np.zeros(5))


# -- the declaration reaches every entry point ------------------------------------------


def _a_valid_other_value(p):
    """A value for parameter `p` that is valid and not its default."""
    if p.kind in ("int", "float"):
        kind = int if p.kind == "int" else float
        return next(kind(v) for v in (3, 2, 1, 0.5, 0.25, 0, -1) if kind(v) == v and kind(v) != p.default and p.valid(kind(v)))
    return {"strings": ["zz", "\n"], "order": ["top_k", "temperature"], "bias": {7: -1.5, "Hi": 2.0}}[p.kind]


def _on_the_command_line(p, v) -> list[str]:
    if p.kind == "strings":
        return [x for b in v for x in (p.flag, b)]
    if p.kind == "order":
        return [p.flag, ";".join(v)]
    if p.kind == "bias":
        return [x for t, b in v.items() for x in (p.flag, f"{t}={b}")]
    return [p.flag, str(v)]


def _same(p, a, b) -> bool:
    if p.kind == "order":
        return a.order == b.order
    if p.kind == "bias":  # ids and text keys, wherever they were given
        return (a.logit_bias, a.logit_bias_text) == (b.logit_bias, b.logit_bias_text)
    return getattr(a, p.name) == getattr(b, p.name)


def test_every_parameter_reaches_the_cli_the_server_and_the_chat_panel():
    """Walks the declarations, so a new parameter cannot be left out of an entry point:
    each one with a flag parses on `run` and `chat` and survives the chat panel's form;
    each one a body carries is in the server's field map and read from a body."""
    from localrun.cli import build_parser
    from localrun.sampling.flags import sampling_from_args
    from localrun.server.fields import SAMPLING_FIELDS, Body, sampling_params
    from localrun.tui.settings import ChatSettings, form_values, parse_form, sampler_fields

    panel = {name for name, _, _ in sampler_fields()}
    parser = build_parser()
    assert len({p.flag for p in PARAMETERS if p.flag}) == len([p for p in PARAMETERS if p.flag])
    for p in PARAMETERS:
        value = _a_valid_other_value(p)
        want = SamplingParams(**{p.name: value})
        assert not _same(p, want, SamplingParams()), p.name
        if p.flag:
            for command in ("run", "chat"):
                args = parser.parse_args([command, "model.gguf", *_on_the_command_line(p, value)])
                assert _same(p, sampling_from_args(args), want), (command, p.name)
            assert p.name in panel
            back = parse_form(form_values(ChatSettings(want)), True, "", "gbnf")
            assert _same(p, back.sampling, want), p.name
        else:
            assert p.note and p.name not in panel
        if p.body:
            assert p.name in SAMPLING_FIELDS
            assert _same(p, sampling_params(Body({p.name: value})), want), p.name
            assert _same(p, sampling_params(Body({"options": {p.name: value}}).obj("options")), want), p.name
        else:
            assert p.note and p.name not in SAMPLING_FIELDS
