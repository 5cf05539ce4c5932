#!/usr/bin/env python3
"""Benchmark (a script, not a test): the chat app's decode speed against `localrun run`'s
on the same model, prompt and settings (issue 16: app / cli >= 0.95, idle or busy).

Each round runs, interleaved (the order alternates between rounds), on a fresh process
or app each time:
  cli  `localrun run MODEL PROMPT --verbose` as a subprocess; reads `eval count` and
       `eval rate` from its timings.
  app  the real chat app answering the same question as the only turn of a new chat:
       --driver tmux (default when tmux is installed) runs the real `localrun chat`
         command (`python -m localrun chat`) in a tmux terminal, types the question,
         and reads tok/s from the status bar when the answer is saved. The terminal,
         its escape sequences and tmux itself cost CPU as they do for a user.
       --driver pilot runs the same ChatApp in this process with Textual's headless
         Pilot (`App.run_test`): every widget, Markdown parse and layout is real, only
         the bytes to a terminal are skipped; it reads the engine's Timings from the
         status bar's values.
Both sides: the same model, chat template, temperature 0, --max-tokens, --threads, --ctx
and prompt lookup setting, so with lookup off they decode the same tokens; the script checks
that the answers are the same text and the token counts are equal, and says so.

    python -m scripts.bench.bench_chat_app [--model PATH] [--repeat 3] [--max-tokens 200]
                                           [--threads N|fitted] [--driver tmux|pilot] [--busy] [--long]

--threads fitted (the default) passes no --threads to either side, so both fit their threads
to the load as a user's `localrun chat` and `localrun run` do. A forced count that the load
leaves no cores for measures llama.cpp's spinning barriers, not the app: with one core busy
and --threads 2, `localrun run` fell from ~130 to 24-40 tok/s and the app to 0.5-2, while
fitted threads gave 79 and 77. The app falls further because tmux starts it in a session
of its own, and Linux's autogroup scheduling shares the CPU between sessions: the spinner's
session gets one core, the app's the other, so its two spinning threads take turns on one
core and every barrier waits a time slice (`localrun run` shares a session, and so two
cores, with the spinner). --busy keeps one core spinning in
another process during every run. --long asks for a 400-token answer, so that frames drawn
while it decodes count as in a real session (the default answer is ~90 tokens). Prints per-round
tok/s (with lookup on, the share of drafted tokens each answer kept), the medians,
`app / cli = X.XX` (of the medians, and the median of each round's own ratio, which a load
that changes between rounds disturbs less), the geometric mean of the rounds' ratios with
its 95% interval, and the load average. With lookup on the two sides' texts and draft plans
differ from run to run, so only the mean over many rounds (10 or more) says anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts.lookup.common import paired_ratio

REPO = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache" / "localrun" / "test-models"))
DEFAULT_MODEL = MODELS / "smollm2-135m-instruct-q4_1.gguf"
QUESTION = "Write a Python function that parses a CSV file and returns the average of each numeric column."
# a question SmolLM2 answers with 400+ tokens (one long code block): ~4 s of decoding, so
# the frames drawn while it decodes weigh as they do in a real session, not just the first
LONG_QUESTION = ("Write a Python command-line todo app with add, list, done and delete commands that stores"
                 " tasks in a JSON file, then explain how each part works.")
SPIN = "while True: pass"
SCREEN = (160, 40)  # wide enough that the status line is never cut


@dataclass
class Run:
    side: str  # "cli" | "app"
    tok_s: float
    generated: int  # tokens in the answer
    text: str
    draft: float | None = None  # share of drafted tokens kept, % (None: lookup drafted nothing)


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ")[0]
    except OSError:
        return f"{os.getloadavg()[0]:.2f}"


FITTED = "fitted"


def threads_arg(value: str) -> int | str:
    if value == FITTED:
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a thread count or '{FITTED}', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("a thread count must be at least 1")
    return n


def flags(args) -> list[str]:
    """The settings both sides share, as command-line flags."""
    out = [str(args.model), "--temperature", "0", "--max-tokens", str(args.max_tokens), "--ctx", str(args.ctx)]
    if args.threads != FITTED:
        out += ["--threads", str(args.threads)]
    return out if args.lookup else out + ["--no-lookup"]


def isolated_env(tmp: Path) -> dict[str, str]:
    """A private data folder (the app saves the chat there) and model store."""
    env = dict(os.environ)
    for var, sub in (("LOCALRUN_DATA", "data"), ("LOCALRUN_MODELS", "models"), ("HF_HUB_CACHE", "hf"),
                     ("LOCALRUN_LMSTUDIO_MODELS", "lms")):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp / sub)
    return env


# -- the CLI -----------------------------------------------------------------------------

def run_cli(args, tmp: Path) -> Run:
    model, *rest = flags(args)  # the prompt right after the model: argparse reads both positionals at once
    cmd = [sys.executable, "-m", "localrun.cli", "run", model, args.question, *rest, "--verbose"]
    proc = subprocess.run(cmd, cwd=REPO, env=isolated_env(tmp), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"error: localrun run failed:\n{proc.stderr}")
    count = re.search(r"^eval count:\s+(\d+)", proc.stderr, re.M)
    rate = re.search(r"^eval rate:\s+([\d.]+)", proc.stderr, re.M)
    if not (count and rate):
        raise SystemExit(f"error: no timings in localrun run's output:\n{proc.stderr}")
    text = proc.stdout[:-1] if proc.stdout.endswith("\n") else proc.stdout  # run adds one newline
    draft = re.search(r"^draft acceptance:.*\((\d+)%\)", proc.stderr, re.M)
    return Run("cli", float(rate.group(1)), int(count.group(1)), text, float(draft.group(1)) if draft else None)


# -- the app in tmux ------------------------------------------------------------------------

STATUS = re.compile(r"([\d.]+) tok/s (?:│ draft (\d+)% )?.*?ctx (\d+)/(\d+)")


def saved_answer(data: Path) -> str | None:
    db = data / "conversations.db"
    if not db.exists():
        return None
    try:
        with sqlite3.connect(db) as con:
            row = con.execute("SELECT content FROM messages WHERE role = 'assistant'").fetchone()
    except sqlite3.OperationalError:  # the app is creating or writing it right now
        return None
    return row[0] if row else None


def run_app_tmux(args, tmp: Path, prompt_tokens: int) -> Run:
    env = isolated_env(tmp)
    name = f"localrun-bench-{uuid.uuid4().hex[:8]}"
    command = " ".join([sys.executable, "-m", "localrun", "chat", *map(_quote, flags(args))])
    passed = [a for var in ("LOCALRUN_DATA", "LOCALRUN_MODELS", "HF_HUB_CACHE", "LOCALRUN_LMSTUDIO_MODELS")
              for a in ("-e", f"{var}={env[var]}")]
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", str(SCREEN[0]), "-y", str(SCREEN[1]),
                    "-c", str(REPO), *passed, command], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout

    def wait(condition, what: str, timeout: float = 300, every: float = 0.1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = condition()
            if found:
                return found
            time.sleep(every)
        raise SystemExit(f"error: timed out waiting for {what}; screen:\n{screen()}")

    try:
        wait(lambda: f"ctx 0/{args.ctx}" in screen(), "the model to load")
        subprocess.run(["tmux", "send-keys", "-t", name, "-l", args.question], check=True)
        subprocess.run(["tmux", "send-keys", "-t", name, "Enter"], check=True)
        # looked for twice a second: this script's own polling must not slow the app it measures
        text = wait(lambda: saved_answer(Path(env["LOCALRUN_DATA"])), "the answer to be saved", every=0.5)

        def final_status():  # the status line once it shows the whole answer's context
            m = STATUS.search(screen())
            return m if m and int(m.group(3)) > prompt_tokens else None

        time.sleep(0.3)  # the saved answer's last status update reaches the screen
        m = wait(final_status, "the status line")
        return Run("app", float(m.group(1)), int(m.group(3)) - prompt_tokens, text,
                   float(m.group(2)) if m.group(2) else None)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


# -- the app in this process (Pilot) ----------------------------------------------------------

def run_app_pilot(args, tmp: Path) -> Run:
    os.environ.update(isolated_env(tmp))
    from localrun.cli import build_parser
    from localrun.tui.app import ChatApp
    from localrun.tui.conversations import ConversationStore
    from localrun.tui.input import PromptInput
    from localrun.tui.session import ChatSession, resolve
    from localrun.tui.settings import settings_from_args

    parsed = build_parser().parse_args(["chat", *flags(args)])
    threads = None if args.threads == FITTED else args.threads
    app = ChatApp(ChatSession(n_ctx=args.ctx, threads=threads), settings_from_args(parsed),
                  ConversationStore.open(), resolve(str(args.model)))

    async def drive() -> Run:
        async with app.run_test(size=SCREEN) as pilot:
            while app.loading or app.session.engine is None:
                await pilot.pause(0.05)
            app.query_one(PromptInput).text = args.question
            app.query_one(PromptInput).focus()
            await pilot.press("enter")
            await pilot.pause(0.05)
            while app.generating:
                await pilot.pause(0.05)
            t = app.status.values.timings
            return Run("app", t.decode_tps, t.generated_tokens, app.messages[-1]["content"],
                       100 * t.acceptance if t.drafted else None)

    try:
        return asyncio.run(drive())
    finally:
        app.session.close()
        app.store.close()


# -- rounds and report ----------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a GGUF file (default: SmolLM2-135M Q4_1)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--threads", type=threads_arg, default=FITTED,
                   help=f"both sides: N, or '{FITTED}' (the default: no --threads, each fits its threads"
                        " to the load as a user's does)")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--long", action="store_true",
                   help="ask the long-answer question with --max-tokens 400 (instead of --question)")
    p.add_argument("--no-lookup", dest="lookup", action="store_false", help="prompt lookup off on both sides")
    p.add_argument("--driver", choices=("tmux", "pilot"), default="tmux" if shutil.which("tmux") else "pilot")
    p.add_argument("--busy", action="store_true", help="keep one core busy with another process during the runs")
    p.add_argument("--json", type=Path, default=None, help="also write the runs here")
    args = p.parse_args()
    if not args.model.exists():
        raise SystemExit(f"error: no model at {args.model}: run scripts/fetch_test_models.py or pass --model")
    if args.repeat < 1 or args.max_tokens < 1:
        raise SystemExit("error: --repeat and --max-tokens must be at least 1")
    if args.long:
        args.question, args.max_tokens = LONG_QUESTION, 400

    print(f"model {args.model.name} │ driver {args.driver} │ threads {args.threads} │ max tokens {args.max_tokens}"
          f" │ lookup {'on' if args.lookup else 'off'} │ {'one core busy' if args.busy else 'no load of ours'}"
          f" │ loadavg {loadavg()}")
    spin = subprocess.Popen([sys.executable, "-c", SPIN]) if args.busy else None
    runs: list[Run] = []
    loads: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp_root:
            for i in range(args.repeat):
                sides = ("cli", "app") if i % 2 == 0 else ("app", "cli")
                prompt_tokens = None
                for side in sides:
                    tmp = Path(tmp_root) / f"{i}-{side}"
                    if side == "cli":
                        run = run_cli(args, tmp)
                    elif args.driver == "pilot":
                        run = run_app_pilot(args, tmp)
                    else:
                        prompt_tokens = prompt_tokens if prompt_tokens is not None else count_prompt(args)
                        run = run_app_tmux(args, tmp, prompt_tokens)
                    runs.append(run)
                    loads.append(loadavg())
                    kept = f"  drafts kept {run.draft:3.0f}%" if run.draft is not None else ""
                    print(f"round {i + 1} {side}: {run.tok_s:6.1f} tok/s  {run.generated} tokens{kept}  "
                          f"loadavg {loads[-1]}", flush=True)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()

    cli = [r for r in runs if r.side == "cli"]
    app = [r for r in runs if r.side == "app"]
    cli_tps = statistics.median(r.tok_s for r in cli)
    app_tps = statistics.median(r.tok_s for r in app)
    same_count = len({r.generated for r in runs}) == 1
    same_text = len({r.text for r in runs}) == 1
    print(f"cli median {cli_tps:.1f} tok/s │ app median {app_tps:.1f} tok/s")
    print(f"tokens: {'equal' if same_count else 'DIFFER'} ({sorted({r.generated for r in runs})}); "
          f"text: {'identical' if same_text else 'DIFFERS'} on every run")
    # each round's own ratio: load that changes between rounds cancels within a round
    paired = statistics.median(a.tok_s / c.tok_s for a, c in zip(app, cli))
    print(f"app / cli = {app_tps / cli_tps:.2f} (of the medians; median of the rounds' own ratios {paired:.2f})")
    mean = paired_ratio([a.tok_s for a in app], [c.tok_s for c in cli])
    if mean:
        print(f"rounds' ratios: geometric mean {mean[0]:.2f}, 95% interval {mean[1]:.2f}-{mean[2]:.2f}")
    if not same_text and args.lookup:
        # measured on SmolLM2 with one core busy: the 400-token answers took 130 to 368 steps,
        # and one and the same text decoded at 88.5 tok/s in the CLI and 63.8 in the app
        print("with lookup on, the answers differ from run to run (a near tie that a many-row step decided "
              "the other way; draft lengths follow step times measured as the answer runs), so a round's "
              "ratio mixes the app's cost with what each side's drafts kept: take the geometric mean over "
              "many rounds, or --no-lookup for the same text on both sides")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model.name, "driver": args.driver, "threads": args.threads,
                                         "busy": args.busy, "loadavg": loads, "app_over_cli": app_tps / cli_tps,
                                         "app_over_cli_paired": paired, "app_over_cli_geomean": mean,
                                         "runs": [asdict(r) for r in runs]}, indent=1))
    # with lookup on the texts, and so their lengths, may differ (see above); off, they must not
    return 0 if same_count or args.lookup else 1


def count_prompt(args) -> int:
    """The chat prompt's token count (the status line's ctx counts prompt + answer)."""
    from localrun.engine import Engine

    with Engine.open(args.model, n_ctx=args.ctx, threads=1) as engine:
        return len(engine.chat_prompt([{"role": "user", "content": args.question}]))


if __name__ == "__main__":
    raise SystemExit(main())
