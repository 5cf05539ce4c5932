"""GGUF models on llama.cpp, through llama-cpp-python's low-level (ctypes) API.

Not the high-level `Llama` class: it owns its own sampling and a single sequence. Here
one `llama_batch`, allocated once, carries tokens of several sequences per
`llama_decode`; logits are read through the context's output buffer as numpy views (no
per-token copy of the vocabulary); the KV cache is edited per sequence through the
memory API. Every sequence may use up to `n_ctx`
positions in a KV stream of its own (`kv_unified = False`): with this llama.cpp, a
unified cache plus flash attention gave wrong logits to the second of two sequences
decoded in one batch (tests/test_backend_contract.py::test_two_sequences_in_one_decode
and test_generation.py::test_two_generations_stepped_together_match_solo catch it).

`kv_cache_type` q8_0 / q4_0 stores K and V in llama.cpp's block quantizations (34 or 18
bytes per 32 values instead of 64). llama.cpp attends over a quantized V only inside its
flash-attention kernel, so flash attention is switched on for those.

With an f16 cache on the CPU, flash attention is on or off by what it timed on this
machine for this model at the thread counts it may run with (backends/attention_timing.py;
`localrun doctor` lists the timings): its CPU kernel was the slower one at one thread in
llama-bench (SmolLM2-135M, one token at depth 650: 49 tok/s off, 33 on) and the faster one
at two (90 off, 110 on at depth 832). Without it llama.cpp keeps the attention scores of a
micro-batch (n_ubatch x context x heads floats), so it stays llama.cpp's choice when those
would pass `CPU_SCORES_MAX_BYTES`. On a GPU llama.cpp's choice stands.
`LOCALRUN_FLASH_ATTN=on|off|auto` overrides all of this.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from localrun.cluster import rpc
from localrun.errors import BackendUnavailableError, CacheNotTrimmableError, DecodeError, ModelLoadError
from localrun.model.formats import file_type_name
from localrun.hardware import OthersLoad, fitted_threads, inference_threads

from . import attention_timing
from .attention import MEASURE, attention_scores_bytes, flash_attention_choice
from .base import BackendOptions, BatchEntry, DecodeInterrupted, KvLedger, ModelInfo, check_batch, neighbour_passes

try:
    import llama_cpp as _lc
except ImportError as exc:  # pragma: no cover - depends on the install
    _lc = None
    _IMPORT_ERROR = exc

# --kv-cache-type names -> ggml element types (ggml.h: GGML_TYPE_F16 = 1, Q4_0 = 2, Q8_0 = 8)
_GGML_KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}

# llama_decode's return codes other than 0 and 2 (aborted), as llama.h documents them
_DECODE_CODES = {1: "no room in the KV cache for this batch", -1: "an invalid batch"}

_log = logging.getLogger("localrun")
_LOG_CALLBACK = None  # keep the ctypes callback alive for the process lifetime
_BACKEND_READY = False


def init_llama() -> None:
    """Initialise llama.cpp once and keep its log quiet unless LOCALRUN_LLAMA_LOG is set.
    Anything in this process that calls llama.cpp directly (quant/imatrix.py) calls this first."""
    global _LOG_CALLBACK, _BACKEND_READY
    if _BACKEND_READY:
        return
    if _lc is None:
        raise BackendUnavailableError(
            f"llama-cpp-python is not installed ({_IMPORT_ERROR}); run: pip install llama-cpp-python"
        )
    verbose = bool(os.environ.get("LOCALRUN_LLAMA_LOG"))

    @_lc.llama_log_callback
    def _log(level, text, user_data):  # noqa: ARG001 - ctypes signature
        if verbose:
            os.write(2, text)

    _LOG_CALLBACK = _log
    _lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    _lc.llama_backend_init()
    _BACKEND_READY = True


def _set_attention(cparams, kv_cache_type: str, flash_attn: str) -> None:
    cparams.type_k = cparams.type_v = _GGML_KV_TYPES[kv_cache_type]
    if flash_attn == "auto":
        return  # llama.cpp's own choice (its default)
    # Older llama-cpp-python releases have a bool `flash_attn`; newer ones a tri-state type.
    if hasattr(cparams, "flash_attn_type"):
        cparams.flash_attn_type = (_lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn == "on"
                                   else _lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    else:
        cparams.flash_attn = flash_attn == "on"


REFIT_THREADS_S = 1.0  # how often decoding re-reads the load (~0.1 ms a reading)


class LlamaCppBackend:
    name = "llama.cpp"

    def __init__(self, path: str | os.PathLike, options: BackendOptions | None = None, **fields) -> None:
        """`options` (or its fields as keywords): see BackendOptions. With a `cluster`, the
        model is split over its RPC workers (localrun/cluster/rpc.py). repack=False keeps
        the weights in their stored layout instead of the CPU's gemm layouts (slower; rows
        of a many-row step then drift less, see scripts/lookup/batch_drift.py). A GGUF holds
        no code, so trust_remote_code changes nothing here."""
        o = BackendOptions.of(options, **fields)
        self.options = o
        n_ctx, n_seq, n_batch, threads, n_gpu_layers = o.n_ctx, o.n_seq, o.n_batch, o.threads, o.n_gpu_layers
        self.kv_cache_type = o.kv_cache_type
        init_llama()
        self._model = None
        self._ctx = None
        self._batch = None
        self._embedder = None  # (context, batch) made on the first embed() call
        # no --threads: fit the cores others leave free, read over the load and again
        # every REFIT_THREADS_S of decoding (an explicit count always wins)
        self._load = None if threads else OthersLoad()
        path = str(path)
        mparams = _lc.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers  # -1: all layers on the GPU where one exists
        mparams.use_extra_bufts = o.repack
        self.placement = self._place_on_devices(mparams, path, o.cluster)
        model = _lc.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {path}; set LOCALRUN_LLAMA_LOG=1 to see why")
        self._model = model
        self._vocab = _lc.llama_model_get_vocab(model)
        self.n_vocab = _lc.llama_vocab_n_tokens(self._vocab)
        n_ctx_train = _lc.llama_model_n_ctx_train(model)
        self.n_ctx = int(n_ctx or min(4096, n_ctx_train))
        self.n_seq = int(n_seq)
        self._ledger = KvLedger(self.n_seq)
        self.n_batch = int(min(n_batch, self.n_ctx * self.n_seq))
        threads = int(threads) if threads else fitted_threads(self._load.busy_cores(wait=True))

        # This machine's devices decide, for RPC workers too (llama.cpp cannot say what a
        # worker computes on): a split model then attends, and answers, as it does here.
        on_cpu = n_gpu_layers == 0 or not rpc.local_gpus()
        scores = attention_scores_bytes(self.n_batch, self.n_ctx * self.n_seq, _lc.llama_model_n_head(model))
        self.attention_timing: attention_timing.AttentionTiming | None = None  # what a measured choice rests on
        self.flash_attn = o.flash_attn or flash_attention_choice(self.kv_cache_type, on_cpu, scores)
        if self.flash_attn == MEASURE:
            self.flash_attn = self._measured_flash_attention(model, path, threads, o.cluster)
        cparams = self._context_params(self.flash_attn, self.n_ctx * self.n_seq, self.n_batch, threads, self.n_seq)
        ctx = _lc.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            if self.kv_cache_type != "f16":
                raise ModelLoadError(
                    f"llama.cpp could not create a context with --kv-cache-type {self.kv_cache_type} for {path}"
                    " (a quantized KV cache needs flash attention, which this model or device may lack);"
                    " try --kv-cache-type f16 or a smaller --ctx; LOCALRUN_LLAMA_LOG=1 shows why"
                )
            raise ModelLoadError(
                f"llama.cpp could not create a context of {self.n_ctx * self.n_seq} tokens for {path};"
                " try a smaller --ctx"
            )
        self._ctx = ctx
        self._mem = _lc.llama_get_memory(ctx)
        self._arm_interrupt(ctx)
        self.threads = threads
        self._refit_at = time.monotonic() + REFIT_THREADS_S
        # One batch for the life of the context; each token belongs to one sequence.
        self._batch = _lc.llama_batch_init(self.n_batch, 0, 1)
        self._piece_buf = ctypes.create_string_buffer(256)
        # llama_get_logits as an address (the binding's own returns a float pointer, which
        # numpy reads slowly), in a function object of our own: the binding's stays as it is
        self._logits_addr = _lc.llama_cpp._lib["llama_get_logits"]
        self._logits_addr.restype, self._logits_addr.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        self._logits_view: tuple[int, np.ndarray] | None = None
        self._pieces: dict[int, bytes] = {}
        self.info = self._read_info(path, n_ctx_train)

    def _context_params(self, flash_attn: str, n_ctx: int, n_batch: int, threads: int, n_seq: int = 1):
        cparams = _lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False  # see the module docstring
        cparams.no_perf = True
        _set_attention(cparams, self.kv_cache_type, flash_attn)
        return cparams

    def _measured_flash_attention(self, model, path: str, threads: int, cluster) -> str:
        """"on" or "off", whichever decodes this model faster here (backends/attention_timing.py).
        The context keeps its setting for life, while the load-following threads may
        change the count under it: the choice is the one for the count it starts with,
        which is the count of an idle machine (all cores) unless others were busy at load,
        and it is what every answer gets while the machine stays as it is. A model split
        over RPC workers is not timed (its steps cross the network): it takes what this
        machine measured for the model before, else attends without flash attention."""
        if cluster is not None:
            known = attention_timing.recall(path, self.kv_cache_type, threads)
            return known.winner(self.n_seq) if known else "off"

        def time_both(counts: list[int]) -> list[attention_timing.AttentionTiming]:
            def make_context(setting: str, n_ctx: int, n_batch: int, t: int):
                return _lc.llama_init_from_model(model, self._context_params(setting, n_ctx, n_batch, t))

            return attention_timing.measure(_lc, model, self.n_vocab, make_context, counts)

        try:
            self.attention_timing = attention_timing.choose(path, self.kv_cache_type, threads, inference_threads(),
                                                            time_both)
        except RuntimeError as e:  # llama.cpp refused a timing context
            _log.info("could not time flash attention (%s): attending without it", e)
        return self.attention_timing.winner(self.n_seq) if self.attention_timing else "off"  # untimed: the old rule

    # -- devices (llama.cpp RPC workers) ------------------------------------------

    def _place_on_devices(self, mparams, path: str, cluster) -> "rpc.Placement | None":
        """With a cluster: an explicit NULL-terminated device list (local GPUs, then each
        worker's devices), their proportions, and n_gpu_layers keeping this machine's share
        of the first layers on its CPU. Without: llama.cpp's default devices, unless workers
        were registered in this process (registration is process-wide), in which case the
        list names this machine's GPUs only."""
        if cluster is None:
            if rpc.any_registered():
                self._devices = rpc.device_array(rpc.local_gpus())
                mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
            return None
        from localrun.model.facts import facts

        placement = rpc.placement_for(cluster, facts(path).n_layer)
        if len(placement.devices) > _lc.llama_max_devices():
            raise ModelLoadError(f"{len(placement.devices)} devices, more than this llama.cpp's"
                                 f" {_lc.llama_max_devices()}: use fewer --rpc workers")
        self._devices = rpc.device_array(placement.devices)
        # llama.cpp copies llama_max_devices() floats from tensor_split
        self._split = (ctypes.c_float * _lc.llama_max_devices())(*placement.split)
        self._overrides = rpc.head_override(placement)
        mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        mparams.tensor_split = self._split
        mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        mparams.n_gpu_layers = placement.n_gpu_layers
        mparams.split_mode = _lc.LLAMA_SPLIT_MODE_LAYER
        _log.info("%s over RPC workers: %s", Path(path).name, placement.describe())
        return placement

    # -- model facts -------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = _lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        return buf.value.decode("utf-8", errors="replace")

    def _token_or_none(self, tok: int) -> int | None:
        return int(tok) if 0 <= tok < self.n_vocab else None

    def _read_info(self, path: str, n_ctx_train: int) -> ModelInfo:
        lc, m, v = _lc, self._model, self._vocab
        arch = self._meta("general.architecture") or "unknown"
        n_head = lc.llama_model_n_head(m)
        n_embd = lc.llama_model_n_embd(m)
        head_dim = self._meta(f"{arch}.attention.key_length")
        head_dim = int(head_dim) if head_dim else n_embd // max(1, n_head)
        ft = self._meta("general.file_type")
        bos = self._token_or_none(lc.llama_vocab_bos(v))
        eos = self._token_or_none(lc.llama_vocab_eos(v))
        eot = self._token_or_none(lc.llama_vocab_eot(v))
        template = lc.llama_model_chat_template(m, None)
        swa = lc.llama_model_n_swa(m)
        return ModelInfo(
            path=path,
            backend=self.name,
            architecture=arch,
            n_vocab=self.n_vocab,
            n_ctx_train=n_ctx_train,
            n_layer=lc.llama_model_n_layer(m),
            n_head=n_head,
            n_head_kv=lc.llama_model_n_head_kv(m),
            head_dim=head_dim,
            sliding_window=int(swa) if swa else None,
            bos_id=bos,
            eos_id=eos,
            eot_id=eot,
            add_bos=bool(lc.llama_vocab_get_add_bos(v)),
            stop_ids=frozenset(self._eog_ids()),
            chat_template=template.decode("utf-8", errors="replace") if template else None,
            bos_text=self._special_text(bos),
            eos_text=self._special_text(eos),
            quant=file_type_name(int(ft) if ft and ft.isdigit() else None),
            fim_prefix_id=self._token_or_none(lc.llama_vocab_fim_pre(v)),
            fim_suffix_id=self._token_or_none(lc.llama_vocab_fim_suf(v)),
            fim_middle_id=self._token_or_none(lc.llama_vocab_fim_mid(v)),
            n_params=int(lc.llama_model_n_params(m)),
            size_bytes=Path(path).stat().st_size,
        )

    def _eog_ids(self) -> list[int]:
        # llama.cpp marks end-of-generation tokens (eos, eot, <|im_end|>, <end_of_turn>, ...)
        # while loading the vocab; they are all control tokens, so only those are asked.
        is_eog, is_ctl, v = _lc.llama_vocab_is_eog, _lc.llama_vocab_is_control, self._vocab
        return [t for t in range(self.n_vocab) if is_ctl(v, t) and is_eog(v, t)] or [
            t for t in (_lc.llama_vocab_eos(v), _lc.llama_vocab_eot(v)) if 0 <= t < self.n_vocab
        ]

    def _special_text(self, tok: int | None) -> str:
        if tok is None:
            return ""
        text = _lc.llama_vocab_get_text(self._vocab, tok)
        return text.decode("utf-8", errors="replace") if text else ""

    # -- tokens ------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (_lc.llama_token * cap)()
        n = _lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # the buffer was too small: -n is the size needed
            cap = -n
            buf = (_lc.llama_token * cap)()
            n = _lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = self._piece_buf
            n = _lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = _lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def is_control(self, token: int) -> bool:
        return bool(_lc.llama_vocab_is_control(self._vocab, token))

    def token_text(self, token: int) -> str:
        return self._special_text(token)

    # -- forward pass ------------------------------------------------------------

    def decode(self, batch: Sequence[BatchEntry]) -> list[np.ndarray]:
        # Lean on purpose: the decode before this line streamed the weights through the
        # caches, so each Python object touched here is a miss to memory (~0.1 us; a
        # token's Python work measured ~15x its warm cost). One generation's token is the
        # common step: no sort, no dictionary, the logits view reused.
        check_batch(batch, self.n_seq, self.n_ctx, self.n_batch)
        if self._load is not None and time.monotonic() >= self._refit_at:
            self._refit_threads()
        b = self._batch
        tok, pos, nsq, sid, lgt = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        # With a KV stream per sequence, llama.cpp puts in one ubatch only sequences whose
        # ids rise by one from the batch's first token on; any other order splits a step
        # into several decodes. So the batch goes in seq order (and runs of consecutive
        # ids are the engine's business: see localrun/slots.py).
        ordered = batch if len(batch) == 1 else sorted(batch, key=lambda e: e.seq)
        i = 0
        for e in ordered:
            first_out = len(e.tokens) - e.n_logits
            for j, t in enumerate(e.tokens):
                tok[i] = t
                pos[i] = e.pos + j
                nsq[i] = 1
                sid[i][0] = e.seq
                lgt[i] = j >= first_out
                i += 1
        b.n_tokens = i
        rc = _lc.llama_decode(self._ctx, b)
        if rc != 0 or self._interrupt_asked:  # an interrupt stops one decode (this one, or the next)
            ctypes.memmove(self._abort_flag, b"\0", 1)
            self._interrupt_asked = False
        if rc == 2:  # aborted: drop whatever part of the batch reached the cache
            for e in batch:
                _lc.llama_memory_seq_rm(self._mem, e.seq, e.pos, -1)
            raise DecodeInterrupted()
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} ({_DECODE_CODES.get(rc, 'an internal error')}) on a"
                              f" batch of {i} tokens; set LOCALRUN_LLAMA_LOG=1 to see why")
        self._ledger.fed(batch)
        n_out = sum(e.n_logits for e in batch)
        if n_out == 0:
            return [np.empty((0, self.n_vocab), np.float32) for _ in batch]
        rows = self._logits(n_out)
        if len(batch) == 1:
            return [rows]
        # Rows with logits sit contiguously in llama_batch order in the context's output buffer.
        by_seq, r = {}, 0
        for e in ordered:
            by_seq[e.seq] = rows[r : r + e.n_logits]
            r += e.n_logits
        return [by_seq[e.seq] for e in batch]

    def _logits(self, n_out: int) -> np.ndarray:
        """The context's first n_out logit rows, a view of its output buffer. The view is
        kept while the buffer stays where it is (llama.cpp moves it only to grow it):
        building one through ctypes costs ~60 us right after a decode."""
        addr = self._logits_addr(self._ctx)
        view = self._logits_view
        if view is None or view[0] != addr or view[1].shape[0] < n_out:
            floats = (ctypes.c_float * (n_out * self.n_vocab)).from_address(addr)
            self._logits_view = view = (addr, np.frombuffer(floats, np.float32).reshape(n_out, self.n_vocab))
        return view[1][:n_out]

    def _refit_threads(self) -> None:
        """Follow the cores other processes leave free (hardware.fitted_threads): a
        busy core stalls every step that puts a thread on it. llama.cpp takes a new count
        on a live context, for the next decode."""
        self._refit_at = time.monotonic() + REFIT_THREADS_S
        busy = self._load.busy_cores()
        if busy is None:
            return
        threads = fitted_threads(busy)
        if threads != self.threads:
            _lc.llama_set_n_threads(self._ctx, threads, threads)
            self.threads = threads

    # -- interrupting a decode ---------------------------------------------------

    can_interrupt = True
    batches_neighbours_only = True  # split_equal(sequential) with a KV stream per sequence
    passes = staticmethod(neighbour_passes)

    def _arm_interrupt(self, ctx) -> None:
        """ggml asks its abort callback `bool f(void *data)` between graph nodes, on its
        own compute threads, hundreds of times per decode. A Python callback would take
        the GIL each time; libc's `strlen` over a 2-byte buffer answers the same question
        in C: "" (0) = go on, "x" (1) = stop. The 0/1 result lands in the return
        register's low byte, which is where a C bool is read on x86-64 and arm64."""
        self._abort_flag = ctypes.create_string_buffer(2)
        self._interrupt_asked = False
        strlen = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
        self._abort_fn = _lc.ggml_abort_callback(strlen) if hasattr(_lc, "ggml_abort_callback") else strlen
        _lc.llama_set_abort_callback(ctx, self._abort_fn, ctypes.cast(self._abort_flag, ctypes.c_void_p))

    def interrupt(self) -> None:
        self._interrupt_asked = True  # first: decode() clears the flag when it sees this
        ctypes.memmove(self._abort_flag, b"x", 1)

    def clear_interrupt(self) -> None:
        ctypes.memmove(self._abort_flag, b"\0", 1)
        self._interrupt_asked = False

    # -- embeddings --------------------------------------------------------------

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The mean of the last hidden states over `tokens`, L2-normalised. A context
        of its own (embeddings on, mean pooling) keeps the generation context untouched."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"embed: {len(tokens)} tokens, expected 1..{self.n_ctx}")
        if self._embedder is None:
            p = _lc.llama_context_default_params()
            p.n_ctx = p.n_batch = p.n_ubatch = self.n_ctx  # one pooled sequence fits one ubatch
            p.n_seq_max = 1
            p.n_threads = p.n_threads_batch = self.threads
            p.embeddings = True
            p.pooling_type = _lc.LLAMA_POOLING_TYPE_MEAN
            p.no_perf = True
            ctx = _lc.llama_init_from_model(self._model, p)
            if not ctx:
                raise ModelLoadError("llama.cpp could not create an embedding context; try a smaller --ctx")
            self._embedder = (ctx, _lc.llama_batch_init(self.n_ctx, 0, 1))
        ctx, b = self._embedder
        _lc.llama_memory_clear(_lc.llama_get_memory(ctx), True)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, True
            b.seq_id[i][0] = 0
        b.n_tokens = len(tokens)
        rc = _lc.llama_decode(ctx, b)
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} ({_DECODE_CODES.get(rc, 'an internal error')})"
                              f" while embedding {len(tokens)} tokens")
        n_embd = _lc.llama_model_n_embd(self._model)
        vec = np.ctypeslib.as_array(_lc.llama_get_embeddings_seq(ctx, 0), shape=(n_embd,)).astype(np.float32)
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    # -- KV cache ----------------------------------------------------------------

    def kv_trim(self, seq: int, n_keep: int) -> None:
        if not _lc.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            # llama.cpp cuts a recurrent state (Mamba, RWKV) only whole
            raise CacheNotTrimmableError(f"llama.cpp cannot cut sequence {seq}'s cache back to {n_keep} tokens")
        self._ledger.trimmed(seq, n_keep)

    def kv_copy(self, src: int, dst: int, n: int) -> None:
        # Between separate KV streams llama.cpp copies whole sequences only (a partial
        # range aborts the process), so copy everything and trim the copy.
        _lc.llama_memory_seq_rm(self._mem, dst, -1, -1)
        _lc.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._ledger.copied(src, dst, n)
        self.kv_trim(dst, n)

    def kv_clear(self, seq: int) -> None:
        _lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._ledger.cleared(seq)

    def kv_tokens(self, seq: int) -> list[int]:
        return self._ledger.tokens(seq)

    def kv_state_bytes(self, seq: int) -> int:
        """Bytes llama.cpp would write to save `seq`'s KV cache: what its cached tokens
        occupy in the cache's element type (a measure of --kv-cache-type's saving)."""
        return int(_lc.llama_state_seq_get_size(self._ctx, seq))

    def close(self) -> None:
        if self._embedder is not None:
            ctx, b = self._embedder
            _lc.llama_batch_free(b)
            _lc.llama_free(ctx)
            self._embedder = None
        if self._batch is not None:
            _lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            _lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            _lc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # a forgotten close must not leak the model
        try:
            self.close()
        except Exception:  # at interpreter exit the library may already be gone: nothing to free
            return
