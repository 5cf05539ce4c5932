"""`localrun serve` under load and under fuzzing, against real server processes:
10 streaming clients over 4 slots for LOCALRUN_SOAK_SECONDS (default 20: each client
streams its answer ~12 times here, the slots refilled ~120 times while others decode; set 600 or
more for a soak before a release) with zero errors and streamed text equal to the
non-streamed text at temperature 0; and hypothesis-generated request bodies that must
never produce a 5xx."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from localrun.backends.attention import FLASH_ATTN_ENV
from serving import Server

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a test extra")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SOAK_SECONDS = float(os.environ.get("LOCALRUN_SOAK_SECONDS", "20"))
TOPICS = ["rivers", "bread", "chess", "owls", "volcanoes", "jazz", "glass", "tides", "maps", "bees"]


def ask(topic: str) -> dict:
    return {"messages": [{"role": "user", "content": f"Write one sentence about {topic}."}],
            "max_tokens": 24, "temperature": 0}


def streamed_text(client: httpx.Client, url: str, body: dict) -> str:
    parts = []
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise AssertionError(f"status {r.status_code}: {r.read()!r}")
        lines = [line for line in r.iter_lines() if line]
    if lines[-1] != "data: [DONE]":
        raise AssertionError(f"stream did not end with [DONE]: {lines[-3:]}")
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            raise AssertionError(f"error in stream: {chunk}")
        parts.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    return "".join(parts)


@pytest.mark.slow
def test_ten_streaming_clients_over_four_slots(smollm2_gguf):
    # Flash attention on: SmolLM2's rows are then bit-identical however requests are batched
    # together (test_generation.py's batch_invariant), so a streamed answer that differs from
    # the one answered alone is cross-talk between slots, not rounding.
    srv = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "4", "--queue", "16",
                 env={FLASH_ATTN_ENV: "on"})
    try:
        with httpx.Client(timeout=120) as c:
            reference = {}
            for t in TOPICS:
                r = c.post(srv.url + "/v1/chat/completions", json=ask(t))
                assert r.status_code == 200, r.text
                reference[t] = r.json()["choices"][0]["message"]["content"]
        errors: list[str] = []
        done = [0] * len(TOPICS)
        deadline = time.monotonic() + SOAK_SECONDS

        def client(i: int) -> None:
            with httpx.Client(timeout=120) as c:
                while time.monotonic() < deadline:
                    try:
                        text = streamed_text(c, srv.url, ask(TOPICS[i]))
                    except Exception as exc:  # every failure is a finding, counted below
                        errors.append(f"client {i}: {exc}")
                        return
                    if text != reference[TOPICS[i]]:
                        errors.append(f"client {i}: streamed {text!r} != non-streamed {reference[TOPICS[i]]!r}")
                    done[i] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(TOPICS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert min(done) >= 1, done
        processing, deferred = 0, 0
        for line in httpx.get(srv.url + "/metrics").text.splitlines():
            if line.startswith("llamacpp:requests_processing{"):
                processing = float(line.split()[-1])
            if line.startswith("llamacpp:requests_deferred{"):
                deferred = float(line.split()[-1])
        assert (processing, deferred) == (0, 0)
    finally:
        srv.stop()


# -- fuzzing ---------------------------------------------------------------------

M = "smollm2-135m-instruct-q4_1"
CHAT = [{"role": "user", "content": "hi"}]
# a valid body per endpoint; the fuzzer overrides and adds fields, so it reaches past the required ones
ENDPOINTS = {
    "/v1/chat/completions": {"model": M, "messages": CHAT, "max_tokens": 3},
    "/v1/completions": {"model": M, "prompt": "hi", "max_tokens": 3},
    "/v1/embeddings": {"model": M, "input": "hi"},
    "/api/chat": {"model": M, "messages": CHAT, "options": {"num_predict": 3}, "stream": False},
    "/api/generate": {"model": M, "prompt": "hi", "options": {"num_predict": 3}},
    "/api/show": {"model": M},
    "/api/embed": {"model": M, "input": ["hi"]},
    "/completion": {"prompt": "hi", "n_predict": 3},
    "/infill": {"input_prefix": "a", "input_suffix": "b", "n_predict": 3},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
KEYS = ["model", "messages", "prompt", "suffix", "input", "content", "tokens", "stream", "max_tokens", "n_predict",
        "temperature", "top_k", "top_p", "min_p", "stop", "seed", "logit_bias", "response_format", "format",
        "options", "keep_alive", "grammar", "json_schema", "samplers", "n_probs", "logprobs", "top_logprobs",
        "input_prefix", "input_suffix", "input_extra", "raw", "mirostat", "dry_multiplier", "t_max_predict_ms"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12), st.sampled_from(["smollm2-135m-instruct-q4_1", "json", "user", "5m"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(KEYS + ["role", "type"]), inner, max_size=3)),
                      max_leaves=8)
bodies = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)


@pytest.fixture(scope="module")
def tiny_server(smollm2_gguf):
    # a 32-token context bounds every generation a fuzzed body may start
    srv = Server("--model", str(smollm2_gguf), "--ctx", "32", "--parallel", "2")
    yield srv
    srv.stop()


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=bodies, keep_base=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(tiny_server, endpoint, extra, keep_base):
    body = {**ENDPOINTS[endpoint], **extra} if keep_base else extra
    try:
        payload = json.dumps(body, allow_nan=True)
    except (ValueError, TypeError):
        return
    r = httpx.post(tiny_server.url + endpoint, content=payload, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code < 500, (endpoint, body, r.status_code, r.text[:300])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_fuzzed_bytes_never_get_a_5xx(tiny_server, raw):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", content=raw, timeout=60)
    assert r.status_code < 500, (raw, r.status_code, r.text[:300])


def test_mlx_model_serves_concurrent_requests_like_solo(smollm2_mlx):
    """MLX runs its sequences one after another inside each step: correct and fair."""
    srv = Server("--model", str(smollm2_mlx), "--ctx", "256", "--parallel", "2")
    try:
        bodies = [{"prompt": f"The {word} is", "n_predict": 6, "temperature": 0, "lookup": False} for word in ("sea", "sky")]
        solo = [httpx.post(srv.url + "/completion", json=b, timeout=120).json()["content"] for b in bodies]
        results: list = [None, None]

        def run(i: int) -> None:
            results[i] = httpx.post(srv.url + "/completion", json=bodies[i], timeout=120).json()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r["content"] for r in results] == solo
        assert all(r["tokens_predicted"] == 6 for r in results)
    finally:
        srv.stop()
