#!/usr/bin/env python3
"""Worker half of scripts/bench/bench.py: one engine, one model, in its own process.

    python -m scripts.bench.bench_peers ENGINE JOB.json     # from the repository's root

ENGINE is one of `tokens`, `localrun`, `llama_cpp`, `mlx_lm`. JOB.json holds the model
path, threads, n_ctx, n_gen, a short warm-up prompt and one prompt (a list of token ids)
per measured repeat. The result is printed as a single line `BENCH_RESULT {json}` on
stdout; everything else a library prints (llama.cpp logs, warnings) is noise around it.

Each engine gets its own process so that no two engines share a thread pool, an
allocator or page cache warm-up, and so that a crash in one costs only its row.
Every repeat starts from an empty KV cache with a prompt that shares no prefix with
the others (bench.py shifts the text window), so no engine can skip its prefill.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

MARK = "BENCH_RESULT "


def _emit(obj: dict) -> None:
    sys.stdout.flush()
    print(MARK + json.dumps(obj), flush=True)


def _run(prefill_s: float, n_prompt: int, decode_s: float, n_decode: int, **extra) -> dict:
    return {
        "prompt_tokens": n_prompt,
        "prefill_tps": n_prompt / prefill_s if prefill_s > 0 else None,
        "decode_tokens": n_decode,
        "decode_tps": n_decode / decode_s if decode_s > 0 else None,
        **extra,
    }


# -- localrun -------------------------------------------------------------------------

def _open_localrun(job: dict):
    from localrun.engine import Engine

    # MLX sizes its own thread pool and refuses a thread count (mlx_lm gets none either)
    threads = None if Path(job["model"]).is_dir() else job["threads"]
    return Engine.open(job["model"], n_ctx=job["n_ctx"], threads=threads)


def work_tokens(job: dict) -> dict:
    """localrun's own tokenizer makes the one prompt every engine is fed."""
    eng = _open_localrun(job)
    try:
        special = eng.tokenize("", add_special=True)  # BOS (or nothing) as the model wants
        body = eng.tokenize(job["text"], add_special=False)
    finally:
        eng.close()
    return {"special": list(special), "body": list(body)}


def work_localrun(job: dict) -> dict:
    eng = _open_localrun(job)
    from localrun.sampling import SamplingParams

    kw = {"sampling": SamplingParams(temperature=0.0), "ignore_eos": True}
    # Prompt-lookup speculation is on by default in the engine; the peers have none, so a
    # plain decode comparison turns it off and `--lookup` measures it as a row of its own.
    if "lookup" in inspect.signature(eng.start).parameters:
        kw["lookup"] = bool(job.get("lookup"))
    elif job.get("lookup"):
        raise SystemExit("this localrun has no prompt lookup")
    runs = []
    try:
        eng.complete(job["warm"], max_tokens=4, **kw)
        for prompt in job["prompts"]:
            t0 = time.perf_counter()
            res = eng.complete(prompt, max_tokens=job["n_gen"], **kw)
            wall = time.perf_counter() - t0
            t = res.timings
            # The engine's own clock is what the table shows; the outer wall clock is kept
            # so that time spent outside its prefill/decode windows is visible too.
            runs.append({
                "prompt_tokens": t.prompt_tokens, "prefill_tps": t.prefill_tps,
                "decode_tokens": t.decode_tokens, "decode_tps": t.decode_tps,
                "ttft_ms": t.ttft_ms, "wall_s": wall, "generated": len(res.tokens),
                "finish_reason": res.finish_reason,
                **{k: getattr(t, k) for k in ("steps", "drafted", "accepted") if hasattr(t, k)},
            })
        # the peers are told to attend the same way (scripts/bench/bench.py passes it on)
        flash_attn = getattr(eng.backend, "flash_attn", None)
    finally:
        eng.close()
    return {"runs": runs, **({"flash_attn": flash_attn} if flash_attn else {})}


# -- llama-cpp-python high-level Llama -------------------------------------------------

def work_llama_cpp(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(
        model_path=job["model"], n_ctx=job["n_ctx"],
        n_threads=job["threads"], n_threads_batch=job["threads"],
        # llama-bench's defaults, so that a prefill is split the same way everywhere
        n_batch=2048, n_ubatch=512, verbose=False,
        # the attention kernel localrun chose; this class has no "auto", which llama.cpp
        # resolves to on wherever the device has the kernel
        flash_attn=job.get("flash_attn", "auto") != "off",
    )

    def one(prompt: list[int], n_gen: int) -> dict:
        llm.reset()  # n_tokens = 0; the next eval drops the KV cache from position 0
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        # What a caller of the high-level class pays per token: sample (greedy) from the
        # last logits, then eval that token. EOS is not checked, as with ignore_eos.
        for _ in range(n_gen):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        t2 = time.perf_counter()
        return _run(t1 - t0, len(prompt), t2 - t1, n_gen)

    one(job["warm"], 4)
    runs = [one(p, job["n_gen"]) for p in job["prompts"]]
    if hasattr(llm, "close"):
        llm.close()
    return {"runs": runs, "version": llama_cpp.__version__}


# -- mlx_lm ----------------------------------------------------------------------------

def work_mlx_lm(job: dict) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local dir; never reach for the hub
    import mlx.core as mx
    import mlx_lm
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(job["model"])
    tok.eos_token_ids = set()  # as ignore_eos: always generate n_gen tokens
    sampler = make_sampler(temp=0.0)

    def one(prompt: list[int], n_gen: int) -> dict:
        last = None
        for last in stream_generate(model, tok, mx.array(prompt), max_tokens=n_gen, sampler=sampler):
            pass
        mx.clear_cache()
        # mlx_lm's own numbers: prompt_tps = prompt / time to first token, generation_tps
        # = tokens / time since the first token.
        return {
            "prompt_tokens": last.prompt_tokens, "prefill_tps": last.prompt_tps,
            "decode_tokens": last.generation_tokens, "decode_tps": last.generation_tps,
            "finish_reason": last.finish_reason,
        }

    one(job["warm"], 4)
    runs = [one(p, job["n_gen"]) for p in job["prompts"]]
    return {"runs": runs, "version": getattr(mlx_lm, "__version__", None), "device": str(mx.default_device())}


WORKERS = {
    "tokens": work_tokens,
    "localrun": work_localrun,
    "llama_cpp": work_llama_cpp,
    "mlx_lm": work_mlx_lm,
}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in WORKERS:
        print(f"usage: python -m scripts.bench.bench_peers {{{','.join(WORKERS)}}} JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    _emit(WORKERS[argv[0]](job))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
