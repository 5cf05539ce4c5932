"""One model over several machines on llama.cpp's RPC layer: endpoint parsing, the probe
(against fake servers), the layer placement, and real `localrun rpc-worker` processes on
loopback ports serving SmolLM2 and Gemma-3 to `run`, `chat`, `serve` and `fit`."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from localrun import rpc
from localrun.errors import BadRequestError

PROMPT = "Name three colours."
GREEDY = ["--temperature", "0", "--max-tokens", "24", "--no-lookup", "--ctx", "512", "--threads", "1"]


def _has_rpc() -> bool:
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_rpc())
    except Exception:
        return False


needs_rpc = pytest.mark.skipif(
    not _has_rpc(),
    reason="llama-cpp-python was built without GGML_RPC; scripts/setup.sh builds it with RPC",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localrun(*args: str, env: dict | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localrun.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, **kw)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- endpoints and proportions ---------------------------------------------------------


def test_endpoints_parse_as_llama_cpp_reads_them():
    eps = rpc.parse_endpoints(" 192.168.1.20:50052, box.lan:6000 ")
    assert [str(e) for e in eps] == ["192.168.1.20:50052", "box.lan:6000"]


@pytest.mark.parametrize("text, words", [
    ("", "HOST:PORT"),
    ("10.0.0.1", "HOST:PORT"),
    ("10.0.0.1:0", "1-65535"),
    ("10.0.0.1:x", "HOST:PORT"),
    ("[::1]:50052", "IPv4 only"),
    ("fe80::1:50052", "IPv4 only"),
    ("a:1,a:1", "twice"),
    (",".join(f"h{i}:1" for i in range(17)), "at most 16"),
])
def test_bad_endpoints_are_one_line_errors(text, words):
    with pytest.raises(BadRequestError, match=re.escape(words)):
        rpc.parse_endpoints(text)


def test_tensor_split_names_this_machine_then_each_worker():
    assert rpc.parse_tensor_split("1,2,2", 2) == (1.0, 2.0, 2.0)
    assert rpc.parse_tensor_split(None, 2) is None
    for text, words in (("1,2", "needs 3 proportions"), ("1,-1,1", ">= 0"), ("0,0,0", "not all 0"),
                        ("1,x,1", "numbers"), ("1,nan,1", ">= 0")):
        with pytest.raises(BadRequestError, match=re.escape(words)):
            rpc.parse_tensor_split(text, 2)


# -- placement -------------------------------------------------------------------------


def test_layer_owners_follow_llama_cpps_split_points():
    """llama_model_base::load_tensors: layers below n_layer + 1 - n_gpu_layers stay on the
    CPU; the rest go to the device whose cumulative share first exceeds their position."""
    # 4 layers + head, all offloaded, 1:1 -> positions 0, .2, .4 | .6, .8
    assert rpc.layer_owners(4, 5, (1.0, 1.0)) == [0, 0, 0, 1, 1]
    # 3 offloaded: layers 0-1 on the CPU, then 1:2 over positions 0, 1/3, 2/3
    assert rpc.layer_owners(4, 3, (1.0, 2.0)) == [-1, -1, 0, 1, 1]
    assert rpc.layer_owners(4, 5, (0.0, 1.0)) == [1, 1, 1, 1, 1]  # a zero share gets nothing
    assert rpc.layer_owners(4, 0, (1.0,)) == [-1] * 5


def _worker(name: str, *frees: int) -> rpc.Worker:
    host, port = name.split(":")
    devs = tuple(rpc.Device(i + 1, f"RPC{i}", name, f, f) for i, f in enumerate(frees))
    return rpc.Worker(rpc.Endpoint(host, int(port)), rpc.Hello((7, 0, 0)), devs)


def test_plan_keeps_this_machines_share_on_its_cpu():
    w = (_worker("a:1", 100), _worker("b:2", 200))
    p = rpc.plan(30, w, [], 100)  # by free memory: 1:1:2 of 31 slots
    assert p.n_gpu_layers == 23 and p.split == (100.0, 200.0)
    assert p.layer_counts() == [("this machine", 8), ("a:1", 8), ("b:2", 14)]
    assert rpc.plan(30, w, [], 100, (1.0, 0.0, 1.0)).layer_counts() == [("this machine", 15), ("a:1", 0), ("b:2", 15)]


def test_plan_gives_this_machines_share_to_its_gpus_and_spreads_a_worker_over_its_devices():
    gpu = rpc.Device(9, "CUDA0", None, 300, 400)
    p = rpc.plan(30, (_worker("a:1", 100, 200),), [gpu], 0)
    assert p.n_gpu_layers == 31  # everything offloaded: the GPU holds this machine's share
    assert [d.name for d in p.devices] == ["CUDA0", "RPC0", "RPC1"]
    assert p.split == (300.0, 100.0, 200.0)
    assert p.describe().startswith("this machine (GPU): 0 layers, CUDA0: ")


def test_device_array_is_null_terminated():
    arr = rpc.device_array([rpc.Device(0x1000, "RPC0", "a:1", 0, 0), 0x2000])
    assert [arr[i] for i in range(3)] == [0x1000, 0x2000, None]


# -- the probe, against fake servers ---------------------------------------------------


class FakeServer:
    """A listening socket whose accepted connections get `reply(conn)`."""

    def __init__(self, reply) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = rpc.Endpoint("127.0.0.1", self.sock.getsockname()[1])
        self.received = b""
        threading.Thread(target=self._serve, args=(reply,), daemon=True).start()

    def _serve(self, reply) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            self.received = conn.recv(64)
            reply(conn)

    def close(self) -> None:
        self.sock.close()


def test_probe_says_hello_as_llama_cpp_and_reads_the_version():
    server = FakeServer(lambda c: c.sendall(struct.pack("<Q", 28) + bytes([7, 1, 2, 0]) + bytes(24)))
    try:
        assert rpc.probe(server.endpoint).version == (7, 1, 2)
        assert server.received == bytes([14]) + struct.pack("<Q", 24) + bytes(24)  # RPC_CMD_HELLO, 24 caps
    finally:
        server.close()


def test_probe_errors_name_the_worker_and_the_cause():
    port = free_port()  # nothing listens there
    with pytest.raises(rpc.RpcError, match=f"127.0.0.1:{port} refused the connection"):
        rpc.probe(rpc.Endpoint("127.0.0.1", port))
    silent = FakeServer(lambda c: time.sleep(2))  # accepts, never answers: busy with another client
    try:
        with pytest.raises(rpc.RpcError, match="busy with another client"):
            rpc.probe(silent.endpoint, timeout=0.5)
    finally:
        silent.close()
    http = FakeServer(lambda c: c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"))
    try:
        with pytest.raises(rpc.RpcError, match="not as a llama.cpp RPC worker"):
            rpc.probe(http.endpoint)
    finally:
        http.close()


def test_probe_leaves_another_protocol_generation_to_llama_cpp():
    """A worker of another protocol hangs up on a HELLO of the wrong size: the version is
    unknown, and llama.cpp's own handshake (under the abort hook) gives the verdict."""
    server = FakeServer(lambda c: None)
    try:
        assert rpc.probe(server.endpoint).version is None
    finally:
        server.close()


