"""The typed generation request: every bound (one test each, the field named in the
message), the same request from every dialect, and `prepare` doing the model work so
that `Engine.start` (the scheduler thread's part) finds only cache hits."""

from __future__ import annotations

import math

import pytest

from localrun.engine import Engine
from localrun.errors import BadRequestError
from localrun.grammar.core import Grammar
from localrun.request import (
    MAX_CONTENT_PARTS,
    MAX_FIELD_NAME_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_MESSAGES,
    MAX_N_INDENT,
    MAX_RESPONSE_FIELDS,
    MAX_ROLE_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_T_MAX_PREDICT_MS,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    prepare,
)
from localrun.sampling import SamplingParams, TokenText
from localrun.server import llama_api, ollama_api, openai_api
from localrun.server.fields import Body, grammar_from, messages
from localrun.speculation.lookup import LookupConfig

from fakes import N_VOCAB, ScriptedBackend, text_script

GREEDY = SamplingParams(temperature=0)


def refused(field: str, **fields) -> str:
    with pytest.raises(BadRequestError) as info:
        GenerationRequest(**fields)
    assert str(info.value).startswith(field), str(info.value)
    return str(info.value)


# -- the request's own bounds ------------------------------------------------------


def test_stop_holds_at_most_16_strings():
    GenerationRequest(stop=["x"] * MAX_STOP_STRINGS)
    assert "17" in refused("stop", stop=["x"] * (MAX_STOP_STRINGS + 1))


def test_a_stop_string_holds_at_most_256_characters():
    GenerationRequest(stop=["ok", "y" * MAX_STOP_CHARS])
    assert "257" in refused("stop[1]", stop=["ok", "y" * (MAX_STOP_CHARS + 1)])


def test_stop_must_be_strings():
    refused("stop[0]", stop=[7])
    refused("stop", stop={"a": 1})


def test_max_tokens_is_never_negative():
    GenerationRequest(max_tokens=0)
    refused("max_tokens", max_tokens=-1)


def test_max_tokens_fits_a_c_int():
    GenerationRequest(max_tokens=MAX_TOKENS_LIMIT)
    refused("max_tokens", max_tokens=MAX_TOKENS_LIMIT + 1)
    refused("max_tokens", max_tokens=10**30)


def test_max_tokens_is_an_integer():
    assert GenerationRequest(max_tokens=12.0).max_tokens == 12  # JSON clients send 12.0
    refused("max_tokens", max_tokens="12")
    refused("max_tokens", max_tokens=True)


def test_t_max_predict_ms_is_at_most_a_day():
    assert GenerationRequest(t_max_predict_ms=-1).t_max_predict_ms == -1.0  # llama-server's "no limit"
    GenerationRequest(t_max_predict_ms=MAX_T_MAX_PREDICT_MS)
    refused("t_max_predict_ms", t_max_predict_ms=MAX_T_MAX_PREDICT_MS + 1)


def test_t_max_predict_ms_is_a_finite_number():
    refused("t_max_predict_ms", t_max_predict_ms=math.inf)
    refused("t_max_predict_ms", t_max_predict_ms="300")


def test_n_indent_is_bounded():
    GenerationRequest(n_indent=MAX_N_INDENT)
    refused("n_indent", n_indent=MAX_N_INDENT + 1)
    refused("n_indent", n_indent=-1)


def test_ignore_eos_and_lookup_are_booleans():
    refused("ignore_eos", ignore_eos="yes")
    refused("lookup", lookup=1)


def test_sampling_and_grammar_are_typed():
    refused("sampling", sampling={"temperature": 0})
    refused("grammar", grammar="root ::= \"x\"")


def test_equal_asks_make_equal_requests():
    a = GenerationRequest(stop=["x", ""], lookup=True)
    b = GenerationRequest(stop=("x",), lookup=LookupConfig(enabled=True))
    assert a == b and a.stop == ("x",)  # an empty stop string would end every answer at once
    with pytest.raises(Exception):
        a.max_tokens = 3  # frozen: a prepared request cannot change under the scheduler


