"""The server's model manager: leases (a model is never unloaded under a request that
resolved it), loads keyed by real path and counted against --max-models while in flight,
the model-path policy (what a request may name; FIFOs, files outside the served set and
MLX folders that ship code are refused), cached store look-ups, and 500 bodies that keep
their detail in the log. Unit tests run the real manager and scheduler over the scripted
fake backend; the last tests run a real `localrun serve`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from fakes import ScriptedBackend
from localrun.store import local as store
from localrun.backends.mlx import MLXBackend, RemoteCodeError
from localrun.engine import Engine
from localrun.errors import ModelNotFoundError, UnsupportedFormatError
from localrun.server import scheduler as scheduler_module
from localrun.server.models import ModelManager, request_scope
from localrun.server.scheduler import QueueFullError
from serving import Server

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n"


class ClosableBackend(ScriptedBackend):
    """The scripted backend, recording whether its memory was freed."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def empty_store(tmp_path, monkeypatch):
    """Empty store, HF cache and LM Studio folders: never the user's models."""
    for var, name in (("LOCALRUN_MODELS", "store"), ("HF_HUB_CACHE", "hf"), ("LOCALRUN_LMSTUDIO_MODELS", "lms")):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(var, str(tmp_path / name))


@pytest.fixture
def opened(monkeypatch):
    """Engine.open replaced by the scripted backend; the list of paths it was asked for.
    `opened.gate` (a threading.Event), when set to one, holds every open until it is set."""

    class Opened(list):
        gate: threading.Event | None = None

    calls = Opened()

    def fake_open(path, options=None, **fields):
        calls.append(str(path))
        if calls.gate is not None:
            assert calls.gate.wait(30), "the test never let the load finish"
        return Engine(ClosableBackend(str(path)))

    monkeypatch.setattr(Engine, "open", fake_open)
    return calls


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Three tiny "GGUF" files (the magic is all the path policy reads) and a secret."""
    out = {}
    for name in ("a", "b", "c"):
        out[name] = tmp_path / f"{name}.gguf"
        out[name].write_bytes(b"GGUF" + bytes(60))
    out["secret"] = tmp_path / "home" / ".ssh" / "id_ed25519"
    out["secret"].parent.mkdir(parents=True)
    out["secret"].write_bytes(SECRET)
    return out


def manager(models=(), **kw) -> ModelManager:
    return ModelManager([str(m) for m in models], n_ctx=64, parallel=2, threads=1, max_queue=4, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def held(mgr: ModelManager, name: str, until: asyncio.Event):
    """A request that holds `name` until `until` is set."""
    with request_scope():
        model = await mgr.get(name)
        await until.wait()
        return model


async def use_once(mgr: ModelManager, name: str):
    with request_scope():
        return await mgr.get(name)


# -- leases --------------------------------------------------------------------------


def test_keep_alive_zero_waits_for_the_request_holding_the_model(files, opened):
    async def main():
        mgr = manager([files["a"]])
        with request_scope():
            model = await mgr.get("a")  # e.g. its prompt is being tokenized: nothing queued yet
            assert not model.scheduler.busy
            mgr.expire("a")
            await mgr.reap(grace=0)
            assert "a" in mgr.loaded and not model.engine.backend.closed
        await mgr.reap(grace=0)  # the response is over: now it goes
        assert "a" not in mgr.loaded and model.engine.backend.closed
        assert model.leases == 0

    run(main())


def test_eviction_never_picks_a_held_model(files, opened):
    async def main():
        mgr = manager([files["a"], files["b"], files["c"]], max_loaded=2)
        release_a = asyncio.Event()
        holder = asyncio.create_task(held(mgr, "a", release_a))
        while "a" not in mgr.loaded:
            await asyncio.sleep(0.01)
        b = await use_once(mgr, "b")  # b was used after a: a is the least recently used
        c = await use_once(mgr, "c")  # a full house: the idle one goes, never the held one
        assert set(mgr.loaded) == {"a", "c"} and b.engine.backend.closed
        release_c = asyncio.Event()
        holder_c = asyncio.create_task(held(mgr, "c", release_c))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="--max-models 2"):
            await use_once(mgr, "b")  # both held: refuse, unload nothing
        assert set(mgr.loaded) == {"a", "c"} and not c.engine.backend.closed
        release_a.set()
        release_c.set()
        await asyncio.gather(holder, holder_c)
        await mgr.close()

    run(main())


def test_max_models_counts_a_load_in_flight(files, opened):
    opened.gate = threading.Event()

    async def main():
        mgr = manager([files["a"], files["b"]], max_loaded=1)
        loading_a = asyncio.create_task(use_once(mgr, "a"))
        while not opened:
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            await use_once(mgr, "b")  # a holds the only place while it loads
        assert opened == [str(files["a"])]
        opened.gate.set()
        await loading_a
        b = await use_once(mgr, "b")  # a is idle now: it makes room
        assert list(mgr.loaded) == ["b"] and b.path == os.path.realpath(files["b"])
        await mgr.close()

    run(main())


def test_two_spellings_of_one_file_load_once(files, opened, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(files["a"])
    spellings = [str(files["a"]), str(tmp_path / "." / "a.gguf"), str(tmp_path / "home" / ".." / "a.gguf"), str(link)]

    async def main():
        mgr = manager(allow_paths=True, max_loaded=1)
        got = await asyncio.gather(*(use_once(mgr, s) for s in spellings))
        assert all(m is got[0] for m in got)
        assert opened == [os.path.realpath(files["a"])]
        assert len(mgr.loaded) == 1
        assert (await mgr.resolve(str(link)))[0] == got[0].name  # listed under one name
        await mgr.close()

    run(main())


def test_an_engine_is_freed_only_after_its_scheduler_thread_exits(files, opened, monkeypatch):
    stop = scheduler_module.Scheduler.stop
    monkeypatch.setattr(scheduler_module.Scheduler, "stop", lambda self, wait_s=0.2: stop(self, wait_s))
    in_step, finish_step = threading.Event(), threading.Event()

    def long_step():  # stands for a decode the stop cannot interrupt
        in_step.set()
        finish_step.wait(30)

    async def main():
        mgr = manager([files["a"]], max_loaded=1)
        with request_scope():
            model = await mgr.get("a")
            call = asyncio.ensure_future(model.scheduler.call(long_step))
        await asyncio.to_thread(in_step.wait, 10)
        mgr.expire("a")
        await mgr.reap(grace=0)  # not busy (a call is no job), unheld: it unloads...
        assert "a" not in mgr.loaded
        assert not model.engine.backend.closed  # ...but the step still runs on its engine
        with pytest.raises(QueueFullError):
            await use_once(mgr, "a")  # its memory still counts against --max-models 1
        finish_step.set()
        await call
        for _ in range(100):
            await mgr.reap()
            if model.engine.backend.closed:
                break
            await asyncio.sleep(0.05)
        assert model.engine.backend.closed

    run(main())


# -- what a request may name --------------------------------------------------------


def test_a_file_outside_the_served_set_gets_the_same_404_as_a_missing_one(files, opened):
    async def refusal(mgr, name: str) -> str:
        with pytest.raises(ModelNotFoundError) as err:
            await mgr.resolve(name)
        return str(err.value).replace(name, "NAME")

    async def main():
        mgr = manager([files["a"]])
        secret, missing = str(files["secret"]), str(files["secret"].with_name("id_missing"))
        texts = {await refusal(mgr, n) for n in (secret, missing, str(files["b"]), "~/.ssh/id_ed25519")}
        assert len(texts) == 1, texts  # a secret, a missing file and a real model outside: one answer
        (text,) = texts
        assert "BEGIN" not in text and "--allow-paths" in text
        assert opened == []

    run(main())


def test_served_names_resolve_to_real_paths(files, opened):
    async def main():
        mgr = manager([files["a"]])
        real = os.path.realpath(files["a"])
        assert await mgr.resolve("a") == ("a", real)  # the listed name
        assert await mgr.resolve("a:latest") == ("a", real)
        assert await mgr.resolve(str(files["a"])) == ("a", real)  # the --model as given
        assert await mgr.resolve(None) == ("a", real)  # the default

    run(main())


def test_a_path_named_like_a_served_model_is_listed_by_its_path(files, opened, tmp_path):
    other = tmp_path / "elsewhere" / "a.gguf"
    other.parent.mkdir()
    other.write_bytes(b"GGUF" + bytes(60))

    async def main():
        mgr = manager([files["a"]], allow_paths=True)
        mine, theirs = await use_once(mgr, "a"), await use_once(mgr, str(other))
        assert mine is not theirs and theirs.name == os.path.realpath(other)
        assert (await mgr.resolve("a"))[1] == os.path.realpath(files["a"])  # "a" still means the --model
        await mgr.close()

    run(main())


def test_allowed_paths_are_gguf_files_and_model_folders_only(files, opened, tmp_path):
    folder = tmp_path / "no-config"
    folder.mkdir()
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(SECRET)

    async def main():
        mgr = manager(allow_paths=True)
        for name, error, text in ((str(files["secret"]), UnsupportedFormatError, "not a GGUF file"),
                                  (str(not_gguf), UnsupportedFormatError, "not a GGUF file"),
                                  (str(folder), UnsupportedFormatError, "without config.json"),
                                  (str(tmp_path / "missing.gguf"), ModelNotFoundError, "no model at")):
            with pytest.raises(error, match=text) as err:
                await mgr.resolve(name)
            assert "BEGIN" not in str(err.value)
        assert await mgr.resolve(str(files["b"])) == ("b", os.path.realpath(files["b"]))

    run(main())


def test_a_fifo_is_refused_without_blocking(tmp_path, opened):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    folder = tmp_path / "fifo-folder"
    folder.mkdir()
    os.mkfifo(folder / "config.json")

    async def main():
        mgr = manager(allow_paths=True)
        with pytest.raises(UnsupportedFormatError, match="not a regular file"):
            await asyncio.wait_for(mgr.resolve(str(fifo)), 5)
        with pytest.raises(UnsupportedFormatError, match="without config.json"):
            await asyncio.wait_for(mgr.resolve(str(folder)), 5)
        with pytest.raises(ModelNotFoundError):
            await asyncio.wait_for(manager().resolve(str(fifo)), 5)

    try:
        run(main())
        with pytest.raises(UnsupportedFormatError, match="not a regular file"):
            store.resolve_model(str(fifo))  # the CLI's path too
    finally:
        for f in (fifo, folder / "config.json"):  # free a reader the code under test left waiting
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader waits: nothing to free
                continue


def mlx_folder(root: Path, config: dict, tokenizer_config: dict | None = None) -> Path:
    """A folder shaped like an MLX model whose config may name code; the code, if ever
    imported, leaves a marker file beside it."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (root / "model.safetensors").write_bytes(b"\0" * 16)
    (root / "evil.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n")
    return root


