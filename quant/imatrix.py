"""Compute an importance matrix by running a GGUF model in llama.cpp over a text.

    im = compute_imatrix("model-f16.gguf", text, chunk_size=512)
    save_imatrix(im, "model.imatrix.gguf")

llama.cpp calls an eval callback (`cb_eval` in the context parameters) for every node
of the compute graph: first with ask=true ("do you want this tensor?"), then, for the
nodes we said yes to, again once the node is computed. We ask for the matrix
multiplications whose weight (src[0]) is a layer matrix ("blk.*") and read their
activations (src[1], [n_cols, n_tokens] float32): for every input column j we add the
squares x_j^2 over the chunk's tokens and count the tokens. That is what llama.cpp's
own imatrix tool accumulates, so the numbers mean the same thing to its quantizer.

Text is cut into chunks of `chunk_size` tokens, each starting with BOS (where the
model adds one) and decoded in one batch with a fresh cache. Mixture-of-experts
matrices (MUL_MAT_ID) are not collected yet; a model that has them gets no entries for
its experts, and a quantizer that needs them says so by name.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable

import numpy as np

from localrun.errors import BadRequestError, DecodeError, LocalrunError, ModelLoadError, ModelNotFoundError
from localrun.hardware import inference_threads

from . import ggml_lib
from .imatrix_file import ImportanceMatrix

MIN_ROWS = 16  # llama.cpp skips tiny batches (a lone token tells little); so do we
_GGML_F32 = 0


def _op_id(name: str) -> int:
    for i in range(256):
        try:
            if ggml_lib.op_name(i) == name:
                return i
        except Exception:  # past the end of the enum: ggml returns NULL
            break
    raise LocalrunError(f"this ggml has no {name} operation")


def _weight_name(raw: bytes) -> str:
    """A weight's own name: a backend copy is called 'CPU#blk.0.attn_q.weight#0'."""
    name = raw.decode("utf-8", errors="replace")
    if "#" in name:
        name = name.split("#")[1]
    return name


class _Collector:
    """The cb_eval callback and the sums it fills."""

    def __init__(self, im: ImportanceMatrix, collect_output: bool) -> None:
        self.im = im
        self.collect_output = collect_output
        self.mul_mat = _op_id("MUL_MAT")
        self.g = ggml_lib.lib()
        self.error: BaseException | None = None
        self.c_callback = None

    def wanted(self, t: ggml_lib.GgmlTensor) -> str | None:
        if t.op != self.mul_mat or not t.src[0] or not t.src[1]:
            return None
        src0 = ggml_lib.GgmlTensor.from_address(t.src[0])
        src1 = ggml_lib.GgmlTensor.from_address(t.src[1])
        name = _weight_name(src0.name)
        if not (name.startswith("blk.") or (self.collect_output and name == "output.weight")):
            return None
        if src1.type != _GGML_F32 or src1.ne[1] < MIN_ROWS:
            return None
        return name

    def read_src1(self, src1_ptr: int) -> np.ndarray:
        """src[1] as a float32 array [ne3, ne2, ne1, ne0], copied out of ggml's buffer."""
        src1 = ggml_lib.GgmlTensor.from_address(src1_ptr)
        nbytes = int(self.g.ggml_nbytes(src1_ptr))
        if src1.buffer and self.g.ggml_backend_buffer_is_host(src1.buffer) and src1.data:
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(src1.data))
        else:  # on a GPU: fetch it
            raw = np.empty(nbytes, np.uint8)
            self.g.ggml_backend_tensor_get(src1_ptr, raw.ctypes.data, 0, nbytes)
        ne = [int(x) for x in src1.ne]
        nb = [int(x) for x in src1.nb]
        view = np.lib.stride_tricks.as_strided(
            raw.view(np.float32), shape=(ne[3], ne[2], ne[1], ne[0]), strides=(nb[3], nb[2], nb[1], nb[0])
        )
        return np.array(view, dtype=np.float32)  # copy: the buffer is reused by the next node

    def collect(self, t: ggml_lib.GgmlTensor, name: str) -> None:
        src0 = ggml_lib.GgmlTensor.from_address(t.src[0])
        x = self.read_src1(t.src[1])  # [ne3, ne2, ne1, ne0]
        n_mat = int(src0.ne[2] * src0.ne[3])
        x64 = x.astype(np.float64)
        if not np.isfinite(x64).all():
            raise LocalrunError(f"non-finite activations reached {name}; the model or text is broken")
        for i3 in range(x.shape[0]):
            for i2 in range(x.shape[1]):
                # a 2-D weight broadcast over a 3-D activation folds into matrix 0
                mat = (i3 % int(src0.ne[3])) * int(src0.ne[2]) + (i2 % int(src0.ne[2]))
                rows = x64[i3, i2]
                self.im.add(name, (rows * rows).sum(axis=0), rows.shape[0], mat, n_mat)

    def callback(self):
        import llama_cpp

        @llama_cpp.ggml_backend_sched_eval_callback
        def cb(t_ptr, ask, _user_data):
            if self.error is not None:
                return False
            try:
                t = ggml_lib.GgmlTensor.from_address(t_ptr)
                name = self.wanted(t)
                if ask:
                    return name is not None
                if name is not None:
                    self.collect(t, name)
                return True
            except BaseException as e:  # an exception must not unwind through C
                self.error = e
                return False

        self.c_callback = cb  # keep it alive as long as the context may call it
        return cb


