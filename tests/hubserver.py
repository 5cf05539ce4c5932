"""A local Hugging Face Hub look-alike for tests: real files, real endpoints, injected faults.

It answers what huggingface_hub and localrun's downloader ask:

- GET  /api/models/{org}/{repo}[/revision/{rev}]   model_info (with `blobs`: sizes, LFS sha256)
- GET  /api/models/{org}/{repo}/tree/{rev}[/{path}] list_repo_tree
- POST /api/models/{org}/{repo}/paths-info/{rev}   get_paths_info
- GET/HEAD /{org}/{repo}/resolve/{rev}/{path}      the file, with Range support

A repo is a dict {file name: Path or bytes}; `.gguf` and `.safetensors` files are
"LFS" files (sha256 in the metadata), the rest plain git blobs (sha1 blob id).
Unknown repos answer 404 with `X-Error-Code: RepoNotFound` as the Hub does.
A file named in `server.no_hash` is listed by model_info with its size only (no LFS
sha256, no git blob id), as a mirror without file metadata may answer.

Faults (`server.faults`, consumed in order by GETs of the matching file):
  Fault("cut", after=N)       send N bytes of the body, then drop the connection
  Fault("corrupt")            the right number of bytes, some of them wrong
  Fault("ignore_range")       answer a Range request with 200 and the whole file
  Fault("stall", after=N, seconds=S)  send N bytes, then go silent for S seconds
Every request is logged in `server.log` as (method, path, Range header or None).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".gguf", ".safetensors")
_DIGESTS: dict[tuple[str, int, float], str] = {}  # sha256 of big files, once per process


@dataclass
class Fault:
    kind: str  # "cut" | "corrupt" | "ignore_range" | "stall"
    file: str | None = None  # only this file name (None: any file)
    after: int = 0
    seconds: float = 0.0
    times: int = 1  # how many requests it hits (-1: every one)


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


class HubServer:
    def __init__(self, repos: dict[str, dict[str, Path | bytes]]) -> None:
        self.repos = repos
        self.faults: list[Fault] = []
        self.no_hash: set[str] = set()  # file names model_info lists without any hash
        self.log: list[tuple[str, str, str | None]] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the data ---------------------------------------------------------------

    def size(self, content: Path | bytes) -> int:
        return len(content) if isinstance(content, bytes) else content.stat().st_size

    def entry(self, name: str, content: Path | bytes) -> dict:
        """A file's metadata as the tree and paths-info endpoints give it."""
        size = self.size(content)
        if name.endswith(LFS_SUFFIXES):
            sha = hashlib.sha256(content).hexdigest() if isinstance(content, bytes) else _sha256(content)
            return {"type": "file", "path": name, "size": size, "oid": hashlib.sha1(sha.encode()).hexdigest(),
                    "lfs": {"oid": sha, "size": size, "pointerSize": 134}}
        data = content if isinstance(content, bytes) else content.read_bytes()
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return {"type": "file", "path": name, "size": size, "oid": oid}

    def model_info(self, repo: str) -> dict:
        siblings = []
        for name, content in self.repos[repo].items():
            e = self.entry(name, content)
            if name in self.no_hash:
                siblings.append({"rfilename": name, "size": e["size"]})
                continue
            s = {"rfilename": name, "size": e["size"], "blobId": e["oid"]}
            if "lfs" in e:
                s["lfs"] = {"sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}
            siblings.append(s)
        gguf = any(n.endswith(".gguf") for n in self.repos[repo])
        return {"_id": "x" * 24, "id": repo, "modelId": repo, "sha": COMMIT, "private": False, "disabled": False,
                "gated": False, "downloads": 0, "likes": 0, "tags": ["gguf" if gguf else "mlx"],
                "library_name": "gguf" if gguf else "mlx", "createdAt": "2025-01-01T00:00:00.000Z",
                "lastModified": "2025-01-01T00:00:00.000Z", "siblings": siblings}

    def take_fault(self, name: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.times != 0 and (f.file is None or f.file == name):
                    if f.times > 0:
                        f.times -= 1
                    return f
        return None


def _make_handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _json(self, obj, status: int = 200, headers: dict | None = None) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _not_found(self, code: str = "RepoNotFound") -> None:
            self._json({"error": "Repository not found"}, 404 if code != "GatedRepo" else 403, {"X-Error-Code": code})

        def _route(self, method: str) -> None:
            path = unquote(urlparse(self.path).path)
            server.log.append((method, path, self.headers.get("Range")))
            m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
            if m and method == "GET":
                return self._json(server.model_info(m.group(1))) if m.group(1) in server.repos else self._not_found()
            m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
            if m and method == "GET":
                if m.group(1) not in server.repos:
                    return self._not_found()
                prefix = (m.group(3) or "").strip("/")
                files = server.repos[m.group(1)]
                return self._json([server.entry(n, c) for n, c in files.items() if n.startswith(prefix)])
            m = re.match(r"^/api/models/([^/]+/[^/]+)/paths-info/([^/]+)$", path)
            if m and method == "POST":
                if m.group(1) not in server.repos:
                    return self._not_found()
                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                files = server.repos[m.group(1)]
                return self._json([server.entry(n, files[n]) for n in form.get("paths", []) if n in files])
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if m and method in ("GET", "HEAD"):
                files = server.repos.get(m.group(1))
                if files is None:
                    return self._not_found()
                if m.group(3) not in files:
                    return self._not_found("EntryNotFound")
                return self._file(method, m.group(3), files[m.group(3)])
            self._json({"error": f"no route {method} {path}"}, 404)

        def _file(self, method: str, name: str, content: Path | bytes) -> None:
            size = server.size(content)
            entry = server.entry(name, content)
            fault = server.take_fault(name) if method == "GET" else None
            start, end, status = 0, size - 1, 200
            rng = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range") or "")
            if rng and not (fault and fault.kind == "ignore_range"):
                start = int(rng.group(1))
                end = min(int(rng.group(2)), size - 1) if rng.group(2) else size - 1
                if start >= size:
                    return self._json({"error": "range not satisfiable"}, 416, {"Content-Range": f"bytes */{size}"})
                status = 206
            etag = (entry.get("lfs") or {}).get("oid") or entry["oid"]
            self.send_response(status)
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{etag}"')
            self.send_header("X-Repo-Commit", COMMIT)
            if "lfs" in entry:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(size))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if method == "HEAD":
                return
            self._body(content, start, end + 1, fault)

        def _body(self, content: Path | bytes, start: int, stop: int, fault: Fault | None) -> None:
            sent = 0
            limit = fault.after if fault and fault.kind in ("cut", "stall") else None
            corrupt_at = start + (stop - start) // 2 if fault and fault.kind == "corrupt" else None
            f = open(content, "rb") if isinstance(content, Path) else None
            try:
                pos = start
                if f:
                    f.seek(start)
                while pos < stop:
                    n = min(1 << 20, stop - pos)
                    if limit is not None:
                        n = min(n, limit - sent)
                    if n <= 0:
                        break
                    chunk = f.read(n) if f else content[pos:pos + n]
                    if corrupt_at is not None and pos <= corrupt_at < pos + len(chunk):
                        i = corrupt_at - pos  # same length, different bytes
                        chunk = chunk[:i] + bytes(b ^ 0xFF for b in chunk[i:i + 64]) + chunk[i + 64:]
                    self.wfile.write(chunk)
                    pos += len(chunk)
                    sent += len(chunk)
                self.wfile.flush()
                if fault and fault.kind == "stall" and pos < stop:
                    server.stopping.wait(fault.seconds)
                    self.close_connection = True
                elif fault and fault.kind == "cut" and pos < stop:
                    self.close_connection = True  # Content-Length promised more: the client sees a cut
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            finally:
                if f:
                    f.close()

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler


# -- running the CLI --------------------------------------------------------------------


def cli_command(*args: str) -> list[str]:
    """argv for a subprocess running `localrun ARGS...` (a fresh interpreter: env read at import)."""
    import sys

    return [sys.executable, "-m", "localrun", *args]


def run_cli(argv: list[str]) -> int:
    """`localrun ARGV` in this process; returns the exit code."""
    from localrun import cli

    return cli.main(argv)


def main() -> None:
    """Serve a repo from the command line: python tests/hubserver.py ORG/REPO FILE... (for manual tries)."""
    import sys
    import time

    repo, files = sys.argv[1], [Path(p) for p in sys.argv[2:]]
    with HubServer({repo: {p.name: p for p in files}}) as hub:
        print(f"HF_ENDPOINT={hub.url}", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
