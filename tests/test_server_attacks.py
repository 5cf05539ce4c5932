"""One request must never freeze, crash or starve the server.

Each hostile request runs against a real `localrun serve` process WHILE a victim client
streams a greedy answer from the same model: the attack gets its 4xx (or a bounded
answer) within a few seconds, `/health` answers within a second throughout, the victim's
text equals its text without the attack, and the server's memory grows by less than
1 GiB. Then SIGTERM or Ctrl+C in the middle of an attack ends every generation, unloads
the model and exits cleanly, and a step the stop cannot interrupt is ended by the watchdog.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from serving import Server, make_template_copy

MODEL = "smollm2-135m-instruct-q4_1"
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"  # a template with tools, for the tool-schema attacks
BOMB = "template-bomb"
ATTACK_WAIT_S = 10.0  # generous for a loaded 2-core CI machine; the bug took minutes
HEALTH_WAIT_S = 1.0
MEMORY_GROWTH_BYTES = 1 << 30  # issue 49's attacks grew the server by 5.8-13.6 GiB
VICTIM = {"prompt": "Write a long story about a lighthouse keeper and the sea.", "n_predict": 160,
          "temperature": 0, "ignore_eos": True, "stream": True, "lookup": False}
# the victim on Qwen, shorter: it decodes ~4x slower than SmolLM2 on one thread
QWEN_VICTIM = dict(VICTIM, model=QWEN, n_predict=48)


@pytest.fixture(scope="module")
def bomb_model(smollm2_gguf, tmp_path_factory):
    """SmolLM2 under a chat template that would loop 10^10 times."""
    template = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    return make_template_copy(smollm2_gguf, tmp_path_factory.mktemp("bomb") / f"{BOMB}.gguf", template)


@pytest.fixture(scope="module")
def server(smollm2_gguf, bomb_model, qwen_coder_gguf):
    srv = Server("--model", str(smollm2_gguf), "--model", str(bomb_model), "--model", str(qwen_coder_gguf),
                 "--ctx", "1024", "--parallel", "2", "--threads", "1")
    yield srv
    srv.stop()


def stream_victim(url: str, out: dict, started: threading.Event, victim: dict = VICTIM) -> None:
    parts = []
    with httpx.stream("POST", url + "/completion", json=victim, timeout=120) as r:
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


@pytest.fixture(scope="module")
def qwen_baseline(server) -> str:
    out: dict = {}
    stream_victim(server.url, out, threading.Event(), QWEN_VICTIM)
    assert "error" not in out and out["text"]
    return out["text"]


def rss(server) -> int:
    """The server process's resident memory, in bytes."""
    return psutil.Process(server.proc.pid).memory_info().rss


def under_attack(server, baseline: str, attack, victim_body: dict = VICTIM) -> httpx.Response:
    """Run attack() while the victim streams; check the victim, /health and the server's
    memory (sampled with /health: its peak, not only its end), return the attack's response."""
    out: dict = {}
    started = threading.Event()
    rss_before = rss(server)
    victim = threading.Thread(target=stream_victim, args=(server.url, out, started, victim_body))
    victim.start()
    assert started.wait(60), "the victim never started streaming"
    health: list[float] = []
    peak = [rss_before]
    stop_polling = threading.Event()

    def poll() -> None:
        while not stop_polling.is_set():
            t0 = time.monotonic()
            httpx.get(server.url + "/health", timeout=30)
            health.append(time.monotonic() - t0)
            peak.append(rss(server))
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
    peak.append(rss(server))
    assert elapsed < ATTACK_WAIT_S, f"the attack took {elapsed:.1f} s"
    assert health and max(health) < HEALTH_WAIT_S, f"/health took up to {max(health):.2f} s"
    growth = max(peak) - rss_before
    assert growth < MEMORY_GROWTH_BYTES, f"the server grew by {growth / 2**20:.0f} MiB under the attack"
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


# -- issue 49: the grammar engine, response sizes, cross-site requests ---------------------

# A 4 KB ambiguous Lark grammar: it compiles at once and its mask allows "a", but after
# ~44 of them llguidance's parser exceeds 2,000 items per row in consume_token. SmolLM2's
# "a" (id 81) is pushed up so greedy decoding walks there rather than to EOS.
AMBIGUOUS = "%llguidance {}\nstart: s0\n" + "\n".join(f's{i}: s{i} s{i + 1} | "a"' for i in range(200)) + '\ns200: "a"'
AMBIGUOUS_BODY = {"prompt": "a a a a", "n_predict": 120, "temperature": 0, "ignore_eos": True, "lookup": False,
                  "grammar": AMBIGUOUS, "logit_bias": [[81, 30.0]]}
TOKENIZE_TEXT = ("The quick brown fox jumps over the lazy dog 12345. " * 150_000)[:7_500_000]
# what an <img src=http://127.0.0.1:PORT/props> on another site sends: no Origin
CROSS_SITE_IMG = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"}