def compute_imatrix(
    model: str | os.PathLike,
    text: str,
    chunk_size: int = 512,
    max_chunks: int | None = None,
    threads: int | None = None,
    dataset_name: str = "calibration",
    collect_output: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ImportanceMatrix:
    """Run the GGUF `model` over `text` and return the accumulated importance matrix."""
    import llama_cpp as lc

    from localrun.backends.llamacpp import init_llama
    from localrun.model.gguf_check import check_gguf

    model = Path(model).expanduser()
    if not model.is_file():
        raise ModelNotFoundError(f"no such model file: {model}")
    if chunk_size < MIN_ROWS:
        raise BadRequestError(f"--chunk-size must be at least {MIN_ROWS} tokens, got {chunk_size}")
    check_gguf(model)  # typed error for a corrupt file before llama.cpp parses it
    init_llama()
    im = ImportanceMatrix(datasets=[dataset_name], chunk_size=chunk_size)
    collector = _Collector(im, collect_output)

    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = -1
    m = lc.llama_model_load_from_file(str(model).encode(), mparams)
    if not m:
        raise ModelLoadError(f"llama.cpp could not load {model}; set LOCALRUN_LLAMA_LOG=1 to see why")
    ctx = batch = None
    try:
        vocab = lc.llama_model_get_vocab(m)
        n_threads = int(threads or inference_threads())
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = chunk_size  # one chunk: one matmul per weight
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.no_perf = True
        cp.cb_eval = collector.callback()
        cp.cb_eval_user_data = None
        ctx = lc.llama_init_from_model(m, cp)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a {chunk_size}-token context for {model}")

        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
        n = lc.llama_tokenize(vocab, data, len(data), buf, cap, add_bos, False)
        tokens = list(buf[: max(0, n)])
        n_chunks = len(tokens) // chunk_size
        if max_chunks is not None:
            n_chunks = min(n_chunks, max_chunks)
        if n_chunks == 0:
            raise BadRequestError(
                f"the calibration text has {len(tokens)} tokens, fewer than one chunk of {chunk_size}; "
                "give a longer text or a smaller --chunk-size"
            )
        bos = lc.llama_vocab_bos(vocab)
        batch = lc.llama_batch_init(chunk_size, 0, 1)
        mem = lc.llama_get_memory(ctx)
        for c in range(n_chunks):
            chunk = tokens[c * chunk_size : (c + 1) * chunk_size]
            if add_bos and bos >= 0:
                chunk[0] = bos  # every chunk reads like the start of a document
            lc.llama_memory_clear(mem, True)
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
                batch.seq_id[i][0] = 0
                # every row: otherwise llama.cpp prunes the last layer to the rows with
                # logits and its matrices would see one token
                batch.logits[i] = True
            batch.n_tokens = len(chunk)
            rc = lc.llama_decode(ctx, batch)
            if collector.error is not None:
                raise collector.error
            if rc != 0:
                raise DecodeError(f"llama_decode failed with code {rc} on calibration chunk {c + 1}")
            im.chunk_count = c + 1
            if progress:
                progress(c + 1, n_chunks)
    finally:
        if batch is not None:
            lc.llama_batch_free(batch)
        if ctx:
            lc.llama_free(ctx)
        lc.llama_model_free(m)
    if not len(im):
        raise LocalrunError(f"no layer matrix of {model.name} was seen; it cannot get an importance matrix")
    return im
