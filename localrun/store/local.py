"""The model store: where models live, what is installed, and what a name means.

One folder (`models_dir()`) holds what `localrun pull` downloads:

    <models_dir>/<org>/<repo>/<file>.gguf   name "org/repo:QUANT"
    <models_dir>/<org>/<repo>/              an MLX model (config.json + *.safetensors), name "org/repo"

Models already downloaded by other tools are used in place, never copied: the Hugging
Face cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) and LM
Studio's models folder (LOCALRUN_LMSTUDIO_MODELS, else ~/.lmstudio/models and
~/.cache/lm-studio/models), both laid out by org and repo as well. When one name is in
several places the localrun store wins, then the Hugging Face cache, then LM Studio.

Downloads in progress live under `<models_dir>/.downloads/` (see hub.py), so a partial
file never sits where a finished model belongs and never shows up here.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from localrun.datafiles import data_dir  # noqa: F401 - the store's folders hang off it; callers import it from here
from localrun.errors import ModelNotFoundError
from localrun.model.paths import model_path_kind
from localrun.model.formats import SPLIT_SUFFIX, quality_rank, quant_from_filename, split_parts

SOURCES = ("localrun", "hf-cache", "lmstudio")
DOWNLOADS = ".downloads"
# "org/repo" or "org/repo:QUANT"; Ollama-style "hf.co/" prefixes are accepted too.
_NAME = re.compile(r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?([\w.\-]+)/([\w.\-]+)(?::([\w.\-]+))?$")


@dataclass(frozen=True)
class StoredModel:
    name: str  # what users type: "org/repo:QUANT" for GGUF, "org/repo" for MLX
    path: Path  # the .gguf file (first part of a split model) or the MLX folder
    format: str  # "gguf" | "mlx"
    quant: str  # "Q4_K_M", "F16", "4bit", ...
    size_bytes: int  # all parts / all weight files
    source: str  # "localrun" | "hf-cache" | "lmstudio"

    @property
    def repo(self) -> str:
        return self.name.split(":", 1)[0]


# -- folders --------------------------------------------------------------------


def models_dir() -> Path:
    """$LOCALRUN_MODELS, else the data folder + /models."""
    env = os.environ.get("LOCALRUN_MODELS")
    return Path(env).expanduser() if env else data_dir() / "models"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (not at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def lmstudio_dirs() -> list[Path]:
    env = os.environ.get("LOCALRUN_LMSTUDIO_MODELS")
    if env is not None:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


# -- reading one model ------------------------------------------------------------


def gguf_quant(path: Path) -> str:
    """The quant of a GGUF file: its name's quant token, else the header's file type."""
    named = quant_from_filename(path.name)
    if named:
        return named
    from localrun.model.facts import facts

    try:
        return facts(path).quant
    except Exception:  # an unreadable file still lists; `show` and `run` explain the flaw
        return "unknown"


def mlx_quant(folder: Path) -> str:
    """"4bit" etc. from config.json's quantization block, else the weights' dtype."""
    from localrun.model.facts import mlx_quant as quant_of_config

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unknown"
    return quant_of_config(config) if isinstance(config, dict) else "unknown"


def _file_size(p: Path) -> int:
    try:
        return p.stat().st_size  # follows the HF cache's symlinks to the blobs
    except OSError:
        return 0


def _is_mlx_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _models_in_repo(folder: Path, name: str, source: str) -> list[StoredModel]:
    """The models inside one repo folder (a store repo, an HF snapshot, an LM Studio repo)."""
    found: list[StoredModel] = []
    if _is_mlx_folder(folder):
        size = sum(_file_size(p) for p in folder.glob("*.safetensors"))
        found.append(StoredModel(name, folder, "mlx", mlx_quant(folder), size, source))
    for f in sorted(folder.rglob("*.gguf")):
        if f.name.lower().startswith("mmproj") or any(part.startswith(".") for part in f.relative_to(folder).parts):
            continue  # vision projectors are not chat models; hidden folders hold downloads
        m = SPLIT_SUFFIX.search(f.name)
        if m and int(m.group(1)) != 1:
            continue
        parts = split_parts(f)
        if parts is None:
            continue  # an incomplete split model cannot load
        quant = gguf_quant(f)
        found.append(StoredModel(f"{name}:{quant}", f, "gguf", quant, sum(_file_size(p) for p in parts), source))
    return found


def _org_repo_folders(root: Path):
    """(org, repo, folder) for every <root>/<org>/<repo>/ folder."""
    try:
        orgs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return
    for org in orgs:
        try:
            repos = sorted(p for p in org.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:  # an unreadable folder hides its models, it does not break the listing
            continue
        for repo in repos:
            yield org.name, repo.name, repo


def _hf_snapshot(repo_cache: Path) -> Path | None:
    """The snapshot `refs/main` points at, else the newest one."""
    snaps = repo_cache / "snapshots"
    ref = repo_cache / "refs" / "main"
    try:
        if ref.is_file():
            commit = ref.read_text(encoding="utf-8").strip()
            if (snaps / commit).is_dir():
                return snaps / commit
        candidates = sorted((p for p in snaps.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return candidates[-1] if candidates else None


def _scan_store() -> list[StoredModel]:
    out: list[StoredModel] = []
    for org, repo, folder in _org_repo_folders(models_dir()):
        out += _models_in_repo(folder, f"{org}/{repo}", "localrun")
    return out


def _scan_hf_cache() -> list[StoredModel]:
    out: list[StoredModel] = []
    root = hf_cache_dir()
    try:
        repos = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("models--"))
    except OSError:
        return out
    for repo_cache in repos:
        org_repo = repo_cache.name[len("models--"):].split("--", 1)
        snap = _hf_snapshot(repo_cache)
        if len(org_repo) == 2 and snap is not None:
            out += _models_in_repo(snap, "/".join(org_repo), "hf-cache")
    return out


def _scan_lmstudio() -> list[StoredModel]:
    out: list[StoredModel] = []
    for root in lmstudio_dirs():
        for org, repo, folder in _org_repo_folders(root):
            out += _models_in_repo(folder, f"{org}/{repo}", "lmstudio")
    return out


def list_models() -> list[StoredModel]:
    """Every installed model, sorted by name; a name found in two places keeps the first source."""
    seen: dict[str, StoredModel] = {}
    for model in _scan_store() + _scan_hf_cache() + _scan_lmstudio():
        seen.setdefault(model.name.lower(), model)
    return sorted(seen.values(), key=lambda m: m.name.lower())


# -- names -------------------------------------------------------------------------


def parse_name(name: str) -> tuple[str, str | None] | None:
    """("org/repo", "QUANT" or None) for a model name, None when it is not one."""
    m = _NAME.match(name.strip())
    if not m or m.group(1) in (".", "..") or m.group(2) in (".", ".."):
        return None
    return f"{m.group(1)}/{m.group(2)}", m.group(3)


def is_store_name(text: str) -> bool:
    """A name the store resolves ("org/repo[:QUANT]"), not something to read as a path."""
    return parse_name(text) is not None and not _looks_like_path(text)


def _looks_like_path(text: str) -> bool:
    return (text.startswith(("/", "./", "../", "~", "\\")) or text.lower().endswith(".gguf")
            or (len(text) > 1 and text[1] == ":"))


def best_installed(candidates: list[StoredModel]) -> StoredModel:
    """The best quant that fits this machine, else the smallest (it has the best chance to run)."""
    from localrun.quant.selector import fit_verdict

    fitting = [m for m in candidates if fit_verdict(m.path) != "Won't fit"]
    if fitting:
        return max(fitting, key=lambda m: (quality_rank(m.quant), -m.size_bytes))
    return min(candidates, key=lambda m: m.size_bytes)


def find_models(name: str, installed: list[StoredModel] | None = None) -> list[StoredModel]:
    """Installed models that a name stands for: one for "org/repo:QUANT", all of a repo for
    "org/repo". `installed` is a listing to search instead of scanning the folders again."""
    parsed = parse_name(name)
    if parsed is None:
        return []
    repo, quant = parsed
    listing = list_models() if installed is None else installed
    same_repo = [m for m in listing if m.repo.lower() == repo.lower()]
    if quant is None:
        return same_repo
    return [m for m in same_repo if m.quant.lower() == quant.lower()]


def resolve_model(name_or_path: str) -> Path:
    """A path that exists passes through; a store name resolves; else ModelNotFoundError.

    "org/repo:Q4_K_M" is that quant; "org/repo" alone is its MLX model, or the best
    installed GGUF quant of it.
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return model_path_kind(path)[0]
    parsed = parse_name(text)
    if parsed is None or _looks_like_path(text):
        raise ModelNotFoundError(
            f"no model at {path}: give a .gguf file, an MLX model folder, or a name like org/repo:Q4_K_M"
        )
    return resolve_installed(text)


