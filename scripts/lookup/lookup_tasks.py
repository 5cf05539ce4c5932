"""Task texts for scripts/bench/bench_lookup.py and the instruments here: prompts whose
answer copies the prompt (grounded: where prompt lookup pays) and open-ended chat (the
control, where it must not cost), plus a few more short prompts for the temperature-0
identity check; and an engine with the tasks' prompts, and one greedy answer on it.

Each task is (group, chat message for instruct models, raw prompt for base models):
an instruct model gets its chat template applied to the message, a base model (no
template) gets the raw prompt, which it continues by copying.
"""

from contextlib import contextmanager

CODE = '''def summarize_requests(lines, window_s=60, slow_ms=500):
    """Aggregate access-log lines into per-endpoint statistics."""
    stats = {}
    errors = []
    first_ts = None
    last_ts = None
    for raw in lines:
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        parts = raw.split(" ")
        if len(parts) < 5:
            errors.append(("short", raw))
            continue
        entry = {
            "ts": float(parts[0]),
            "method": parts[1],
            "path": parts[2].split("?")[0],
            "status": int(parts[3]),
            "ms": float(parts[4]),
        }
        if first_ts is None:
            first_ts = entry["ts"]
        last_ts = entry["ts"]
        if entry["ts"] - first_ts > window_s:
            break
        key = (entry["method"], entry["path"])
        bucket = stats.setdefault(key, {
            "count": 0, "errors": 0, "slow": 0, "total_ms": 0.0, "max_ms": 0.0, "samples": [],
        })
        bucket["count"] += 1
        bucket["total_ms"] += entry["ms"]
        bucket["samples"].append(entry["ms"])
        if entry["ms"] > bucket["max_ms"]:
            bucket["max_ms"] = entry["ms"]
        if entry["status"] >= 500:
            bucket["errors"] += 1
            errors.append(("server", entry))
        elif entry["status"] >= 400:
            errors.append(("client", entry))
        if entry["ms"] >= slow_ms:
            bucket["slow"] += 1
    report = []
    for (method, path), bucket in sorted(stats.items()):
        samples = sorted(bucket["samples"])
        p95 = samples[min(len(samples) - 1, int(len(samples) * 0.95))]
        report.append({
            "endpoint": f"{method} {path}",
            "count": bucket["count"],
            "mean_ms": bucket["total_ms"] / bucket["count"],
            "p95_ms": p95,
            "max_ms": bucket["max_ms"],
            "error_rate": bucket["errors"] / bucket["count"],
            "slow": bucket["slow"],
        })
    span = (last_ts - first_ts) if first_ts is not None else 0.0
    return {"span_s": span, "endpoints": report, "errors": errors}'''

# A code edit as an editor asks for it: the function written back with one rarely used
# name changed (`tol`, 4 uses), so that almost all of the answer is a copy of the prompt.
EDIT_CODE = '''def merge_intervals(intervals, tol=0.0):
    \"\"\"Merge overlapping [start, end] intervals; gaps up to tol count as overlap.\"\"\"
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: (pair[0], pair[1]))
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        if start > end:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        last = merged[-1]
        if start <= last[1] + tol:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in merged)
    covered = max(end for _, end in merged) - min(start for start, _ in merged)
    gaps = covered - total
    if gaps < -tol:
        raise AssertionError("merged intervals overlap")
    return [tuple(pair) for pair in merged]'''


# ~125 words, 8 typos: thier, wich, arive, colege, vistors, beautful, beleive, untill.
TYPOS = (
    "The old harbour town wakes up slowly in the winter. Fishermen check thier nets before dawn, while the bakery on "
    "the corner starts its ovens and the smell of fresh bread, wich drifts down to the water, fills the empty "
    "streets. By eight o'clock the first buses arive from the valley, bringing students to the colege on the hill. "
    "Most vistors come in summer, when the beaches are crowded and every cafe has a queue, but the locals prefer the "
    "quiet months. They say the light is softer, the sea is more beautful, and the walks along the cliffs are empty "
    "enough to hear the birds. In the evening the lighthouse keeper turns on the lamp, and the whole town seems to "
    "beleive it is safe untill morning.")

