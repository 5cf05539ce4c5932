"""The chat app driven with Textual's Pilot on the real test models: type, send, a
streamed answer; Esc mid-answer; switch model through the picker; sampler values (and
a rejected one); resume a saved conversation; slash commands.

Every test points the store and the data folder at temporary folders (`tui_env`), so
nothing here sees or writes the user's real models or conversations."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from textual.widgets import ProgressBar

from localrun.backends.llamacpp import LlamaCppBackend
from localrun.cli import build_parser
from localrun.sampling import SamplingParams
from localrun.tui.app import ChatApp, ChatOpener
from localrun.tui.thinking_view import ThinkingView
from localrun.tui.conversations import ConversationStore
from localrun.tui.help import HelpScreen
from localrun.tui.history import Conversations
from localrun.tui.input import PromptInput
from localrun.tui.picker import ModelPicker
from localrun.tui.session import ChatSession, resolve
from localrun.tui.settings import settings_from_args
from localrun.tui.settings_screen import SettingsPanel

SMOL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
GEMMA_NAME = "google/gemma-3-270m-GGUF:Q4_K_M"
SIZE = (100, 32)
pytestmark = pytest.mark.anyio  # async tests through anyio's pytest plugin (a dependency of httpx)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


@pytest.fixture
def tui_env(tmp_path, monkeypatch, smollm2_gguf, gemma3_gguf):
    """A private model store holding links to the two GGUF test models, an empty HF
    cache and LM Studio folder, and a private data folder for conversations."""
    models = tmp_path / "models"
    for org_repo, src in (("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", smollm2_gguf),
                          ("google/gemma-3-270m-GGUF", gemma3_gguf)):
        folder = models / org_repo
        folder.mkdir(parents=True)
        (folder / src.name).symlink_to(src)
    for var, sub in (("LOCALRUN_MODELS", "models"), ("HF_HUB_CACHE", "hf"),
                     ("LOCALRUN_LMSTUDIO_MODELS", "lmstudio"), ("LOCALRUN_DATA", "data")):
        (tmp_path / sub).mkdir(exist_ok=True)
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    while _made:  # free each test's model and database now, not whenever GC runs
        app = _made.pop()
        app.session.close()
        app.store.close()


_made: list[ChatApp] = []


def make_app(model: str = SMOL_NAME, *flags: str, ctx: int = 512) -> ChatApp:
    argv = ["chat", model, "--temperature", "0", "--max-tokens", "12", *flags]
    args = build_parser().parse_args(argv)
    opener = ChatOpener.from_args(args) if "--draft" in flags else None  # run_chat's opener, for --draft
    app = ChatApp(
        ChatSession(n_ctx=ctx, threads=2, **({"opener": opener} if opener else {})),
        settings_from_args(args),
        ConversationStore.open(),
        resolve(model),
        verdict=lambda path: "CPU",  # the machine's real fit is not what these tests check
        rss=lambda: 123 << 20,
    )
    _made.append(app)
    return app


async def wait_for(pilot, condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.02)


async def loaded(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: not app.loading and app.session.engine is not None, what="the model to load")


async def send(pilot, text: str) -> None:
    """Type `text` as keys and press Enter."""
    await pilot.click(PromptInput)
    pilot.app.query_one(PromptInput).focus()
    await pilot.press(*[{" ": "space"}.get(c, c) for c in text])
    await pilot.press("enter")


async def answered(pilot, timeout: float = 60.0) -> None:
    app = pilot.app
    await pilot.pause(0.05)
    await wait_for(pilot, lambda: not app.generating, timeout, "the answer to finish")


async def test_send_streams_answer_saves_and_keeps_multiline(tui_env, monkeypatch):
    app = make_app(SMOL_NAME, "--max-tokens", "40")  # long enough to be seen half-written
    partial = []  # what the answer widget showed after each frame
    draw_frame = ChatApp.draw_frame

    async def recording_frame(self, force=False):
        await draw_frame(self, force)
        if self._answer is not None:
            partial.append(self._answer.source)

    # recorded inside the frame, not by polling: a fast machine can finish all 40
    # tokens before a poll first sees the answer in flight
    monkeypatch.setattr(ChatApp, "draw_frame", recording_frame)
    decoded_on = set()  # the threads the load and the answer decoded on
    decode = LlamaCppBackend.decode

    def recording_decode(self, batch):
        decoded_on.add(threading.current_thread())
        return decode(self, batch)

    monkeypatch.setattr(LlamaCppBackend, "decode", recording_decode)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.status.values.n_ctx == 512
        box = app.query_one(PromptInput)
        box.focus()
        await pilot.press("a", "ctrl+j", "b")  # a new line, not a send
        assert box.text == "a\nb" and not app.messages
        box.clear()

        await send(pilot, "Count from 1 to 30.")
        assert box.text == ""  # sent: the box is empty again
        await wait_for(pilot, lambda: len(app.messages) == 2 and not app.generating, what="the answer")
        # each ended with its work, and its OpenMP pool with it (backends/compute_threads.py)
        assert decoded_on and not any(t.is_alive() or t is threading.main_thread() for t in decoded_on)
        shown = [text for text in partial if text]
        assert shown and len(shown[0]) < len(app.messages[-1]["content"])  # on screen before it was finished

        question, answer = app.messages
        assert question == {"role": "user", "content": "Count from 1 to 30."}
        assert answer["role"] == "assistant" and answer["content"].strip()
        assert app.query(".assistant").last().source == answer["content"]
        # the streamed text is exactly what the engine answers without the UI
        engine = app.session.engine
        direct = engine.complete(engine.chat_prompt([question]), sampling=SamplingParams(temperature=0), max_tokens=40)
        assert answer["content"] == direct.text

        status = str(app.status.render())
        t = app.status.values.timings
        assert t is not None and t.generated_tokens > 0
        assert f"ctx {t.prompt_tokens + t.generated_tokens}/512" in status
        assert "tok/s" in status and "TTFT" in status and "mem 123 MB" in status

        saved = app.store.list()
        assert len(saved) == 1 and saved[0].n_messages == 2 and saved[0].title == "Count from 1 to 30."


async def test_escape_stops_mid_answer_and_ui_stays_responsive(tui_env, monkeypatch):
    app = make_app(SMOL_NAME, "--max-tokens", "400", "--temperature", "0.8", "--seed", "7")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        # A machine fast enough wrote all 400 tokens (~2.6 s at 150 tok/s) before the key
        # presses below arrived, and there was no answer left to stop: each decode waits
        # 20 ms more here, so the answer outlasts them however fast the model runs.
        backend = app.session.engine.backend
        decode = backend.decode
        monkeypatch.setattr(backend, "decode", lambda batch: (time.sleep(0.02), decode(batch))[1])
        await send(pilot, "Write a long story about a brave knight and a dragon.")
        await wait_for(pilot, lambda: (app.status.values.timings or 0) and app.status.values.timings.generated_tokens >= 4,
                       what="a few tokens")
        assert gc.get_freeze_count() > 0  # no full collection stalls this answer's decoding
        await pilot.press("x")  # typing while the model writes: the event loop is free
        assert app.query_one(PromptInput).text == "x"
        t0 = time.monotonic()
        await pilot.press("escape")
        await answered(pilot, timeout=10)
        stop_latency = time.monotonic() - t0
        assert stop_latency < 5, f"Esc took {stop_latency:.2f} s to stop the answer"
        assert gc.get_freeze_count() == 0  # a stopped answer hands its objects back to the collector

        answer = app.messages[-1]
        assert answer["role"] == "assistant" and answer["content"]
        assert app.status.values.timings.generated_tokens < 400
        widget = app.query(".assistant").last()
        assert widget.border_subtitle == "stopped" and widget.has_class("noted")
        assert widget.source == answer["content"]

        # the slot was given back: the next question is answered
        app.settings.max_tokens = 8
        app.query_one(PromptInput).clear()
        await send(pilot, "Thanks!")
        await answered(pilot)
        assert [m["role"] for m in app.messages] == ["user", "assistant", "user", "assistant"]
        assert app.store.list()[0].n_messages == 4


async def test_switch_model_in_the_picker(tui_env):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        smol_backend = app.session.engine.backend
        await pilot.press("ctrl+o")
        picker = app.screen
        assert isinstance(picker, ModelPicker)
        await wait_for(pilot, lambda: picker.models, what="the model list")
        assert [m.name for m in picker.models] == [GEMMA_NAME, SMOL_NAME]
        table = picker.query_one("DataTable")
        assert table.get_row_at(1)[0].startswith("●")  # the open model is marked
        assert table.get_row_at(0)[1:] == ["gguf", "Q4_K_M", "241 MB", "CPU"]
        seen_while_loading = []
        real_load = app.session.load

        def load_and_look(path, name=None):  # what the screen showed while the model loaded
            bar = app.query_one("#loading", ProgressBar)
            seen_while_loading.append((bar.display, bar.total is None, app.status.values.state))
            real_load(path, name)

        app.session.load = load_and_look
        table.move_cursor(row=0)
        await pilot.press("enter")
        await pilot.pause(0.05)
        await loaded(pilot)
        assert seen_while_loading == [(True, True, "loading…")]  # an animated progress bar and the state
        bar = app.query_one("#loading", ProgressBar)
        assert not bar.display
        assert bar.total is not None  # not animating: its timer would fire all through every answer

        assert app.session.model_name == GEMMA_NAME
        assert app.session.engine.info.architecture.startswith("gemma")
        assert app.session.engine.backend is not smol_backend
        assert str(app.status.render()).startswith("gemma-3-270m-GGUF:Q4_K_M │")
        app.settings.max_tokens = 4
        await send(pilot, "Hello")
        await answered(pilot)
        assert app.messages[-1]["role"] == "assistant"
        assert app.store.list()[0].model == GEMMA_NAME

        # and by name, with /model
        await send(pilot, f"/model {SMOL_NAME}")
        await loaded(pilot)
        assert app.session.model_name == SMOL_NAME


async def test_a_draft_model_sits_out_a_model_it_does_not_pair_with(tui_env, smollm2_gguf, monkeypatch):
    """--draft: switching to a model of another vocabulary loads it without the draft
    model (as serve does) and says why in one notice; switching back drafts again."""
    from localrun.speculation.draft_model import DraftModel

    # the pair's step prices, timed at load, are not what this checks (and take long on a busy CPU)
    monkeypatch.setattr(DraftModel, "measure", lambda self, target, cost, rounds=2: None)
    app = make_app(SMOL_NAME, "--draft", str(smollm2_gguf))  # SmolLM2 pairs with itself
    notices = []
    monkeypatch.setattr(app, "notify", lambda message, **kw: notices.append((message, kw.get("severity"))))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert app.session.engine.draft_model is not None and not notices

        await send(pilot, f"/model {GEMMA_NAME}")
        await loaded(pilot)
        assert app.session.model_name == GEMMA_NAME and not app.query(".error")
        assert app.session.engine.info.architecture.startswith("gemma")
        assert app.session.engine.draft_model is None
        assert str(app.status.render()).startswith("gemma-3-270m-GGUF:Q4_K_M │")
        ((notice, severity),) = notices
        assert severity == "warning" and "\n" not in notice
        assert notice.startswith(f"{GEMMA_NAME} runs without the draft model: {smollm2_gguf.name} cannot draft for")
        app.settings.max_tokens = 4
        await send(pilot, "Hello")
        await answered(pilot)
        assert app.messages[-1]["role"] == "assistant"

        await send(pilot, f"/model {SMOL_NAME}")
        await loaded(pilot)
        assert app.session.model_name == SMOL_NAME
        assert app.session.engine.draft_model is not None and len(notices) == 1


async def test_sampler_panel_applies_values_and_rejects_bad_ones_inline(tui_env):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+s")
        panel = app.screen
        assert isinstance(panel, SettingsPanel)

        panel.query_one("#f-top_p").value = "1.5"
        await pilot.press("ctrl+s")
        assert app.screen is panel  # still open: nothing applied
        error = str(panel.query_one("#settings-error").render())
        assert "top_p must be in (0, 1]" in error
        assert panel.query_one("#f-top_p").has_class("invalid")

        panel.query_one("#f-top_p").value = "0.9"
        panel.query_one("#f-top_k").value = "many"
        await pilot.press("ctrl+s")
        assert "top_k must be an integer, got 'many'" in str(panel.query_one("#settings-error").render())
        assert not panel.query_one("#f-top_p").has_class("invalid")

        grammar = tui_env / "yes_no.gbnf"
        grammar.write_text('root ::= "yes" | "no"\n')
        panel.query_one("#f-top_k").value = "5"
        panel.query_one("#f-temperature").value = "0.3"
        panel.query_one("#f-max_tokens").value = "8"
        panel.query_one("#f-grammar_path").value = str(grammar)
        await pilot.press("ctrl+s")
        assert app.screen is not panel
        s = app.settings
        assert (s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, s.max_tokens) == (0.3, 5, 0.9, 8)
        assert s.grammar is not None

        # the next answer follows the grammar
        await send(pilot, "Is the sky blue?")
        await answered(pilot)
        assert app.messages[-1]["content"] in ("yes", "no")


async def test_resume_a_saved_conversation(tui_env):
    store = ConversationStore.open()
    older = store.save(None, "Old chat", SMOL_NAME, "", [{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": "Hello!"}])
    cid = store.save(None, "Colors", SMOL_NAME, "Answer briefly.", [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "One color, briefly."}])
    store.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+l")
        assert isinstance(app.screen, Conversations)
        table = app.screen.query_one("DataTable")
        assert [table.get_row_at(i)[0] for i in range(table.row_count)] == ["Colors", "Old chat"]
        await pilot.press("enter")  # the newest is highlighted first
        await pilot.pause()
        assert app.conv_id == cid and app.settings.system == "Answer briefly."
        assert [w.source for w in app.query(".message")] == ["Name a color.", "Blue."]
        # the saved thinking comes back folded before its answer, and goes to the template again
        views = list(app.query(ThinkingView))
        assert [v.text for v in views] == ["One color, briefly."] and views[0].collapsed
        assert app.messages[1]["reasoning_content"] == "One color, briefly."

        await send(pilot, "Another one?")
        await answered(pilot)
        conv = app.store.load(cid)
        assert len(conv.messages) == 4 and conv.messages[2]["content"] == "Another one?"
        assert app.store.load(older).messages[1]["content"] == "Hello!"  # untouched


async def test_conversation_list_renames_deletes_exports(tui_env):
    store = ConversationStore.open()
    keep = store.save(None, "Keep me", SMOL_NAME, "", [{"role": "user", "content": "one"}])
    gone = store.save(None, "Delete me", SMOL_NAME, "", [{"role": "user", "content": "two"}])
    store.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+l")
        screen = app.screen
        await pilot.press("d")  # asks first
        assert gone in {c.id for c in app.store.list()}
        await pilot.press("d")
        assert [c.id for c in app.store.list()] == [keep]
        await pilot.press("e")
        exported = tui_env / "keep-me.md"
        assert exported.read_text().startswith("# Keep me")
        await pilot.press("r")
        prompt = app.screen
        assert prompt.query_one("Input").value == "Keep me"
        prompt.query_one("Input").value = "Renamed"
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is screen
        assert [c.title for c in app.store.list()] == ["Renamed"]
        assert screen.query_one("DataTable").get_row_at(0)[0] == "Renamed"


async def test_slash_commands(tui_env):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "/system Answer in one word.")
        assert app.settings.system == "Answer in one word."
        await send(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await send(pilot, "/settings")
        assert isinstance(app.screen, SettingsPanel)
        await pilot.press("escape")
        await send(pilot, "/nonsense")
        assert not app.messages  # not sent to the model

        await send(pilot, "Name a fruit.")
        await answered(pilot)
        await send(pilot, "/save Fruit talk")
        assert app.store.load(app.conv_id).title == "Fruit talk"
        assert app.store.load(app.conv_id).system == "Answer in one word."
        await send(pilot, "/export out/fruit.md")
        text = (tui_env / "out" / "fruit.md").read_text()
        assert "# Fruit talk" in text and "Name a fruit." in text and app.messages[1]["content"] in text

        first = app.messages[1]["content"]
        await pilot.press("ctrl+r")  # regenerate: greedy gives the same answer again
        await answered(pilot)
        assert len(app.messages) == 2 and app.messages[1]["content"] == first
        assert len(app.query(".assistant")) == 1
        await send(pilot, "/copy")
        assert app.clipboard == first

        await send(pilot, "/clear")
        assert not app.messages and app.conv_id is None and app.query("#welcome")
        assert len(app.store.list()) == 1  # the old chat stays saved


async def test_message_longer_than_the_context_comes_back_to_the_box(tui_env):
    app = make_app(SMOL_NAME, ctx=64)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        long = "word " * 80
        box = app.query_one(PromptInput)
        box.text = long
        await pilot.press("enter")
        await answered(pilot)
        assert not app.messages
        assert box.text == long.strip()  # handed back to edit
        error = app.query(".error").last().source
        assert "context holds 64" in error and "--ctx" in error


async def test_bad_model_path_fails_before_the_chat(tui_env):
    bad = tui_env / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    app = make_app(str(bad))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.startup_error is not None, what="the load error")
    assert "GGUF" in str(app.startup_error) or "gguf" in str(app.startup_error)


async def test_tool_call_in_an_answer_shows_as_a_readable_block(tui_env, monkeypatch):
    """An answer's tool calls (the engine's deltas: a name first, then argument fragments)
    are drawn as fenced `🔧 name(arguments)` blocks among the answer's text, never as the
    model's markup. A block closes when another call begins, when text follows, and when
    the answer ends."""
    from localrun.engine import Timings
    from localrun.tools import ToolCallDelta
    from localrun.tui.session import Reply

    app = make_app(SMOL_NAME)

    def scripted_reply(messages, settings, cancel, on_text):
        on_text("Let me look.", Timings())
        on_text("", Timings(), [ToolCallDelta(0, "call_" + "a" * 24, "get_weather", '{"city": ')])
        on_text("", Timings(), [ToolCallDelta(0, None, None, '"Paris"}'),
                                ToolCallDelta(1, "call_" + "b" * 24, "get_time", '{"zone": "CET"}')])
        on_text("And:", Timings())
        on_text("", Timings(), [ToolCallDelta(2, "call_" + "c" * 24, "get_date", "{}")])
        return Reply("Let me look.And:", "tool_calls", Timings(), 10, 0, app.session.model_name)

    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        monkeypatch.setattr(app.session, "reply", scripted_reply)
        await send(pilot, "Weather in Paris?")
        await answered(pilot)
        shown = app.query(".assistant").last().source
        block = "\n\n```\n🔧 {}\n```\n\n".format
        assert shown == ("Let me look." + block('get_weather({"city": "Paris"})') + block('get_time({"zone": "CET"})')
                         + "And:" + block("get_date({})"))
        assert app.messages[-1] == {"role": "assistant", "content": "Let me look.And:"}


async def test_decoding_never_waits_for_a_frozen_ui_and_every_piece_arrives_once(tui_env, monkeypatch):
    """The answer worker hands each piece over without waiting for the event loop: here
    the loop is frozen (this test blocks it) while the worker writes 300 pieces, and the
    worker still finishes. When the loop runs again the pieces are drawn in a frame or
    two, not one UI update per piece, in order, each once, and the chat keeps the text the
    worker returned."""
    import sys
    import threading

    from localrun.engine import Timings
    from localrun.tui.session import Reply
    from localrun.tui.stream import GIL_SWITCH_S, AnswerFeed

    app = make_app(SMOL_NAME)
    pieces = [f"w{i} " for i in range(300)]
    loop_frozen, worker_finished = threading.Event(), threading.Event()

    def scripted_reply(messages, settings, cancel, on_text):
        assert loop_frozen.wait(30)
        for i, piece in enumerate(pieces):
            on_text(piece, Timings(prompt_tokens=5, generated_tokens=i + 1))
        worker_finished.set()
        return Reply("".join(pieces), "stop", Timings(prompt_tokens=5, generated_tokens=300), 5, 0,
                     app.session.model_name)

    takes = []  # pieces per frame that drew something
    take = AnswerFeed.take

    def counting_take(self):
        batch = take(self)
        if batch.pieces:
            takes.append(len(batch.pieces))
        return batch

    monkeypatch.setattr(AnswerFeed, "take", counting_take)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert sys.getswitchinterval() <= GIL_SWITCH_S  # a drawing UI keeps the GIL only briefly
        monkeypatch.setattr(app.session, "reply", scripted_reply)
        await send(pilot, "Go.")
        loop_frozen.set()
        # blocking here blocks the event loop: a worker waiting for the UI would never finish
        finished_while_frozen = worker_finished.wait(30)
        assert finished_while_frozen, "the answer worker waited for the frozen UI"
        await answered(pilot)
        assert sum(takes) == 300 and len(takes) <= 2
        assert app.query(".assistant").last().source == "".join(pieces)
        assert app.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
        assert app.status.values.timings.generated_tokens == 300
    assert sys.getswitchinterval() > GIL_SWITCH_S  # given back when the app ends
