"""One request must never freeze, crash or starve the server.

Each hostile request runs against a real `localrun serve` process WHILE a victim client
streams a greedy answer from the same model: the attack gets its 4xx within a few
seconds, `/health` answers within a second throughout, and the victim's text equals its
text without the attack. Then SIGTERM in the middle of an attack ends the server within
5 seconds.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from serving import Server, make_template_copy

MODEL = "smollm2-135m-instruct-q4_1"
BOMB = "template-bomb"
ATTACK_WAIT_S = 10.0  # generous for a loaded 2-core CI machine; the bug took minutes
HEALTH_WAIT_S = 1.0
VICTIM = {"prompt": "Write a long story about a lighthouse keeper and the sea.", "n_predict": 160,
          "temperature": 0, "ignore_eos": True, "stream": True, "lookup": False}


@pytest.fixture(scope="module")
def bomb_model(smollm2_gguf, tmp_path_factory):
    """SmolLM2 under a chat template that would loop 10^10 times."""
    template = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    return make_template_copy(smollm2_gguf, tmp_path_factory.mktemp("bomb") / f"{BOMB}.gguf", template)


@pytest.fixture(scope="module")
def server(smollm2_gguf, bomb_model):
    srv = Server("--model", str(smollm2_gguf), "--model", str(bomb_model), "--ctx", "1024", "--parallel", "2",
                 "--threads", "1")
    yield srv
    srv.stop()


def stream_victim(url: str, out: dict, started: threading.Event) -> None:
    parts = []
    with httpx.stream("POST", url + "/completion", json=VICTIM, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                out["error"] = msg["error"]
                break
            parts.append(msg.get("content", ""))
            if len(parts) >= 3:
                started.set()
    out["text"] = "".join(parts)
    started.set()


@pytest.fixture(scope="module")
def baseline(server) -> str:
    out: dict = {}
    stream_victim(server.url, out, threading.Event())
    assert "error" not in out and out["text"]
    return out["text"]


def under_attack(server, baseline: str, attack) -> httpx.Response:
    """Run attack() while the victim streams; check the victim and /health, return the attack's response."""
    out: dict = {}
    started = threading.Event()
    victim = threading.Thread(target=stream_victim, args=(server.url, out, started))
    victim.start()
    assert started.wait(60), "the victim never started streaming"
    health: list[float] = []
    stop_polling = threading.Event()

    def poll() -> None:
        while not stop_polling.is_set():
            t0 = time.monotonic()
            httpx.get(server.url + "/health", timeout=30)
            health.append(time.monotonic() - t0)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.monotonic()
    try:
        resp = attack(server.url)
    finally:
        elapsed = time.monotonic() - t0
        stop_polling.set()
        poller.join()
        victim.join(120)
    assert elapsed < ATTACK_WAIT_S, f"the attack took {elapsed:.1f} s"
    assert health and max(health) < HEALTH_WAIT_S, f"/health took up to {max(health):.2f} s"
    assert "error" not in out, out.get("error")
    assert out["text"] == baseline, "the victim's answer changed under the attack"
    assert server.proc.poll() is None, server.output()
    return resp


def post(path: str, body: dict):
    return lambda url: httpx.post(url + path, json=body, timeout=60)


ATTACKS = {
    "logit_bias id beyond int64": post("/completion", {"prompt": "hi", "n_predict": 4,
                                                       "logit_bias": {"99999999999999999999": 1}}),
    "logit_bias id beyond the vocabulary": post("/completion", {"prompt": "hi", "n_predict": 4,
                                                                "logit_bias": [[49152 + 7, 1.0]]}),
    "a huge logit_bias map": post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                      "logit_bias": {str(i): -1 for i in range(30000)}}),
    "200,000 stop strings": post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                     "stop": [f"s{i}" for i in range(200_000)]}),
    "a 100 kB stop string": post("/completion", {"prompt": "hi", "n_predict": 4, "stop": ["x" * 100_000]}),
    "100,000 DRY breakers": post("/completion", {"prompt": "hi", "n_predict": 4, "dry_multiplier": 0.8,
                                                 "dry_sequence_breakers": [f"b{i}" for i in range(100_000)]}),
    "n_probs of a billion": post("/completion", {"prompt": "hi", "n_predict": 4, "n_probs": 1_000_000_000}),
    "top_logprobs of 1000": post("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "logprobs": True,
                                                          "top_logprobs": 1000,
                                                          "messages": [{"role": "user", "content": "hi"}]}),
    "a GBNF of 40,000 [": post("/completion", {"prompt": "hi", "n_predict": 4, "grammar": "root ::= " + "[" * 40_000}),
    "a 2 MB GBNF": post("/completion", {"prompt": "hi", "n_predict": 4,
                                        "grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(250_000))}),
    "a 1 MB JSON schema enum": post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "enum": [f"value-{i:07d}" for i in range(60_000)]}}}}),
    "a chat template bomb": post("/api/chat", {"model": BOMB, "stream": False,
                                               "messages": [{"role": "user", "content": "hi"}]}),
    "a model path outside the served models": post("/api/show", {"model": "/etc/passwd"}),
    "3,000 texts to embed": post("/api/embed", {"model": MODEL, "input": ["hi"] * 3000}),
    "a keep_alive of NaN": post("/api/generate", {"model": MODEL, "prompt": "hi", "keep_alive": "nan",
                                                  "stream": False}),
    "a 1 MB keep_alive": post("/api/generate", {"model": MODEL, "prompt": "hi", "keep_alive": "5" * 1_000_000,
                                                "stream": False}),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_refused_while_a_victim_streams(server, baseline, name):
    resp = under_attack(server, baseline, ATTACKS[name])
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    assert "Traceback" not in resp.text


def test_a_file_outside_is_indistinguishable_from_a_missing_one_and_never_echoed(server, tmp_path):
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nSECRETSECRET\n")
    there = httpx.post(server.url + "/api/show", json={"model": str(secret)})
    missing = httpx.post(server.url + "/api/show", json={"model": str(tmp_path / "nothing-here")})
    assert there.status_code == missing.status_code and 400 <= there.status_code < 500
    assert "SECRET" not in there.text and "OPENSSH" not in there.text
    assert there.json()["error"].replace(str(secret), "X") == missing.json()["error"].replace(
        str(tmp_path / "nothing-here"), "X")


def test_a_fifo_named_as_model_is_refused_without_blocking(server, baseline, tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for path in ("/api/show", "/api/chat"):
        body = {"model": str(fifo), "messages": [{"role": "user", "content": "hi"}], "stream": False}
        resp = under_attack(server, baseline, post(path, body))
        assert 400 <= resp.status_code < 500


def test_sigterm_mid_attack_stops_the_server_within_5_s(smollm2_gguf):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "1024", "--parallel", "2", "--threads", "1")
    try:
        out: dict = {}
        started = threading.Event()
        victim = threading.Thread(target=stream_victim, args=(srv.url, out, started), daemon=True)
        victim.start()
        assert started.wait(60)
        # a long prompt that is being read while the signal comes
        attack = threading.Thread(target=lambda: _quietly(post("/completion", {
            "prompt": "The quick brown fox jumps over the lazy dog. " * 80, "n_predict": 400,
            "ignore_eos": True}), srv.url), daemon=True)
        attack.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=15)
        took = time.monotonic() - t0
        assert took <= 5.0, f"the server took {took:.1f} s to stop"
        assert "SIGTERM" in srv.output()
    finally:
        srv.stop()


def _quietly(fn, url) -> None:
    try:
        fn(url)
    except httpx.HTTPError:
        return  # the server went away under it, which is what the test does
