"""`localrun pull`: list a Hugging Face repo, pick a quant, download it safely.

Listing goes through huggingface_hub's HfApi (file names, sizes and the LFS sha256 of
each file). Downloading is our own, because the Hub client checks only sizes:

- a file downloads to `<models_dir>/.downloads/<org>/<repo>/<file>.part`, beside a
  small `.json` that records which file (size and sha256) the bytes belong to;
- an interrupted download (a cut connection, a stall, a killed process) resumes with a
  Range request from the bytes already on disk; a server that answers a Range request
  with the whole file (200) is read from the start again;
- every LFS file is checked against the sha256 the Hub published (other files against
  their git blob id); a mismatch deletes the bytes and downloads once more, then fails;
- only verified files are renamed into the store (fsynced first, their folder after),
  the first part of a split model last, an MLX folder as a whole: nothing partial ever
  sits where a finished model belongs;
- a file the Hub gives no hash for (no LFS sha256, no git blob id) is refused before any
  byte is fetched, unless the caller allows unverified files;
- "already installed" is proved by hash once; a hidden `.<name>.verified` beside the file
  (hash, size, mtime) spares later pulls the hashing until the file changes, and a
  same-size corrupt file is downloaded again.

HF_ENDPOINT is read at each call (huggingface_hub reads it once, at import), so tests
can point a running process at a local Hub-like server.
LOCALRUN_DOWNLOAD_TIMEOUT (seconds without a byte before a retry, default 30) and
LOCALRUN_DOWNLOAD_RETRIES (default 5) tune the downloader.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable
from urllib.parse import quote

from localrun.errors import BadRequestError, LocalrunError, ModelNotFoundError
from localrun.quant.atomic import atomic_output, replace_durably
from localrun.model.formats import SPLIT_SUFFIX, quant_from_filename
from localrun.store.local import DOWNLOADS, models_dir, parse_name

CHUNK = 1 << 20
MLX_FILE_TYPES = (".json", ".safetensors", ".txt", ".model", ".tiktoken", ".jinja")
Progress = Callable[[str, int, int], None]  # (file name, bytes done, bytes total)


class DownloadError(LocalrunError):
    exit_code = 4


@dataclass(frozen=True)
class RepoFile:
    path: str  # relative to the repo root, "/"-separated
    size: int
    sha256: str | None  # LFS files
    git_oid: str | None  # git blob sha1 (files kept in git itself)


@dataclass(frozen=True)
class Variant:
    """One downloadable model in a repo: a GGUF quant (maybe split) or the MLX folder."""

    quant: str
    format: str  # "gguf" | "mlx"
    files: tuple[RepoFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise BadRequestError(f"{name} must be a number, got {os.environ[name]!r}") from None


def safe_relpath(name: str) -> PurePosixPath:
    """A repo file name as a relative path, or an error: no `..`, absolute, drive or UNC paths."""
    if (not name or "\\" in name or "\x00" in name or name.startswith("/")
            or (len(name) > 1 and name[1] == ":")):
        raise DownloadError(f"refusing the repo file name {name!r}: it is not a plain relative path")
    parts = name.split("/")  # split by hand: PurePosixPath would quietly drop "." and empty parts
    if any(part in ("", ".", "..") for part in parts) or ":" in parts[0]:
        raise DownloadError(f"refusing the repo file name {name!r}: it leaves the model folder")
    return PurePosixPath(*parts)


# -- listing ------------------------------------------------------------------------


def _transport_errors() -> tuple[type[Exception], ...]:
    """Connection failures of the HTTP client huggingface_hub uses (httpx, or httpx2 in 2.x)."""
    import httpx

    errors: list[type[Exception]] = [httpx.TransportError, OSError]
    try:
        import httpx2

        errors.append(httpx2.TransportError)
    except ImportError:  # older huggingface_hub speaks httpx only; its errors are already listed
        pass
    return tuple(errors)


def list_repo(repo: str, revision: str | None = None) -> tuple[str, list[RepoFile]]:
    """(commit sha, files) of a model repo, with sizes and hashes."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    try:
        info = HfApi(endpoint=endpoint()).model_info(repo, revision=revision, files_metadata=True)
    except hf_errors.GatedRepoError:
        raise DownloadError(f"{repo} is gated: accept its terms on the Hub, then log in with `hf auth login`") from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelNotFoundError(f"no model repo {repo} on {endpoint()} (or it is private); check the name") from None
    except hf_errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo} has no revision {revision}") from None
    except hf_errors.HfHubHTTPError as exc:
        raise DownloadError(f"the Hub refused to list {repo}: {str(exc).splitlines()[0]}") from None
    except _transport_errors() as exc:
        raise DownloadError(f"cannot reach {endpoint()}: {exc}; check the connection or HF_ENDPOINT") from None
    files = [RepoFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                      s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id)
             for s in info.siblings or []]
    return str(info.sha or revision or "main"), files


