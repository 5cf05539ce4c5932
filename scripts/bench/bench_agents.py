#!/usr/bin/env python3
"""Agent sessions stay warm: turn 2 of a long conversation reads only its new tokens.

    python -m scripts.bench.bench_agents               # Qwen2.5-Coder, ~10.5k-token prompt (--tokens 13000), 3 dialects
    python -m scripts.bench.bench_agents --tokens 12000 --dialects messages responses --json agents.json
    python -m scripts.bench.bench_agents --agents      # also the real Claude Code and Codex CLI, two turns each

An agent resends its whole conversation every turn. Per dialect (Anthropic Messages,
OpenAI Responses, OpenAI Chat Completions), through the official SDK's stream: turn 1 sends
an agent-sized prompt (a system prompt of real source code, three tools, one question);
turn 2 sends the same conversation plus the answer and one new question. Printed: each
turn's prompt tokens, time to first token (the first text or tool-call delta), the tokens
the server reports as read from its prefix cache, and turn 1 / turn 2. Each dialect's
prompt opens with its own tag, so its turn 1 finds nothing cached from another.

With --agents: `claude -p` then `claude -p --continue`, and `codex exec` then
`codex exec resume --last`, against the same server with the agents' full default
prompts (scripts/install_agents.sh installs them); printed: each turn's wall time and the
cached tokens the agent itself reports (its JSON output).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.serving import Server

REPO = Path(__file__).resolve().parents[2]

MODELS = Path(os.environ.get("LOCALRUN_TEST_MODELS", Path.home() / ".cache/localrun/test-models"))
QWEN = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"
TOOLS = [
    ("read_file", "Read a file of the project.", {"path": {"type": "string"}}),
    ("run_tests", "Run the project's tests.", {"pattern": {"type": "string"}}),
    ("edit_file", "Replace text in a file.", {"path": {"type": "string"}, "old": {"type": "string"},
                                              "new": {"type": "string"}}),
]
QUESTIONS = ("In one sentence: what does the first module above do?", "And in one sentence, the second one?")


def source_text(n_tokens: int) -> str:
    """Real code for the system prompt: the project's own server modules, about n_tokens
    (at ~3.2 characters a token; this code is nearer 4, so --tokens 13000 makes ~10.5k)."""
    text = ""
    for path in sorted((REPO / "localrun").rglob("*.py")):
        text += f"\n# file: {path.relative_to(REPO)}\n" + path.read_text()
        if len(text) > n_tokens * 3.2:
            break
    return text[: int(n_tokens * 3.2)]


def messages_turn(client, system: str, history: list[dict], max_tokens: int) -> dict:
    tools = [{"name": n, "description": d, "input_schema": {"type": "object", "properties": p}} for n, d, p in TOOLS]
    t0, first = time.perf_counter(), None
    # this SDK takes no sampling arguments: the server reads them from the body
    with client.messages.stream(model=NAME, system=system, messages=history, tools=tools, max_tokens=max_tokens,
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            if first is None and event.type == "content_block_delta":
                first = time.perf_counter() - t0
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    u = final.usage
    return {"ttft": first, "prompt": u.input_tokens + (u.cache_read_input_tokens or 0),
            "cached": u.cache_read_input_tokens or 0, "reply": {"role": "assistant", "content": text or "(no text)"}}


def responses_turn(client, system: str, history: list[dict], max_tokens: int) -> dict:
    tools = [{"type": "function", "name": n, "description": d, "parameters": {"type": "object", "properties": p}}
             for n, d, p in TOOLS]
    t0, first = time.perf_counter(), None
    with client.responses.stream(model=NAME, instructions=system, input=history, tools=tools,
                                 max_output_tokens=max_tokens, temperature=0) as stream:
        final = None
        for event in stream:
            if first is None and event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                first = time.perf_counter() - t0
            if event.type in ("response.completed", "response.incomplete"):  # the SDK's helper wants completed
                final = event.response
    u = final.usage
    return {"ttft": first, "prompt": u.input_tokens, "cached": u.input_tokens_details.cached_tokens,
            "reply": {"role": "assistant", "content": final.output_text or "(no text)"}}


def chat_turn(client, system: str, history: list[dict], max_tokens: int) -> dict:
    tools = [{"type": "function", "function": {"name": n, "description": d,
                                               "parameters": {"type": "object", "properties": p}}}
             for n, d, p in TOOLS]
    t0, first, parts, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": system}, *history],
                                            tools=tools, max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if first is None and (choice.delta.content or choice.delta.tool_calls):
                first = time.perf_counter() - t0
            parts.append(choice.delta.content or "")
    return {"ttft": first, "prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens,
            "reply": {"role": "assistant", "content": "".join(parts) or "(no text)"}}


def session(dialect: str, url: str, tokens: int, max_tokens: int) -> dict:
    import anthropic
    import openai

    system = f"[{dialect} session] You are a coding agent working on this project.\n" + source_text(tokens)
    if dialect == "messages":
        client, turn = anthropic.Anthropic(base_url=url, api_key="local", timeout=1800), messages_turn
    else:
        client = openai.OpenAI(base_url=url + "/v1", api_key="local", timeout=1800)
        turn = responses_turn if dialect == "responses" else chat_turn
    history = [{"role": "user", "content": QUESTIONS[0]}]
    one = turn(client, system, history, max_tokens)
    history += [one["reply"], {"role": "user", "content": QUESTIONS[1]}]
    two = turn(client, system, history, max_tokens)
    return {"dialect": dialect, "turn1": {k: v for k, v in one.items() if k != "reply"},
            "turn2": {k: v for k, v in two.items() if k != "reply"}}


def agent_runs(url: str, bin_dir: Path, ctx: int) -> list[dict]:
    """Two turns of each real agent, as a user would run them, in a scratch project."""
    out = []
    work = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    claude_env = {**os.environ, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "local",
                  "ANTHROPIC_MODEL": NAME, "ANTHROPIC_SMALL_FAST_MODEL": NAME,
                  "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(ctx), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                  "HOME": str(work / "home")}
    for i, extra in enumerate(([], ["--continue"])):
        t0 = time.perf_counter()
        p = subprocess.run([str(bin_dir / "claude"), "-p", QUESTIONS[i].replace("module above", "file here"),
                            "--output-format", "json", *extra], cwd=work, env=claude_env, capture_output=True,
                           text=True, timeout=3600)
        wall = time.perf_counter() - t0
        usage = json.loads(p.stdout).get("usage", {}) if p.returncode == 0 else {}
        out.append({"agent": "claude", "turn": i + 1, "rc": p.returncode, "wall_s": wall,
                    "cached": usage.get("cache_read_input_tokens"), "input": usage.get("input_tokens"),
                    "error": p.stderr[-300:] if p.returncode else ""})
    home = work / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{NAME}"\nmodel_provider = "localrun"\nmodel_context_window = {ctx}\n\n'
        f'[model_providers.localrun]\nname = "localrun"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
    codex_env = {**os.environ, "CODEX_HOME": str(home)}
    for i, cmd in enumerate((["exec"], ["exec", "resume", "--last"])):
        t0 = time.perf_counter()
        p = subprocess.run([str(bin_dir / "codex"), *cmd, "--skip-git-repo-check", "--json", QUESTIONS[i]],
                           cwd=work, env=codex_env, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        usage = {}
        for line in p.stdout.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("type") == "turn.completed":
                usage = ev.get("usage", {})
        out.append({"agent": "codex", "turn": i + 1, "rc": p.returncode, "wall_s": wall,
                    "cached": usage.get("cached_input_tokens"), "input": usage.get("input_tokens"),
                    "error": p.stderr[-300:] if p.returncode else ""})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=QWEN)
    ap.add_argument("--tokens", type=int, default=13000, help="size of the system prompt in tokens (about)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--dialects", nargs="+", default=["messages", "responses", "chat"],
                    choices=["messages", "responses", "chat"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--agents", action="store_true", help="also run Claude Code and Codex CLI, two turns each")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    global NAME
    NAME = a.model.stem
    srv = Server("--model", str(a.model), "--threads", str(a.threads), "--parallel", "2",
                 "--alias", f"claude-*={NAME}")
    try:
        ctx = httpx.post(srv.url + "/api/show", json={"model": NAME}, timeout=60).json()
        ctx = next(v for k, v in ctx["model_info"].items() if k.endswith(".context_length"))
        print(f"{NAME}: served context {ctx} tokens per request")
        rows = []
        for d in a.dialects:
            rows.append(session(d, srv.url, a.tokens, a.max_tokens))
            print(d, json.dumps(rows[-1]), flush=True)
        print(f"\n{'dialect':<10} {'prompt 1':>8} {'TTFT 1 s':>9} {'prompt 2':>8} {'cached 2':>8} {'TTFT 2 s':>9}"
              f" {'1/2':>6}")
        for r in rows:
            one, two = r["turn1"], r["turn2"]
            r["ratio"] = one["ttft"] / two["ttft"]
            print(f"{r['dialect']:<10} {one['prompt']:>8} {one['ttft']:>9.2f} {two['prompt']:>8} {two['cached']:>8}"
                  f" {two['ttft']:>9.2f} {r['ratio']:>6.1f}")
        agents = []
        if a.agents:
            bin_dir = Path(subprocess.run(["bash", str(REPO / "scripts/install_agents.sh")], check=True,
                                          capture_output=True, text=True).stdout.strip().splitlines()[-1])
            agents = agent_runs(srv.url, bin_dir, ctx)
            print(f"\n{'agent':<8} {'turn':>4} {'rc':>3} {'wall s':>8} {'input':>8} {'cached':>8}")
            for r in agents:
                print(f"{r['agent']:<8} {r['turn']:>4} {r['rc']:>3} {r['wall_s']:>8.1f} {r['input']!s:>8}"
                      f" {r['cached']!s:>8}  {r['error'].strip()[-120:]}")
        if a.json:
            a.json.write_text(json.dumps({"model": NAME, "ctx": ctx, "sessions": rows, "agents": agents}, indent=1))
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
