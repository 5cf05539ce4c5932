"""What a quantization cost: perplexity and KL divergence against the source model.

    base = reference_logprobs("model-f16.gguf", text, ctx=256)
    row = measure("model-q4_k_m.gguf", base)      # QualityRow: size, bpw, ppl, KLD mean/p99
    print(format_table([row]))

Both models read exactly the same token ids (the source's tokenization of the text),
in chunks of `ctx` tokens each starting fresh, and, as llama.cpp's perplexity tool
does, only the second half of every chunk is scored (ctx/2 - 1 tokens), so each scored
token has at least ctx/2 tokens of context; the numbers agree with `llama-perplexity
--kl-divergence` on the same text and context. Per scored position:

    KLD = sum_v p_base(v) * (log p_base(v) - log p_quant(v))

reported as the mean and 99th percentile over positions, plus the perplexity of each
model on the text's next tokens and how often both models rank the same token first.
The source's log-probabilities are kept in memory (scored tokens x vocabulary x 4
bytes: 256 tokens of a 49k vocabulary is 50 MB), so each quant is run alone.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from localrun.errors import BadRequestError, LocalrunError

from .atomic import replace_durably


@dataclass
class Reference:
    path: str
    tokens: list[int]  # the evaluated text, as the source tokenized it
    ctx: int
    positions: np.ndarray  # indices into tokens of the scored (predicted) tokens
    logprobs: np.ndarray  # [n_scored, n_vocab] float32, the source's log-softmax
    n_vocab: int
    n_params: int = 0  # the source's weight count: bits per weight of quants that cannot say


@dataclass
class QualityRow:
    name: str
    size_bytes: int
    n_params: int
    ppl: float
    base_ppl: float
    kld_mean: float
    kld_p99: float
    kld_max: float
    top1_agree: float  # fraction of positions where both models' argmax agree
    n_tokens: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.size_bytes / max(1, self.n_params)


def _open(path: str | os.PathLike, ctx: int, threads: int | None):
    from localrun.backends import open_backend

    # The reference and every quant attend with one kernel (flash attention off, as
    # llama-perplexity -fa off), so that a KLD measures the quantization alone: a choice
    # timed per file (backends/attention_timing.py) could differ between two of them, and
    # the two kernels round differently (a Q4_K_M SmolLM2's perplexity moved 1%).
    fixed = {"flash_attn": "off"} if Path(path).is_file() else {}  # an MLX model is a folder
    return open_backend(path, n_ctx=ctx, n_seq=1, n_batch=ctx, threads=threads, **fixed)


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, np.float64)
    m = rows.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
    return (rows - lse).astype(np.float32)


def _chunks(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    return [(s, s + ctx) for s in range(0, n_tokens - ctx + 1, ctx)]


def _scored_logprobs(backend, tokens: Sequence[int], ctx: int, bos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(positions, log-probs of the token at each position) over every chunk's second half."""
    pos_all, rows_all = [], []
    first = ctx // 2
    from localrun.backends.base import BatchEntry

    for start, end in _chunks(len(tokens), ctx):
        chunk = list(tokens[start:end])
        if bos is not None and start > 0:
            chunk[0] = bos  # every chunk starts like a document, as llama.cpp does
        backend.kv_clear(0)
        logits = np.array(backend.decode([BatchEntry(0, chunk, 0, n_logits=len(chunk))])[0])
        # row j predicts token j+1 of the chunk; like llama.cpp's perplexity tool, rows
        # first..ctx-2 are scored (tokens first+1..ctx-1: ctx/2 - 1 per chunk)
        rows_all.append(_log_softmax(logits[first : len(chunk) - 1]))
        pos_all.append(np.arange(start + first + 1, end))
    if not rows_all:
        raise BadRequestError(f"the evaluation text is shorter than one chunk of {ctx} tokens; "
                              "give a longer text or a smaller --ctx")
    return np.concatenate(pos_all), np.concatenate(rows_all)


def reference_logprobs(
    base: str | os.PathLike, text: str, ctx: int = 256, max_chunks: int | None = None,
    threads: int | None = None,
) -> Reference:
    """Tokenize `text` with the source model and keep its log-probabilities."""
    if ctx < 16:
        raise BadRequestError(f"--ctx must be at least 16, got {ctx}")
    b = _open(base, ctx, threads)
    try:
        add_bos = b.info.add_bos and b.info.bos_id is not None
        tokens = b.tokenize(text, add_special=add_bos, parse_special=False)
        if max_chunks is not None:
            tokens = tokens[: ctx * max_chunks]
        positions, logprobs = _scored_logprobs(b, tokens, ctx, b.info.bos_id if add_bos else None)
        n_params = b.info.n_params or _safetensors_params(Path(base))
        return Reference(str(base), tokens, ctx, positions, logprobs, b.info.n_vocab, n_params)
    finally:
        b.close()