def test_rpc_aborts_become_one_line_that_names_the_worker():
    gone = f"127.0.0.1:{free_port()}"  # nothing listens: the worker that is gone
    alive = FakeServer(lambda c: None)
    hellos = {gone: rpc.Hello((8, 0, 0)), str(alive.endpoint): rpc.Hello((7, 0, 0))}
    try:
        assert "speaks another RPC protocol (v8.0.0)" in rpc.abort_message(
            f"/src/ggml-rpc.cpp:550: RPC handshake failed for {gone}", hellos)
        line = rpc.abort_message("/src/ggml-rpc.cpp:35: Remote RPC server crashed or returned malformed response",
                                 hellos)
        assert f"the RPC worker at {gone} stopped answering" in line and str(alive.endpoint) not in line
    finally:
        alive.close()
    assert rpc.abort_message("/src/llama-kv-cache.cpp:9: GGML_ASSERT(x) failed", hellos) is None  # not ours


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


# -- command-line errors (any build) ---------------------------------------------------


def test_unreachable_worker_is_a_one_line_error(smollm2_gguf):
    res = localrun("run", str(smollm2_gguf), PROMPT, "--rpc", f"127.0.0.1:{free_port()}", timeout=120)
    assert res.returncode == 3, res.stderr
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    if _has_rpc():
        assert "refused the connection" in lines[0]
    else:
        assert "built without GGML_RPC" in lines[0]
    assert res.stdout == ""


def test_worker_binds_other_addresses_only_when_allowed():
    res = localrun("rpc-worker", "--host", "0.0.0.0", "--port", str(free_port()), timeout=60)
    assert res.returncode == 1 and "--allow-network" in res.stderr and "no authentication" in res.stderr
    res = localrun("rpc-worker", "--host", "localhost", timeout=60)
    assert res.returncode == 1 and "IPv4 address" in res.stderr


