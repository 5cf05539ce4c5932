"""`repack=False` reaches llama.cpp: K-quant weights stay in their stored layout, so a
prompt-sized batch runs other kernels (the logits move a little, the model does not)."""

from __future__ import annotations

import numpy as np

from localrun.backends.base import BatchEntry
from localrun.backends.llamacpp import LlamaCppBackend


def _rows(path, repack: bool) -> np.ndarray:
    # attention pinned: where this machine timed flash attention faster it is on, and its
    # f16 rounding moves Gemma-3's logits by up to ~16 here, which would swamp the layouts'
    be = LlamaCppBackend(path, n_ctx=256, threads=2, repack=repack, flash_attn="off")
    try:
        tokens = be.tokenize("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
        return np.array(be.decode([BatchEntry(0, tokens, 0, len(tokens))])[0])
    finally:
        be.close()


def test_weights_kept_as_stored_change_the_kernels_not_the_model(gemma3_gguf):
    packed, stored = _rows(gemma3_gguf, True), _rows(gemma3_gguf, False)
    assert not np.array_equal(packed, stored)
    assert (packed.argmax(axis=1) == stored.argmax(axis=1)).mean() > 0.9
