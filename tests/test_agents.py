"""The real coding agents work against `localrun serve` with no flag beyond --model, --alias
and --temp 0.

Claude Code (`claude -p`, Anthropic Messages) and Codex CLI (`codex exec`, OpenAI
Responses), installed from npm by scripts/install_agents.sh, each complete a turn, and
each runs a tool that the model called: Claude Code's Write, Codex's shell. The model is
Qwen2.5-Coder-0.5B, served with its trained 32k context (no --ctx). A 0.5B model calls a
tool reliably only when the prompt names the tool and its arguments ("steered"), and it
does not reliably stop calling tools after: the tool tests check that the call was
parsed and run by the agent (the file exists with its content), and stop the agent there.

--temp 0 makes every request greedy that sends no temperature: Codex sends none (Claude
Code is sent temperature 0 through CLAUDE_CODE_EXTRA_BODY as well), so each session
answers the same way every run, and a test runs one session, with no retries.

Cost on the 2-core test machine: Codex's first request is ~10k tokens of instructions and
tool schemas (read once; its second run finds them in the prefix cache), Claude Code's with
one tool ~1k. scripts/bench/bench_agents.py --agents runs both with their full default prompts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from serving import Server

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
REPO = Path(__file__).resolve().parent.parent
AGENT_TIMEOUT_S = 600  # a whole agent run, on a loaded 2-core CI machine


@pytest.fixture(scope="module")
def agents() -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts/install_agents.sh")], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server(qwen_coder_gguf):
    # --temp 0: greedy for every request that sends no temperature (Codex sends none)
    srv = Server("--model", str(qwen_coder_gguf), "--parallel", "2", "--alias", f"claude-*={QWEN}", "--temp", "0")
    yield srv
    srv.stop()


def claude(agents: Path, server, work: Path, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "local", "ANTHROPIC_MODEL": QWEN,
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "32768", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "200",
           # greedy, so the test sees the same answer each run
           "CLAUDE_CODE_EXTRA_BODY": json.dumps({"temperature": 0}),
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "HOME": str(work / "home")}
    return subprocess.run([str(agents / "claude"), "-p", prompt, "--output-format", "json", *flags], cwd=work,
                          env=env, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S)


def test_claude_code_completes_a_turn(agents, server, tmp_path):
    p = claude(agents, server, tmp_path, "Say hi.", "--system-prompt", "You are a helpful assistant. Answer briefly.",
               "--tools", "")
    assert p.returncode == 0, p.stderr[-2000:] + server.output()
    result = json.loads(p.stdout)
    assert result["is_error"] is False and result["result"].strip(), result
    assert result["usage"]["output_tokens"] > 0


def test_claude_code_runs_the_write_tool_the_model_called(agents, server, tmp_path):
    target = tmp_path / "hello.txt"
    p = claude(agents, server, tmp_path, f'Call the Write tool with file_path "{target}" and content "hi".',
               "--system-prompt", "You are a coding agent.", "--tools", "Write", "--permission-mode", "acceptEdits",
               "--max-turns", "2")
    assert target.exists(), p.stdout[-2000:] + p.stderr[-2000:]
    assert target.read_text().strip() == "hi"
    assert json.loads(p.stdout)["num_turns"] >= 2  # the call, then the turn that read its result


# Both Codex tests run with the same flags, folder and CODEX_HOME: Codex's instructions
# name its approval policy and its home's skills folder before its tools' schemas, and
# the folder right after, so a session that differs in any re-reads ~5k of its ~8.7k
# prompt tokens (~60 s here) where this one finds them in the prefix cache.
SAME_INSTRUCTIONS = ("--dangerously-bypass-approvals-and-sandbox",)


@pytest.fixture(scope="module")
def codex_work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("codex-work")


def codex_home(tmp_path: Path, server) -> Path:
    home = tmp_path / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{QWEN}"\nmodel_provider = "localrun"\nmodel_context_window = 32768\n\n'
        '[model_providers.localrun]\nname = "localrun"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\n')
    return home


def codex(agents: Path, server, work: Path, prompt: str, *flags: str, done=None,
          timeout: float = AGENT_TIMEOUT_S) -> tuple[list[dict], list[dict]]:
    """Run `codex exec --json` until it exits, or until `done(work)` holds (then it is
    stopped). Returns its JSON events (Codex writes them when it exits: to a pipe it does
    not flush line by line) and the items of its session log, which it writes as it goes."""
    home = codex_home(work, server)
    started = time.time()
    proc = subprocess.Popen([str(agents / "codex"), "exec", "--skip-git-repo-check", "--json", *flags, prompt],
                            cwd=work, env={**os.environ, "CODEX_HOME": str(home)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its npm launcher runs the real binary as a child
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not (done and done(work)):
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):  # the launcher, the agent and the commands it ran
        os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    logs = [log for log in home.glob("sessions/**/rollout-*.jsonl") if log.stat().st_mtime >= started]  # this session's
    items = [json.loads(line).get("payload", {}) for log in logs for line in log.read_text().splitlines() if line.strip()]
    assert events or items, err[-2000:] + server.output()
    return events, items


def test_codex_completes_a_turn(agents, server, codex_work):
    """Codex sends no temperature; the server's --temp 0 makes the model's answer greedy,
    so one session answers the same way every run."""
    events, _ = codex(agents, server, codex_work, 'Reply with the single word "hi". Do not run any command.',
                      *SAME_INSTRUCTIONS)
    assert events and events[-1]["type"] == "turn.completed", events[-3:]
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages and messages[-1].strip(), events[-3:]
    assert events[-1]["usage"]["input_tokens"] > 5000  # Codex's own instructions and tools were all read


def test_codex_runs_the_shell_command_the_model_called(agents, server, codex_work):
    """Codex sends no temperature; the server's --temp 0 makes the model's call greedy, so
    one session makes the same call every run (sampled, about one session in three added a
    `justification` argument that Codex's own policy refuses). When it runs after the test
    above, it finds all but the last few dozen of Codex's ~8.7k prompt tokens in the prefix
    cache (SAME_INSTRUCTIONS); alone, it reads them cold (~80 s on an idle 2-core CPU)."""
    _, items = codex(agents, server, codex_work, 'Call exec_command with exactly these arguments:'
                     ' {"cmd": "echo hi > hello.txt"}', *SAME_INSTRUCTIONS,
                     done=lambda w: (w / "hello.txt").exists())
    calls = [json.loads(i["arguments"]) for i in items
             if i.get("type") == "function_call" and i.get("name") == "exec_command"]
    assert (codex_work / "hello.txt").exists(), calls[:2]  # the calls the model made
    assert (codex_work / "hello.txt").read_text().strip() == "hi", calls[:2]
    assert any("hello.txt" in c.get("cmd", "") for c in calls), calls[:2]