def variants(files: list[RepoFile]) -> list[Variant]:
    """The GGUF quants of a repo (split parts grouped), or its MLX model."""
    groups: dict[str, list[RepoFile]] = {}
    for f in files:
        base = f.path.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        quant = quant_from_filename(f.path) or SPLIT_SUFFIX.sub("", base).removesuffix(".gguf")
        groups.setdefault(quant, []).append(f)
    out = []
    for quant, group in groups.items():
        group.sort(key=lambda f: f.path)
        m = SPLIT_SUFFIX.search(group[0].path)
        if m and len(group) != int(m.group(2)):
            continue  # a split set with parts missing from the repo cannot load
        if not m and len(group) > 1:  # two files of one quant ("x-Q4_K_M.gguf", "x-Q4_K_M-v2.gguf"): the plainest
            group = [min(group, key=lambda f: (len(f.path), f.path))]
        out.append(Variant(quant, "gguf", tuple(group)))
    names = {f.path for f in files}
    if "config.json" in names and any(n.endswith(".safetensors") and "/" not in n for n in names):
        keep = tuple(f for f in files if "/" not in f.path and f.path.endswith(MLX_FILE_TYPES))
        out.append(Variant("mlx", "mlx", keep))
    return out


# -- reading a remote GGUF header --------------------------------------------------


def remote_header(repo: str, revision: str, f: RepoFile):
    """The validated GGUF header of a remote file, from its first bytes (Range requests):
    4 MiB first, then at least what the reader asks for (4x more each time)."""
    import httpx
    from huggingface_hub.utils import build_hf_headers

    from localrun.model.gguf_header import MAX_HEADER_BYTES, MalformedGGUFError, NeedMoreBytes, read_header_prefix

    url = file_url(repo, revision, f.path)
    size = f.size or None  # a listing without a size: the reader bounds the header itself
    want = min(4 << 20, size or 4 << 20)
    while True:
        buf = bytearray()
        try:
            with httpx.stream("GET", url, headers={**build_hf_headers(), "Range": f"bytes=0-{want - 1}"},
                              follow_redirects=True, timeout=_env_number("LOCALRUN_DOWNLOAD_TIMEOUT", 30)) as r:
                if r.status_code not in (200, 206):
                    raise DownloadError(f"cannot read the header of {f.path}: HTTP {r.status_code}")
                for chunk in r.iter_bytes(CHUNK):
                    buf += chunk
                    if len(buf) >= want:
                        break  # a server that ignored the Range: stop reading the whole file
        except httpx.HTTPError as exc:
            raise DownloadError(f"cannot read the header of {f.path}: {exc}") from None
        try:
            return read_header_prefix(bytes(buf[:want]), size, f"{repo}/{f.path}")
        except MalformedGGUFError as exc:
            raise DownloadError(f"the GGUF header of {f.path} in {repo} is malformed ({exc.reason} at byte"
                                f" {exc.offset}); this file cannot load") from None
        except NeedMoreBytes as more:
            if len(buf) < want:  # the server ended the body early: asking again gets no further
                raise DownloadError(f"{endpoint()} sent only {len(buf)} bytes of the header of {f.path}") from None
            want = min(max(want * 4, more.at_least), size or MAX_HEADER_BYTES, MAX_HEADER_BYTES)


def remote_shape(repo: str, revision: str, f: RepoFile):
    """The selector's ModelShape of a remote GGUF, from its header alone: the model facts
    (localrun.model.facts) and the tensor sizes, as for a local file."""
    from localrun.quant.selector import shape_from_gguf

    header = remote_header(repo, revision, f)
    return shape_from_gguf(header.metadata, header.tensors)


# -- downloading --------------------------------------------------------------------


def file_url(repo: str, revision: str, path: str) -> str:
    return f"{endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(path)}"


class _Retry(Exception):
    """A transient failure: resume from the bytes on disk."""


