"""A thinking model in the terminal front ends (issue 50): `localrun run` writes the
thinking to stderr (dimmed on a terminal, or hidden with --hide-thinking) and only the
answer to stdout; --reasoning-budget and --think/--no-think reach the request and the
template; the piped chat and the chat app keep the thinking with its answer as
`reasoning_content`, which the template sees on the next turn; the app shows it folded.
The model is the scripted thinking model of tests/thinking_fakes.py."""

from __future__ import annotations

import io

import pytest

from localrun.cli import build_parser, main
from localrun.engine import Engine
from localrun.tui.app import ChatApp
from localrun.tui.conversations import ConversationStore
from localrun.tui.session import ChatSession
from localrun.tui.settings import settings_from_args
from localrun.tui.thinking import DIM, RESET, ThinkingOut
from localrun.tui.thinking_view import TITLE_DONE, ThinkingView
from thinking_fakes import ANSWER, PLAN, thinking_engine


@pytest.fixture
def engines(monkeypatch) -> list:
    made = []

    def fake_open(path, *args, **options):
        made.append(thinking_engine())
        return made[-1]

    monkeypatch.setattr(Engine, "open", fake_open)
    return made


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_thinking_out_dims_on_a_terminal_and_ends_its_line():
    plain, tty, hidden = io.StringIO(), Terminal(), io.StringIO()
    for stream, out in ((plain, ThinkingOut(plain)), (tty, ThinkingOut(tty)), (hidden, ThinkingOut(hidden, hidden=True))):
        out.write("pl")
        out.write("")
        out.write("an")
        out.end()
        out.end()  # a second end writes nothing
    assert plain.getvalue() == "plan\n"
    assert tty.getvalue() == f"{DIM}plan{RESET}\n"
    assert hidden.getvalue() == ""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["run", "thinker.gguf", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_writes_the_answer_to_stdout_and_the_thinking_to_stderr(capsys, engines):
    assert run(capsys, "hi") == (0, ANSWER + "\n", PLAN + "\n")
    assert run(capsys, "hi", "--hide-thinking") == (0, ANSWER + "\n", "")
    assert run(capsys, "hi", "--no-think") == (0, ANSWER + "\n", "")  # the template wrote an empty think block
    assert engines[-1].requests[-1].template_kwargs == {"enable_thinking": False}
    code, out, err = run(capsys, "hi", "--think", "--reasoning-budget", "3")
    # the engine ended the thinking after 3 of its 4 tokens; the answer followed whole
    assert (code, out, err) == (0, ANSWER + "\n", PLAN[:3] + "\n")
    request = engines[-1].requests[-1]
    assert (request.reasoning_budget, request.template_kwargs) == (3, {"enable_thinking": True})
    assert run(capsys, "hi", "--reasoning-budget", "-1")[0] == 0 and engines[-1].requests[-1].reasoning_budget is None
    # a raw prompt skips the template: the raw text, thinking markup and all, on stdout
    assert run(capsys, "<|im_start|>assistant\n", "--raw", "--max-tokens", "40") == (
        0, f"<think>{PLAN}</think>{ANSWER}\n", "")


def test_run_refuses_a_negative_budget_in_one_line_before_loading(capsys, engines):
    code, out, err = run(capsys, "hi", "--reasoning-budget", "-2")
    assert code != 0 and out == "" and engines == []
    assert err.count("\n") == 1 and "--reasoning-budget" in err


def test_piped_chat_keeps_thinking_for_the_template(engines, monkeypatch, capsys):
    from localrun.tui.repl import run_repl

    args = build_parser().parse_args(["chat", "thinker.gguf"])
    stdout = io.StringIO()
    assert run_repl(args, stdin=io.StringIO("hi\nagain\n"), stdout=stdout) == 0
    # the second answer shows the template read the first one's reasoning_content
    assert stdout.getvalue() == f"{ANSWER}\n\n{ANSWER} (after {PLAN})\n\n"
    assert capsys.readouterr().err == f"{PLAN}\n{PLAN}\n"


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


@pytest.mark.anyio  # through anyio's pytest plugin (a dependency of httpx)
async def test_the_chat_app_folds_the_thinking_and_keeps_it_for_the_template(tmp_path, monkeypatch):
    from localrun.tui.input import PromptInput

    monkeypatch.setenv("LOCALRUN_DATA", str(tmp_path))
    args = build_parser().parse_args(["chat", "thinker.gguf", "--reasoning-budget", "9"])
    engines = []
    session = ChatSession(n_ctx=2048, opener=lambda path, **kw: engines.append(thinking_engine()) or engines[-1])
    store = ConversationStore.open()
    app = ChatApp(session, settings_from_args(args), store, (tmp_path / "thinker.gguf", "thinker"),
                  verdict=lambda path: "CPU", rss=lambda: 1 << 20)

    async def wait(pilot, condition) -> None:
        for _ in range(1500):
            if condition():
                return
            await pilot.pause(0.02)
        raise AssertionError("timed out")

    async def ask(pilot, text: str) -> None:
        app.query_one(PromptInput).focus()
        await pilot.press(*[{" ": "space"}.get(c, c) for c in text], "enter")
        await pilot.pause(0.05)
        await wait(pilot, lambda: not app.generating)

    try:
        async with app.run_test(size=(100, 40)) as pilot:
            await wait(pilot, lambda: not app.loading and session.engine is not None)
            await ask(pilot, "hi")
            views = list(app.query(ThinkingView))
            assert len(views) == 1 and views[0].collapsed and views[0].title == TITLE_DONE
            assert views[0].text == PLAN
            shown = list(app.view.children)
            assert shown.index(views[0]) + 1 == shown.index(app.query(".assistant").last())  # just above its answer
            assert app.query(".assistant").last().source == ANSWER  # the answer holds no thinking
            assert app.messages[-1] == {"role": "assistant", "content": ANSWER, "reasoning_content": PLAN}
            assert engines[-1].requests[-1].reasoning_budget == 9
            views[0].collapsed = False  # unfolding draws the text
            await pilot.pause(0.05)
            assert str(views[0].query_one(".thinking-text").render()) == PLAN
            await ask(pilot, "again")
            assert app.messages[-1]["content"] == f"{ANSWER} (after {PLAN})"
            await pilot.press("ctrl+r")  # regenerating drops the last answer's thinking with it
            await pilot.pause(0.05)
            await wait(pilot, lambda: not app.generating)
            assert len(app.query(ThinkingView)) == 2 and len(app.query(".assistant")) == 2
    finally:
        session.close()
        store.close()


def test_serve_flags_set_the_servers_defaults():
    import argparse

    from localrun.errors import BadRequestError
    from localrun.server.reasoning import Reasoning
    from localrun.server.reasoning_options import add_reasoning_flags, reasoning_defaults

    parser = argparse.ArgumentParser()
    add_reasoning_flags(parser)
    assert reasoning_defaults(parser.parse_args([])) == Reasoning()
    flags = parser.parse_args(["--reasoning-budget", "256", "--reasoning-format", "none"])
    assert reasoning_defaults(flags) == Reasoning(256, "none")
    assert reasoning_defaults(flags).request_fields() == {"reasoning_budget": 256, "reasoning_format": "none",
                                                          "template_kwargs": {}}
    with pytest.raises(BadRequestError, match="--reasoning-budget"):
        reasoning_defaults(parser.parse_args(["--reasoning-budget", "-3"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-format", "deepseek-legacy"])