def test_tensor_split_without_workers_is_refused(smollm2_gguf):
    res = localrun("run", str(smollm2_gguf), PROMPT, "--tensor-split", "1,1", timeout=60)
    assert res.returncode == 1 and "--tensor-split needs --rpc" in res.stderr


# -- real workers ----------------------------------------------------------------------


class WorkerProcess:
    """`localrun rpc-worker` on a free loopback port; ready once it says it is serving."""

    def __init__(self, tmp: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.err_path = tmp / f"worker-{self.port}-{time.monotonic_ns()}.err"
        with open(tmp / f"worker-{self.port}.out", "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "localrun.cli", "rpc-worker", "--port",
                                          str(self.port), "--threads", "1", *extra], stdout=out, stderr=err)
        deadline = time.monotonic() + 120
        while "serving" not in self.stderr():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"rpc-worker did not start: {self.stderr()}")
            time.sleep(0.2)

    @classmethod
    def on_port(cls, tmp: Path, port: int) -> "WorkerProcess":
        """A worker on a given port (restarting one that died), retried while the port is
        still being released."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return cls(tmp, port=port)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stderr(self) -> str:
        return self.err_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    if not _has_rpc():
        pytest.skip("llama-cpp-python was built without GGML_RPC; scripts/setup.sh builds it with RPC")
    tmp = tmp_path_factory.mktemp("rpc")
    pair = [WorkerProcess(tmp), WorkerProcess(tmp)]
    yield pair
    for w in pair:
        assert w.stop() == 0 and "rpc-worker stopped" in w.stderr()  # SIGTERM ends a worker cleanly


def buffers_by_device(log: str) -> dict[str, float]:
    """`load_tensors: RPC0[127.0.0.1:P] model buffer size = 12.34 MiB` lines of llama.cpp's log."""
    out: dict[str, float] = {}
    for dev, mib in re.findall(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", log):
        out[dev] = out.get(dev, 0.0) + float(mib)
    return out


@needs_rpc
@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_two_workers_give_the_local_greedy_answer(model, workers, request):
    path = str(request.getfixturevalue(model))
    local = localrun("run", path, PROMPT, *GREEDY)
    assert local.returncode == 0, local.stderr
    endpoints = ",".join(w.endpoint for w in workers)
    split = localrun("run", path, PROMPT, *GREEDY, "--rpc", endpoints, "--tensor-split", "1,1,1", "--verbose",
                     env={"LOCALRUN_LLAMA_LOG": "1"})
    assert split.returncode == 0, split.stderr[-3000:]
    assert split.stdout == local.stdout and split.stdout.strip()
    buffers = buffers_by_device(split.stderr)
    for w in workers:  # both workers hold a part of the weights
        assert any(dev.startswith("RPC") and w.endpoint in dev and mib > 1 for dev, mib in buffers.items()), buffers
    # every layer sits where localrun's placement said it would (RPC0 is the first --rpc worker)
    from localrun.quant.selector import model_shape

    n_layer = model_shape(Path(path)).n_layer
    plan = rpc.plan(n_layer, (_worker("a:1", 1), _worker("b:2", 1)), [], 1, (1.0, 1.0, 1.0))
    expected = {il: "CPU" if o < 0 else f"RPC{o}" for il, o in enumerate(plan.owners())}
    logged = {int(il): dev for il, dev in re.findall(r"layer +(\d+) assigned to device (\w+)", split.stderr)}
    assert logged == expected and len(set(logged.values())) == 3
    assert all(f"rpc worker {w.endpoint} (v" in split.stderr for w in workers)  # --verbose names each worker


@needs_rpc
def test_fit_shows_the_split_over_the_workers(workers, smollm2_gguf):
    res = localrun("fit", str(smollm2_gguf), "--rpc", ",".join(w.endpoint for w in workers),
                   "--tensor-split", "1,1,1", "--ctx", "512")
    assert res.returncode == 0, res.stderr
    lines = {line.strip().split(": ")[0]: line for line in res.stdout.splitlines() if line.startswith("  ")
             and " layers, " in line}
    assert set(lines) == {"this machine"} | {w.endpoint for w in workers}, res.stdout
    counts = [int(re.search(r"(\d+) layers", line).group(1)) for line in lines.values()]
    assert sorted(counts) == [9, 10, 11]  # SmolLM2's 30 layers (+ the head), a third each, as the load puts them
    assert "does not fit" not in res.stdout


@needs_rpc
def test_a_killed_worker_ends_the_answer_with_one_error_line(tmp_path, smollm2_gguf):
    """The piped chat answers once over two workers; one is then killed, and the next
    answer ends with `error:` and exit code 3 instead of a core dump."""
    doomed, other = WorkerProcess(tmp_path), WorkerProcess(tmp_path)
    try:
        chat = subprocess.Popen([sys.executable, "-m", "localrun.cli", "chat", str(smollm2_gguf), *GREEDY,
                                 "--rpc", f"{doomed.endpoint},{other.endpoint}", "--tensor-split", "1,1,1"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        chat.stdin.write(PROMPT + "\n")
        chat.stdin.flush()
        first = chat.stdout.readline()  # the first answer streams back, then a blank line
        assert first.strip(), chat.stderr.read() if chat.poll() is not None else "no answer"
        doomed.proc.kill()
        doomed.proc.wait()
        out, err = chat.communicate("And three more?\n", timeout=120)
        assert chat.returncode == 3, err
        last = error_lines(err)[-1]
        assert last.startswith("error: ") and f"the RPC worker at {doomed.endpoint} stopped answering" in last, err
        assert "Aborted" not in err and "backtrace" not in err.lower()
    finally:
        doomed.stop()
        other.stop()


@needs_rpc
def test_serve_answers_over_workers(workers, smollm2_gguf):
    sys.path.insert(0, str(Path(__file__).parent))
    import httpx
    from serving import Server

    local = localrun("run", str(smollm2_gguf), PROMPT, *GREEDY)
    server = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "1",
                    "--rpc", ",".join(w.endpoint for w in workers), "--tensor-split", "1,1,1")
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == local.stdout.rstrip("\n")
        assert "over RPC workers: this machine:" in server.output()
    finally:
        server.stop()


# -- serve: the model in a child process, so a dead worker fails only its answers ------------


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

    cluster = rpc.connect([rpc.Endpoint("127.0.0.1", w.port) for w in workers], (1.0, 1.0, 1.0), activate=False)
    options = dict(n_ctx=256, n_seq=2, n_batch=64, threads=1, workers=cluster)
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
    import httpx

    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24})


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
    server = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "1",
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
    server = Server("--model", str(smollm2_gguf), "--ctx", "512", "--parallel", "1",
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


# -- MLX ring (experimental) -------------------------------------------------------------


def test_mlx_shard_check_names_what_does_not_divide():
    from localrun.errors import UnsupportedFormatError
    from localrun.mlx_ring import check_shardable

    class Sharded:
        def shard(self, group):
            raise AssertionError("only checked")

    smollm2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    check_shardable(Sharded(), smollm2, 3)  # 9 / 3 / 1536 all divide by 3
    with pytest.raises(BadRequestError, match="divisible by 2; this model has 9 attention heads, 3 KV heads"):
        check_shardable(Sharded(), smollm2, 2)
    with pytest.raises(UnsupportedFormatError, match="mlx-lm cannot shard gpt_bigcode"):
        check_shardable(object(), {"model_type": "gpt_bigcode"}, 2)


@pytest.mark.slow
def test_mlx_ring_of_three_ranks_matches_one_process(smollm2_mlx):
    """SmolLM2 (9 heads, 3 KV heads) over 3 ring ranks on loopback: rank 0 runs localrun's
    engine, and the greedy answer is the single-process one."""
    import mlx.core as mx

    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend")
    question = "What is the capital of France?"
    one = localrun("run", str(smollm2_mlx), question, "--temperature", "0", "--max-tokens", "8", "--no-lookup",
                   "--ctx", "256", timeout=600)
    assert one.returncode == 0, one.stderr
    ring = localrun("mlx-ring", str(smollm2_mlx), question, "--ranks", "3", "--max-tokens", "8", "--ctx", "256",
                    timeout=900)
    assert ring.returncode == 0, ring.stderr[-2000:]
    assert ring.stdout == one.stdout and one.stdout.strip()
    assert "rank 1 of 3 ready" in ring.stderr and "rank 2 of 3 ready" in ring.stderr


@needs_rpc
def test_worker_offers_what_mem_says(tmp_path):
    """--mem is what a client reads from the registered device (and what the split follows)."""
    worker = WorkerProcess(tmp_path, "--mem", "512")
    try:
        assert "CPU (512 MB offered)" in worker.stderr()
        code = ("from localrun import rpc; import sys; "
                "c = rpc.connect(rpc.parse_endpoints(sys.argv[1]), activate=False); "
                "print(c.workers[0].free, c.workers[0].devices[0].total)")
        res = subprocess.run([sys.executable, "-c", code, worker.endpoint], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        free, total = map(int, res.stdout.split())
        assert total == 512 << 20 and 0 < free <= total
    finally:
        assert worker.stop() == 0