def resolve_installed(name: str, installed: list[StoredModel] | None = None) -> Path:
    """The installed model a store name stands for (never a path on disk); `installed` is a
    listing to search instead of scanning the folders again."""
    parsed = parse_name(name)
    if parsed is None:
        raise ModelNotFoundError(f"{name} is not a model name: give one like org/repo:Q4_K_M")
    repo, quant = parsed
    same_repo = find_models(repo, installed)
    if not same_repo:
        raise ModelNotFoundError(
            f"{name} is not installed (looked in {models_dir()}, the Hugging Face cache and LM Studio);"
            f" run `localrun pull {name}` or see `localrun ls`"
        )
    if quant is None:
        # MLX is the fast path on Apple Silicon only; elsewhere a GGUF of the repo wins.
        apple = sys.platform == "darwin" and platform.machine() == "arm64"
        mlx = [m for m in same_repo if m.format == "mlx"]
        gguf = [m for m in same_repo if m.format == "gguf"]
        if mlx and (apple or not gguf):
            return mlx[0].path
        return best_installed(gguf).path
    for m in same_repo:
        if m.quant.lower() == quant.lower():
            return m.path
    have = ", ".join(sorted({m.quant for m in same_repo}))
    raise ModelNotFoundError(
        f"{repo} has no {quant} installed (installed: {have}); run `localrun pull {repo}:{quant}`"
    )