def _hash_existing(part: Path, hasher) -> int:
    n = 0
    with open(part, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
            n += len(chunk)
    return n


def _new_hasher(f: RepoFile):
    if f.sha256:
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(f"blob {f.size}\0".encode())  # git's blob id: sha1 of this header + content
    return h


def _fetch(client, url: str, part: Path, f: RepoFile, hasher, progress: Progress | None):
    """Append the missing bytes of `f` to `part`. Returns the hasher (new if restarted)."""
    import httpx

    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        with client.stream("GET", url, headers=headers) as r:
            if r.status_code in (404, 401, 403):
                raise DownloadError(f"{f.path}: HTTP {r.status_code} from {endpoint()}")
            if r.status_code == 416 or r.status_code >= 500 or r.status_code == 429:
                raise _Retry(f"HTTP {r.status_code}")
            if r.status_code == 206:
                start = r.headers.get("content-range", "").removeprefix("bytes ").split("-", 1)[0]
                if start != str(have):
                    raise _Retry(f"asked for bytes from {have}, got {r.headers.get('content-range')!r}")
            elif r.status_code == 200:
                if have:  # the server ignored our Range: the body is the whole file
                    have, hasher = 0, _new_hasher(f)
            else:
                raise DownloadError(f"{f.path}: unexpected HTTP {r.status_code} from {endpoint()}")
            with open(part, "r+b" if part.exists() else "wb") as out:
                out.seek(have)
                out.truncate()
                for chunk in r.iter_bytes(CHUNK):
                    if have + len(chunk) > f.size:
                        out.truncate(0)
                        raise _Retry(f"the server sent more than the {f.size} bytes of {f.path}")
                    out.write(chunk)
                    hasher.update(chunk)
                    have += len(chunk)
                    if progress:
                        progress(f.path, have, f.size)
                out.flush()
                os.fsync(out.fileno())
    except httpx.HTTPError as exc:  # connection cut, stall (read timeout), refused
        raise _Retry(f"{type(exc).__name__}: {exc}") from None
    if have < f.size:
        raise _Retry(f"connection closed at {have} of {f.size} bytes")
    return hasher


def download_file(repo: str, revision: str, f: RepoFile, part: Path, progress: Progress | None = None) -> Path:
    """Download (or resume) one repo file into `part` and verify it; returns `part`."""
    import httpx
    from huggingface_hub.utils import build_hf_headers

    part.parent.mkdir(parents=True, exist_ok=True)
    meta = part.with_name(part.name + ".json")
    expected = {"path": f.path, "size": f.size, "sha256": f.sha256, "git_oid": f.git_oid}
    try:
        if json.loads(meta.read_text()) != expected:
            part.unlink(missing_ok=True)  # bytes of another version of the file
    except (OSError, ValueError):
        part.unlink(missing_ok=True)
    meta.write_text(json.dumps(expected))
    retries = int(_env_number("LOCALRUN_DOWNLOAD_RETRIES", 5))
    stall = _env_number("LOCALRUN_DOWNLOAD_TIMEOUT", 30)
    url = file_url(repo, revision, f.path)
    failures, mismatches = 0, 0
    timeout = httpx.Timeout(stall, connect=min(stall, 30))
    with httpx.Client(headers=build_hf_headers(), follow_redirects=True, timeout=timeout) as client:
        while True:
            hasher = _new_hasher(f)
            if part.exists() and part.stat().st_size > f.size:
                part.unlink()
            have = _hash_existing(part, hasher) if part.exists() else 0
            if have < f.size:
                try:
                    hasher = _fetch(client, url, part, f, hasher, progress)
                except _Retry as why:
                    gained = (part.stat().st_size if part.exists() else 0) > have
                    failures = 0 if gained else failures + 1
                    if failures > retries:
                        raise DownloadError(f"downloading {f.path} failed {retries + 1} times in a row ({why});"
                                            " run the same pull again to resume") from None
                    time.sleep(min(0.1 * 2 ** failures, 5.0))
                    continue
            want = f.sha256 or f.git_oid
            if want and hasher.hexdigest() != want.lower():
                part.unlink()
                mismatches += 1
                if mismatches > 1:
                    raise DownloadError(f"{f.path} arrived corrupt twice (sha256 {hasher.hexdigest()[:16]}..., "
                                        f"expected {want[:16]}...); nothing was installed")
                continue
            return part


def _lock(folder: Path):
    """An exclusive lock on a repo's download folder; None where locking is unavailable."""
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / ".lock", "w")
    try:
        import fcntl

        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # Windows: no flock; concurrent pulls of one repo are the user's risk
        pass
    except OSError:
        fh.close()
        raise DownloadError(f"another `localrun pull` is downloading into {folder}; wait for it") from None
    return fh


