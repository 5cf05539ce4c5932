"""Quantize an MLX model folder with mlx-lm (affine, per-group scales and biases).

    quantize_mlx("smollm2-mlx-f16", "smollm2-mlx-4bit", bits=4, group_size=64)
    quantize_mlx(src, out, bits=3, recipe="mixed_3_6")   # mlx-lm's mixed-precision recipes

mlx-lm does the work (its loader, `quantize_model` and `save`, through its `convert`),
so the folder is exactly what `mlx_lm.load` expects. It writes into a hidden sibling
folder that is renamed onto `out` only when complete.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

from localrun.errors import BadRequestError, LocalrunError, ModelNotFoundError, UnsupportedFormatError

from .atomic import replace_durably

MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)


def recipes() -> list[str]:
    from mlx_lm.convert import QUANT_RECIPES

    return list(QUANT_RECIPES)


def _check_source(src: Path) -> dict:
    if not src.exists():
        raise ModelNotFoundError(f"no model folder at {src}")
    cfg = src / "config.json"
    if not src.is_dir() or not cfg.is_file() or not list(src.glob("*.safetensors")):
        raise UnsupportedFormatError(
            f"{src} is not an MLX/Hugging Face model folder (config.json + *.safetensors); "
            "for a .gguf use --type, or convert it first: localrun convert MODEL.gguf --to mlx"
        )
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedFormatError(f"{cfg} is not valid JSON ({e.msg} at line {e.lineno})") from e


def quantize_mlx(
    src: str | os.PathLike,
    out: str | os.PathLike,
    bits: int = 4,
    group_size: int = 64,
    recipe: str | None = None,
    allow_requantize: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    src, out = Path(src).expanduser(), Path(out).expanduser()
    say = progress or (lambda _m: None)
    if bits not in MLX_BITS:
        raise BadRequestError(f"--bits must be one of {', '.join(map(str, MLX_BITS))} for MLX, not {bits}")
    if group_size not in MLX_GROUP_SIZES:
        raise BadRequestError(
            f"--group-size must be one of {', '.join(map(str, MLX_GROUP_SIZES))}, not {group_size}"
        )
    if recipe is not None and recipe not in recipes():
        raise BadRequestError(f"unknown MLX recipe '{recipe}'; choose one of: {', '.join(recipes())}")
    config = _check_source(src)
    if (config.get("quantization") or config.get("quantization_config")) and not allow_requantize:
        raise BadRequestError(
            f"{src} is already quantized; quantize the float16/bfloat16 original instead "
            "(or pass --allow-requantize to quantize its dequantized weights)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LocalrunError(f"{out} already exists and is not empty; choose another -o path or remove it")
    if out.resolve() == src.resolve():
        raise BadRequestError("the output folder is the source model; choose another -o path")

    from mlx_lm.convert import convert

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    say(f"quantizing {src.name} to {bits} bits (group size {group_size}{', ' + recipe if recipe else ''})")
    try:
        quiet = io.StringIO()  # mlx-lm prints [INFO] lines to stdout; keep stdout for results
        with contextlib.redirect_stdout(quiet):
            convert(
                str(src), mlx_path=str(tmp), quantize=True, q_group_size=group_size, q_bits=bits,
                quant_predicate=recipe, dequantize=False,
            )
        if out.exists():
            out.rmdir()  # empty (checked above): replace it
        replace_durably(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LocalrunError(f"could not write {out}: {e.strerror or e}") from e
    except ValueError as e:  # mlx-lm's own validation (shapes a group size does not divide)
        shutil.rmtree(tmp, ignore_errors=True)
        raise BadRequestError(f"mlx-lm could not quantize {src.name}: {e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {out}")
    return out
