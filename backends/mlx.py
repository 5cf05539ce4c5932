"""MLX models (a folder with config.json + safetensors) on Apple's MLX, via mlx-lm.

mlx-lm's loader builds the model module and its Hugging Face tokenizer; each sequence
owns one list of mlx-lm's per-layer caches, which are trimmable, so speculative
rejection and prefix reuse work as on llama.cpp. On Linux MLX runs on the CPU
(`mlx[cpu]`): a correctness path; on Apple Silicon the same code runs on Metal.

Sequences are run one after another inside `decode`: the seam allows a batched MLX step
later without changing the engine.

`kv_cache_type` q8_0 / q4_0 puts mlx-lm's QuantizedKVCache (8 or 4 bits, an f16 scale
and bias per group of 64 values) in place of each layer's plain KVCache; attention
then runs on the quantized keys and values directly. Layers with another cache kind
(sliding-window rotating caches, recurrent state) keep theirs: those are bounded already.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Sequence

import numpy as np

from localrun.errors import (
    BackendUnavailableError,
    BadRequestError,
    CacheNotTrimmableError,
    ModelLoadError,
    UnsupportedFormatError,
)
from .base import BackendOptions, BatchEntry, KvLedger, ModelInfo, check_batch

_KV_BITS = {"f16": None, "q8_0": 8, "q4_0": 4}
# llama.cpp's load parameters: MLXBackend names them so that one set of options opens a
# model on either backend, and refuses any value but the default, which here would do
# nothing. name -> (default, how the user sets it, why MLX has no use for it)
_LLAMA_CPP_ONLY = {
    "threads": (None, "--threads", "MLX sizes its own thread pool"),
    "n_gpu_layers": (-1, "n_gpu_layers", "MLX runs every layer on its default device"),
    "cluster": (None, "--rpc", "MLX spreads a model over machines with mlx-ring instead"),
    "repack": (True, "repack", "MLX keeps its weights in one layout"),
    "flash_attn": (None, "flash_attn", "MLX picks its own attention kernel"),
}
CONFIG_READ_LIMIT = 4 << 20  # a config.json is a few KB; a bigger one is not read whole


class RemoteCodeError(UnsupportedFormatError):
    """A model folder whose configuration asks to import Python code shipped with it."""


def remote_code_asked(folder: str | os.PathLike) -> str | None:
    """What a model folder's configuration asks to run as Python code, None when nothing:
    config.json's `model_file` (mlx-lm imports that file to build the model) or an
    `auto_map` in config.json or tokenizer_config.json (Hugging Face classes defined by
    the repository's own code). A missing or unreadable file asks nothing here; the
    loader reports it."""
    folder = Path(folder)
    for name, keys in (("config.json", ("model_file", "auto_map")), ("tokenizer_config.json", ("auto_map",))):
        config = _read_json_object(folder / name)
        for key in keys:
            if config.get(key) is not None:
                return f"{name} names {key} {json.dumps(config[key])[:120]}"
    return None


def check_remote_code(folder: str | os.PathLike, allowed: bool, how_to_allow: str) -> None:
    """Refuse a folder that asks to run its own code unless the user allowed it."""
    asked = remote_code_asked(folder)
    if asked and not allowed:
        raise RemoteCodeError(
            f"{folder} asks to run Python code that ships with the model ({asked}); load it only if you"
            f" trust where it came from: {how_to_allow}"
        )


def _read_json_object(path: Path) -> dict:
    """A small JSON object file, {} when absent or unreadable. Opened non-blocking and
    checked to be a regular file first, so a FIFO in its place cannot hang the caller."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):
        return {}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        raw = f.read(CONFIG_READ_LIMIT + 1)
    if len(raw) > CONFIG_READ_LIMIT:
        raise UnsupportedFormatError(f"{path} is over {CONFIG_READ_LIMIT >> 20} MiB; a model config is a few KB")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _import_mlx():
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load
    except ImportError as exc:
        raise BackendUnavailableError(
            f"MLX is not usable here ({exc}); install it with: pip install 'mlx[cpu]' mlx-lm"
            " (plain 'mlx' on Apple Silicon)"
        ) from exc
    return mx, make_prompt_cache, load


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (each byte shown as a printable char)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _uses_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in decoder.get("decoders", []) or [])