def test_an_mlx_folder_that_ships_code_is_refused_unless_trusted(tmp_path, opened, monkeypatch):
    asks = [mlx_folder(tmp_path / "model-file", {"model_file": "evil.py"}),
            mlx_folder(tmp_path / "auto-map", {"auto_map": {"AutoModel": "evil.Model"}}),
            mlx_folder(tmp_path / "tokenizer-map", {}, {"auto_map": {"AutoTokenizer": ["evil.Tok", None]}})]

    async def main():
        mgr = manager(allow_paths=True)
        for folder in asks:
            with pytest.raises(RemoteCodeError, match="--trust-remote-code"):
                await use_once(mgr, str(folder))
        assert opened == [] and not mgr.loaded

    run(main())
    for folder in asks:
        with pytest.raises(RemoteCodeError, match="--trust-remote-code"):
            MLXBackend(folder)  # `localrun run` and `chat` load through here
        assert not (folder / "RAN").exists()

    trusted_opens = []

    def open_engine(path, options, chat_template=None):
        trusted_opens.append(options.trust_remote_code)
        return Engine(ClosableBackend(str(path)))

    monkeypatch.setattr(Engine, "open", open_engine)

    async def trusted():
        mgr = manager(allow_paths=True, trust_remote_code=True)
        await use_once(mgr, str(asks[0]))
        await mgr.close()

    run(trusted())
    assert trusted_opens == [True]


