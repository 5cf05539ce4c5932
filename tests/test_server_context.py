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
from localrun.hardware import format_bytes
from localrun.quant.selector import Budget, estimate, kv_cache_bytes, model_shape, weights_bytes, without_draft
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


def fits_beside(draft, path, n_ctx: int, gb: float, n_seq: int) -> bool:
    """Whether the model fits at n_ctx once its draft model, at the same context and
    slots (Engine.load_draft), has had its share."""
    left, _ = without_draft(Budget(int(gb * (1 << 30)), 0, False, "--memory", True), draft, n_ctx, n_seq=n_seq)
    return estimate(model_shape(path), weights_bytes(path), n_ctx, left, n_seq=n_seq).fits


def test_a_draft_model_takes_its_share_before_the_context_is_chosen(qwen_coder_15b_gguf, qwen_coder_gguf,
                                                                    monkeypatch):
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "6")
    alone = served_context(str(qwen_coder_15b_gguf), n_seq=4)
    choice = served_context(str(qwen_coder_15b_gguf), n_seq=4, draft=str(qwen_coder_gguf))
    assert 256 <= choice.n_ctx < alone.n_ctx and choice.n_ctx % 256 == 0
    # the draft's weights, its own KV for every slot at the model's context, its buffers
    assert fits_beside(qwen_coder_gguf, qwen_coder_15b_gguf, choice.n_ctx, 6, 4)
    assert not fits_beside(qwen_coder_gguf, qwen_coder_15b_gguf, choice.n_ctx + 256, 6, 4)
    assert fits(qwen_coder_15b_gguf, choice.n_ctx + 256, 6, 4)  # it is the draft that made the difference
    draft_kv = kv_cache_bytes(model_shape(qwen_coder_gguf), choice.n_ctx, n_seq=4)
    assert f"after the draft model ({format_bytes(weights_bytes(qwen_coder_gguf))} weights" in choice.why
    assert f" + {format_bytes(draft_kv)} KV + " in choice.why
    # a request's larger context is judged with the draft model too
    assert served_context(str(qwen_coder_15b_gguf), n_seq=4, asked=choice.n_ctx,
                          draft=str(qwen_coder_gguf)).n_ctx == choice.n_ctx
    with pytest.raises(BadRequestError, match=f"at most {choice.n_ctx} fits with 4 slots and the draft model"):
        served_context(str(qwen_coder_15b_gguf), n_seq=4, asked=alone.n_ctx, draft=str(qwen_coder_gguf))
    # --ctx still wins
    assert served_context(str(qwen_coder_15b_gguf), n_seq=4, fixed=1000, draft=str(qwen_coder_gguf)).n_ctx == 1000


def test_a_draft_model_that_cannot_pair_is_not_counted(qwen_coder_15b_gguf, smollm2_gguf, monkeypatch):
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "6")
    alone = served_context(str(qwen_coder_15b_gguf), n_seq=4)
    choice = served_context(str(qwen_coder_15b_gguf), n_seq=4, draft=str(smollm2_gguf))  # 49k tokens, not 151k
    assert choice.n_ctx == alone.n_ctx and "no draft model (it does not pair with this model)" in choice.why


def test_serve_counts_its_draft_model_and_says_so_at_start(qwen_coder_15b_gguf, qwen_coder_gguf, monkeypatch,
                                                          capsys):
    from localrun.commands.serve import _announce_contexts
    from localrun.server.models import ModelManager

    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "6")
    manager = ModelManager([str(qwen_coder_15b_gguf)], n_ctx=None, parallel=4, threads=1, max_queue=4,
                           draft=str(qwen_coder_gguf))
    expected = served_context(str(qwen_coder_15b_gguf), n_seq=4, draft=str(qwen_coder_gguf))
    assert manager.context_for(str(qwen_coder_15b_gguf)) == expected
    _announce_contexts(manager)
    line = capsys.readouterr().err
    assert f": context {expected.n_ctx} tokens per request (" in line and "after the draft model (" in line


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
