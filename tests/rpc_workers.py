"""Shared by the RPC tests (test_rpc.py, test_rpc_serve.py): real `localrun rpc-worker`
processes on free loopback ports, a fake listening server, the `localrun` CLI as a
subprocess, and the skip for a llama-cpp-python built without RPC."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localrun.cluster import rpc

PROMPT = "Name three colours."
GREEDY = ["--temperature", "0", "--max-tokens", "24", "--no-lookup", "--ctx", "512", "--threads", "1"]
NO_RPC = "llama-cpp-python was built without GGML_RPC; scripts/setup.sh builds it with RPC"


def has_rpc() -> bool:
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_rpc())
    except Exception:
        return False


needs_rpc = pytest.mark.skipif(not has_rpc(), reason=NO_RPC)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localrun(*args: str, env: dict | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localrun.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, **kw)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


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


def worker_pair(tmp_path_factory):
    """Two workers for a module-scoped `workers` fixture (each test module declares its own,
    `yield from worker_pair(tmp_path_factory)`); stopped, and checked to stop cleanly, after."""
    if not has_rpc():
        pytest.skip(NO_RPC)
    tmp = tmp_path_factory.mktemp("rpc")
    pair = [WorkerProcess(tmp), WorkerProcess(tmp)]
    yield pair
    for w in pair:
        assert w.stop() == 0 and "rpc-worker stopped" in w.stderr()  # SIGTERM ends a worker cleanly