def _piece_table(hf, n_vocab: int, special: set[int]) -> list[bytes]:
    """Raw bytes of every token, so the engine's UTF-8 stream works as on llama.cpp."""
    tokens = hf.convert_ids_to_tokens(list(range(n_vocab)))
    decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder")
    table: list[bytes] = []
    if _uses_byte_level(decoder):
        inv = _byte_decoder()
        for i, t in enumerate(tokens):
            if t is None or i in special:
                table.append(b"")
            else:
                table.append(bytes(inv[c] for c in t if c in inv) if all(c in inv for c in t) else t.encode())
        return table
    for i, t in enumerate(tokens):  # sentencepiece style: "▁" for space, <0xNN> byte tokens
        if t is None or i in special:
            table.append(b"")
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            table.append(bytes([int(t[3:5], 16)]))
        else:
            table.append(t.replace("\u2581", " ").encode())
    return table


def _refuse_llama_cpp_only(path, options: BackendOptions) -> None:
    for name, (default, flag, why) in _LLAMA_CPP_ONLY.items():
        value = getattr(options, name)
        if value != default:
            shown = flag if name == "cluster" else f"{flag} {value}"
            raise BadRequestError(f"{shown} applies to llama.cpp models only ({why}); leave it unset for {path}")


class MLXBackend:
    name = "mlx"

    def __init__(self, path: str | os.PathLike, options: BackendOptions | None = None, **fields) -> None:
        """`options` (or its fields as keywords): see BackendOptions. trust_remote_code lets
        a model whose config names its own Python code (`model_file`, `auto_map`) import
        it; refused otherwise, before anything loads. threads, n_gpu_layers, cluster and
        repack mean nothing to MLX: any value but their default is a one-line error."""
        o = BackendOptions.of(options, **fields)
        _refuse_llama_cpp_only(path, o)
        self.options = o
        n_ctx, n_seq, n_batch, trust_remote_code = o.n_ctx, o.n_seq, o.n_batch, o.trust_remote_code
        self.kv_cache_type = o.kv_cache_type
        path = Path(path)
        check_remote_code(path, trust_remote_code, "pass --trust-remote-code")
        mx, make_prompt_cache, load = _import_mlx()
        self._mx = mx
        trusted = {}
        if trust_remote_code:  # mlx-lm's own gates: the model's module, and the tokenizer's auto_map
            trusted = {"trust_remote_code": True, "tokenizer_config": {"trust_remote_code": True}}
        try:
            self._model, wrapper = load(str(path), **trusted)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from exc
        self._hf = wrapper._tokenizer
        config = json.loads((path / "config.json").read_text())
        self._config = config
        n_ctx_train = int(config.get("max_position_embeddings") or 4096)
        self.n_ctx = int(n_ctx or min(4096, n_ctx_train))
        self.n_seq = int(n_seq)
        self.n_batch = int(n_batch)
        hf = self._hf
        self.n_vocab = int(config.get("vocab_size") or len(hf))
        self._special = set(hf.all_special_ids)
        for tid, tok in hf.added_tokens_decoder.items():
            if getattr(tok, "special", False):
                self._special.add(int(tid))
        self._pieces = _piece_table(hf, self.n_vocab, self._special)
        stop = set(wrapper.eos_token_ids or [])
        self.info = self._read_info(path, config, n_ctx_train, stop)
        self._make_cache = self._cache_maker(make_prompt_cache)
        self._caches = [self._make_cache() for _ in range(self.n_seq)]
        self._offsets = [0] * self.n_seq
        self._ledger = KvLedger(self.n_seq)

    def _cache_maker(self, make_prompt_cache):
        """A function that makes one sequence's per-layer caches in the asked element type."""
        model, bits = self._model, _KV_BITS[self.kv_cache_type]
        if bits is None:
            return lambda: make_prompt_cache(model)
        from mlx_lm.models.cache import KVCache, QuantizedKVCache

        flag = f"--kv-cache-type {self.kv_cache_type}"
        head_dim = self.info.head_dim
        # mx.quantize groups along the head dimension, which must split into whole groups.
        group = next((g for g in (64, 32) if head_dim % g == 0), None)
        if group is None:
            raise ModelLoadError(f"{flag} needs a head size divisible by 32; this model's is {head_dim}: use f16")
        if not any(type(c) is KVCache for c in make_prompt_cache(model)):
            raise ModelLoadError(f"{flag}: this MLX model has no plain KV cache layer to quantize; use f16")

        def make():
            return [
                QuantizedKVCache(group_size=group, bits=bits) if type(c) is KVCache else c
                for c in make_prompt_cache(model)
            ]

        return make

    def _read_info(self, path: Path, cfg: dict, n_ctx_train: int, stop: set[int]) -> ModelInfo:
        hf = self._hf
        text_cfg = cfg.get("text_config", cfg)
        n_head = int(text_cfg.get("num_attention_heads", 0))
        hidden = int(text_cfg.get("hidden_size", 0))
        q = cfg.get("quantization")
        if isinstance(q, dict) and "bits" in q:
            quant = f"{q['bits']}bit"
        else:
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
            quant = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}.get(dtype, dtype)
        tok_cfg_path = path / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
        add_bos = bool(tok_cfg.get("add_bos_token", False))
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        return ModelInfo(
            path=str(path),
            backend=self.name,
            architecture=str(cfg.get("model_type", "unknown")),
            n_vocab=self.n_vocab,
            n_ctx_train=n_ctx_train,
            n_layer=int(text_cfg.get("num_hidden_layers", 0)),
            n_head=n_head,
            n_head_kv=int(text_cfg.get("num_key_value_heads", n_head)),
            head_dim=int(text_cfg.get("head_dim") or (hidden // max(1, n_head))),
            sliding_window=text_cfg.get("sliding_window"),
            bos_id=hf.bos_token_id,
            eos_id=hf.eos_token_id,
            eot_id=None,
            add_bos=add_bos,
            stop_ids=frozenset(stop),
            chat_template=getattr(hf, "chat_template", None),
            bos_text=hf.bos_token or "",
            eos_text=hf.eos_token or "",
            quant=quant,
            size_bytes=size,
        )

    # -- tokens ------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        # Hugging Face tokenizers always parse added special tokens; parse_special=False
        # is honoured by llama.cpp only.
        ids = self._hf.encode(text, add_special_tokens=False)
        if add_special and self.info.add_bos and self.info.bos_id is not None:
            ids = [self.info.bos_id] + ids
        return list(ids)

    def token_bytes(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""

    def is_control(self, token: int) -> bool:
        return token in self._special

    def token_text(self, token: int) -> str:
        return self._hf.convert_ids_to_tokens(int(token)) or ""

    # -- forward pass ------------------------------------------------------------

    def decode(self, batch: Sequence[BatchEntry]) -> list[np.ndarray]:
        check_batch(batch, self.n_seq, self.n_ctx, self.n_batch)
        mx = self._mx
        out = []
        for e in batch:
            if e.pos != self._offsets[e.seq]:
                if e.pos > self._offsets[e.seq]:
                    raise ValueError(f"sequence {e.seq}: position {e.pos} leaves a gap after {self._offsets[e.seq]}")
                self.kv_trim(e.seq, e.pos)
            cache, tokens = self._caches[e.seq], list(e.tokens)
            head = len(tokens) - e.n_logits
            if head:
                # Rows without logits: evaluate only the cache, so MLX's lazy graph never
                # runs the output layer for them (on a prompt, most of the work).
                self._model(mx.array([tokens[:head]]), cache=cache)
                mx.eval([c.state for c in cache])
            self._offsets[e.seq] = e.pos + len(tokens)
            if e.n_logits:
                logits = self._model(mx.array([tokens[head:]]), cache=cache)
                out.append(np.array(logits[0].astype(mx.float32), copy=False))
            else:
                out.append(np.empty((0, self.n_vocab), np.float32))
        self._ledger.fed(batch)
        return out

    can_interrupt = False
    batches_neighbours_only = False  # each sequence runs its own pass (see decode)

    @staticmethod
    def passes(counts: Sequence[int]) -> list[int]:
        return [n for n in counts if n]

    def interrupt(self) -> None:
        """MLX evaluates a pass as one graph; there is no point to stop it at. Callers
        keep steps short instead (see can_interrupt)."""

    def clear_interrupt(self) -> None:
        """Nothing to withdraw: `interrupt` sets nothing here."""

    # -- embeddings --------------------------------------------------------------

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The mean of the last hidden states (the model body's normed output, before
        the vocabulary projection) over `tokens`, L2-normalised."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"embed: {len(tokens)} tokens, expected 1..{self.n_ctx}")
        mx = self._mx
        body = getattr(self._model, "model", None) or getattr(self._model, "language_model", None)
        if body is None:
            raise BadRequestError(f"{self.info.path} does not expose its hidden states, so it cannot embed")
        hidden = body(mx.array([list(tokens)]))
        vec = np.array(mx.mean(hidden[0].astype(mx.float32), axis=0))
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    # -- KV cache ----------------------------------------------------------------

    def kv_trim(self, seq: int, n_keep: int) -> None:
        drop = self._offsets[seq] - n_keep
        if drop <= 0:
            return
        caches = self._caches[seq]
        if not all(c.is_trimmable() for c in caches):  # check all first: never cut half the layers
            raise CacheNotTrimmableError(f"sequence {seq}'s cache cannot be cut back (an MLX rotating window is full)")
        for c in caches:
            c.trim(drop)
        self._offsets[seq] = n_keep
        self._ledger.trimmed(seq, n_keep)

    def kv_copy(self, src: int, dst: int, n: int) -> None:
        n = min(n, self._offsets[src])
        fresh = self._make_cache()
        for s, d in zip(self._caches[src], fresh):
            if getattr(s, "keys", None) is None or not n:
                continue
            # Slicing makes new arrays, so writes into dst never reach src. A quantized
            # layer holds (data, scales, biases) for keys and for values, each with the
            # positions on axis -2 like a plain cache: every part is cut at n alike.
            if isinstance(s.keys, (tuple, list)):
                d.keys = tuple(x[..., :n, :] for x in s.keys)
                d.values = tuple(x[..., :n, :] for x in s.values)
            else:
                d.keys, d.values = s.keys[..., :n, :], s.values[..., :n, :]
            d.offset = n
        self._caches[dst] = fresh
        self._offsets[dst] = n
        self._ledger.copied(src, dst, n)

    def kv_clear(self, seq: int) -> None:
        self._caches[seq] = self._make_cache()
        self._offsets[seq] = 0
        self._ledger.cleared(seq)

    def kv_tokens(self, seq: int) -> list[int]:
        return self._ledger.tokens(seq)

    def kv_state_bytes(self, seq: int) -> int:
        """Bytes `seq`'s cached positions occupy in the cache's element type (the
        caches' spare capacity, allocated in steps of 256 positions, not counted)."""
        from mlx.utils import tree_flatten

        total = 0
        for c in self._caches[seq]:
            held = min(getattr(c, "offset", 0), self._offsets[seq])
            for _, a in tree_flatten((getattr(c, "keys", None), getattr(c, "values", None))):
                if a is not None and a.ndim >= 2 and a.shape[-2]:
                    total += a.nbytes // a.shape[-2] * min(held, a.shape[-2])
        return total

    # -- for tensor-parallel sharding (localrun/commands/mlx_ring.py) ------------------------

    @property
    def model(self):
        """mlx-lm's model module (the ring shards its weights across ranks)."""
        return self._model

    @property
    def config(self) -> dict:
        """The model folder's config.json, as loaded."""
        return self._config

    def close(self) -> None:
        self._caches = []
        self._model = None