def _expected_hash(f: RepoFile) -> str | None:
    """What the Hub says the bytes hash to: "sha256:<hex>" (LFS), "git-blob:<hex>", or None."""
    return f"sha256:{f.sha256.lower()}" if f.sha256 else f"git-blob:{f.git_oid.lower()}" if f.git_oid else None


def verified_marker(path: Path) -> Path:
    """The hidden file beside an installed file that records its verified hash."""
    return path.with_name(f".{path.name}.verified")


def _marker_record(path: Path, f: RepoFile) -> dict:
    st = path.stat()
    return {"hash": _expected_hash(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _remember_verified(path: Path, f: RepoFile) -> None:
    """Record that `path` (as it is now: size and mtime) holds the bytes the Hub hashed."""
    if _expected_hash(f) is None:
        return  # downloaded unverified (allowed): there is nothing to remember
    try:
        with atomic_output(verified_marker(path)) as tmp:
            tmp.write_text(json.dumps(_marker_record(path, f)))
    except LocalrunError:
        return  # a read-only store folder: the file is still verified, only the next pull hashes again


def _is_verified(path: Path, f: RepoFile) -> bool:
    """True when the marker says `path` was verified against this hash and has not changed since."""
    try:
        return json.loads(verified_marker(path).read_text()) == _marker_record(path, f)
    except (OSError, ValueError):
        return False


def _holds_expected_bytes(path: Path, f: RepoFile) -> bool:
    """Hash an installed file (once: a match is remembered beside it)."""
    hasher = _new_hasher(f)
    _hash_existing(path, hasher)
    if hasher.hexdigest() != (f.sha256 or f.git_oid or "").lower():
        return False
    _remember_verified(path, f)
    return True


def _refuse_unverifiable(repo: str, variant: Variant, allow_unverified: bool) -> None:
    unhashed = [f.path for f in variant.files if _expected_hash(f) is None]
    if unhashed and not allow_unverified:
        shown = ", ".join(unhashed[:3]) + (f" and {len(unhashed) - 3} more" if len(unhashed) > 3 else "")
        raise DownloadError(f"the Hub gives no sha256 (nor git blob id) for {shown} in {repo}, so what arrives"
                            " cannot be checked; pass --allow-unverified to download it anyway")


def _needs_download(targets: list[Path], files: tuple[RepoFile, ...], say: Callable[[str], None]) -> list[int]:
    """Indices of the files to (re)download: missing, another size, or bytes that do not
    hash to what the Hub says. A file without a hash (allowed unverified) is judged by size."""
    todo = []
    for i, (target, f) in enumerate(zip(targets, files)):
        if not target.is_file() or target.stat().st_size != f.size:
            todo.append(i)
        elif _expected_hash(f) is not None and not _is_verified(target, f):
            say(f"checking {target.name} against the Hub's hash (once)")
            if not _holds_expected_bytes(target, f):
                say(f"{target.name} differs from the Hub's file; downloading it again")
                todo.append(i)
    return todo


def install(repo: str, revision: str, variant: Variant, progress: Progress | None = None,
            allow_unverified: bool = False, announce: Callable[[str], None] | None = None) -> Path:
    """Download a variant into the store; returns the model path (first GGUF part or MLX folder).
    Files already installed and proved by hash are kept; the others are downloaded."""
    org, name = repo.split("/", 1)
    final_repo = models_dir() / org / name
    staging = models_dir() / DOWNLOADS / org / name
    rels = [safe_relpath(f.path) for f in variant.files]  # refuse bad names before any byte is written
    _refuse_unverifiable(repo, variant, allow_unverified)
    gguf = variant.format == "gguf"
    targets = [final_repo.joinpath(*r.parts) if gguf else final_repo / r.name for r in rels]
    result = targets[0] if gguf else final_repo
    whole_mlx = not gguf and not all(
        t.is_file() and t.stat().st_size == f.size for t, f in zip(targets, variant.files))
    todo = (list(range(len(targets))) if whole_mlx
            else _needs_download(targets, variant.files, announce or (lambda _msg: None)))
    if not todo:
        return result
    lock = _lock(staging)
    try:
        parts = {}
        for i in todo:
            part = staging.joinpath(*rels[i].parts)
            parts[i] = download_file(repo, revision, variant.files[i], part.with_name(part.name + ".part"), progress)
        if whole_mlx:
            return _install_mlx_folder(final_repo, staging.with_name(name + ".mlx-staging"),
                                       [(parts[i], rels[i].name, variant.files[i]) for i in todo])
        for i in reversed(todo):  # a split model's first part appears last
            targets[i].parent.mkdir(parents=True, exist_ok=True)
            replace_durably(parts[i], targets[i])
            _remember_verified(targets[i], variant.files[i])
        return result
    finally:
        for meta in staging.rglob("*.part.json"):
            if not meta.with_name(meta.name[: -len(".json")]).exists():
                meta.unlink()
        lock.close()
        _drop_finished_staging(staging)


def _install_mlx_folder(final_repo: Path, folder: Path, files: list[tuple[Path, str, RepoFile]]) -> Path:
    """Gather verified downloads in a staging folder, then rename it into place at once."""
    folder.mkdir(parents=True, exist_ok=True)
    for part, file_name, f in files:
        os.replace(part, folder / file_name)  # within the staging area: synced with the folder below
        _remember_verified(folder / file_name, f)  # a rename keeps the mtime: the marker stays true
    if final_repo.exists():
        if any(final_repo.iterdir()):
            raise DownloadError(f"{final_repo} exists and is not this MLX model; remove it first")
        final_repo.rmdir()
    final_repo.parent.mkdir(parents=True, exist_ok=True)
    replace_durably(folder, final_repo)  # the whole folder appears at once
    return final_repo


def _drop_finished_staging(staging: Path) -> None:
    """Remove a repo's download folder once no partial file is left to resume."""
    import shutil

    if any(staging.rglob("*.part")):
        return
    shutil.rmtree(staging, ignore_errors=True)
    top = models_dir() / DOWNLOADS
    for folder in (staging.parent, top):
        try:
            folder.rmdir()  # only when empty
        except OSError:
            break


# -- pull --------------------------------------------------------------------------


@dataclass(frozen=True)
class PullPlan:
    repo: str
    revision: str
    variant: Variant
    note: str  # the selector's explanation, or why this variant
    name: str  # the store name it will have


def plan_pull(name: str, n_ctx: int | None = None, budget=None, kv_type: str | None = None) -> PullPlan:
    parsed = parse_name(name)
    if parsed is None:
        raise BadRequestError(f"pull takes a Hub repo name like org/repo or org/repo:Q4_K_M, got {name!r}")
    repo, quant = parsed
    revision, files = list_repo(repo)
    found = variants(files)
    ggufs = [v for v in found if v.format == "gguf"]
    mlx = [v for v in found if v.format == "mlx"]
    if quant:
        for v in ggufs:
            if v.quant.lower() == quant.lower():
                return PullPlan(repo, revision, v, f"{v.quant} as asked", f"{repo}:{v.quant}")
        have = ", ".join(sorted(v.quant for v in ggufs)) or "none (an MLX repo: pull it without :QUANT)"
        raise ModelNotFoundError(f"{repo} has no {quant} file; available quants: {have}")
    if not ggufs and mlx:
        return PullPlan(repo, revision, mlx[0], "MLX model", repo)
    if not ggufs:
        shown = ", ".join(f.path for f in files[:8]) or "no files"
        raise ModelNotFoundError(f"{repo} holds no GGUF files and no MLX model ({shown})")
    from localrun.quant.selector import Budget, choose

    smallest = min(ggufs, key=lambda v: v.size)
    shape = remote_shape(repo, revision, smallest.files[0])
    choice = choose(shape, [(v.quant, v.size) for v in ggufs], n_ctx, budget or Budget.from_hardware(), kv_type)
    if choice.pick is None:
        raise LocalrunError(f"no quant of {repo} fits this machine: {choice.estimates[0].explain()}"
                            " (see `localrun fit`)")
    v = next(v for v in ggufs if v.quant == choice.pick.quant)
    return PullPlan(repo, revision, v, f"{choice.pick.explain()} ({choice.note})", f"{repo}:{v.quant}")


def pull(name: str, n_ctx: int | None = None, budget=None, kv_type: str | None = None,
         progress: Progress | None = None, announce: Callable[[str], None] | None = None,
         allow_unverified: bool = False) -> tuple[PullPlan, Path]:
    """Plan and install a model; allow_unverified downloads files the Hub gives no hash for."""
    plan = plan_pull(name, n_ctx, budget, kv_type)
    _refuse_unverifiable(plan.repo, plan.variant, allow_unverified)  # before anything is announced
    if announce:
        announce(f"pulling {plan.name}: {plan.note}")
    return plan, install(plan.repo, plan.revision, plan.variant, progress, allow_unverified, announce)