ATTACKS.update({
    "an ambiguous grammar that trips llguidance's parser": post("/completion", AMBIGUOUS_BODY),
    "/tokenize of 7.5 MB with pieces": post("/tokenize", {"content": TOKENIZE_TEXT, "with_pieces": True}),
    "/detokenize of 1,000,000 ids": post("/detokenize", {"tokens": [81] * 1_000_000}),
    "/api/embed of a 7.5 MB text": post("/api/embed", {"model": MODEL, "input": TOKENIZE_TEXT}),
    "a cross-site <img> GET of /props": lambda url: httpx.get(url + "/props", headers=CROSS_SITE_IMG, timeout=60),
    "a cross-site <form> POST of /completion": lambda url: httpx.post(
        url + "/completion", content=json.dumps({"prompt": "hi", "n_predict": 4}),
        headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Content-Type": "text/plain"},
        timeout=60),
})

# Answered with a 4xx or a bounded 200: what llguidance is allowed to do is localrun's
# (part A of issue 49: localrun's options win over a grammar's own `%llguidance` line).
BOUNDED_ATTACKS = {
    "a grammar that turns llguidance's forcing back on": (post("/completion", {
        "prompt": "hi", "n_predict": 4, "grammar": '%llguidance {"no_forcing": false}\nstart: R{10000}\nR: /[a]{10000}/'}),
        MODEL),
    "a tool of 10,000 items matching ^a{10000}$, a call required": (post("/v1/chat/completions", {
        "model": QWEN, "max_tokens": 8, "messages": [{"role": "user", "content": "call f"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "required": ["x"], "properties": {"x": {
                "type": "array", "minItems": 10000, "maxItems": 10000,
                "items": {"type": "string", "pattern": "^a{10000}$"}}}}}}]}), QWEN),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_refused_while_a_victim_streams(server, baseline, name):
    resp = under_attack(server, baseline, ATTACKS[name])
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    assert "Traceback" not in resp.text


@pytest.mark.parametrize("name", list(BOUNDED_ATTACKS))
def test_attack_is_refused_or_answered_briefly_while_a_victim_streams(server, baseline, qwen_baseline, name):
    attack, model = BOUNDED_ATTACKS[name]
    resp = (under_attack(server, baseline, attack) if model == MODEL
            else under_attack(server, qwen_baseline, attack, QWEN_VICTIM))
    assert resp.status_code < 500 and len(resp.content) < 100_000, (resp.status_code, resp.text[:300])
    assert "Traceback" not in resp.text


def test_a_grammar_whose_parser_gives_up_ends_only_its_own_stream(server, baseline):
    """The ambiguous grammar, streamed: its client gets an in-band error naming the
    parser's limit; the victim in the same steps streams its usual text."""

    def attack(url):
        with httpx.stream("POST", url + "/completion", json=dict(AMBIGUOUS_BODY, stream=True), timeout=60) as r:
            return r.status_code, [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]

    status, messages = under_attack(server, baseline, attack)
    errors = [m["error"] for m in messages if "error" in m]
    if status == 200 and errors:  # refused mid-stream: the error says what, as a 400 would
        assert errors[0]["code"] == 400 and "the grammar's parser hit its limit" in errors[0]["message"], errors
        assert "".join(m.get("content", "") for m in messages).strip("a") == ""
    else:  # refused before streaming (a grammar compiled with a tighter budget): a 4xx
        assert 400 <= status < 500, (status, messages[:2])


