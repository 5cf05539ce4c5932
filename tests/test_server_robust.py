"""`localrun serve` under hostile or careless clients, each against a real server
process: DNS rebinding, CORS, API keys, oversized and malformed bodies, prompts too long
for the context, clients that hang up while queued, in prefill or in decode, and a
full queue."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from serving import Server

MODEL = "smollm2-135m-instruct-q4_1"
LONG = "The quick brown fox jumps over the lazy dog. " * 150  # ~1.5k tokens


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    # one thread: the step time (which bounds how soon a hang-up frees a slot) stays short
    # even when other processes share the cores
    srv = Server("--model", str(smollm2_gguf), "--ctx", "2048", "--parallel", "2", "--queue", "2", "--threads", "1",
                 "--max-body", "200000", "--batch", "128")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(smollm2_gguf):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "256", "--api-key", "s3cret")
    yield srv
    srv.stop()


def wait_until(check, timeout: float) -> float:
    """Seconds until check() is true; fails after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


def busy(server) -> tuple[int, int]:
    """(processing, deferred) requests, from /metrics."""
    vals = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        for key in ("requests_processing", "requests_deferred"):
            if line.startswith(f"llamacpp:{key}{{"):
                vals[key] = int(float(line.split()[-1]))
    return vals.get("requests_processing", 0), vals.get("requests_deferred", 0)


# -- the guard -----------------------------------------------------------------------


@pytest.mark.parametrize("host", ["evil.com", "evil.com:11435", "127.0.0.1.evil.com", "localhost.evil.com"])
def test_foreign_host_header_is_403(server, host):
    r = httpx.get(server.url + "/api/tags", headers={"Host": host})
    assert r.status_code == 403


@pytest.mark.parametrize("host", ["localhost", "localhost:11435", "127.0.0.1", "127.0.0.1:8080", "[::1]", "[::1]:11435"])
def test_loopback_host_header_is_ok(server, host):
    assert httpx.get(server.url + "/api/version", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1", "vscode-webview://abc123"])
def test_cors_allows_local_origins(server, origin):
    r = httpx.get(server.url + "/api/version", headers={"Origin": origin})
    assert r.headers.get("access-control-allow-origin") == origin
    pre = httpx.options(server.url + "/v1/chat/completions",
                        headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["https://evil.com", "http://localhost.evil.com", "null"])
def test_cors_refuses_other_origins(server, origin):
    r = httpx.get(server.url + "/api/version", headers={"Origin": origin})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(server.url + "/v1/chat/completions",
                        headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    # a "simple" request a page may send without a preflight must not run either
    simple = httpx.post(server.url + "/completion", content=b'{"prompt": "hi", "n_predict": 1}',
                        headers={"Origin": origin, "Content-Type": "text/plain"})
    assert simple.status_code == 403
    assert busy(server) == (0, 0)


def test_api_key(keyed):
    body = {"prompt": "Hi", "n_predict": 1}
    assert httpx.post(keyed.url + "/completion", json=body).status_code == 401
    wrong = httpx.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    ok = httpx.post(keyed.url + "/completion", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
    assert ok.status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200  # load balancers probe without a key


# -- bad requests ----------------------------------------------------------------------


def test_oversized_body_is_413(server):
    r = httpx.post(server.url + "/completion", json={"prompt": "x" * 300_000})
    assert r.status_code == 413


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", b"{not json", "JSON"),
        ("/api/chat", b"[1, 2]", "object"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_k": 1.5}, "top_k"),
        ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"top_p": "x"}}, "options.top_p"),
        ("/api/generate", {"model": MODEL, "prompt": "hi", "format": 7}, "format"),
        ("/completion", {"prompt": "hi", "stop": [1, 2]}, "stop"),
        ("/completion", {"prompt": "hi", "grammar": "root ::= ("}, "GBNF"),
        ("/completion", {"prompt": "hi", "logit_bias": [[1]]}, "logit_bias"),
        ("/tokenize", {"content": 3}, "content"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "keep_alive": "soon"}, "keep_alive"),
        ("/completion", b'{"prompt": "\\ud800"}', "surrogate"),
        ("/completion", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nests"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(server, path, body, field):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    assert field in r.text


def test_prompt_longer_than_context_is_400_before_streaming(server):
    body = {"messages": [{"role": "user", "content": LONG * 2}], "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert r.headers["content-type"].startswith("application/json")


def test_max_tokens_beyond_context_is_capped(keyed):
    auth = {"Authorization": "Bearer s3cret"}
    prompt = httpx.post(keyed.url + "/tokenize", json={"content": LONG[:800]}, headers=auth).json()["tokens"]
    body = {"prompt": prompt, "n_predict": 100_000, "ignore_eos": True, "temperature": 0}
    r = httpx.post(keyed.url + "/completion", json=body, headers=auth, timeout=300)
    assert r.status_code == 200
    out = r.json()
    assert out["stop_type"] == "limit" and out["tokens_predicted"] == 256 - len(prompt)


# -- clients that go away --------------------------------------------------------------


def raw_stream(server, path: str, body: dict) -> socket.socket:
    """Send a request on a bare socket and return it, so the test can hang up mid-answer."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return s


def test_disconnect_during_decode_frees_the_slot(server):
    s = raw_stream(server, "/completion", {"prompt": "Count:", "n_predict": 1500, "ignore_eos": True, "stream": True})
    s.recv(4096)  # the first streamed bytes: decoding has begun
    assert busy(server)[0] == 1
    s.close()
    assert wait_until(lambda: busy(server) == (0, 0), 0.5) < 0.5


def test_disconnect_during_prefill_frees_the_slot(server):
    s = raw_stream(server, "/completion", {"prompt": LONG, "n_predict": 50, "stream": False})
    wait_until(lambda: busy(server)[0] == 1, 5)
    s.close()  # while the ~1.5k-token prompt is still being read
    assert wait_until(lambda: busy(server) == (0, 0), 0.5) < 0.5


def test_disconnect_while_queued_and_full_queue(server):
    hog = {"prompt": "Count:", "n_predict": 1500, "ignore_eos": True, "stream": True}
    hogs = [raw_stream(server, "/completion", hog) for _ in range(2)]  # both slots
    wait_until(lambda: busy(server)[0] == 2, 10)
    waiting = [raw_stream(server, "/completion", hog) for _ in range(2)]  # the whole queue
    wait_until(lambda: busy(server) == (2, 2), 5)
    r = httpx.post(server.url + "/completion", json={"prompt": "hi", "n_predict": 1}, timeout=30)
    assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
    for s in waiting:
        s.close()
    assert wait_until(lambda: busy(server)[1] == 0, 0.5) < 0.5
    for s in hogs:
        s.close()
    wait_until(lambda: busy(server) == (0, 0), 0.5)


def test_a_refused_request_never_runs(server):
    for _ in range(3):  # more than the slots: a leak would leave them busy
        r = httpx.post(server.url + "/completion", json={"prompt": "Tell a story", "stream": "yes"}, timeout=30)
        assert r.status_code == 400 and "stream" in r.text
    assert busy(server) == (0, 0)


def test_server_survives_a_flood_of_bad_requests(server):
    def bad():
        for _ in range(20):
            httpx.post(server.url + "/v1/chat/completions", content=b"\x00\xff", timeout=30)

    threads = [threading.Thread(target=bad) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=60)
    assert r.status_code == 200