# ~190 words; exactly two sentences mention copper.
SOURCE = (
    "The village of Arlen sits at the end of a narrow valley, three hours by road from the nearest city. For most of "
    "its history it lived from sheep and from the small orchards that climb the southern slope. In 1871 a surveyor "
    "found copper in the rocks above the church, and within ten years the population had doubled. The mine brought a "
    "railway, a school and a doctor, but it also brought smoke that killed the pear trees along the river. Families "
    "who had farmed the same fields for generations sold their land to the company and moved into rows of brick "
    "houses near the shafts. When the price of copper collapsed after the war, the company closed the mine in a "
    "single week. The railway stopped running soon after, and the young people left for the coast. Today Arlen has "
    "fewer than four hundred residents. The brick houses have been repainted in bright colours and rented to hikers, "
    "the orchards have been replanted, and an old engine house has become a small museum where visitors can see the "
    "tools, the maps and the letters of the miners who once lived there.")

# name -> (group, chat message for instruct models, raw prompt for base models)
TASKS = {
    "rename": ("grounded",
               f"Rename the variable `entry` to `record` in this Python function. Reply with the whole "
               f"rewritten function and nothing else.\n\n```python\n{CODE}\n```",
               f"Original:\n```python\n{CODE}\n```\n\nSame code with the variable `entry` renamed to "
               f"`record`:\n```python\n"),
    "edit": ("grounded",
             f"Rename the parameter `tol` to `tolerance` in this Python function. Reply with the whole "
             f"rewritten function and nothing else.\n\n```python\n{EDIT_CODE}\n```",
             f"Original:\n```python\n{EDIT_CODE}\n```\n\nSame code with the parameter `tol` renamed to "
             f"`tolerance`:\n```python\n"),
    "typos": ("grounded",
              f"Fix the spelling mistakes in this paragraph. Reply with the corrected paragraph only.\n\n{TYPOS}",
              f"Text with typos:\n{TYPOS}\n\nSame text with the typos fixed:\n"),
    "quote": ("grounded",
              f"{SOURCE}\n\nQuote, word for word, the two sentences of this text that mention copper.",
              f"Text:\n{SOURCE}\n\nThe two sentences of the text that mention copper, quoted verbatim:\n1. \""),
    "poem": ("chat", "Write a short poem about the sea.", "Q: Write a short poem about the sea.\nA:"),
    "bicycle": ("chat", "Explain how a bicycle works.", "Q: Explain how a bicycle works.\nA:"),
    "trip": ("chat", "Give me three ideas for a weekend trip.", "Q: Give me three ideas for a weekend trip.\nA:"),
}


# More short prompts for the identity check (name -> (chat message, raw prompt)); with the
# tasks they make the set over which "lookup on gives the lookup-off text" is counted.
IDENTITY_EXTRA = {
    "planets": ("List the planets of the solar system in order.",
                "Q: List the planets of the solar system in order.\nA:"),
    "capital": ("What is the capital of Australia, and why is it not Sydney?",
                "Q: What is the capital of Australia, and why is it not Sydney?\nA:"),
    "reverse": ("Write a Python function that reverses the words of a sentence.",
                "Q: Write a Python function that reverses the words of a sentence.\nA:"),
    "translate": ("Translate 'good morning, my friend' into French, Spanish and German.",
                  "Q: Translate 'good morning, my friend' into French, Spanish and German.\nA:"),
    "romeo": ("Summarize the plot of Romeo and Juliet in three sentences.",
              "Q: Summarize the plot of Romeo and Juliet in three sentences.\nA:"),
}


def prompt_texts(chat: bool) -> dict[str, str]:
    """name -> the chat message (chat=True) or the raw prompt, tasks first, then the extras."""
    out = {n: t[1] if chat else t[2] for n, t in TASKS.items()}
    out.update({n: p[0] if chat else p[1] for n, p in IDENTITY_EXTRA.items()})
    return out


def task_prompts(eng, names=None) -> dict[str, list[int]]:
    """The named tasks' prompts (all of prompt_texts' where `names` is None) as `eng` reads
    them: through the model's chat template where it has one (an instruct model), as raw
    text otherwise (a base model)."""
    chat = eng.info.chat_template is not None
    return {n: eng.chat_prompt([{"role": "user", "content": t}]) if chat else eng.tokenize(t)
            for n, t in prompt_texts(chat).items() if names is None or n in names}


@contextmanager
def task_engine(path, threads: int, names):
    """An engine on the model at `path` (4096 tokens of context, `threads`) and the named
    tasks' prompts for it."""
    from localrun.engine import Engine

    with Engine.open(path, n_ctx=4096, threads=threads) as eng:
        yield eng, task_prompts(eng, names)


def greedy_answer(eng, prompt: list[int], lookup, max_tokens: int):
    """One greedy answer from an empty KV cache: every run prefills in full, as in
    bench_lookup.py, whatever the run before it left."""
    from localrun.sampling import SamplingParams

    eng.backend.kv_clear(0)
    return eng.complete(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens, lookup=lookup)