# -- facts for `localrun show` ------------------------------------------------------------


def _capabilities(f, extra: list[str]) -> str:
    caps = ["completion"]
    if f.chat_template:
        caps.append("chat")
        if f.has_tools:
            caps.append("tools")
        if "<think>" in f.chat_template or "enable_thinking" in f.chat_template:
            caps.append("thinking")
    return ", ".join(caps + extra)


def model_facts(name_or_path: str) -> dict:
    """What `localrun show` prints: localrun.model.facts' facts, the store's quant name and
    the files beside the model (a vision projector)."""
    path = resolve_model(name_or_path)
    from localrun.model.facts import facts as read_facts
    from localrun.quant.selector import weights_bytes

    f = read_facts(path)
    extra = (["fill-in-the-middle"] if f.has_fim else []) + (["embedding"] if f.pooling_type is not None else [])
    if f.format == "gguf" and any(p.name.lower().startswith("mmproj") for p in path.parent.glob("*.gguf")):
        extra.append("vision (mmproj file beside it)")
    return {"path": str(path), "format": f.format, "architecture": f.architecture,
            "parameters": _human_count(f.n_params), "context length": f.context_length or "unknown",
            "quant": gguf_quant(path) if f.format == "gguf" else f.quant,
            "size": f"{weights_bytes(path) / (1 << 30):.2f} GB", "capabilities": _capabilities(f, extra),
            "chat template": f.chat_template}


def _human_count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit} ({n:,})"
    return str(n)