def test_store_look_ups_are_cached_and_off_the_loop(files, opened, monkeypatch):
    listed = []
    installed = store.StoredModel("org/repo:Q4_0", files["c"], "gguf", "Q4_0", 64, "localrun")

    def list_models():
        listed.append(threading.current_thread() is threading.main_thread())
        return [installed]

    monkeypatch.setattr(store, "list_models", list_models)

    async def main():
        mgr = manager([files["a"]])
        for _ in range(3):
            assert await mgr.resolve("org/repo:Q4_0") == ("org/repo:Q4_0", os.path.realpath(files["c"]))
            with pytest.raises(ModelNotFoundError):
                await mgr.resolve("org/other")
            assert ("org/repo:Q4_0", str(files["c"])) in await mgr.available()
        model = await use_once(mgr, "org/repo:Q4_0")
        assert model.path == os.path.realpath(files["c"])
        await mgr.close()

    run(main())
    assert listed == [False]  # one scan for every look-up above, in a worker thread


def test_get_outside_a_request_scope_is_refused(files, opened):
    with pytest.raises(RuntimeError, match="request_scope"):
        run(manager([files["a"]]).get("a"))


# -- 500 bodies ------------------------------------------------------------------------


def test_a_bug_answers_500_without_its_text_and_logs_the_traceback(files, monkeypatch, caplog):
    from starlette.testclient import TestClient

    from localrun.server.app import build_app

    async def broken(self):
        raise RuntimeError("detail that must stay in the log")

    monkeypatch.setattr(ModelManager, "available", broken)
    client = TestClient(build_app(manager([files["a"]])), base_url="http://127.0.0.1")
    with caplog.at_level(logging.ERROR, logger="localrun.server"):
        r = client.get("/v1/models")
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal error (see the server log)"
    assert "detail that must stay" in caplog.text and "Traceback" in caplog.text