def _safetensors_params(folder: Path) -> int:
    """Weights in an unquantized safetensors folder (MLX reports no parameter count)."""
    import json
    import struct

    total = 0
    for f in folder.glob("*.safetensors") if folder.is_dir() else []:
        with open(f, "rb") as fp:
            (n,) = struct.unpack("<Q", fp.read(8))
            header = json.loads(fp.read(n))
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] in ("F32", "F16", "BF16"):
                total += int(np.prod(info["shape"]))
    return total


def model_size(path: str | os.PathLike) -> int:
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.glob("*.safetensors"))
    return p.stat().st_size


def measure(quant: str | os.PathLike, ref: Reference, name: str | None = None,
            threads: int | None = None) -> QualityRow:
    """Perplexity and KL divergence of `quant` against the reference source."""
    q = _open(quant, ref.ctx, threads)
    try:
        if q.info.n_vocab != ref.n_vocab:
            raise BadRequestError(
                f"{quant} has a vocabulary of {q.info.n_vocab} tokens, the source {ref.n_vocab}; "
                "they are not the same model"
            )
        bos = ref.tokens[0] if q.info.add_bos and q.info.bos_id is not None else None
        positions, lq = _scored_logprobs(q, ref.tokens, ref.ctx, bos)
        n_params = q.info.n_params
    finally:
        q.close()
    lp = ref.logprobs
    targets = np.asarray(ref.tokens)[positions]
    idx = np.arange(len(positions))
    # float64 for the sum: thousands of tiny terms, some of opposite sign.
    kld = (np.exp(lp.astype(np.float64)) * (lp.astype(np.float64) - lq)).sum(axis=1)
    kld = np.maximum(kld, 0.0)  # rounding can give -1e-9 where the two agree exactly
    return QualityRow(
        name=name or Path(quant).name,
        size_bytes=model_size(quant),
        n_params=int(n_params or ref.n_params),  # a quant has its source's weights
        ppl=math.exp(-float(lq[idx, targets].astype(np.float64).mean())),
        base_ppl=math.exp(-float(lp[idx, targets].astype(np.float64).mean())),
        kld_mean=float(kld.mean()),
        kld_p99=float(np.percentile(kld, 99)),
        kld_max=float(kld.max()),
        top1_agree=float((lp.argmax(axis=1) == lq.argmax(axis=1)).mean()),
        n_tokens=len(positions),
    )


def format_table(rows: Sequence[QualityRow]) -> str:
    head = f"{'model':<28} {'size MB':>8} {'bpw':>6} {'PPL':>9} {'dPPL %':>7} " \
           f"{'KLD mean':>9} {'KLD p99':>9} {'top-1 %':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        dppl = 100.0 * (r.ppl / r.base_ppl - 1.0)
        lines.append(
            f"{r.name[:28]:<28} {r.size_bytes / 1e6:>8.1f} {r.bits_per_weight:>6.2f} {r.ppl:>9.3f} "
            f"{dppl:>+7.2f} {r.kld_mean:>9.5f} {r.kld_p99:>9.5f} {100 * r.top1_agree:>8.1f}"
        )
    if rows:
        lines.append(f"source PPL {rows[0].base_ppl:.3f}; {rows[0].n_tokens} scored tokens")
    return "\n".join(lines)


def plot(rows: Sequence[QualityRow], out: str | os.PathLike, title: str = "size vs KL divergence") -> Path:
    """A PNG of model size (x) against mean KLD (y, log scale), one labelled point per quant."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and never pop a window
    import matplotlib.pyplot as plt

    if not rows:
        raise LocalrunError("nothing to plot: no quality rows")
    out = Path(out).expanduser()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        xs = [r.size_bytes / 1e6 for r in rows]
        # a lossless row (KLD 0) cannot sit on a log axis: floor it for display only
        ys = [max(r.kld_mean, 1e-7) for r in rows]
        ax.scatter(xs, ys, color="tab:blue", zorder=3)
        for x, y, r in zip(xs, ys, rows):
            label = r.name[:-5] if r.name.endswith(".gguf") else r.name
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("size (MB)")
        ax.set_ylabel("mean KL divergence vs source (nats)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        tmp = out.with_name(f".{out.name}.partial.png")
        fig.savefig(tmp, format="png")
        replace_durably(tmp, out)
    finally:
        plt.close(fig)
    return out


def compare(base: str | os.PathLike, quants: Sequence[str | os.PathLike], text: str, ctx: int = 256,
            max_chunks: int | None = None, threads: int | None = None,
            progress: Callable[[str], None] | None = None) -> list[QualityRow]:
    say = progress or (lambda _m: None)
    say(f"scoring the source {Path(base).name}")
    ref = reference_logprobs(base, text, ctx, max_chunks, threads)
    rows = []
    for qp in quants:
        say(f"scoring {Path(qp).name}")
        rows.append(measure(qp, ref, threads=threads))
    return rows
