"""How far a wide step's rows stray from the same rows decoded one at a time, on one
GGUF model as localrun's llama.cpp backend runs it (the number behind speculative.BatchDrift).

For each of a few grounded prompts (scripts/lookup/lookup_tasks.py, raw): 64 greedy tokens are
decoded one row at a time, then the same tokens again in steps of --width rows. Prints
the largest change of a top-two margin, the largest logit difference and how many
argmaxes flipped. 0 / 0 / 0 means wide rows are bit-identical to one-row rows (lookup
then changes nothing at temperature 0).

    .venv/bin/python -m scripts.lookup.batch_drift MODEL.gguf [--width 16] [--tokens 64] [--no-repack]
    LOCALRUN_FLASH_ATTN=on|off ...          # the attention kernel
    GGML_CPU_TILED_MM=0 ...                 # no tiled K-quant kernel for 8+ rows
    LLAMA_CPP_LIB_PATH=/build/bin ...       # another llama.cpp build (same version), e.g.
                                            # one configured with -DGGML_LLAMAFILE=OFF

With all three of --no-repack, GGML_CPU_TILED_MM=0 and a -DGGML_LLAMAFILE=OFF build (and
flash attention off) the three test models measured 0 / 0 / 0 on an AVX2 CPU.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from localrun.backends.base import BatchEntry
from localrun.backends.llamacpp import LlamaCppBackend
from localrun.speculation.drift import margin_change
from scripts.lookup.lookup_tasks import prompt_texts

PREFILL_CHUNK = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--width", type=int, default=16, help="rows per wide step")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-repack", action="store_true",
                    help="load the weights as stored (no repacking into the CPU's gemm layouts)")
    a = ap.parse_args()
    be = LlamaCppBackend(a.model, n_ctx=2048, threads=a.threads, repack=not a.no_repack)
    worst_margin = worst_logit = 0.0
    flips = 0
    for text in list(prompt_texts(False).values())[: a.prompts]:
        toks = be.tokenize(text, add_special=True)
        be.kv_clear(0)
        base = len(toks) - 1
        for c in range(0, base, PREFILL_CHUNK):
            be.decode([BatchEntry(0, toks[c : min(c + PREFILL_CHUNK, base)], c, 0)])
        fed, alone = [toks[-1]], []
        for j in range(a.tokens):
            row = np.array(be.decode([BatchEntry(0, [fed[-1]], base + j, 1)])[0][0])
            alone.append(row)
            fed.append(int(np.argmax(row)))
        be.kv_trim(0, base)
        wide = []
        for s in range(0, a.tokens, a.width):
            chunk = fed[s : s + a.width]
            wide.extend(np.array(r) for r in be.decode([BatchEntry(0, chunk, base + s, len(chunk))])[0])
        for one, w in zip(alone, wide):
            worst_margin = max(worst_margin, margin_change(w, one))
            worst_logit = max(worst_logit, float(np.abs(w - one).max()))
            flips += int(np.argmax(w) != np.argmax(one))
    be.close()
    print(f"{os.path.basename(a.model)} flash_attn={be.flash_attn} width={a.width}: margin drift"
          f" {worst_margin:.4f}, max logit diff {worst_logit:.4f}, argmax flips {flips}")


if __name__ == "__main__":
    main()
