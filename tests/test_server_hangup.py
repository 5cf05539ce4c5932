"""A client that hangs up mid-decode leaves the other client's text exactly as it was.

README (Server): "a client that hangs up (queued, reading its prompt, or decoding) frees
its slot at the next step, and interrupts only a decode that holds its request". Two
requests decoding together share every step, so a hang-up interrupts the decode that
holds the other request too (scheduler.cancel -> backend.interrupt); the engine must
then throw that step away and run it again, and the other stream must not notice.

Each test runs against a real `localrun serve` process with SmolLM2: a survivor streams
a greedy answer (temperature 0, `lookup: false`, so no prompt-lookup drafts change the
shape of a step) while other clients join its steps and hang up mid-decode. The
survivor's text must be exactly its text when streamed alone. That comparison crosses a
change of batch shape (1 row alone, 2 rows shared); on llama.cpp's CPU kernels each row
of a step is computed on its own, so greedy text does not depend on it, and the attack
tests (test_server_attacks.py) rely on the same fact for their victim. Had it not held,
the reference would have to be the same concurrency shape without the hang-up.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from serving import Server

SURVIVOR = {"prompt": "Write a long story about a lighthouse keeper and the sea.", "n_predict": 240,
            "temperature": 0, "ignore_eos": True, "stream": True, "lookup": False}
HANGER = {"prompt": "Count from one to a thousand:", "n_predict": 1000, "temperature": 0, "ignore_eos": True,
          "lookup": False}
WAIT_S = 120.0  # only so that a broken server cannot hang the test; never an assertion on speed
BROKEN = ("Traceback", "Exception in ASGI", "ERROR")


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "1024", "--parallel", "2", "--threads", "1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alone(server) -> str:
    """The survivor's text with nobody else on the server."""
    out = Survivor(server)
    out.start()
    out.finish()
    return out.text


class Survivor:
    """The survivor's stream, read in a thread; `events` grows as its tokens arrive."""

    def __init__(self, server) -> None:
        self.server = server
        self.events: list[dict] = []
        self.error: dict | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        self.thread.start()
        assert self.started.wait(WAIT_S), "the survivor never started streaming"

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.server.url + "/completion", json=SURVIVOR, timeout=WAIT_S) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        self.error = msg["error"]
                        break
                    self.events.append(msg)
                    if len(self.events) >= 3:
                        self.started.set()
        finally:
            self.started.set()

    def finish(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the survivor's stream never ended"
        assert self.error is None, self.error
        assert self.events and self.events[-1].get("stop") is True, \
            f"the survivor's stream was cut after {len(self.events)} tokens, with no last event"
        assert self.events[-1].get("tokens_predicted") == SURVIVOR["n_predict"], self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.get("content", "") for e in self.events)


def send(server, body: dict) -> socket.socket:
    """POST /completion on a bare socket, so the test can hang up at a moment it chooses."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    s.sendall(f"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def log_from(server, offset: int) -> str:
    server.log.flush()
    with open(server.log.name) as f:
        return f.read()[offset:]


def log_size(server) -> int:
    return len(log_from(server, 0))


def wait_until(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def slots(server) -> list[dict]:
    return httpx.get(server.url + "/slots", timeout=30).json()


def idle(server) -> bool:
    return not any(s["is_processing"] for s in slots(server))


def assert_healthy(server, before: int) -> None:
    """The server runs, answers, has freed every slot, and logged no error."""
    assert server.proc.poll() is None, log_from(server, before)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    wait_until(lambda: idle(server), "every slot free again")
    r = httpx.post(server.url + "/completion", json={"prompt": "Hello", "n_predict": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4, r.text
    new = log_from(server, before)
    assert not any(word in new for word in BROKEN), new


def test_a_stream_that_hangs_up_mid_decode_leaves_the_other_stream_exact(server, alone):
    before = log_size(server)
    survivor = Survivor(server)
    survivor.start()
    at_hangup = []
    for n_tokens in (8, 16, 24):  # three hang-ups, each while both streams are decoding
        s = send(server, dict(HANGER, stream=True))
        got = b""
        while got.count(b"data: ") < n_tokens:
            chunk = s.recv(65536)
            assert chunk, f"the hanging-up stream ended by itself: {got[-300:]!r}"
            got += chunk
        at_hangup.append(len(survivor.events))
        s.close()
        wait_until(lambda: sum(x["is_processing"] for x in slots(server)) == 1 or idle(server),
                   "the hung-up stream's slot freed")
    survivor.finish()
    # both hang-ups came while the survivor was decoding (not before it began, not after it ended)
    assert all(3 <= n < SURVIVOR["n_predict"] for n in at_hangup), (at_hangup, len(survivor.events))
    assert survivor.text == alone, "the survivor's text changed when the other stream hung up"
    assert_healthy(server, before)


def test_a_request_that_hangs_up_mid_decode_is_one_log_line_and_the_stream_is_exact(server, alone):
    """A non-streamed request's hang-up is noticed by its handler, which logs one line."""
    before = log_size(server)
    survivor = Survivor(server)
    survivor.start()
    s = send(server, HANGER)
    # both slots decoding, the hanger past its first tokens: its decode is the survivor's too
    wait_until(lambda: (lambda xs: len(xs) == 2 and min(x["n_decoded"] for x in xs) >= 8)(
        [x for x in slots(server) if x["is_processing"]]), "both requests decoding")
    at_hangup = len(survivor.events)
    s.close()
    line = "POST /completion: the client hung up before its answer was ready; its generation was cancelled"
    wait_until(lambda: line in log_from(server, before), "the hang-up's log line")
    survivor.finish()
    assert 3 <= at_hangup < SURVIVOR["n_predict"], at_hangup
    assert survivor.text == alone, "the survivor's text changed when the other request hung up"
    assert_healthy(server, before)
    assert log_from(server, before).count("hung up") == 1, log_from(server, before)
