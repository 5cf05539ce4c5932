"""`localrun pull` against a local Hub-like server (tests/hubserver.py) serving the real
test models: listing, the pick, resume, sha256 verification and every injected fault."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from hubserver import COMMIT, Fault, HubServer, cli_command, run_cli
from syncs import record_syncs
from localrun.store import hub
from localrun.errors import ModelNotFoundError
from localrun.store.hub import DownloadError, list_repo, plan_pull, pull, remote_shape, safe_relpath, variants
from localrun.quant.selector import Budget, model_shape
from localrun.store.local import list_models, resolve_model

SMOL = "test-org/SmolLM2-135M-Instruct-GGUF"
Q4 = "SmolLM2-135M-Instruct-Q4_1.gguf"
MB = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MB):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf, gemma3_gguf, smollm2_mlx):
    """The repos: SmolLM2 in Q4_1 and Q8_0 (requantized here), Gemma-3, a split model, an MLX model."""
    import llama_cpp

    d = tmp_path_factory.mktemp("hub-files")
    q8 = d / "SmolLM2-135M-Instruct-Q8_0.gguf"
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = 7, True, 2  # 7: Q8_0
    assert llama_cpp.llama_model_quantize(str(smollm2_gguf).encode(), str(q8).encode(), ctypes.byref(params)) == 0
    data = smollm2_gguf.read_bytes()
    part1, part2 = d / "part1", d / "part2"
    part1.write_bytes(data[: len(data) // 2])
    part2.write_bytes(data[len(data) // 2:])
    repos = {
        SMOL: {Q4: smollm2_gguf, q8.name: q8, "README.md": b"# SmolLM2\n", "mmproj-SmolLM2-F16.gguf": b"proj" * 8},
        "test-org/gemma-3-270m-GGUF": {"gemma-3-270m-Q4_K_M.gguf": gemma3_gguf},
        "test-org/split-GGUF": {"Q4_1/smol-Q4_1-00001-of-00002.gguf": part1,
                                "Q4_1/smol-Q4_1-00002-of-00002.gguf": part2},
        "mlx-community/SmolLM2-135M-Instruct-f16": {
            **{p.name: p for p in smollm2_mlx.iterdir() if p.is_file()}, "README.md": b"# mlx\n"},
        "test-org/docs-only": {"README.md": b"nothing here\n"},
        "test-org/fake-GGUF": {"fake-Q4_0.gguf": b"SECRETKEY-0123456789abcdef" * 64},
        "evil/repo": {"../evil-Q4_0.gguf": b"x" * 64},
    }
    with HubServer(repos) as server:
        yield server


@pytest.fixture
def hubenv(served, tmp_path, monkeypatch):
    """A fresh store per test, pointed at the server; short stall timeout; no leftover faults."""
    monkeypatch.setenv("HF_ENDPOINT", served.url)
    monkeypatch.setenv("LOCALRUN_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("LOCALRUN_LMSTUDIO_MODELS", str(tmp_path / "lms"))
    monkeypatch.setenv("LOCALRUN_DOWNLOAD_TIMEOUT", "0.5")
    served.faults = []
    served.no_hash = set()
    served.log.clear()
    yield served
    served.faults = []
    served.no_hash = set()


def file_gets(server: HubServer, name: str) -> list[str | None]:
    """The Range headers of the GET requests for one file, in order."""
    return [rng for method, path, rng in server.log if method == "GET" and path.endswith("/" + name)]


def installed(tmp_path: Path, name: str = Q4) -> Path:
    return tmp_path / "models" / SMOL / name


def assert_clean(tmp_path: Path) -> None:
    """No partial bytes anywhere, and the downloads folder gone once nothing is left to resume."""
    models = tmp_path / "models"
    assert not [p for p in models.rglob("*.part")], list(models.rglob("*"))
    assert not (models / ".downloads").exists(), list((models / ".downloads").rglob("*"))


def test_listing_sizes_hashes_and_variants(hubenv, smollm2_gguf):
    revision, files = list_repo(SMOL)
    assert revision == COMMIT
    by_name = {f.path: f for f in files}
    assert by_name[Q4].sha256 == sha256(smollm2_gguf) and by_name[Q4].size == smollm2_gguf.stat().st_size
    assert by_name["README.md"].sha256 is None and by_name["README.md"].git_oid
    found = {v.quant: v for v in variants(files)}
    assert sorted(found) == ["Q4_1", "Q8_0"]  # README and the vision projector are not models
    split = variants(list_repo("test-org/split-GGUF")[1])
    assert [(v.quant, len(v.files)) for v in split] == [("Q4_1", 2)]
    (mlx,) = variants(list_repo("mlx-community/SmolLM2-135M-Instruct-f16")[1])
    assert mlx.format == "mlx" and "README.md" not in [f.path for f in mlx.files]


def test_remote_header_gives_the_local_shape(hubenv, gemma3_gguf):
    revision, files = list_repo("test-org/gemma-3-270m-GGUF")
    assert remote_shape("test-org/gemma-3-270m-GGUF", revision, files[0]) == model_shape(gemma3_gguf)
    ranges = file_gets(hubenv, "gemma-3-270m-Q4_K_M.gguf")
    assert ranges == ["bytes=0-4194303", "bytes=0-16777215"]  # a 262k vocabulary needs a second, larger read


def test_a_remote_file_that_is_not_gguf_is_refused_without_its_bytes(hubenv):
    with pytest.raises(DownloadError) as ei:
        plan_pull("test-org/fake-GGUF", budget=Budget.from_gb(4))
    msg = str(ei.value)
    assert "fake-Q4_0.gguf" in msg and "malformed" in msg and "bad magic" in msg and "\n" not in msg
    assert "SECR" not in msg and "0123" not in msg


def test_a_cut_header_read_is_one_download_error(hubenv):
    revision, files = list_repo("test-org/gemma-3-270m-GGUF")
    hubenv.faults = [Fault("cut", file="gemma-3-270m-Q4_K_M.gguf", after=MB, times=-1)]
    with pytest.raises(DownloadError) as ei:
        remote_shape("test-org/gemma-3-270m-GGUF", revision, files[0])
    assert "header of gemma-3-270m-Q4_K_M.gguf" in str(ei.value) and "\n" not in str(ei.value)
    assert len(file_gets(hubenv, "gemma-3-270m-Q4_K_M.gguf")) == 1  # a short body is not asked for again


def test_pull_a_named_quant(hubenv, tmp_path, smollm2_gguf):
    plan, path = pull(f"{SMOL}:q4_1")
    assert path == installed(tmp_path) and sha256(path) == sha256(smollm2_gguf)
    assert plan.name == f"{SMOL}:Q4_1"
    assert_clean(tmp_path)
    assert resolve_model(f"{SMOL}:Q4_1") == path
    assert [m.name for m in list_models()] == [f"{SMOL}:Q4_1"]
    hubenv.log.clear()
    assert pull(f"{SMOL}:Q4_1")[1] == path  # already there: nothing downloads again
    assert file_gets(hubenv, Q4) == []


def test_pull_without_a_quant_asks_the_selector(hubenv, tmp_path):
    big = plan_pull(SMOL, budget=Budget.from_gb(4))
    assert big.variant.quant == "Q8_0" and "best quality that fits" in big.note
    notes = []
    plan, path = pull(SMOL, budget=Budget.from_gb(0.25), announce=notes.append)
    assert plan.variant.quant == "Q4_1" and path == installed(tmp_path)
    assert notes and notes[0].startswith(f"pulling {SMOL}:Q4_1: Q4_1: ") and " of 256 MB free" in notes[0]
    assert plan_pull(SMOL, n_ctx=2048, budget=Budget.from_gb(0.3)).variant.quant == "Q8_0"
    with pytest.raises(Exception, match="no quant of .* fits"):
        plan_pull(SMOL, budget=Budget.from_gb(0.05))


def test_connection_cut_mid_file_resumes_with_a_range(hubenv, tmp_path, smollm2_gguf):
    hubenv.faults = [Fault("cut", file=Q4, after=10 * MB)]
    _, path = pull(f"{SMOL}:Q4_1")
    assert sha256(path) == sha256(smollm2_gguf)
    first, second = file_gets(hubenv, Q4)
    assert first is None and second.startswith("bytes=") and 0 < int(second[6:-1]) <= 10 * MB
    assert_clean(tmp_path)


def test_wrong_bytes_of_the_right_size_are_caught(hubenv, tmp_path, smollm2_gguf):
    hubenv.faults = [Fault("corrupt", file=Q4)]
    _, path = pull(f"{SMOL}:Q4_1")  # the sha256 check fails once, the second download is right
    assert sha256(path) == sha256(smollm2_gguf) and file_gets(hubenv, Q4) == [None, None]
    path.unlink()
    hubenv.faults = [Fault("corrupt", file=Q4, times=-1)]
    with pytest.raises(DownloadError, match="arrived corrupt twice.*nothing was installed"):
        pull(f"{SMOL}:Q4_1")
    assert not path.exists()
    assert_clean(tmp_path)


def test_a_200_answer_to_a_range_request_starts_over(hubenv, tmp_path, smollm2_gguf):
    hubenv.faults = [Fault("cut", file=Q4, after=6 * MB), Fault("ignore_range", file=Q4)]
    _, path = pull(f"{SMOL}:Q4_1")
    assert sha256(path) == sha256(smollm2_gguf)  # the whole body replaced the partial bytes
    ranges = file_gets(hubenv, Q4)
    assert len(ranges) == 2 and ranges[1] is not None  # asked for a range, got the whole file


def test_a_stall_times_out_and_resumes(hubenv, tmp_path, smollm2_gguf):
    hubenv.faults = [Fault("stall", file=Q4, after=5 * MB, seconds=20)]
    start = time.monotonic()
    _, path = pull(f"{SMOL}:Q4_1")
    assert time.monotonic() - start < 10  # 0.5 s without a byte, then a resume
    assert sha256(path) == sha256(smollm2_gguf)
    assert file_gets(hubenv, Q4)[1].startswith("bytes=")


def test_a_killed_pull_resumes_in_a_new_process(hubenv, tmp_path, smollm2_gguf):
    """The process dies mid-file; the next `localrun pull` (a fresh interpreter reading
    HF_ENDPOINT at import) continues from the bytes on disk."""
    hubenv.faults = [Fault("stall", file=Q4, after=12 * MB, seconds=30)]
    env = {**os.environ, "LOCALRUN_DOWNLOAD_TIMEOUT": "60"}
    proc = subprocess.Popen(cli_command("pull", f"{SMOL}:Q4_1"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part = tmp_path / "models" / ".downloads" / SMOL / (Q4 + ".part")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not part.exists() or part.stat().st_size < 8 * MB):
            time.sleep(0.05)
        assert part.exists() and part.stat().st_size >= 8 * MB, "the first pull never got going"
    finally:
        proc.kill()
        proc.wait()
    have = part.stat().st_size
    assert not installed(tmp_path).exists()
    hubenv.faults = []
    hubenv.log.clear()
    res = subprocess.run(cli_command("pull", f"{SMOL}:Q4_1"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{SMOL}:Q4_1 -> {installed(tmp_path)}"
    assert file_gets(hubenv, Q4) == [f"bytes={have}-"]
    assert sha256(installed(tmp_path)) == sha256(smollm2_gguf)
    assert_clean(tmp_path)


def test_split_model_lands_whole(hubenv, tmp_path, smollm2_gguf):
    _, path = pull("test-org/split-GGUF:Q4_1")
    folder = tmp_path / "models" / "test-org" / "split-GGUF" / "Q4_1"
    assert path == folder / "smol-Q4_1-00001-of-00002.gguf"
    joined = path.read_bytes() + (folder / "smol-Q4_1-00002-of-00002.gguf").read_bytes()
    assert hashlib.sha256(joined).hexdigest() == sha256(smollm2_gguf)
    (m,) = list_models()
    assert (m.name, m.size_bytes) == ("test-org/split-GGUF:Q4_1", smollm2_gguf.stat().st_size)


def test_mlx_repo_lands_as_one_folder(hubenv, tmp_path, smollm2_mlx):
    repo = "mlx-community/SmolLM2-135M-Instruct-f16"
    plan, path = pull(repo)
    assert path == tmp_path / "models" / repo and plan.variant.format == "mlx"
    names = sorted(p.name for p in smollm2_mlx.iterdir() if p.is_file())
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == names
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == sorted(f".{n}.verified" for n in names)
    assert sha256(path / "model.safetensors") == sha256(smollm2_mlx / "model.safetensors")
    assert resolve_model(repo) == path
    assert_clean(tmp_path)


def hash_calls(monkeypatch) -> list[str]:
    """The names of the files the puller hashes from disk (installed files and resumed parts)."""
    calls: list[str] = []
    real = hub._hash_existing

    def counting(path, hasher):
        calls.append(Path(path).name)
        return real(path, hasher)

    monkeypatch.setattr(hub, "_hash_existing", counting)
    return calls


def test_installed_is_proved_by_hash_once_then_remembered(hubenv, tmp_path, smollm2_gguf, monkeypatch):
    _, path = pull(f"{SMOL}:Q4_1")
    marker = hub.verified_marker(path)
    assert marker.name == f".{Q4}.verified"
    st = path.stat()
    assert json.loads(marker.read_text()) == {"hash": "sha256:" + sha256(smollm2_gguf), "size": st.st_size,
                                              "mtime_ns": st.st_mtime_ns}
    calls = hash_calls(monkeypatch)
    hubenv.log.clear()
    assert pull(f"{SMOL}:Q4_1")[1] == path and calls == [] and file_gets(hubenv, Q4) == []  # cheap: no hashing

    marker.unlink()  # installed before markers existed: hashed once, then remembered
    notes: list[str] = []
    pull(f"{SMOL}:Q4_1", announce=notes.append)
    assert calls == [Q4] and file_gets(hubenv, Q4) == [] and marker.exists()
    assert any("checking" in n and Q4 in n for n in notes)
    pull(f"{SMOL}:Q4_1")
    assert calls == [Q4]


def test_a_same_size_corrupt_install_is_downloaded_again(hubenv, tmp_path, smollm2_gguf):
    _, path = pull(f"{SMOL}:Q4_1")
    size = path.stat().st_size
    with open(path, "r+b") as f:  # same size, wrong bytes
        f.seek(size // 2)
        f.write(b"\0" * 4096)
    assert path.stat().st_size == size and sha256(path) != sha256(smollm2_gguf)
    hubenv.log.clear()
    notes: list[str] = []
    assert pull(f"{SMOL}:Q4_1", announce=notes.append)[1] == path
    assert file_gets(hubenv, Q4) == [None] and sha256(path) == sha256(smollm2_gguf)
    assert any("differs from the Hub's file" in n for n in notes)
    assert hub._is_verified(path, next(f for f in list_repo(SMOL)[1] if f.path == Q4))
    assert_clean(tmp_path)


def test_a_corrupt_part_of_a_split_install_is_the_only_one_fetched_again(hubenv, tmp_path):
    _, first = pull("test-org/split-GGUF:Q4_1")
    second = first.with_name("smol-Q4_1-00002-of-00002.gguf")
    good = second.read_bytes()
    second.write_bytes(bytes(b ^ 0xFF for b in good[:64]) + good[64:])
    hubenv.log.clear()
    pull("test-org/split-GGUF:Q4_1")
    assert second.read_bytes() == good
    gets = [p for m, p, _ in hubenv.log if m == "GET" and "/resolve/" in p]
    assert gets == [f"/test-org/split-GGUF/resolve/{COMMIT}/Q4_1/smol-Q4_1-00002-of-00002.gguf"]


def test_a_file_without_a_hash_is_refused_unless_allowed(hubenv, tmp_path, smollm2_gguf, capsys):
    hubenv.no_hash = {Q4}
    with pytest.raises(DownloadError, match=rf"no sha256 .*for {Q4} in {SMOL}.*--allow-unverified"):
        pull(f"{SMOL}:Q4_1")
    assert file_gets(hubenv, Q4) == [] and not installed(tmp_path).exists()
    assert run_cli(["pull", f"{SMOL}:Q4_1"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: the Hub gives no sha256") and err.count("\n") == 1

    assert run_cli(["pull", "--allow-unverified", f"{SMOL}:Q4_1"]) == 0  # told to: downloaded unchecked
    assert sha256(installed(tmp_path)) == sha256(smollm2_gguf)
    assert not hub.verified_marker(installed(tmp_path)).exists()  # nothing to prove it by
    assert_clean(tmp_path)


def test_rm_removes_the_verified_markers(hubenv, tmp_path):
    _, path = pull(f"{SMOL}:Q4_1")
    assert hub.verified_marker(path).exists()
    assert run_cli(["rm", f"{SMOL}:Q4_1"]) == 0
    assert not (tmp_path / "models" / SMOL).exists()  # the repo folder went with its last file


def test_an_installed_file_is_synced_before_its_rename_and_its_folder_after(hubenv, tmp_path, monkeypatch):
    events = record_syncs(monkeypatch)
    _, path = pull(f"{SMOL}:Q4_1")
    ino = path.stat().st_ino
    at = events.index(("replace", ino, path))
    assert ("fsync", "file", ino) == events[at - 1]
    assert events[at + 1] == ("fsync", "dir", path.parent.stat().st_ino)


def test_unsafe_file_names_are_refused_before_any_byte(hubenv, tmp_path):
    with pytest.raises(DownloadError, match="refusing the repo file name '../evil-Q4_0.gguf'"):
        pull("evil/repo:Q4_0")
    assert not [p for p in (tmp_path / "models").rglob("*") if p.is_file()]
    assert not (tmp_path / "evil-Q4_0.gguf").exists()
    assert file_gets(hubenv, "evil-Q4_0.gguf") == []


@pytest.mark.parametrize("name", ["../x.gguf", "a/../../x.gguf", "/etc/x.gguf", "C:/x.gguf", "C:x.gguf",
                                  "\\\\server\\share\\x.gguf", "a\\..\\x.gguf", "", "a//b.gguf", "./x.gguf"])
def test_safe_relpath_refuses(name):
    with pytest.raises(DownloadError, match="refusing"):
        safe_relpath(name)


def test_safe_relpath_keeps_subfolders():
    assert safe_relpath("Q4_K_M/model-00001-of-00002.gguf").parts == ("Q4_K_M", "model-00001-of-00002.gguf")


def test_clear_errors_for_wrong_names(hubenv):
    with pytest.raises(ModelNotFoundError, match=r"has no Q2_K file; available quants: Q4_1, Q8_0"):
        plan_pull(f"{SMOL}:Q2_K")
    with pytest.raises(ModelNotFoundError, match="no model repo test-org/nope"):
        plan_pull("test-org/nope")
    with pytest.raises(ModelNotFoundError, match="holds no GGUF files and no MLX model"):
        plan_pull("test-org/docs-only")
    with pytest.raises(Exception, match="pull takes a Hub repo name"):
        plan_pull("just-a-name")


def test_cli_pull_and_fit_errors_are_one_line(hubenv, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    res = subprocess.run(cli_command("pull", f"{SMOL}:Q4_1"), capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and res.stderr.startswith("error: cannot reach http://127.0.0.1:9")
    assert res.stderr.count("\n") == 1


def test_cli_fit_lists_every_quant_of_a_hub_repo(hubenv):
    res = subprocess.run(cli_command("fit", SMOL, "--memory", "0.25"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("llama, 30 layers, trained context 8192 (test-org/SmolLM2-135M-Instruct-GGUF on the Hub)")
    assert lines[1].split() == ["QUANT", "SIZE", "KV", "NEEDS", "VERDICT"]
    q8, q4 = lines[2], lines[3]  # best quality first
    assert q8.split()[0] == "Q8_0" and q8.endswith("Won't fit")
    assert q4.startswith("*") and q4.split()[1] == "Q4_1" and q4.endswith("CPU")
    assert lines[4].startswith("pick: Q4_1: ") and "of 256 MB free" in lines[4]


def test_variants_group_splits_and_skip_what_cannot_load():
    from localrun.store.hub import RepoFile

    files = [RepoFile(p, 1, "0" * 64, None) for p in (
        "x-Q4_K_M.gguf", "x-Q4_K_M-old.gguf",  # one quant twice: the plainest name
        "Q8_0/x-Q8_0-00001-of-00002.gguf", "Q8_0/x-Q8_0-00002-of-00002.gguf",  # a split set in a folder
        "x-Q2_K-00001-of-00002.gguf",  # part 2 missing from the repo
        "mmproj-x-f16.gguf", "x.gguf", "README.md")]
    got = {v.quant: [f.path for f in v.files] for v in variants(files)}
    assert got == {"Q4_K_M": ["x-Q4_K_M.gguf"], "x": ["x.gguf"],
                   "Q8_0": ["Q8_0/x-Q8_0-00001-of-00002.gguf", "Q8_0/x-Q8_0-00002-of-00002.gguf"]}