def test_tokenize_and_detokenize_take_at_most_the_context(server):
    """/tokenize and /detokenize answer up to the model's context length (1024 here) and
    refuse more with a 400 naming the field."""
    ok = httpx.post(server.url + "/tokenize", json={"content": "hi " * 900, "with_pieces": True}, timeout=30)
    assert ok.status_code == 200 and 900 <= len(ok.json()["tokens"]) <= 1024
    over = httpx.post(server.url + "/tokenize", json={"content": "hi " * 1100}, timeout=30)
    assert over.status_code == 400 and "'content' holds 1,10" in over.json()["error"]["message"], over.text
    big = httpx.post(server.url + "/tokenize", json={"content": "x" * 200_000}, timeout=30)
    assert big.status_code == 400 and "'content' is 200,000 bytes" in big.json()["error"]["message"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": [81] * 1024}, timeout=30)
    assert back.status_code == 200 and back.json()["content"] == "a" * 1024
    over = httpx.post(server.url + "/detokenize", json={"tokens": [81] * 1025}, timeout=30)
    assert over.status_code == 400 and "'tokens' holds 1,025 ids" in over.json()["error"]["message"]


def test_a_page_from_another_site_is_refused_but_scripts_and_local_pages_are_not(server):
    """A browser's simple request from another page (no Origin, Sec-Fetch-Site cross-site
    or same-site) gets 403 on every route; an allowed page's fetch (with its Origin), a
    typed URL (Sec-Fetch-Site none) and a script (no Sec-Fetch-*) are answered."""
    for site in ("cross-site", "same-site"):
        for method, path in (("GET", "/props"), ("GET", "/health"), ("POST", "/api/show")):
            r = httpx.request(method, server.url + path, headers={"Sec-Fetch-Site": site}, timeout=30)
            assert r.status_code == 403 and site in r.text, (method, path, r.status_code)
    local_page = {"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:3000"}
    assert httpx.get(server.url + "/props", headers=local_page, timeout=60).status_code == 200
    assert httpx.get(server.url + "/props", headers={"Sec-Fetch-Site": "none"}, timeout=60).status_code == 200
    assert httpx.get(server.url + "/props", timeout=60).status_code == 200


def test_a_client_that_hangs_up_is_one_log_line(server):
    """A non-streamed request whose client goes away: one line in the log, no traceback,
    and the server goes on answering."""
    with open(server.log.name) as f:
        before = len(f.read())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/completion", json={"prompt": "Tell me a story.", "n_predict": 400,
                                                     "ignore_eos": True}, timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(server.log.name) as f:
            new = f.read()[before:]
        if "hung up" in new:
            break
        time.sleep(0.1)
    assert "hung up" in new, new
    assert "Traceback" not in new and "Exception in ASGI" not in new, new
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


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


# -- stopping: SIGTERM / Ctrl+C mid-attack, and the watchdog ---------------------------------

# How `localrun serve` ends (localrun/server/shutdown.py, command.py): at SIGTERM or SIGINT
# every model's scheduler fails its jobs (their streams end at once with a 503 saying the
# model was unloaded), the lifespan unloads each model ("unloaded NAME"), and the process
# exits 0 (BoundedServer does not raise the handled signal again). The watchdog's forced
# exit, SHUTDOWN_BOUND_S after the signal, is os._exit(1), so a test can tell a clean stop
# from a forced one.
CLEAN_EXIT = 0
WATCHDOG_EXIT = 1
WATCHDOG_LINE = "(a request's work did not end): exiting now"
STOP_WAIT_S = 60.0  # only so that a server that never stops cannot hang the test
LONG_PROMPT = {"prompt": "The quick brown fox jumps over the lazy dog. " * 80, "n_predict": 400, "ignore_eos": True}


def _processing(srv) -> int:
    return sum(s["is_processing"] for s in httpx.get(srv.url + "/slots", timeout=30).json())


