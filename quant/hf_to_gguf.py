"""Convert a Hugging Face safetensors model (llama family) into a GGUF F16 file.

    convert_hf_to_gguf("SmolLM2-135M-Instruct/", "smollm2-f16.gguf")

Supported: LlamaForCausalLM, MistralForCausalLM (llama.cpp runs both as `llama`) and
Qwen2ForCausalLM (`qwen2`: q/k/v biases, no row permutation), with byte-level BPE
tokenizers (quant/hf_tokenizer.py). Matrices are written as F16, norms and biases as
F32, as llama.cpp's converter does. For `llama`, the rows of q_proj/k_proj are
reordered inside each head, because llama.cpp rotates adjacent pairs of dimensions
where Hugging Face rotates the two halves (see quant/gguf_to_mlx.py, which undoes it).

Safetensors are read with our own small reader (a JSON header, then raw arrays), so
bfloat16 checkpoints need no torch. The output is written to a temp file and renamed.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from localrun.errors import BadRequestError, LocalrunError, MalformedModelError, ModelNotFoundError, UnsupportedFormatError

from .atomic import atomic_output
from .gguf_to_mlx import GGUF_TO_HF_LAYER_NAMES, GGUF_TO_HF_NAMES, llama3_freq_factors, permute_qk
from .hf_tokenizer import tokenizer_metadata

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_HF_TO_GGUF = {hf: g for g, hf in GGUF_TO_HF_NAMES.items()}
_LAYER_HF_TO_GGUF = {hf: g for g, hf in GGUF_TO_HF_LAYER_NAMES.items()}
_BIASES = {"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
           "self_attn.v_proj.bias": "attn_v.bias"}
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


# --- safetensors -------------------------------------------------------------------


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MalformedModelError(f"{path.name} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise MalformedModelError(f"{path.name}: its header length {n} exceeds the file; it is truncated or corrupt")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MalformedModelError(f"{path.name}: its header is not valid JSON ({e})") from e
    header.pop("__metadata__", None)
    for name, info in header.items():
        start, end = info["data_offsets"]
        if end > size - 8 - n or start > end:
            raise MalformedModelError(f"{path.name}: tensor '{name}' lies past the end of the file; it is truncated")
    return header, 8 + n


def iter_safetensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for every tensor of every *.safetensors file in `folder`."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedFormatError(f"{folder} has no *.safetensors files")
    for path in files:
        header, base = _read_header(path)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            dt = info["dtype"]
            if dt not in _DTYPES:
                raise UnsupportedFormatError(
                    f"{path.name}: tensor '{name}' is {dt}; only F32/F16/BF16 checkpoints convert "
                    "(a quantized checkpoint must be dequantized first)"
                )
            start, end = info["data_offsets"]
            raw = np.frombuffer(mm[base + start : base + end], dtype=_DTYPES[dt])
            if dt == "BF16":  # bfloat16 is the top half of a float32
                arr = (raw.astype(np.uint32) << 16).view(np.float32)
            else:
                arr = raw.astype(np.float32)
            shape = tuple(info["shape"])
            if arr.size != int(np.prod(shape)):
                raise MalformedModelError(f"{path.name}: tensor '{name}' holds {arr.size} values, not {shape}")
            yield name, arr.reshape(shape)


# --- config ------------------------------------------------------------------------


def _arch(config: dict, folder: Path) -> str:
    names = config.get("architectures") or [config.get("model_type", "?")]
    for n in names:
        if n in ARCHS:
            return ARCHS[n]
    raise UnsupportedFormatError(
        f"{folder.name}: architecture '{names[0]}' cannot be converted to GGUF yet; "
        f"supported: {', '.join(ARCHS)}"
    )


def _llama3_freq_factors(rs: dict, head_dim: int, theta: float) -> np.ndarray:
    return llama3_freq_factors(
        head_dim, theta, float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
        float(rs.get("high_freq_factor", 4.0)), int(rs.get("original_max_position_embeddings", 8192)),
    )


def _hparams(writer, arch: str, c: dict, folder: Path) -> tuple[int, int, int]:
    def need(key: str):
        if key not in c:
            raise MalformedModelError(f"{folder.name}/config.json has no '{key}'")
        return c[key]

    hidden, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv = int(c.get("num_key_value_heads") or n_head)
    head_dim = int(c.get("head_dim") or hidden // n_head)
    p = arch + "."
    writer.add_uint32(p + "context_length", int(c.get("max_position_embeddings", 4096)))
    writer.add_uint32(p + "embedding_length", hidden)
    writer.add_uint32(p + "block_count", int(need("num_hidden_layers")))
    writer.add_uint32(p + "feed_forward_length", int(need("intermediate_size")))
    writer.add_uint32(p + "rope.dimension_count", head_dim)
    writer.add_uint32(p + "attention.head_count", n_head)
    writer.add_uint32(p + "attention.head_count_kv", n_kv)
    writer.add_float32(p + "attention.layer_norm_rms_epsilon", float(c.get("rms_norm_eps", 1e-6)))
    writer.add_float32(p + "rope.freq_base", float(c.get("rope_theta", 10000.0)))
    if head_dim != hidden // n_head:
        writer.add_uint32(p + "attention.key_length", head_dim)
        writer.add_uint32(p + "attention.value_length", head_dim)
    if c.get("sliding_window") and c.get("use_sliding_window", arch == "llama"):
        raise UnsupportedFormatError(f"{folder.name} uses sliding-window attention, which this converter does not carry yet")
    return n_head, n_kv, head_dim


def _rope_scaling(writer, arch: str, c: dict, head_dim: int) -> np.ndarray | None:
    rs = c.get("rope_scaling")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", float(rs["factor"]))
        return None
    if kind == "llama3":
        return _llama3_freq_factors(rs, head_dim, float(c.get("rope_theta", 10000.0)))
    raise UnsupportedFormatError(f"rope scaling '{kind}' cannot be converted to GGUF yet")


def _gguf_name(hf: str, arch: str) -> str | None:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    if hf.startswith("model.layers."):
        idx, _, rest = hf[len("model.layers."):].partition(".")
        if rest in _LAYER_HF_TO_GGUF:
            return f"blk.{idx}.{_LAYER_HF_TO_GGUF[rest]}"
        if arch == "qwen2" and rest in _BIASES:
            return f"blk.{idx}.{_BIASES[rest]}"
    if hf.endswith("rotary_emb.inv_freq"):
        return None  # recomputed by llama.cpp from rope.freq_base
    raise UnsupportedFormatError(f"tensor '{hf}' has no GGUF equivalent in this converter; it cannot be converted")


# --- convert -----------------------------------------------------------------------


def convert_hf_to_gguf(
    src: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    import gguf

    src, out = Path(src).expanduser(), Path(out).expanduser()
    say = progress or (lambda _m: None)
    if not src.is_dir():
        raise ModelNotFoundError(f"no model folder at {src}" if not src.exists()
                                 else f"{src} is a file; --to gguf converts a Hugging Face model folder")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedFormatError(f"{src} has no config.json; it is not a Hugging Face model folder")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise MalformedModelError(f"{cfg_path} is not valid JSON ({e.msg} at line {e.lineno})") from e
    if config.get("quantization") or config.get("quantization_config"):
        raise UnsupportedFormatError(f"{src.name} is a quantized checkpoint; convert its float16/bfloat16 original")
    if out.exists() and not overwrite:
        raise LocalrunError(f"{out} already exists; choose another output path")
    if out.is_dir():
        raise BadRequestError(f"{out} is a folder; give a .gguf file path")
    arch = _arch(config, src)
    vocab_size = int(config.get("vocab_size", 0))

    tok_meta = tokenizer_metadata(src, vocab_size, config)  # cheap and likeliest to fail: first
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out, overwrite) as tmp:
        w = gguf.GGUFWriter(tmp, arch=arch, use_temp_file=False)
        try:
            w.add_name(config.get("_name_or_path") or src.name)
            w.add_file_type(1)  # MOSTLY_F16
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
            n_head, n_kv, head_dim = _hparams(w, arch, config, src)
            freq_factors = _rope_scaling(w, arch, config, head_dim)
            w.add_uint32(f"{arch}.vocab_size", len(tok_meta["tokenizer.ggml.tokens"]))
            for key, value in tok_meta.items():
                if isinstance(value, list):
                    w.add_array(key, value)
                elif isinstance(value, bool):
                    w.add_bool(key, value)
                elif isinstance(value, int):
                    w.add_uint32(key, value)
                else:
                    w.add_string(key, value)

            tied = bool(config.get("tie_word_embeddings", False))
            count = 0
            for hf, arr in iter_safetensors(src):
                name = _gguf_name(hf, arch)
                if name is None or (tied and name == "output.weight"):
                    continue
                if arch == "llama" and name.endswith("attn_q.weight"):
                    arr = permute_qk(arr, n_head)
                elif arch == "llama" and name.endswith("attn_k.weight"):
                    arr = permute_qk(arr, n_kv)
                # matrices as F16; 1-D norms and biases stay F32 (tiny and precision-sensitive)
                w.add_tensor(name, arr.astype(np.float16) if arr.ndim >= 2 else arr.astype(np.float32))
                count += 1
                if count % 32 == 0:
                    say(f"read {count} tensors")
            if freq_factors is not None:
                w.add_tensor("rope_freqs.weight", freq_factors)
            if count == 0:
                raise MalformedModelError(f"{src.name} has no tensors")
            say(f"writing {out.name}")
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    say(f"wrote {out}")
    return out
