"""`localrun serve --temp/--top-k/--top-p/--min-p/--seed` against a real server on SmolLM2:
the values a request gets for the sampler fields it leaves out, in every dialect, while a
request's own value wins; a value out of range is one `error:` line at startup."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from serving import Server, free_port

MODEL = "smollm2-135m-instruct-q4_1"
PROMPT = "Write a short story about a cat."
RAW = "Once upon a time, a cat"  # /completion's raw prompt: a text to go on with
N = 16  # tokens per answer: enough for sampled answers to part


@pytest.fixture(scope="module")
def greedy(smollm2_gguf):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "512", "--temp", "0")
    yield srv
    srv.stop()


def answer(server: Server, dialect: str, **fields) -> str:
    """The text of one non-streamed answer to PROMPT; `fields` are sampler fields (Ollama's
    go into `options`)."""
    msgs = [{"role": "user", "content": PROMPT}]
    if dialect == "chat":
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": N, **fields})
        return r["choices"][0]["message"]["content"]
    if dialect == "messages":
        r = post(server, "/v1/messages", {"model": MODEL, "messages": msgs, "max_tokens": N, **fields})
        return "".join(block["text"] for block in r["content"] if block["type"] == "text")
    if dialect == "responses":
        r = post(server, "/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": N, **fields})
        return "".join(part["text"] for item in r["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
    if dialect == "ollama":
        r = post(server, "/api/chat", {"model": MODEL, "messages": msgs, "stream": False,
                                       "options": {"num_predict": N, **fields}})
        return r["message"]["content"]
    r = post(server, "/completion", {"prompt": RAW, "n_predict": N, **fields})  # llama-server
    return r["content"]


def post(server: Server, route: str, body: dict) -> dict:
    resp = httpx.post(server.url + route, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


DIALECTS = ["chat", "messages", "responses", "ollama", "completion"]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_temp_0_makes_a_request_without_temperature_greedy(greedy, dialect):
    first = answer(greedy, dialect)
    assert first.strip()
    assert answer(greedy, dialect) == first  # the same text again: nothing was sampled
    assert answer(greedy, dialect, temperature=0) == first  # ... and it is the greedy answer


@pytest.mark.parametrize("dialect", ["chat", "ollama"])
def test_a_requests_own_temperature_wins_over_temp(greedy, dialect):
    sampled = [answer(greedy, dialect, temperature=1.5, seed=seed) for seed in range(3)]
    assert len(set(sampled)) > 1, sampled  # the seeds drew different answers: nothing was greedy
    assert answer(greedy, dialect, temperature=1.5, seed=2) == sampled[2]  # a seed still repeats its answer


def test_props_lists_the_defaults_a_request_gets(greedy):
    params = httpx.get(greedy.url + "/props", timeout=60).json()["default_generation_settings"]["params"]
    assert params["temperature"] == 0 and params["top_k"] == 40 and params["seed"] == -1
    assert params["n_predict"] == -1


def test_seed_and_top_k_defaults_and_a_requests_own_greedy(smollm2_gguf):
    """A sampling server (--temp 1.5) with --seed answers a request without a seed the same
    way twice; one sending its own temperature 0 is greedy; /props lists all three."""
    srv = Server("--model", str(smollm2_gguf), "--ctx", "512", "--temp", "1.5", "--seed", "7", "--top-k", "0")
    try:
        params = httpx.get(srv.url + "/props", timeout=60).json()["default_generation_settings"]["params"]
        assert (params["temperature"], params["seed"], params["top_k"]) == (1.5, 7, 0)
        sampled = answer(srv, "chat")
        assert answer(srv, "chat") == sampled  # the server's seed: the same draws again
        assert answer(srv, "chat", temperature=0) != sampled  # greedy; the server's 1.5 did sample
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, line", [
    (["--temp", "-1"], "error: --temp must be >= 0 and at most 1e6 (0 = greedy), got -1.0"),
    (["--temperature", "nan"], "error: --temp must be >= 0 and at most 1e6 (0 = greedy), got nan"),
    (["--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0"),
    (["--min-p", "1.5"], "error: --min-p must be in [0, 1], got 1.5"),
    (["--top-k", "-2"], "error: --top-k must be 0 or -1 (off) or a positive count up to 2147483647, got -2"),
    (["--seed", "-5"], "error: --seed must be an integer 0..2**64-1, or -1 for a random one, got -5"),
])
def test_a_bad_default_is_one_error_line_at_startup(flags, line):
    res = subprocess.run([sys.executable, "-m", "localrun", "serve", "--port", str(free_port()), *flags],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert [x for x in res.stderr.splitlines() if "error:" in x] == [line], res.stderr
