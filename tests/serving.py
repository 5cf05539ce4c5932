"""Test helpers for `localrun serve`: a real server process on a free port, and copies of
a GGUF with metadata changed: fill-in-the-middle token ids (the small test models have
none), or another chat template."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

# SmolLM2's vocabulary has no FIM tokens; three of its unused control tokens stand in
FIM_IDS = {"tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.fim_suf_token_id": 4, "tokenizer.ggml.fim_mid_token_id": 6}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`localrun serve ARGS` in a subprocess; ready once /health answers."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "localrun.cli", "serve", "--port", str(self.port), "--threads", "2", *args]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"localrun-serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not answer /health within 60 s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def stop_process(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """Ask a server process to exit (it finishes its streams), then kill it after grace_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_fim_copy(src: Path, dst: Path) -> Path:
    """Copy a GGUF, adding FIM_IDS to its metadata; tensors are copied byte for byte."""
    return copy_gguf_with(src, dst, uint32=FIM_IDS)


def make_template_copy(src: Path, dst: Path, template: str) -> Path:
    """Copy a GGUF whose chat template is `template` (a model file anyone could publish)."""
    return copy_gguf_with(src, dst, strings={"tokenizer.chat_template": template})


def copy_gguf_with(src: Path, dst: Path, uint32: dict | None = None, strings: dict | None = None) -> Path:
    """Copy a GGUF with metadata keys added or replaced; tensors are copied byte for byte."""
    uint32, strings = uint32 or {}, strings or {}
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".tmp")
    writer = GGUFWriter(str(tmp), arch=arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        if name in uint32 or name in strings:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)
    for name, value in uint32.items():
        writer.add_uint32(name, value)
    for name, value in strings.items():
        writer.add_string(name, value)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(np.asarray(t.data))
    writer.close()
    tmp.replace(dst)
    return dst
