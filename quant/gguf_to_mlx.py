"""Convert a llama-architecture GGUF into an MLX model folder (Hugging Face layout).

    convert_gguf_to_mlx("model.gguf", "model-mlx")   # -> Path("model-mlx")

The folder holds config.json, model.safetensors (dense weights in the chosen dtype),
tokenizer.json / tokenizer_config.json / special_tokens_map.json and
generation_config.json: what `mlx_lm.load` reads.

MLX cannot run GGML's quantization formats, so every tensor is dequantized. The
result is exactly the function the GGUF computes (up to the float16/bfloat16 rounding
of already-dequantized values), not the original full-precision model.

Everything is written into a hidden sibling folder that is renamed onto `out_dir`
only when complete, so an interrupted run never leaves a half model at `out_dir`.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

from localrun.model.gguf_check import check_gguf
from localrun.errors import (
    BadRequestError,
    LocalrunError,
    MalformedModelError,
    ModelNotFoundError,
    UnsupportedFormatError,
)

from .atomic import replace_durably
from .gguf_tokenizer import write_tokenizer

SUPPORTED_ARCHS = ("llama",)
DTYPES = ("float16", "bfloat16", "float32")

# GGUF tensor name -> Hugging Face llama name (hf_to_gguf.py reads them the other way).
# Per-layer names are the part after "blk.N." / "model.layers.N.".
GGUF_TO_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_TO_HF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


# --- the Q/K row permutation -------------------------------------------------------
#
# llama.cpp applies rotary embeddings to adjacent pairs of a head's dimensions
# (0,1), (2,3), ...; Hugging Face's llama rotates the two halves (i, i + d/2). Its
# HF->GGUF converter therefore reorders the rows of q_proj/k_proj inside every head:
# viewing a head's rows as [2, d/2] (half, index) it transposes them to [d/2, 2].
# Converting back we view the rows as [d/2, 2] and transpose to [2, d/2].


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The reordering llama.cpp's converter applies (kept for the round-trip test)."""
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d_half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: GGUF (interleaved pairs) rows -> HF (split halves) rows."""
    if w.shape[0] % (2 * n_head):
        raise MalformedModelError(
            f"a Q/K tensor has {w.shape[0]} rows, not a multiple of 2 x {n_head} heads"
        )
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- metadata ----------------------------------------------------------------------


def _open(src: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(src)
    except Exception as e:  # gguf raises ValueError/struct errors on a broken header
        raise MalformedModelError(f"{src} is not a readable GGUF file ({e})") from e
    # contents() turns array fields (tokens, merges) into Python lists; ~0.1 s here.
    meta = {key: field.contents() for key, field in reader.fields.items()}
    return reader, meta


def llama3_freq_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    """Llama 3.x rope scaling as per-frequency divisors (what a GGUF's rope_freqs holds):
    long wavelengths are divided by `factor`, short ones kept, the band between blended."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Llama 3.1-style `rope_scaling` from the `rope_freqs` tensor.

    A GGUF stores only the per-frequency divisors llama.cpp's converter computed, not
    the parameters. Llama 3.x uses low/high_freq_factor 1/4 and an original context of
    8192 with factor = the largest divisor; we accept that guess only if it reproduces
    the stored divisors, so an unusual model fails loudly instead of running wrong.
    """
    factor = float(factors.max())
    low, high, orig = 1.0, 4.0, 8192
    want = llama3_freq_factors(head_dim, theta, factor, low, high, orig)
    if factors.shape != (head_dim // 2,) or not np.allclose(factors, want, rtol=1e-4):
        raise UnsupportedFormatError(
            "this GGUF's rope_freqs tensor does not match Llama 3 rope scaling; "
            "its rotary embedding cannot be converted to MLX yet"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def _config(meta: dict[str, Any], vocab_size: int, tied: bool, dtype: str) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise MalformedModelError(f"the GGUF has no 'llama.{key}'")
        return value

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedFormatError(
            "this GGUF's attention heads have different key and value sizes, "
            "which the MLX llama model cannot represent"
        )
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        # HF's llama rotates whole heads; a partial rotary model is a different arch.
        raise UnsupportedFormatError(
            f"this GGUF rotates {rope_dim} of {head_dim} head dimensions; "
            "partial rotary embeddings cannot be converted to MLX yet"
        )
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "num_hidden_layers": int(get("block_count")),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "type": "linear",
            "factor": float(get("rope.scaling.factor")),
        }
    elif scaling != "none":
        raise UnsupportedFormatError(
            f"this GGUF uses '{scaling}' rope scaling, which cannot be converted to MLX yet"
        )
    return config


# --- weights -----------------------------------------------------------------------


def _hf_name(name: str) -> str:
    if name in GGUF_TO_HF_NAMES:
        return GGUF_TO_HF_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in GGUF_TO_HF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{GGUF_TO_HF_LAYER_NAMES[m.group(2)]}"
    # Dropping a tensor we do not understand (biases, extra norms) would give a model
    # that loads and talks nonsense, so refuse instead.
    raise UnsupportedFormatError(
        f"this GGUF has a tensor '{name}' with no MLX llama equivalent; it cannot be converted"
    )


def _expected_shape(hf: str, c: dict[str, Any]) -> tuple[int, ...]:
    """The Hugging Face (row-major [out, in]) shape each tensor must have."""
    h, ff, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    suffix = hf.rsplit(".", 2)[-2]
    return {
        "embed_tokens": (v, h),
        "lm_head": (v, h),
        "norm": (h,),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (ff, h),
        "up_proj": (ff, h),
        "down_proj": (h, ff),
    }[suffix]


def _convert_weights(reader, config: dict[str, Any], dtype: str, progress) -> dict[str, Any]:
    import mlx.core as mx
    from gguf.quants import dequantize

    mx_dtype = getattr(mx, dtype)
    out: dict[str, Any] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = t.name
        if name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"] by the caller
        hf = _hf_name(name)
        # GGUF lists dims fastest-first ([in, out]); the reader's array and
        # dequantize's result are numpy row-major, i.e. already [out, in] like HF.
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        want = _expected_shape(hf, config)
        if w.shape != want:
            raise MalformedModelError(
                f"tensor '{name}' has shape {w.shape}; the GGUF's hyperparameters say {want}"
            )
        if hf.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        # Cast right away so at most one float32 tensor is alive at a time.
        out[hf] = mx.array(w).astype(mx_dtype)
        mx.eval(out[hf])
        if (i + 1) % 32 == 0 or i + 1 == total:
            progress(f"dequantized {i + 1}/{total} tensors")
    return out


def _check_complete(weights: dict[str, Any], config: dict[str, Any]) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for n in range(config["num_hidden_layers"]):
        need += [f"model.layers.{n}.{v}" for v in GGUF_TO_HF_LAYER_NAMES.values()]
    missing = [k for k in need if k not in weights]
    if missing:
        raise MalformedModelError(
            f"the GGUF lacks {len(missing)} tensors a llama model needs (first: {missing[0]})"
        )


# --- the output folder -------------------------------------------------------------


def _refuse_nonempty(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise LocalrunError(
            f"{out_dir} already exists and is not empty; choose another output path or remove it"
        )


def convert_gguf_to_mlx(
    src: str | Path,
    out_dir: str | Path,
    dtype: str = "float16",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Convert the llama GGUF `src` into an MLX model folder at `out_dir`; return it.

    dtype: "float16" (default), "bfloat16" or "float32" for the dequantized weights.
    progress: called with short human-readable status lines.
    Raises LocalrunError subclasses for every user-facing failure.
    """
    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise BadRequestError(f"dtype must be one of {', '.join(DTYPES)}, not '{dtype}'")
    # Fail before the slow part rather than after it.
    _refuse_nonempty(out_dir)

    say = progress or (lambda _msg: None)
    if not src.is_file():
        raise ModelNotFoundError(f"no such model file: {src}")
    # localrun's own validating parser: ~0.1 s where GGUFReader needs ~25 s on a 262k
    # vocabulary, so an unsupported or corrupt model is refused before the slow part.
    _check_arch(src, check_gguf(src).metadata.get("general.architecture"))
    say(f"reading {src}")
    reader, meta = _open(src)
    if "general.architecture" not in meta:
        raise MalformedModelError(f"{src} has no general.architecture; it is not a model GGUF")
    _check_arch(src, meta["general.architecture"])

    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise MalformedModelError(f"{src.name} has no token_embd.weight tensor")
    vocab_size = int(by_name["token_embd.weight"].shape[-1])
    # Without an output matrix llama.cpp reuses the embedding as the LM head.
    tied = "output.weight" not in by_name
    config = _config(meta, vocab_size, tied, dtype)
    if "rope_freqs.weight" in by_name:
        factors = np.asarray(by_name["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        config["rope_scaling"] = _llama3_rope_scaling(
            factors, config["head_dim"], config["rope_theta"]
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename; mkdir honours umask.
    tmp = out_dir.parent / f".{out_dir.name}.partial-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        # The tokenizer is cheap and the likeliest to be unsupported: do it first.
        say("building tokenizer")
        ids = write_tokenizer(meta, tmp, model_max_length=config["max_position_embeddings"])
        for key in ("bos_token_id", "eos_token_id"):
            config[key] = ids[key]

        weights = _convert_weights(reader, config, dtype, say)
        _check_complete(weights, config)

        say("writing model.safetensors")
        import mlx.core as mx

        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        _write_json(tmp / "config.json", config)
        gen = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}
        if ids["pad_token_id"] is not None:
            gen["pad_token_id"] = ids["pad_token_id"]
        _write_json(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})

        # Someone may have filled out_dir while we worked; never overwrite it.
        _refuse_nonempty(out_dir)
        if out_dir.exists():
            out_dir.rmdir()  # empty: replace it (rename onto a dir fails on Windows)
        replace_durably(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {out_dir}")
    return out_dir


def _check_arch(src: Path, arch: str | None) -> None:
    if arch is not None and arch not in SUPPORTED_ARCHS:
        raise UnsupportedFormatError(
            f"{src.name}: architecture '{arch}' cannot be converted to MLX yet; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}"
        )


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
