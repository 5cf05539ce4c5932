"""Whether llama.cpp attends with its flash-attention kernel: the choice the llama.cpp
backend makes and the selector's memory model counts (see backends/llamacpp.py's
docstring for the measurements behind it)."""

from __future__ import annotations

import os

from localrun.errors import ModelLoadError

FLASH_ATTN_ENV = "LOCALRUN_FLASH_ATTN"
CPU_SCORES_MAX_BYTES = 1 << 30  # the attention scores one micro-batch may take without flash attention


def attention_scores_bytes(n_ubatch: int, n_ctx_total: int, n_head: int) -> int:
    """What llama.cpp keeps for one micro-batch's attention scores without flash attention
    (f32, every query row against every cached position, per head)."""
    return n_ubatch * n_ctx_total * n_head * 4


MEASURE = "measure"


def flash_attention_choice(kv_cache_type: str, on_cpu: bool, score_bytes: int) -> str:
    """"on", "off", "auto" (llama.cpp decides) or MEASURE (time both on this machine:
    backends/attention_timing.py). A quantized cache needs it on; on the CPU, an f16 cache
    is faster with one or the other by model, CPU and threads, while the scores that
    attending without it keeps stay small."""
    forced = os.environ.get(FLASH_ATTN_ENV, "").strip().lower()
    if forced in ("on", "off", "auto"):
        if forced == "off" and kv_cache_type != "f16":
            raise ModelLoadError(f"--kv-cache-type {kv_cache_type} needs flash attention;"
                                 f" unset {FLASH_ATTN_ENV} or use --kv-cache-type f16")
        return forced
    if forced:
        raise ModelLoadError(f"{FLASH_ATTN_ENV}={forced!r}: use on, off or auto")
    if kv_cache_type != "f16":
        return "on"
    return MEASURE if on_cpu and score_bytes <= CPU_SCORES_MAX_BYTES else "auto"
