"""The model store: folders, discovery (store, Hugging Face cache, LM Studio), names, and
the `ls` / `rm` / `show` / `ps` commands."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hubserver import run_cli
from localrun.store import local as store
from localrun.errors import ModelNotFoundError
from localrun.store.local import StoredModel, list_models, models_dir, resolve_model


@pytest.fixture(autouse=True)
def folders(tmp_path, monkeypatch):
    """Every test gets empty store, HF cache and LM Studio folders: never the user's models."""
    roots = {"models": tmp_path / "models", "hf": tmp_path / "hf-cache", "lms": tmp_path / "lmstudio"}
    for p in roots.values():
        p.mkdir()
    monkeypatch.setenv("LOCALRUN_MODELS", str(roots["models"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(roots["hf"]))
    monkeypatch.setenv("LOCALRUN_LMSTUDIO_MODELS", str(roots["lms"]))
    monkeypatch.delenv("LOCALRUN_MEMORY_GB", raising=False)
    return roots


def put(path: Path, data: bytes | Path = b"x" * 100) -> Path:
    """A file in a fake layout: bytes, or a symlink to a real model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, Path):
        path.symlink_to(data)
    else:
        path.write_bytes(data)
    return path


def hf_cache_file(root: Path, repo: str, name: str, data: bytes | Path, commit: str = "abc123") -> Path:
    """The Hugging Face cache layout: blobs, a snapshot symlink, refs/main."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    blob = put(repo_dir / "blobs" / f"blob-{name}", data)
    snap = repo_dir / "snapshots" / commit / name
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    put(repo_dir / "refs" / "main", commit.encode())
    return snap


def test_folders_follow_the_environment_and_the_platform(tmp_path, monkeypatch):
    assert models_dir() == tmp_path / "models"
    monkeypatch.delenv("LOCALRUN_MODELS")
    monkeypatch.setenv("LOCALRUN_DATA", str(tmp_path / "data"))
    assert models_dir() == tmp_path / "data" / "models"
    monkeypatch.delenv("LOCALRUN_DATA")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    expected = (Path.home() / "Library/Application Support/localrun" if store.sys.platform == "darwin"
                else tmp_path / "xdg" / "localrun")
    assert store.data_dir() == expected
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert store.hf_cache_dir() == tmp_path / "hfhome" / "hub"


def test_discovery_in_all_three_places(folders, smollm2_gguf, smollm2_mlx):
    put(folders["models"] / "bartowski" / "Qwen2.5-7B-Instruct-GGUF" / "Qwen2.5-7B-Instruct-Q4_K_M.gguf", b"a" * 300)
    put(folders["models"] / "bartowski" / "Qwen2.5-7B-Instruct-GGUF" / "Qwen2.5-7B-Instruct-Q8_0.gguf", b"a" * 500)
    put(folders["models"] / "test-org" / "smol" / "model.gguf", smollm2_gguf)  # quant from the header
    mlx = folders["models"] / "mlx-community" / "SmolLM2-mlx"
    mlx.parent.mkdir(parents=True)
    mlx.symlink_to(smollm2_mlx, target_is_directory=True)
    hf_cache_file(folders["hf"], "unsloth/gemma-3-GGUF", "gemma-3-Q6_K.gguf", b"g" * 700)
    put(folders["lms"] / "lmstudio-community" / "Phi-4-GGUF" / "phi-4-IQ4_XS.gguf", b"p" * 900)
    got = {m.name: m for m in list_models()}
    assert sorted(got) == ["bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M", "bartowski/Qwen2.5-7B-Instruct-GGUF:Q8_0",
                           "lmstudio-community/Phi-4-GGUF:IQ4_XS", "mlx-community/SmolLM2-mlx",
                           "test-org/smol:Q4_1", "unsloth/gemma-3-GGUF:Q6_K"]
    assert got["unsloth/gemma-3-GGUF:Q6_K"].source == "hf-cache"
    assert got["unsloth/gemma-3-GGUF:Q6_K"].size_bytes == 700  # the blob's size, through the symlink
    assert got["lmstudio-community/Phi-4-GGUF:IQ4_XS"].source == "lmstudio"
    m = got["mlx-community/SmolLM2-mlx"]
    assert (m.format, m.quant, m.source) == ("mlx", "F16", "localrun")
    assert m.size_bytes == (smollm2_mlx / "model.safetensors").stat().st_size


def test_split_models_partial_downloads_and_projectors(folders):
    repo = folders["models"] / "org" / "big-GGUF"
    put(repo / "big-Q4_K_M-00001-of-00002.gguf", b"1" * 10)
    put(repo / "big-Q4_K_M-00002-of-00002.gguf", b"2" * 20)
    put(repo / "big-Q8_0-00001-of-00003.gguf", b"1" * 10)  # parts 2 and 3 missing: not loadable
    put(repo / "mmproj-big-F16.gguf")  # a vision projector, not a model
    put(folders["models"] / ".downloads" / "org" / "big-GGUF" / "big-Q6_K.gguf.part")
    (models,) = list_models()
    assert (models.name, models.size_bytes) == ("org/big-GGUF:Q4_K_M", 30)
    assert models.path.name == "big-Q4_K_M-00001-of-00002.gguf"


def test_mlx_quant_from_config(folders):
    folder = folders["models"] / "mlx-community" / "Qwen3-4B-4bit"
    put(folder / "config.json", json.dumps({"model_type": "qwen3", "quantization": {"group_size": 64, "bits": 4}}).encode())
    put(folder / "model.safetensors", b"w" * 64)
    (m,) = list_models()
    assert (m.name, m.quant, m.format) == ("mlx-community/Qwen3-4B-4bit", "4bit", "mlx")
    put(folder.with_name("no-weights") / "config.json", b"{}")  # config without weights: not a model
    assert len(list_models()) == 1


def test_store_wins_over_the_hf_cache_for_the_same_name(folders):
    hf_cache_file(folders["hf"], "org/repo", "repo-Q4_K_M.gguf", b"h" * 10)
    put(folders["models"] / "org" / "repo" / "repo-Q4_K_M.gguf", b"s" * 10)
    (m,) = list_models()
    assert m.source == "localrun" and resolve_model("org/repo:Q4_K_M") == m.path


def test_resolve_names_and_paths(folders, smollm2_gguf, monkeypatch):
    repo = folders["models"] / "org" / "smol-GGUF"
    q4 = put(repo / "smol-Q4_1.gguf", smollm2_gguf)
    q8 = put(repo / "smol-Q8_0.gguf", smollm2_gguf)
    assert resolve_model(str(smollm2_gguf)) == smollm2_gguf  # a path passes through
    assert resolve_model("org/smol-GGUF:Q4_1") == q4
    assert resolve_model("ORG/smol-gguf:q8_0") == q8  # Hub names are case-insensitive
    assert resolve_model("hf.co/org/smol-GGUF:Q4_1") == q4
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "8")
    assert resolve_model("org/smol-GGUF") == q8  # the best quant that fits
    with pytest.raises(ModelNotFoundError, match=r"org/smol-GGUF has no Q2_K installed \(installed: Q4_1, Q8_0\)"):
        resolve_model("org/smol-GGUF:Q2_K")
    with pytest.raises(ModelNotFoundError, match="localrun pull org/other"):
        resolve_model("org/other")
    with pytest.raises(ModelNotFoundError, match="no model at"):
        resolve_model("./missing.gguf")
    with pytest.raises(ModelNotFoundError, match="no model at"):
        resolve_model("/abs/dir/model")


def test_bare_name_picks_the_smallest_when_nothing_fits(folders, monkeypatch):
    repo = folders["models"] / "org" / "r"
    put(repo / "r-Q8_0.gguf", b"8" * 800)
    small = put(repo / "r-Q2_K.gguf", b"2" * 200)
    monkeypatch.setenv("LOCALRUN_MEMORY_GB", "0.000001")
    assert resolve_model("org/r") == small  # fake files: no header, nothing fits; the smallest has the best chance


def test_ls_shows_verdicts(folders, smollm2_gguf, capsys, monkeypatch):
    put(folders["models"] / "org" / "smol" / "smol-Q4_1.gguf", smollm2_gguf)
    assert run_cli(["ls", "--memory", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FORMAT", "QUANT", "SIZE", "FIT", "SOURCE", "DRAFTS", "FOR"]
    assert out[1].split() == ["org/smol:Q4_1", "gguf", "Q4_1", "94", "MB", "CPU", "localrun", "-"]
    assert run_cli(["ls", "--memory", "0.1"]) == 0
    assert "Won't fit" in capsys.readouterr().out
    monkeypatch.setenv("LOCALRUN_MODELS", str(folders["models"] / "empty"))
    assert run_cli(["ls"]) == 0
    assert "localrun pull" in capsys.readouterr().out


def test_ls_and_show_mark_which_model_drafts_for_which(folders, smollm2_gguf, qwen_coder_gguf, qwen_coder_15b_gguf,
                                                      capsys):
    """Qwen2.5-Coder-0.5B and -1.5B share a vocabulary: the smaller one drafts for the
    bigger (`--draft`); SmolLM2's vocabulary pairs with neither. Read from the files'
    token lists, no model loaded."""
    put(folders["models"] / "Qwen" / "coder-0.5b" / "coder-Q4_K_M.gguf", qwen_coder_gguf)
    put(folders["models"] / "Qwen" / "coder-1.5b" / "coder-Q4_K_M.gguf", qwen_coder_15b_gguf)
    put(folders["models"] / "org" / "smol" / "smol-Q4_1.gguf", smollm2_gguf)
    assert run_cli(["ls", "--memory", "8"]) == 0
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {"Qwen/coder-0.5b:Q4_K_M": "Qwen/coder-1.5b:Q4_K_M", "Qwen/coder-1.5b:Q4_K_M": "-",
                    "org/smol:Q4_1": "-"}
    assert run_cli(["show", "Qwen/coder-1.5b:Q4_K_M"]) == 0
    out = capsys.readouterr().out
    assert "drafts for      -" in out and "drafted by      Qwen/coder-0.5b:Q4_K_M" in out
    assert run_cli(["show", str(qwen_coder_gguf)]) == 0  # a path outside the store is compared too
    assert "drafts for      Qwen/coder-1.5b:Q4_K_M" in capsys.readouterr().out


def test_fit_counts_the_draft_models_memory_first(folders, qwen_coder_gguf, qwen_coder_15b_gguf, capsys):
    """`fit --draft`: the draft's weights, KV and buffers come out of the memory before the
    model's quant is chosen, so a budget the model alone fits may not fit both."""
    big = qwen_coder_15b_gguf
    assert run_cli(["fit", str(big), "--memory", "2.2"]) == 0
    assert "pick: Q4_K_M" in capsys.readouterr().out
    assert run_cli(["fit", str(big), "--memory", "2.2", "--draft", str(qwen_coder_gguf)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("draft model: draft: 469 MB weights") and "nothing fits" in out
    assert run_cli(["fit", str(big), "--memory", "2.2", "--draft", "org/none"]) == 2


def test_rm_deletes_store_models_only(folders, capsys):
    repo = folders["models"] / "org" / "big"
    put(repo / "big-Q4_K_M-00001-of-00002.gguf")
    put(repo / "big-Q4_K_M-00002-of-00002.gguf")
    hf_cache_file(folders["hf"], "org/cached", "cached-Q4_0.gguf", b"c")
    assert run_cli(["rm", "org/big:Q4_K_M"]) == 0
    assert "deleted org/big:Q4_K_M" in capsys.readouterr().out
    assert not (folders["models"] / "org").exists()  # empty repo and org folders go too
    assert run_cli(["rm", "org/cached:Q4_0"]) == 1
    assert "Hugging Face cache" in capsys.readouterr().err
    assert run_cli(["rm", "org/nothing"]) == 2
    assert capsys.readouterr().err.startswith("error: org/nothing is not installed")


def test_rm_of_a_bare_name_with_several_quants_asks_for_one(folders, capsys):
    put(folders["models"] / "org" / "r" / "r-Q4_0.gguf")
    put(folders["models"] / "org" / "r" / "r-Q8_0.gguf")
    assert run_cli(["rm", "org/r"]) == 1
    assert "several models installed" in capsys.readouterr().err
    assert len(list_models()) == 2


def test_show_gguf_and_mlx(folders, smollm2_gguf, gemma3_gguf, smollm2_mlx, capsys):
    put(folders["models"] / "org" / "smol" / "smol-Q4_1.gguf", smollm2_gguf)
    assert run_cli(["show", "org/smol:Q4_1"]) == 0
    out = capsys.readouterr().out
    assert "architecture    llama" in out and "134.5M" in out and "context length  8192" in out
    assert "capabilities    completion, chat" in out and "<|im_start|>" in out
    assert run_cli(["show", str(gemma3_gguf)]) == 0
    out = capsys.readouterr().out
    assert "gemma3" in out and "Q4_K_M" in out and "chat template" not in out  # a base model
    assert run_cli(["show", str(smollm2_mlx), "--template"]) == 0
    out = capsys.readouterr().out
    assert "format          mlx" in out and "134.5M" in out
    assert run_cli(["show", "org/none"]) == 2


class _PsHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        body = json.dumps({"models": [{"name": "org/smol:Q4_1", "model": "org/smol:Q4_1", "size": 250 << 20,
                                       "size_vram": 0, "expires_at": "2026-01-01T00:05:00Z", "details": {}}]}).encode()
        self.send_response(200 if self.path == "/api/ps" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep test output clean
        pass


def test_ps_talks_to_the_server(monkeypatch, capsys):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _PsHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("LOCALRUN_HOST", f"127.0.0.1:{httpd.server_address[1]}")
        assert run_cli(["ps"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split() == ["NAME", "SIZE", "GPU", "MEMORY", "UNTIL"]
        assert out[1].split()[:3] == ["org/smol:Q4_1", "250", "MB"]
    finally:
        httpd.shutdown()
        httpd.server_close()
    monkeypatch.setenv("LOCALRUN_HOST", f"http://127.0.0.1:{httpd.server_address[1]}")  # closed now
    assert run_cli(["ps"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no localrun server is running at http://127.0.0.1:") and "localrun serve" in err
    assert err.count("\n") == 1


def test_stored_model_repo_property():
    m = StoredModel("org/repo:Q4_K_M", Path("x.gguf"), "gguf", "Q4_K_M", 1, "localrun")
    assert m.repo == "org/repo"
