"""`localrun serve --rpc`: the model is hosted in a child process (RemoteBackend), so a
worker that dies or hangs fails only the answers in flight, with one line that names it,
and the server goes on; --rpc-timeout and LOCALRUN_RPC_CALL_TIMEOUT_S bound each call.
Real `localrun rpc-worker` processes on loopback ports, as in test_rpc.py."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from rpc_workers import (
    GREEDY, PROMPT, FakeServer, WorkerProcess, error_lines, free_port, localrun, needs_rpc, worker_pair)

from localrun.cluster import rpc


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    yield from worker_pair(tmp_path_factory)


# -- a lost host process, and the bound on each call ----------------------------------


def test_a_lost_host_process_names_the_worker_that_is_gone_and_what_to_do(monkeypatch):
    from localrun.backends.remote import CALL_TIMEOUT_S, accepts, call_timeout_default, lost_message
    from localrun.errors import ModelLoadError

    gone = f"127.0.0.1:{free_port()}"
    alive = FakeServer(lambda c: None)
    try:
        assert accepts(str(alive.endpoint)) and not accepts(gone)
    finally:
        alive.close()
    line = lost_message("ended with exit code 3 during decode", [gone, str(alive.endpoint)], [gone])
    assert line.startswith(f"lost the RPC worker at {gone} (the process running the model ended with exit code 3")
    assert f"restart `localrun rpc-worker` on {gone}" in line and str(alive.endpoint) not in line
    hung = lost_message("gave no answer within 120 s during decode and was stopped", ["a:1", "b:2"], [])
    assert "every worker (a:1, b:2) still accepts connections" in hung and "restart the one that hangs" in hung

    monkeypatch.delenv("LOCALRUN_RPC_CALL_TIMEOUT_S", raising=False)
    assert call_timeout_default() == CALL_TIMEOUT_S
    monkeypatch.setenv("LOCALRUN_RPC_CALL_TIMEOUT_S", "2.5")
    assert call_timeout_default() == 2.5
    monkeypatch.setenv("LOCALRUN_RPC_CALL_TIMEOUT_S", "inf")
    assert call_timeout_default() is None  # no bound
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv("LOCALRUN_RPC_CALL_TIMEOUT_S", bad)
        with pytest.raises(ModelLoadError, match="LOCALRUN_RPC_CALL_TIMEOUT_S must be a number of seconds"):
            call_timeout_default()


def test_rpc_timeout_flag_wins_over_the_environment(monkeypatch):
    from localrun.backends import remote

    monkeypatch.setattr(remote, "_call_timeout_flag", None)  # whatever another test set
    monkeypatch.setenv("LOCALRUN_RPC_CALL_TIMEOUT_S", "7")
    remote.set_call_timeout(4.0)
    assert remote.call_timeout_default() == 4.0
    remote.set_call_timeout(float("inf"))
    assert remote.call_timeout_default() is None  # no bound
    remote.set_call_timeout(None)
    assert remote.call_timeout_default() == 7.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="above 0 seconds"):
            remote.set_call_timeout(bad)
    assert remote.parse_call_timeout("1e400") == float("inf") and remote.parse_call_timeout("0.5") == 0.5


def test_serve_parses_rpc_timeout():
    from localrun.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--rpc", "127.0.0.1:1", "--rpc-timeout", "30"]).rpc_timeout == 30.0
    assert parser.parse_args(["serve", "--rpc", "127.0.0.1:1", "--rpc-timeout", "inf"]).rpc_timeout == float("inf")
    assert parser.parse_args(["serve"]).rpc_timeout is None  # remote.py's default (120 s) then holds


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "-inf"])
def test_a_bad_rpc_timeout_is_one_error_line(value):
    res = localrun("serve", "--rpc", "127.0.0.1:1", f"--rpc-timeout={value}", timeout=60)  # = lets "-inf" in
    assert res.returncode == 2, res.stderr
    errors = [line for line in error_lines(res.stderr) if "error:" in line]
    assert errors == [f"localrun serve: error: argument --rpc-timeout: must be a number of seconds above 0,"
                      f" or inf to wait as long as a call takes; got {value!r}"], res.stderr


def test_rpc_timeout_without_workers_is_refused():
    res = localrun("serve", "--rpc-timeout", "30", "--port", str(free_port()), timeout=60)
    assert res.returncode == 1, res.stderr
    assert error_lines(res.stderr) == ["error: --rpc-timeout bounds calls to --rpc workers: add --rpc HOST:PORT,"
                                       " or drop it"]



# -- serve: the model in a child process, so a dead worker fails only its answers ------------


@needs_rpc
def test_serve_answers_over_workers(workers, smollm2_gguf):
    sys.path.insert(0, str(Path(__file__).parent))
    import httpx
    from serving import Server

    # lookup off on both sides, as in _chat; one thread on both (GREEDY's --threads 1): flash
    # attention is chosen per thread count, and each setting answers a little differently
    local = localrun("run", str(smollm2_gguf), PROMPT, *GREEDY)
    server = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "1", "--threads", "1",
                    "--rpc", ",".join(w.endpoint for w in workers), "--tensor-split", "1,1,1")
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24, "lookup": False})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == local.stdout.rstrip("\n")
        assert "over RPC workers: this machine:" in server.output()
    finally:
        server.stop()



def _exercise(backend) -> dict:
    """The same calls, as the engine makes them, on a fresh backend; what each answered."""
    from localrun.backends.base import BatchEntry

    out = {"tokens": backend.tokenize(PROMPT, add_special=True), "vocab": [backend.token_bytes(t) for t in
           range(backend.n_vocab)], "control": [t for t in range(backend.n_vocab) if backend.is_control(t)],
           "eos_text": backend.token_text(backend.info.eos_id)}
    a, b = out["tokens"], backend.tokenize("Count to five:", add_special=True)
    rows = backend.decode([BatchEntry(0, a, 0, 1), BatchEntry(1, b, 0, 3)])  # two sequences, 1 and 3 rows
    out["prompt_rows"] = [np.array(r) for r in rows]
    nxt = [int(out["prompt_rows"][0][-1].argmax())], [int(out["prompt_rows"][1][-1].argmax())]
    rows = backend.decode([BatchEntry(1, nxt[1], len(b), 1), BatchEntry(0, nxt[0], len(a), 1)])
    out["step_rows"] = [np.array(r) for r in rows]
    backend.kv_trim(1, len(b) - 2)
    backend.kv_copy(0, 1, len(a) - 1)
    out["kv"] = [list(backend.kv_tokens(s)) for s in (0, 1)]
    out["kv_bytes"] = backend.kv_state_bytes(1)
    backend.kv_clear(0)
    out["cleared"] = list(backend.kv_tokens(0))
    out["embedding"] = np.array(backend.embed(a))
    return out


@needs_rpc
@pytest.mark.parametrize("shared_rows", [66, 2])
def test_the_model_in_a_child_process_answers_as_in_process(workers, smollm2_gguf, shared_rows, monkeypatch):
    """RemoteBackend against LlamaCppBackend over the same two workers: the same tokens,
    vocabulary, bit-identical logits rows of a two-sequence batch, the same KV ledger; it
    keeps the whole Backend contract; interrupt() stops its decode across the process
    boundary; close() ends the child. With a shared block of 2 rows, the 4 rows of the
    prompt's decode come through the pipe and the later 2 through the block."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_backend_contract import contract_gaps

    from localrun.backends import remote
    from localrun.backends.base import Backend, BatchEntry, DecodeInterrupted
    from localrun.backends.llamacpp import LlamaCppBackend
    from localrun.backends.remote import RemoteBackend

    monkeypatch.setattr(remote, "SHARED_ROWS_BYTES", shared_rows * 4 * 49152)  # SmolLM2's vocabulary

    cluster = rpc.connect([rpc.Endpoint("127.0.0.1", w.port) for w in workers], (1.0, 1.0, 1.0))
    options = dict(n_ctx=256, n_seq=2, n_batch=64, threads=1, cluster=cluster)
    local = LlamaCppBackend(str(smollm2_gguf), **options)  # a worker serves one client: one after the other
    try:
        want = _exercise(local)
    finally:
        local.close()
    hosted = RemoteBackend(str(smollm2_gguf), **options)
    try:
        assert hosted._shared.shape == (shared_rows, 49152)
        assert contract_gaps(hosted) == [] and isinstance(hosted, Backend)
        assert hosted.info == local.info and hosted.placement.describe() == local.placement.describe()
        got = _exercise(hosted)
        for key in ("tokens", "vocab", "control", "eos_text", "kv", "kv_bytes", "cleared"):
            assert got[key] == want[key], key
        for key in ("prompt_rows", "step_rows"):
            assert [r.shape for r in got[key]] == [r.shape for r in want[key]]
            for g, w in zip(got[key], want[key]):
                np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(got["embedding"], want["embedding"], rtol=1e-5, atol=1e-6)

        held = list(hosted.kv_tokens(1))
        hosted.interrupt()  # before the decode: "the decode in flight, or the next one"
        with pytest.raises(DecodeInterrupted):
            hosted.decode([BatchEntry(1, got["tokens"], len(held), 1)])
        assert list(hosted.kv_tokens(1)) == held
        hosted.interrupt()
        hosted.clear_interrupt()  # withdrawn: the next decode runs
        assert hosted.decode([BatchEntry(1, [1], len(held), 1)])[0].shape == (1, hosted.n_vocab)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            hosted.token_bytes(hosted.n_vocab)
        pid = hosted._proc.pid
    finally:
        hosted.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child has exited and been reaped


