"""A served model's context is sized for agents, and agents reach it by their own names.

- With no --ctx, `serve` gives a model its trained context where the memory model says it
  fits with every --parallel slot's KV cache, else the most of it that does; it prints the
  number and why. Ollama's `options.num_ctx` reloads a model with a larger context.
- `--alias NAME=MODEL` (NAME may be a glob) sends an agent's model names to a local model
  and lists NAME in /v1/models and /api/tags; other names keep the uniform 404.
"""

from __future__ import annotations

import httpx
import pytest

from localrun.errors import BadRequestError
from localrun.quant.selector import Budget, estimate, model_shape, weights_bytes
from localrun.server.context import FALLBACK_CTX, served_context
from serving import Server

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
SMOL = "smollm2-135m-instruct-q4_1"


def fits(path, n_ctx: int, gb: float, n_seq: int) -> bool:
    budget = Budget(int(gb * (1 << 30)), 0, False, "--memory", True)
    return estimate(model_shape(path), weights_bytes(path), n_ctx, budget, n_seq=n_seq).fits


def test_the_trained_context_when_memory_allows(qwen_coder_gguf, monkeypatch):
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "16")
    choice = served_context(str(qwen_coder_gguf), n_seq=4)
    assert choice.n_ctx == 32768 != 4096
    assert choice.why.startswith("trained context 32768;") and "KV for 4 slots" in choice.why


def test_the_most_that_fits_when_memory_is_short(qwen_coder_gguf, monkeypatch):
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "1.5")
    choice = served_context(str(qwen_coder_gguf), n_seq=4)
    assert 256 <= choice.n_ctx < 32768 and choice.n_ctx % 256 == 0
    assert fits(qwen_coder_gguf, choice.n_ctx, 1.5, 4) and not fits(qwen_coder_gguf, choice.n_ctx + 256, 1.5, 4)
    assert "the most of the trained 32768 that fits" in choice.why


def test_ctx_flag_wins_and_nothing_fitting_falls_back(qwen_coder_gguf, monkeypatch):
    assert served_context(str(qwen_coder_gguf), n_seq=4, fixed=1000).n_ctx == 1000
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "0.1")  # less than the weights
    assert served_context(str(qwen_coder_gguf), n_seq=4).n_ctx == FALLBACK_CTX


def test_an_asked_context_is_bounded_by_training_and_memory(qwen_coder_gguf, monkeypatch):
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "1.5")
    assert served_context(str(qwen_coder_gguf), n_seq=1, asked=8192).n_ctx == 8192
    with pytest.raises(BadRequestError, match=r"'num_ctx' must be 16\.\.32768"):
        served_context(str(qwen_coder_gguf), n_seq=1, asked=40000)
    with pytest.raises(BadRequestError, match=r"does not fit in this machine's memory.*at most \d+ fits with 4 slots"):
        served_context(str(qwen_coder_gguf), n_seq=4, asked=32768)


@pytest.fixture(scope="module")
def served(qwen_coder_gguf):
    srv = Server("--model", str(qwen_coder_gguf), "--parallel", "2",
                 "--alias", f"claude-*={QWEN}", "--alias", f"gpt-local={QWEN}")
    yield srv
    srv.stop()


def test_serve_prints_the_context_it_chose_and_show_reports_it(served):
    assert f"{QWEN}: context 32768 tokens per request (trained context 32768;" in served.output()
    info = httpx.post(served.url + "/api/show", json={"model": QWEN}, timeout=30).json()
    assert info["model_info"]["qwen2.context_length"] == 32768


def test_aliases_reach_the_model_and_are_listed(served):
    for name in ("claude-sonnet-4-5-20250929", "claude-haiku-4-5", "gpt-local"):
        r = httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
            "model": name, "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    ids = {m["id"] for m in httpx.get(served.url + "/v1/models", timeout=30).json()["data"]}
    assert {"claude-*", "gpt-local", QWEN} <= ids
    tags = {m["name"] for m in httpx.get(served.url + "/api/tags", timeout=30).json()["models"]}
    assert {"claude-*", "gpt-local"} <= tags


def test_names_no_alias_matches_keep_the_uniform_404(served):
    for name in ("gpt-4o", "claude", "xclaude-3"):
        r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
            "model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 404, (name, r.text)


def test_an_alias_to_nothing_stops_serve_with_one_line(qwen_coder_gguf):
    with pytest.raises(RuntimeError, match="not found|no model"):
        Server("--model", str(qwen_coder_gguf), "--alias", "claude-*=no-such-model")
    with pytest.raises(RuntimeError, match="--alias must be NAME=MODEL"):
        Server("--model", str(qwen_coder_gguf), "--alias", "claude-*")


def test_ollama_num_ctx_reloads_the_model_with_a_larger_context(smollm2_gguf):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "1")
    try:
        prompt = "Count: " + " ".join(str(i) for i in range(200))  # ~750 tokens: over 512, under 1024
        body = {"model": SMOL, "prompt": prompt, "stream": False, "options": {"num_predict": 2, "temperature": 0}}
        short = httpx.post(srv.url + "/api/generate", json=body, timeout=120)
        assert short.status_code == 400 and "context holds 512" in short.json()["error"]
        body["options"]["num_ctx"] = 1024
        r = httpx.post(srv.url + "/api/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        (ps,) = httpx.get(srv.url + "/api/ps", timeout=30).json()["models"]
        assert ps["context_length"] == 1024
        body["options"]["num_ctx"] = 512  # a smaller one is served by the larger context, no reload
        assert httpx.post(srv.url + "/api/generate", json=body, timeout=120).status_code == 200
        assert httpx.get(srv.url + "/api/ps", timeout=30).json()["models"][0]["context_length"] == 1024
        body["options"]["num_ctx"] = 10**6
        big = httpx.post(srv.url + "/api/generate", json=body, timeout=60)
        assert big.status_code == 400 and "'num_ctx' must be 16..8192" in big.json()["error"]
    finally:
        srv.stop()