# -- a real server -----------------------------------------------------------------------


MODEL = "smollm2-135m-instruct-q4_1"


@pytest.fixture(scope="module")
def isolated_store(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("store")
    env = {}
    for var, name in (("LOCALRUN_MODELS", "store"), ("HF_HUB_CACHE", "hf"), ("LOCALRUN_LMSTUDIO_MODELS", "lms")):
        (root / name).mkdir()
        env[var] = str(root / name)
    return env


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("home") / ".ssh" / "id_ed25519"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


@pytest.fixture(scope="module")
def server(smollm2_gguf, isolated_store):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "1024", "--parallel", "2", env=isolated_store)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(smollm2_gguf, isolated_store):
    srv = Server("--model", str(smollm2_gguf), "--ctx", "1024", "--parallel", "2", "--allow-paths",
                 env=isolated_store)
    yield srv
    srv.stop()


def test_server_answers_a_secret_and_a_missing_file_alike(server, secret_file):
    answers = []
    for name in (str(secret_file), str(secret_file.with_name("id_missing"))):
        r = httpx.post(server.url + "/api/show", json={"model": name}, timeout=30)
        assert r.status_code == 404
        answers.append(r.json()["error"].replace(name, "NAME"))
        assert "BEGIN" not in r.text
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "BEGIN" not in r.text
    assert answers[0] == answers[1] and "not found" in answers[0]


def test_allow_paths_serves_a_path_once_under_any_spelling(open_server, smollm2_gguf, secret_file):
    other = str(smollm2_gguf.parent / "." / smollm2_gguf.name)
    show = httpx.post(open_server.url + "/api/show", json={"model": other}, timeout=30)
    assert show.status_code == 200, show.text
    body = {"model": other, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}
    r = httpx.post(open_server.url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    loaded = [m["name"] for m in httpx.get(open_server.url + "/api/ps", timeout=30).json()["models"]]
    assert loaded == [MODEL]  # the --model under another spelling: one copy
    r = httpx.post(open_server.url + "/api/show", json={"model": str(secret_file)}, timeout=30)
    assert r.status_code == 400 and "not a GGUF file" in r.text and "BEGIN" not in r.text


def test_keep_alive_zero_racing_a_stream_and_an_embed(open_server):
    url = open_server.url
    ask = {"model": MODEL, "prompt": "Write a short story about a lighthouse.",
           "options": {"num_predict": 32, "temperature": 0}}
    expected = httpx.post(url + "/api/generate", json={**ask, "stream": False}, timeout=300).json()["response"]
    results: dict = {}

    def stream():
        parts = []
        with httpx.stream("POST", url + "/api/generate", json={**ask, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line:
                    parts.append(json.loads(line))
        results["stream"] = parts

    def embed():
        # small: an embedding runs on the model's scheduler thread, between the stream's steps
        texts = [f"Paragraph {i}: the tide comes in and the tide goes out." for i in range(2)]
        results["embed"] = httpx.post(url + "/api/embed", json={"model": MODEL, "input": texts}, timeout=300)

    threads = [threading.Thread(target=stream), threading.Thread(target=embed)]
    for t in threads:
        t.start()
    unloads = 0
    while any(t.is_alive() for t in threads):
        r = httpx.post(url + "/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["done_reason"] == "unload"
        unloads += 1
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert unloads >= 1 and open_server.proc.poll() is None
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    chunks = results["stream"]
    assert not any("error" in c for c in chunks), chunks[-1]
    assert chunks[-1]["done"] and "".join(c["response"] for c in chunks) == expected
    assert results["embed"].status_code == 200, results["embed"].text
    assert len(results["embed"].json()["embeddings"]) == 2
    # with no request left, keep_alive 0 unloads at once
    r = httpx.post(url + "/api/generate", json={"model": MODEL, "keep_alive": 0}, timeout=30)
    assert r.json()["done_reason"] == "unload"
    assert httpx.get(url + "/api/ps", timeout=30).json()["models"] == []
