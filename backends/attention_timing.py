"""Flash attention on or off for an f16 cache on the CPU, chosen by timing both on this
machine (issue 52), then remembered.

Which kernel is faster depends on the model's heads, the CPU and the thread count: at
one thread llama-bench had SmolLM2 49 tok/s without flash attention against 33 with it
(depth 650), while at two threads on an idle 2-core machine the same model read 90
without and 110 with it (depth 832). No rule fits both, so the first load of a model
times them: two small contexts of the loaded model (one per setting) read DEPTH prompt
tokens (the prompt rate) and then decode one token at a time at that depth (the decode
rate), at every thread count the load-following threads may pick (hardware.
fitted_threads: from one to all cores), the settings alternating round by round so that
a change of load falls on both.

The winner is the setting with the shorter time for a reference turn of PROMPT_PER_ANSWER
prompt tokens per answer token where one is CLEAR_GAIN faster; between the two, "off" for
a context of one sequence and "on" for one that serves several (AttentionTiming.winner).
The timing is remembered in the cache folder (datafiles.cache_dir) per model (its
bytes, wherever the file lies), llama.cpp build, machine, thread count and KV type (as
the batch drift is), and used by every later load, except a tie, which is timed again
once it is RETIME_TIE_S old: a dozen decodes per setting on a shared machine whose speed
moves with its neighbours' can call two settings even where they are not. On this
project's 2-core host Gemma-3-270M at one thread was timed at 46.2 against 47.4 ms a
token (a tie, so off) on a day the host ran it at half speed; on a later day three
fresh timings chose on twice, and a bare decode loop read on 1.12x off. A clear winner
is kept, as before. A measurement taken while other processes kept a core busy is used
for that load only, and none is taken while they keep one busy at load (the load then
attends without flash attention, the old rule, or by the tie it remembered): a later
load measures.
`LOCALRUN_FLASH_ATTN` overrides it all.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from localrun.hardware import BUSY_CORE_SHARE, OthersLoad, probe
from localrun import datafiles

DEPTH = 512  # cached tokens when a decode step is timed: a chat a few turns in
STEPS = 4  # one-token decodes timed per setting, thread count and round (after one untimed)
ROUNDS = 3
FILL_BATCH = 256  # tokens per decode while reading the prompt (serve's default --batch)
PROMPT_PER_ANSWER = 1.0  # the reference turn: as many new prompt tokens as answer tokens
CLEAR_GAIN = 0.03  # how much faster "on" must be to be chosen
RETIME_TIE_S = 7 * 24 * 3600  # a remembered tie is timed again after a week (a load's few seconds, once)
FILE_NAME = "flash-attention.json"
SETTINGS = ("off", "on")

log = logging.getLogger("localrun")


@dataclass(frozen=True)
class AttentionTiming:
    """What one thread count measured: milliseconds per decoded token at DEPTH and per
    prompt token read, for each setting."""

    threads: int
    decode_ms: dict[str, float]
    prompt_ms: dict[str, float]
    measured_at: float = 0.0  # Unix time of the timing; 0: unknown (an entry from before it was kept)

    def turn_ms(self, setting: str) -> float:
        return self.decode_ms[setting] + PROMPT_PER_ANSWER * self.prompt_ms[setting]

    def winner(self, sequences: int = 1) -> str:
        """"on" where it is clearly faster, "off" where that is, and between the two
        (timings a few percent apart: noise that would flip the choice, and with it the
        answers' last bits, from one load to the next) a fixed default. For a context of
        one sequence that is "off", the setting every earlier release used. For one that
        serves several at once (a server's slots) it is "on": llama.cpp's rows then do
        not depend on which other sequences share the step, so a temperature-0 answer is
        the same whoever else is served. Measured on Gemma-3 (28.7 against 28.4 ms a
        token here), 4 then 8 clients sending one prompt at once, twice: with "off" 22
        of those 24 answers differed from the answer given alone (all 16 at 8 clients),
        with "on" none of 24 did. Prompt lookup copies the prompt into those answers, so
        it drafts under concurrency as it does alone only where they stay the same."""
        on, off = self.turn_ms("on"), self.turn_ms("off")
        if on < (1 - CLEAR_GAIN) * off:
            return "on"
        if off < (1 - CLEAR_GAIN) * on:
            return "off"
        return "on" if sequences > 1 else "off"

    def tie(self) -> bool:
        return self.winner(1) != self.winner(2)

    def due_again(self, now: float) -> bool:
        """Whether a remembered timing is to be taken again: a tie once RETIME_TIE_S old."""
        return self.tie() and now - self.measured_at > RETIME_TIE_S

    def explain(self, sequences: int = 1) -> str:
        rates = "; ".join(f"{s}: decode {1000 / self.decode_ms[s]:.1f} tok/s, prompt {1000 / self.prompt_ms[s]:.0f} tok/s"
                          for s in SETTINGS)
        tie = " (a tie: off for one sequence, on for several at once)" if self.tie() else ""
        return (f"flash attention {self.winner(sequences)}{tie}, measured at {self.threads} thread(s),"
                f" depth {DEPTH} ({rates})")

    def as_json(self) -> dict:
        return {"decode_ms": self.decode_ms, "prompt_ms": self.prompt_ms, "measured_at": self.measured_at}

    @classmethod
    def from_json(cls, threads: int, value) -> "AttentionTiming | None":
        try:
            decode, prompt = ({s: float(value[part][s]) for s in SETTINGS} for part in ("decode_ms", "prompt_ms"))
        except (KeyError, TypeError, ValueError):  # an older or hand-edited entry: measure again
            return None
        if min(*decode.values(), *prompt.values()) <= 0:
            return None
        measured_at = value.get("measured_at", 0.0)
        return cls(threads, decode, prompt, float(measured_at) if isinstance(measured_at, (int, float)) else 0.0)


def _here() -> str:
    """The llama.cpp build and the machine, the first part of every key."""
    try:
        build = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        build = "unknown"
    hw = probe()
    return f"llama.cpp {build}|{hw.cpu_name}|{hw.cpu_physical}c|"


def timing_key(model_path: str, kv_cache_type: str, threads: int) -> str | None:
    """The llama.cpp build, the machine, the thread count, the KV type and the model's
    bytes (datafiles.file_identity: a copy elsewhere is the same model); None for a file
    that cannot be read."""
    identity = datafiles.file_identity(model_path)
    return f"{_here()}t={threads}|kv={kv_cache_type}|{identity}" if identity else None


def recall(model_path: str, kv_cache_type: str, threads: int) -> AttentionTiming | None:
    key = timing_key(model_path, kv_cache_type, threads)
    value = datafiles.read_cache(FILE_NAME).get(key) if key else None
    return AttentionTiming.from_json(threads, value) if value is not None else None


def remembered() -> list[tuple[str, AttentionTiming]]:
    """(model file name and KV type, timing) for every thread count timed on this
    machine with this llama.cpp build, for `localrun doctor`."""
    prefix, out = _here() + "t=", []
    for key, value in datafiles.read_cache(FILE_NAME).items():
        if not key.startswith(prefix):
            continue
        fields = key[len(prefix):].split("|")  # threads, kv=..., identity
        if len(fields) < 3 or not fields[0].isdigit() or not isinstance(value, dict):
            continue
        t = AttentionTiming.from_json(int(fields[0]), value)
        if t is not None:
            out.append((f"{value.get('model', '?')} ({fields[1]})", t))
    return out


def remember(model_path: str, kv_cache_type: str, timings: list[AttentionTiming]) -> None:
    entries = {}
    for t in timings:
        key = timing_key(model_path, kv_cache_type, t.threads)
        if key:  # the file's name, for doctor: the key holds its bytes' identity only
            entries[key] = t.as_json() | {"model": Path(model_path).name}
    if entries:
        datafiles.remember(FILE_NAME, entries)


def thread_counts(threads: int, cores: int) -> list[int]:
    """The counts the load-following threads may pick between (1 and all cores) and the
    one this load starts with."""
    return sorted({1, max(1, cores), max(1, threads)})


def choose(model_path: str, kv_cache_type: str, threads: int, cores: int, time_both) -> AttentionTiming | None:
    """The timing this load's choice rests on: remembered, else measured now, else None
    (other processes keep a core busy: timings would be theirs as much as ours, and
    llama.cpp's spinning threads make them slow to take; a later load times it).
    `time_both(counts)` times both settings at those thread counts (measure() on the
    loaded model)."""
    known = recall(model_path, kv_cache_type, threads)
    if known is not None and not known.due_again(time.time()):
        return known
    others = OthersLoad()
    busy = others.busy_cores(wait=True)
    if busy is not None and busy >= BUSY_CORE_SHARE:
        log.info("flash attention not timed: other processes keep %.1f cores busy (a later load times it)", busy)
        return known  # a tie due again still decides until a quiet load times it
    counts = thread_counts(threads, cores)
    start = time.monotonic()
    stamp = time.time()
    timings = [replace(t, measured_at=stamp) for t in time_both(counts)]
    busy = others.busy_cores()
    mine = next(t for t in timings if t.threads == threads)
    log.info("%s (timed in %.1f s; kept for this model and machine, a tie for a week)", mine.explain(),
             time.monotonic() - start)
    if busy is None or busy < BUSY_CORE_SHARE:
        remember(model_path, kv_cache_type, timings)
    else:  # trusted for this load only
        log.info("other processes kept %.1f cores busy while it was timed: not remembered", busy)
    return mine


def measure(lc, model, n_vocab: int, make_context, counts: list[int]) -> list[AttentionTiming]:
    """Time both settings on `model` (llama.cpp's low-level API `lc`): `make_context(setting,
    n_ctx, n_batch, threads)` gives a context or None. Raises RuntimeError if llama.cpp
    refuses a context or a decode (the caller then keeps the rule's choice)."""
    n_ctx = DEPTH + ROUNDS * len(counts) * (STEPS + 1) + 16
    contexts, batch = {}, lc.llama_batch_init(FILL_BATCH, 0, 1)
    try:
        prompt_ms = {}
        for setting in SETTINGS:
            ctx = make_context(setting, n_ctx, FILL_BATCH, max(counts))
            if not ctx:
                raise RuntimeError(f"llama.cpp gave no context with flash attention {setting}")
            contexts[setting] = ctx
            start = time.perf_counter()
            _fill(lc, ctx, batch, n_vocab)
            prompt_ms[setting] = (time.perf_counter() - start) * 1000 / DEPTH
        steps = {(t, s): [] for t in counts for s in SETTINGS}
        pos = dict.fromkeys(SETTINGS, DEPTH)
        for r in range(ROUNDS):
            for t in counts:
                for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                    ctx = contexts[setting]
                    lc.llama_set_n_threads(ctx, t, t)
                    for i in range(STEPS + 1):  # the first step after a thread change is not timed
                        start = time.perf_counter()
                        _decode(lc, ctx, batch, [_token(pos[setting], n_vocab)], pos[setting])
                        if i:
                            steps[t, setting].append((time.perf_counter() - start) * 1000)
                        pos[setting] += 1
        return [AttentionTiming(t, {s: statistics.median(steps[t, s]) for s in SETTINGS}, prompt_ms) for t in counts]
    finally:
        lc.llama_batch_free(batch)
        for ctx in contexts.values():
            lc.llama_free(ctx)


def _token(i: int, n_vocab: int) -> int:
    return (1000 + i * 7919) % n_vocab  # any tokens: the time does not depend on which


def _fill(lc, ctx, batch, n_vocab: int) -> None:
    for start in range(0, DEPTH, FILL_BATCH):
        n = min(FILL_BATCH, DEPTH - start)
        _decode(lc, ctx, batch, [_token(start + j, n_vocab) for j in range(n)], start)


def _decode(lc, ctx, batch, tokens: list[int], pos: int) -> None:
    for j, tok in enumerate(tokens):
        batch.token[j] = tok
        batch.pos[j] = pos + j
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = 0
        batch.logits[j] = j == len(tokens) - 1
    batch.n_tokens = len(tokens)
    rc = lc.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} while timing flash attention")