def _stream_until_error(url: str, on_tokens, n_before: int = 4, timeout: float = 120) -> tuple[str, list[dict]]:
    """Stream a long llama-server /completion; call on_tokens() once n_before pieces came.
    Returns (text received, error events). httpx's read timeout fails a stream that hangs."""
    import json

    import httpx

    text, errors, pieces = "", [], 0
    body = {"prompt": "Once upon a time", "n_predict": 4000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/completion", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            text += event.get("content", "")
            pieces += 1
            if pieces == n_before:
                on_tokens()
    return text, errors


def _chat(url: str, timeout: float = 120):
    """Greedy, lookup off as in GREEDY: what is compared is the split over workers, and a wide
    step's rows may drift from a one-row step's, so lookup on could part a greedy text."""
    import httpx

    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24, "lookup": False})


@needs_rpc
def test_serve_survives_a_worker_killed_mid_answer(tmp_path, smollm2_gguf):
    """SIGKILL one worker while a client streams: that stream ends with an error event that
    names the worker, as does a request queued behind it (503), the server keeps answering,
    a request while the worker is down gets
    a one-line 503, and once the worker is back on its port the next request reloads the
    model and answers as a local run does."""
    sys.path.insert(0, str(Path(__file__).parent))
    import httpx
    from serving import Server

    doomed, other = WorkerProcess(tmp_path), WorkerProcess(tmp_path)
    server = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "1", "--threads", "1",
                    "--rpc", f"{doomed.endpoint},{other.endpoint}", "--tensor-split", "1,1,1")
    try:
        queued = []  # a second request, waiting for the one slot when the worker dies
        waiting = threading.Thread(target=lambda: queued.append(_chat(server.url)))

        def kill_worker():
            waiting.start()
            time.sleep(1.0)
            doomed.proc.kill()
            doomed.proc.wait()

        text, errors = _stream_until_error(server.url, kill_worker)
        assert text, "the stream never started"
        assert len(errors) == 1, errors
        waiting.join(60)
        assert queued and queued[0].status_code == 503, queued
        assert f"lost the RPC worker at {doomed.endpoint}" in queued[0].text
        assert f"lost the RPC worker at {doomed.endpoint}" in errors[0]["message"], errors
        assert f"restart `localrun rpc-worker` on {doomed.endpoint}" in errors[0]["message"]
        assert server.proc.poll() is None, server.output()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200

        down = _chat(server.url)  # the reload finds the worker gone: one line, no abort
        assert down.status_code == 503, down.text
        assert f"127.0.0.1:{doomed.port} refused the connection" in down.text
        assert server.proc.poll() is None, server.output()

        back = WorkerProcess.on_port(tmp_path, doomed.port)
        try:
            local = localrun("run", str(smollm2_gguf), PROMPT, *GREEDY)
            again = _chat(server.url)
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["message"]["content"] == local.stdout.rstrip("\n")
        finally:
            back.stop()
        assert "Aborted" not in server.output() and "core dumped" not in server.output()
    finally:
        server.stop()
        doomed.stop()
        other.stop()