def test_of_takes_the_python_api_keywords():
    r = GenerationRequest.of(sampling=None, max_tokens=5, stop=None, lookup=False)
    assert r == GenerationRequest(max_tokens=5, lookup=False)
    with pytest.raises(TypeError, match="temprature"):
        GenerationRequest.of(temprature=0)


# -- server-side bounds, read where the field is -------------------------------------


def test_messages_are_capped():
    one = {"role": "user", "content": "hi"}
    assert len(messages(Body({"messages": [one] * MAX_MESSAGES}))) == MAX_MESSAGES
    with pytest.raises(BadRequestError, match="'messages' may hold at most"):
        messages(Body({"messages": [one] * (MAX_MESSAGES + 1)}))


def test_content_parts_are_capped():
    parts = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)
    with pytest.raises(BadRequestError, match=r"'messages\[0\].content' may hold at most"):
        messages(Body({"messages": [{"role": "user", "content": parts}]}))


def test_a_role_is_a_short_string():
    with pytest.raises(BadRequestError, match=r"'messages\[0\].role'"):
        messages(Body({"messages": [{"role": "u" * (MAX_ROLE_CHARS + 1), "content": "x"}]}))


def test_grammar_source_is_capped_before_it_compiles():
    with pytest.raises(BadRequestError, match="'grammar' may be at most"):
        grammar_from(Body({"grammar": "root ::= " + '"a" ' * (MAX_GRAMMAR_CHARS // 4)}))
    schema = {"type": "object", "description": "d" * MAX_GRAMMAR_CHARS}
    with pytest.raises(BadRequestError, match="'response_format.json_schema.schema' may be at most"):
        grammar_from(Body({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}))
    with pytest.raises(BadRequestError, match="'format' may be at most"):
        ollama_api.build_request(Body({"format": schema}))


def test_stop_bound_names_ollamas_options_field():
    with pytest.raises(BadRequestError, match=r"^options\.stop must hold at most"):
        ollama_api.build_request(Body({"options": {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}}))


@pytest.mark.parametrize(
    "build, body, field",
    [
        (lambda b: openai_api.build_request(b, 0), {"max_tokens": MAX_TOKENS_LIMIT + 1}, "'max_tokens'"),
        (lambda b: openai_api.build_request(b, 0), {"max_completion_tokens": -1}, "'max_completion_tokens'"),
        (ollama_api.build_request, {"options": {"num_predict": MAX_TOKENS_LIMIT + 1}}, "'options.num_predict'"),
        (llama_api.build_request, {"n_predict": MAX_TOKENS_LIMIT + 1}, "'n_predict'"),
        (llama_api.build_request, {"n_probs": MAX_TOP_LOGPROBS + 1}, "'n_probs'"),
        (llama_api.build_request, {"n_indent": MAX_N_INDENT + 1}, "n_indent"),
        (llama_api.build_request, {"t_max_predict_ms": 1e12}, "t_max_predict_ms"),
    ],
)
def test_each_dialect_names_its_own_field(build, body, field):
    with pytest.raises(BadRequestError) as info:
        build(Body(body))
    assert str(info.value).startswith(field), str(info.value)


def test_response_fields_are_capped():
    with pytest.raises(BadRequestError, match="'response_fields' may hold at most"):
        llama_api._read_run_fields(Body({"response_fields": ["content"] * (MAX_RESPONSE_FIELDS + 1)}))
    with pytest.raises(BadRequestError, match="'response_fields' must be"):
        llama_api._read_run_fields(Body({"response_fields": ["c" * (MAX_FIELD_NAME_CHARS + 1)]}))


def test_every_dialect_builds_the_same_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shared = {"temperature": 0.5, "top_k": 7, "seed": 3, "stop": ["\n\n", "END"], "lookup": False,
              "logit_bias": {"5": -2}}
    response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    from_openai = openai_api.build_request(Body({**shared, "max_tokens": 9, "response_format": response_format}), 0)
    from_ollama = ollama_api.build_request(Body({"options": {**shared, "num_predict": 9}, "format": schema}))
    from_llama = llama_api.build_request(Body({**shared, "n_predict": 9, "json_schema": schema}))
    assert from_openai == from_ollama == from_llama
    assert from_llama.max_tokens == 9 and from_llama.stop == ("\n\n", "END") and from_llama.grammar is not None
    assert from_llama.sampling.logit_bias == {5: -2.0} and not from_llama.lookup.enabled


def test_llama_server_limits_travel_in_the_request():
    r = llama_api.build_request(Body({"n_predict": -1, "ignore_eos": True, "t_max_predict_ms": 500, "n_indent": 4}))
    assert (r.max_tokens, r.ignore_eos, r.t_max_predict_ms, r.n_indent) == (None, True, 500.0, 4)


# -- prepare: the model's part, before the scheduler sees the request -----------------


def test_prepare_turns_text_bias_into_token_ids():
    eng = Engine(ScriptedBackend())
    req = GenerationRequest(sampling=SamplingParams(logit_bias={"ab": -3, 98: -1}))
    ready = prepare(eng, req)
    assert ready.sampling.logit_bias == {ord("a"): -3.0, ord("b"): -4.0}  # each byte is a token here
    assert ready.sampling.logit_bias_text == {}
    assert prepare(eng, ready) is ready  # prepared twice: nothing left to do


def test_prepare_refuses_a_bias_outside_the_vocabulary():
    eng = Engine(ScriptedBackend())
    prepare(eng, GenerationRequest(sampling=SamplingParams(logit_bias={N_VOCAB - 1: 1})))
    for bad in (N_VOCAB, 99999999999999999999):  # the second once overflowed inside the scheduler thread
        with pytest.raises(BadRequestError, match="logit_bias"):
            prepare(eng, GenerationRequest(sampling=SamplingParams(logit_bias={bad: 1})))


def test_start_after_prepare_scans_no_vocabulary(monkeypatch):
    """What grows with the vocabulary (the grammar's tokenizer, DRY's breakers) happens in
    prepare; starting the generation, the scheduler thread's part, reads no token piece
    and resolves no breaker."""
    backend = ScriptedBackend(text_script(b"aaaa"))
    eng = Engine(backend)
    tails = []  # a breaker a token can start but not hold whole has its tail tokenized
    eng.token_text = TokenText(backend.token_bytes, N_VOCAB, lambda text: tails.append(text) or list(text.encode()))
    pieces_read = []
    real_bytes = backend.token_bytes
    monkeypatch.setattr(backend, "token_bytes", lambda t: pieces_read.append(t) or real_bytes(t))
    sampling = SamplingParams(temperature=0, dry_multiplier=0.8, dry_sequence_breakers=["qz"])
    req = prepare(eng, GenerationRequest(sampling=sampling, grammar=Grammar.from_regex("a+"), max_tokens=3))
    assert tails and len(pieces_read) >= N_VOCAB - 1
    tails.clear()
    pieces_read.clear()
    gen = eng.start("go", req)
    assert pieces_read == []
    while not gen.done:
        eng.step([gen])
    assert tails == []  # the sampler's DRY found the breakers already resolved
    assert len(pieces_read) == 3  # one piece per emitted token, for its text
    assert eng.detokenize(gen.output) == "aaa"


def test_start_takes_a_request_or_keywords_not_both():
    eng = Engine(ScriptedBackend(text_script(b"abc")))
    by_request = eng.complete("Q:", GenerationRequest(sampling=GREEDY, max_tokens=2))
    by_keywords = eng.complete("Q:", sampling=GREEDY, max_tokens=2)
    assert by_request.text == by_keywords.text == "ab"
    with pytest.raises(TypeError, match="not both"):
        eng.start("Q:", GenerationRequest(), max_tokens=2)
    with pytest.raises(BadRequestError, match="stop"):
        eng.start("Q:", stop=["x"] * (MAX_STOP_STRINGS + 1))