def _wait_for(check, what: str, timeout: float = STOP_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_attack_ends_every_generation_and_unloads_the_model(smollm2_gguf, sig):
    """A victim streams and a long prompt is being read when the signal comes: both get a
    503 naming the unload, the model is unloaded, and the process ends cleanly (its
    signal's status, not the watchdog's)."""
    srv = Server("--model", str(smollm2_gguf), "--ctx", "1024", "--parallel", "2", "--threads", "1")
    try:
        out: dict = {}
        started = threading.Event()
        victim = threading.Thread(target=stream_victim, args=(srv.url, out, started), daemon=True)
        victim.start()
        assert started.wait(60)
        attack: dict = {}

        def read_a_long_prompt() -> None:
            try:
                attack["resp"] = httpx.post(srv.url + "/completion", json=LONG_PROMPT, timeout=STOP_WAIT_S)
            except httpx.HTTPError as exc:
                attack["error"] = exc

        attacker = threading.Thread(target=read_a_long_prompt, daemon=True)
        attacker.start()
        _wait_for(lambda: _processing(srv) == 2, "the long prompt admitted beside the victim")
        srv.proc.send_signal(sig)
        rc = srv.proc.wait(timeout=STOP_WAIT_S)
        victim.join(STOP_WAIT_S)
        attacker.join(STOP_WAIT_S)
        log = srv.output()
        assert rc == CLEAN_EXIT, f"exit status {rc}:\n{log}"
        assert f"{sig.name} received: ending every generation and unloading models" in log, log
        assert f"unloaded {MODEL}" in log, log
        assert WATCHDOG_LINE not in log and "Traceback" not in log, log
        # every generation was ended by the stop, each with an error that says so
        assert out.get("error", {}).get("code") == 503 and "unloaded" in out["error"]["message"], out
        resp = attack.get("resp")
        assert resp is not None, attack
        assert resp.status_code == 503 and "unloaded" in resp.json()["error"]["message"], resp.text
    finally:
        srv.stop()


EMBED_TEXT = "The quick brown fox jumps over the lazy dog. " * 200  # 2,001 SmolLM2 tokens


def test_the_watchdog_ends_a_stop_that_a_stuck_step_holds_up(smollm2_gguf):
    """A step the stop cannot interrupt holds the shutdown up; the watchdog ends the
    process with its own status, and the model is never reported unloaded.

    The stuck step is a real one, no test hook: an embedding runs on the model's scheduler
    thread as one llama_decode of a context of its own (LlamaCppBackend.embed), which has
    no abort callback, and request_stop interrupts only a generation step. A text of
    ~2,000 tokens keeps SmolLM2 on one thread busy for ~18 CPU-seconds on the test
    machine, far beyond the 4 s bound. If embeddings ever become interruptible (or a
    CPU runs this one within the bound), the stop is clean and this test fails with the
    SIGTERM status: it then needs another stuck step, or a test hook in the scheduler."""
    srv = Server("--model", str(smollm2_gguf), "--ctx", "2048", "--parallel", "1", "--threads", "1")
    try:
        proc = psutil.Process(srv.proc.pid)
        cpu_before = sum(proc.cpu_times()[:2])
        embed = threading.Thread(target=lambda: _quietly(post("/api/embed", {"model": MODEL, "input": EMBED_TEXT}),
                                                         srv.url), daemon=True)
        embed.start()
        # an idle server spends next to no CPU, and tokenizing the text takes milliseconds:
        # half a CPU-second spent means the scheduler thread is inside the embedding's decode
        _wait_for(lambda: sum(proc.cpu_times()[:2]) - cpu_before >= 0.5, "the embedding running")
        assert srv.proc.poll() is None
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(timeout=STOP_WAIT_S)
        log = srv.output()
        assert rc == WATCHDOG_EXIT, f"exit status {rc} (a clean stop: nothing held it up):\n{log}"
        assert "SIGTERM received: ending every generation and unloading models" in log, log
        assert WATCHDOG_LINE in log, log
        assert f"unloaded {MODEL}" not in log, log
    finally:
        srv.stop()


def _quietly(fn, url) -> None:
    try:
        fn(url)
    except httpx.HTTPError:
        return  # the server went away under it, which is what the test does


# -- --rpc: tokenizing in the model's child process has its own bound -----------------------


class _SlowTokenizer:
    """The child's side pipe, played by a thread: "slow" takes 1.5 s to tokenize, any
    other text is its bytes at once; calls are answered in order, as the child does."""

    def __init__(self, conn) -> None:
        self.conn = conn
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                op, args = self.conn.recv()
            except (EOFError, OSError):
                return
            if args[0] == "slow":
                time.sleep(1.5)
            self.conn.send(("ok", list(args[0].encode())))


def _remote_with_fake_child(monkeypatch):
    import multiprocessing as mp
    from types import SimpleNamespace

    from localrun.backends import remote

    monkeypatch.setattr(remote, "TOKENIZE_TIMEOUT_S", 0.5)
    backend = remote.RemoteBackend.__new__(remote.RemoteBackend)  # no child process: the pipe is played
    parent, child = mp.Pipe()
    never_ready, _keep = os.pipe()  # the child's sentinel: it never exits
    backend.call_timeout, backend.lost, backend._side_owed = 120.0, None, 0
    backend._side, backend._side_lock = parent, threading.Lock()
    backend._proc = SimpleNamespace(sentinel=never_ready)
    backend.info = SimpleNamespace(path="/models/big.gguf")
    backend.endpoints = ["127.0.0.1:50052"]
    return backend, _SlowTokenizer(child)


def test_a_slow_tokenize_over_rpc_fails_its_request_and_keeps_the_child(monkeypatch, caplog):
    from localrun.backends import remote
    from localrun.errors import BadRequestError

    backend, _child = _remote_with_fake_child(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(remote.SideCallTimeoutError) as err:
        backend.tokenize("slow")
    assert time.monotonic() - t0 < 1.2
    assert str(err.value) == "tokenizing a text of 4 bytes took over 0.5 s in the model's process; the model stays loaded"
    assert err.value.http_status == 503 and backend.lost is None  # the child was not given up on
    assert "tokenizing a text of 4 bytes took over 0.5 s" in caplog.text and "workers are not involved" in caplog.text
    # a call while the child still tokenizes it waits its own bound, then fails alone too
    with pytest.raises(remote.SideCallTimeoutError, match="still busy with an earlier tokenize"):
        backend.tokenize("hi")
    time.sleep(0.6)  # "slow" is done: the next call reads past its late answer and gets its own
    assert backend.tokenize("hi") == list(b"hi")
    assert backend._side_owed == 0
    # a text beyond the bound is refused before anything is sent
    with pytest.raises(BadRequestError, match="TOKENIZE_MAX_BYTES"):
        backend.tokenize("x" * (remote.TOKENIZE_MAX_BYTES + 1))
    assert backend.tokenize("ok") == list(b"ok")