@needs_rpc
def test_serve_gives_up_on_a_worker_that_hangs(tmp_path, smollm2_gguf):
    """A worker that stops answering without closing its socket (SIGSTOP: a machine that
    vanished) would hold a decode forever; after --rpc-timeout seconds the answer
    ends with an error and the server goes on; once the worker runs again, so does the model."""
    sys.path.insert(0, str(Path(__file__).parent))
    import httpx
    from serving import Server

    stuck, other = WorkerProcess(tmp_path), WorkerProcess(tmp_path)
    server = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "1", "--threads", "1",
                    "--rpc", f"{stuck.endpoint},{other.endpoint}", "--tensor-split", "1,1,1",
                    "--rpc-timeout", "4")
    try:
        health_while_stuck = []

        def stop_worker():
            stuck.proc.send_signal(signal.SIGSTOP)
            time.sleep(0.5)  # the decode in flight now waits on the stopped worker
            health_while_stuck.append(httpx.get(server.url + "/health", timeout=2).status_code)

        t0 = time.monotonic()
        text, errors = _stream_until_error(server.url, stop_worker)
        assert time.monotonic() - t0 < 60 and health_while_stuck == [200]
        assert text and len(errors) == 1, errors
        assert "gave no answer within 4 s" in errors[0]["message"], errors
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        stuck.proc.send_signal(signal.SIGCONT)  # its old client is gone: it serves the next one
        again = _chat(server.url)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"]
    finally:
        stuck.proc.send_signal(signal.SIGCONT)
        server.stop()
        stuck.stop()
        other.stop()
