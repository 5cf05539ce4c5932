"""`localrun chat`: the Textual chat app.

Every engine call (load, answer) runs on a worker thread, one at a time (ChatSession's
lock); the event loop only draws. The answer worker puts each piece into an
`AnswerFeed` and never waits for the UI; a timer takes what the feed holds once a frame
(`FramePacer`: at most 15 a second, fewer when drawing would take over 2% of a core)
and appends it to a Markdown stream, with one status update; the worker posts one
`AnswerDone` at the end. While an answer is written no full garbage collection runs
(`CollectorPause`), and the highlighter's rules are compiled while the first model
loads. Esc sets the worker's cancel flag: it stops after the current backend step and
the text written so far stays in the chat. A thinking model's thinking is shown folded
and dimmed above its answer (thinking_view.py) and kept with it as the message's
`reasoning_content`, which the template shows or drops in later prompts.

    python -m localrun chat MODEL [chat flags]   # `localrun chat`
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Markdown, ProgressBar

from localrun.backends.base import BackendOptions
from localrun.backends.compute_threads import on_passing_thread
from localrun.commands.draft import draft_options
from localrun.engine import Engine
from localrun.errors import LocalrunError, ModelNotFoundError
from localrun.speculation.draft_model import DRAFT_MAX, DraftPairError

from .conversations import Conversation, ConversationConflictError, ConversationStore, default_title
from .commands import SlashCommands
from .help import HelpScreen, parse_slash
from .history import Conversations
from .input import PromptInput
from .picker import ModelPicker, initial_model, store_models, store_verdict
from .session import ChatSession, Reply, resolve
from .settings import ChatSettings, settings_from_args
from .settings_screen import SettingsPanel
from .status import StatusBar, process_rss
from .stream import GIL_SWITCH_S, AnswerFeed, CollectorPause, FramePacer, warm_highlighter
from .thinking_view import ThinkingView

WELCOME = "Type a message — **Enter** sends, **Esc** stops the answer, **F1** lists every key and `/command`."


class ToolCallBlocks:
    """Writes an answer's tool calls into its Markdown as readable blocks, never as the
    model's markup: each call a fenced block `🔧 name(arguments)` that grows as the
    engine's deltas (localrun.tools.ToolCallDelta: index, name on a call's first delta,
    argument fragments) arrive. Arguments are JSON, whose strings hold no raw newline, so
    no line of them can close the fence."""

    OPEN, CLOSE = "\n\n```\n🔧 ", ")\n```\n\n"

    def __init__(self) -> None:
        self._open: int | None = None  # index of the call whose block is still open

    def text(self, piece: str) -> str:
        """Markdown for a piece of answer text: it follows the open block, if any."""
        return self.close() + piece if piece else ""

    def calls(self, deltas) -> str:
        out = []
        for d in deltas:
            if d.index != self._open:
                out.append(self.close())
                out.append(f"{self.OPEN}{d.name or 'tool'}(")
                self._open = d.index
            out.append(d.arguments)
        return "".join(out)

    def close(self) -> str:
        """Ends the open block (at the answer's end, or when text or another call follows)."""
        if self._open is None:
            return ""
        self._open = None
        return self.CLOSE


class AnswerDone(Message):
    def __init__(self, reply: Reply | None, error: str = "") -> None:
        super().__init__()
        self.reply, self.error = reply, error


class ModelLoaded(Message):
    def __init__(self, name: str, error: LocalrunError | None = None, without_draft: str | None = None) -> None:
        super().__init__()
        self.name, self.error = name, error
        self.without_draft = without_draft  # why the --draft model does not draft for this one


class ChatOpener:
    """Opens each model the chat loads (ChatSession's opener): with the --chat-template
    FILE, --trust-remote-code, the --rpc workers, and the --draft model where it pairs. A
    model the draft model does not pair with opens without it, as under `serve`, and
    `without_draft` then holds the pairing error, one line (None after a load that
    drafts, or with no --draft); switching back to a model it pairs with drafts again."""

    def __init__(self, chat_template: str | None = None, trust_remote_code: bool = False, cluster=None,
                 draft: str | None = None, draft_max: int = DRAFT_MAX) -> None:
        self.chat_template, self.trust_remote_code, self.cluster = chat_template, trust_remote_code, cluster
        self.draft, self.draft_max = draft, draft_max
        self.without_draft: str | None = None

    @classmethod
    def from_args(cls, args) -> "ChatOpener":
        return cls(getattr(args, "chat_template", None), getattr(args, "trust_remote_code", False),
                   getattr(args, "cluster", None), **draft_options(args))

    def __call__(self, path, **fields) -> Engine:
        """Engine.open's `fields` (n_ctx, threads, kv_cache_type, ...) for `path`."""
        self.without_draft = None
        options = BackendOptions(trust_remote_code=self.trust_remote_code, cluster=self.cluster, **fields)
        engine = Engine.open(path, options, chat_template=self.chat_template)
        if self.draft is None:
            return engine
        try:
            engine.load_draft(self.draft, self.draft_max, options)  # as Engine.open(draft=...) does
        except DraftPairError as exc:
            self.without_draft = str(exc)
        except BaseException:
            engine.close()
            raise
        return engine


class ChatApp(SlashCommands, App):
    CSS_PATH = "chat.tcss"
    TITLE = "localrun chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),  # in the footer only while an answer is being written
        Binding("ctrl+o", "models", "Models"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+l", "history", "Chats"),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("ctrl+y", "copy_answer", "Copy"),
        Binding("f1", "help", "Help"),
    ]

    def __init__(
        self,
        session: ChatSession,
        settings: ChatSettings,
        store: ConversationStore,
        model: tuple[Path, str] | None = None,
        models=store_models,
        verdict=None,
        rss=process_rss,
    ) -> None:
        super().__init__()
        self.session, self.settings, self.store = session, settings, store
        self._initial_model = model
        # the fit is judged at the context this chat opens models with
        self._verdict = verdict or (lambda path: store_verdict(path, session.n_ctx))
        self._models, self._rss = models, rss
        self.messages: list[dict] = []
        self.conv_id: int | None = None
        self.conv_version: int | None = None  # the saved version this window last read or wrote
        self.conv_model = ""  # the model of the latest answer, saved with the conversation
        self.title_text: str | None = None  # set by /save or rename; else the first message
        self._generating = self.loading = False
        self.startup_error: LocalrunError | None = None
        self._cancel = threading.Event()
        self._answer: Markdown | None = None
        self._thinking: ThinkingView | None = None  # the answer's thinking, once some came
        self._stream = None
        self._calls = ToolCallBlocks()
        self._feed = AnswerFeed()  # the answer worker's pieces, drawn once a frame
        self._pacer = FramePacer()
        self._frames = None  # the frame timer, running while an answer is written
        self._switch_interval: float | None = None
        self._collector = CollectorPause()  # no full garbage collection while an answer decodes
        self._highlighter_warm = False

    @property
    def generating(self) -> bool:
        return self._generating

    @generating.setter
    def generating(self, value: bool) -> None:
        self._generating = value
        if value:
            self._collector.hold()
        else:
            self._collector.release()
        self.refresh_bindings()  # shows or hides "esc Stop" in the footer

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":
            return self._generating
        return True

    # -- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="conversation"):
            yield Markdown(WELCOME, id="welcome")
        yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="loading")
        yield PromptInput(id="prompt")
        yield StatusBar(rss=self._rss, id="status")
        yield Footer()

    def on_mount(self) -> None:
        # A thread wanting the GIL waits up to the switch interval (5 ms by default) for
        # the one holding it: the decode thread, back from a llama.cpp call, must not
        # wait that long for a frame being drawn
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_S))
        self._show_loading(False)
        self.query_one(PromptInput).focus()
        if self._initial_model is not None:
            self.load_model(*self._initial_model)
        else:
            self.action_models()

    def on_unmount(self) -> None:
        self._collector.release()  # quit mid-answer: the process may go on (a test, an embedder)
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)

    def _show_loading(self, shown: bool) -> None:
        """Show the loading bar, animated, or hide it. A hidden bar is also given a total:
        an indeterminate bar animates on a 15 Hz timer that keeps firing while it is
        hidden, on the UI thread, all through every answer."""
        bar = self.query_one("#loading", ProgressBar)
        bar.update(total=None if shown else 1)
        bar.display = shown

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def view(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    def add_message(self, role: str, text: str) -> Markdown:
        """A message block in the conversation view: user, assistant, error or info."""
        self._clear_welcome()
        widget = Markdown(text, classes=f"message {role}")
        self.view.mount(widget)
        self.view.anchor()  # follow the bottom while the answer grows, until the user scrolls up
        return widget

    def _clear_welcome(self) -> None:
        for w in self.query("#welcome"):
            w.remove()

    # -- models ---------------------------------------------------------------------

    def load_model(self, path: Path, name: str) -> None:
        if self.generating:
            self._cancel.set()  # the load waits for the answer to stop (session lock)
        self.loading = True
        self._show_loading(True)
        self.status.update_values(model=name, quant="", state="loading…", timings=None, n_ctx=0, ctx_used=0)
        self._load(path, name)

    @work(thread=True, group="engine")
    def _load(self, path: Path, name: str) -> None:
        if not self._highlighter_warm:
            warm_highlighter()
            self._highlighter_warm = True
        try:
            # loads and answers each on a thread that ends with them: an executor thread
            # that decoded would keep an OpenMP pool that slows every later decode
            on_passing_thread(self.session.load, path, name, name="localrun-load")
        except LocalrunError as exc:
            self.post_message(ModelLoaded(name, exc))
        except Exception as exc:  # a backend bug must not take the chat down with it
            self.post_message(ModelLoaded(name, LocalrunError(f"loading {name} failed: {exc!r}")))
        else:  # a --draft model that does not pair with this one: the opener loaded it without
            self.post_message(ModelLoaded(name, without_draft=getattr(self.session.opener, "without_draft", None)))

    def on_model_loaded(self, msg: ModelLoaded) -> None:
        self.loading = False
        self._show_loading(False)
        if msg.error:
            if self._initial_model is not None and self.session.engine is None and not self.messages:
                self.startup_error = msg.error  # `localrun chat BAD` ends with one error line
                self.exit(return_code=msg.error.exit_code)
                return
            self.status.update_values(model="", state="", n_ctx=0)
            self.add_message("error", f"**error:** {msg.error}")
            return
        self._initial_model = None
        engine = self.session.engine
        self.status.update_values(model=msg.name, quant=self.session.quant, state="", n_ctx=engine.n_ctx)
        if msg.without_draft:
            self.notify(f"{msg.name} runs without the draft model: {msg.without_draft}", severity="warning",
                        timeout=10)

    def action_models(self) -> None:
        def chosen(model) -> None:
            if model is not None:
                self.load_model(Path(model.path), model.name)

        self.push_screen(ModelPicker(self.session.model_name, self._models, self._verdict), chosen)

    # -- sending and streaming --------------------------------------------------------

    @on(PromptInput.Submitted)
    async def on_prompt_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        command = parse_slash(text)
        if command is not None:
            event.input.clear()
            await self.run_slash(*command)
            return
        if text.startswith("//"):
            text = text[1:]
        if self.generating or self.loading:
            self.notify("Wait for the model (Esc stops an answer).", severity="warning")
            return
        if self.session.engine is None:
            self.notify("No model is open: Ctrl+O picks one.", severity="warning")
            return
        event.input.clear()
        self.messages.append({"role": "user", "content": text})
        self.add_message("user", text)
        self.start_answer()

    def start_answer(self) -> None:
        self._answer = self.add_message("assistant", "")
        self._answer.add_class("pending")
        self._stream = Markdown.get_stream(self._answer)
        self._thinking = None
        self._calls = ToolCallBlocks()
        self._cancel = threading.Event()
        self._feed, self._pacer = AnswerFeed(), FramePacer()
        self.generating = True
        self.status.update_values(state="thinking…", timings=None)
        self._frames = self.set_interval(self._pacer.interval, self.draw_frame)
        self._generate(list(self.messages), self.settings.copy(), self._cancel, self._feed)

    @work(thread=True, group="engine")
    def _generate(self, messages: list[dict], settings: ChatSettings, cancel: threading.Event,
                  feed: AnswerFeed) -> None:
        try:
            # put never waits for the UI; the thread: see _load
            reply = on_passing_thread(self.session.reply, messages, settings, cancel, feed.put, name="localrun-answer")
        except LocalrunError as exc:
            self.post_message(AnswerDone(None, str(exc)))
        except Exception as exc:  # a bug: say so in the chat instead of crashing it
            self.post_message(AnswerDone(None, f"generation failed: {exc!r}"))
        else:
            self.post_message(AnswerDone(reply))

    async def draw_frame(self, force: bool = False) -> None:
        """On the frame timer: draw what the answer worker wrote since the last frame, as
        one Markdown append and one status update, when the pacer says a frame is due
        (always when `force`: the answer's end)."""
        wall, cpu = time.monotonic(), time.thread_time()
        if not force and not self._pacer.due(wall, cpu):
            return
        batch = self._feed.take()
        if not batch.pieces and not batch.thinking:
            return  # nothing new: the next tick looks again
        self._pacer.drawn(wall, cpu)
        t = batch.timings
        if t is not None:
            self.status.update_values(state="", timings=t, lookup=self.settings.lookup,
                                      ctx_used=t.prompt_tokens + t.generated_tokens)
        if batch.thinking and self._answer is not None:
            if self._thinking is None:
                self._thinking = ThinkingView()
                await self.view.mount(self._thinking, before=self._answer)
            self._thinking.add(batch.thinking)
        if self._stream is not None and batch.pieces:
            piece = "".join(self._calls.text(text) + self._calls.calls(calls or ()) for text, calls in batch.pieces)
            # the stream's write queues the piece before it yields: a frame stopped there
            # (the answer ended) has still handed over everything it took
            await self._stream.write(piece)

    async def on_answer_done(self, msg: AnswerDone) -> None:
        if self._frames is not None:
            self._frames.stop()
            self._frames = None
        await self.draw_frame(force=True)  # the worker put its last pieces before posting this
        if self._stream is not None:
            closing = self._calls.close()
            if closing:
                await self._stream.write(closing)
            await self._stream.stop()
        self._stream, answer, self._answer = None, self._answer, None
        thinking, self._thinking = self._thinking, None
        self.generating = False
        reply = msg.reply
        if reply is None or (reply.finish_reason == "cancelled" and not reply.text):
            # nothing was written: take the question back so it can be edited and resent
            if thinking is not None:
                await thinking.remove()
            if answer is not None:
                await answer.remove()
            question = self.messages.pop() if self.messages and self.messages[-1]["role"] == "user" else None
            if question is not None:
                await self.view.children[-1].remove()
                box = self.query_one(PromptInput)
                if not box.text.strip():  # never overwrite what was typed meanwhile
                    box.text = question["content"]
            if msg.error:
                self.add_message("error", f"**error:** {msg.error}")
            self.status.update_values(state="")
            return
        answer.remove_class("pending")
        note = {"cancelled": "stopped", "length": "max tokens reached"}.get(reply.finish_reason)
        if note:
            answer.border_subtitle = note
            answer.add_class("noted")  # draws the bottom border the note sits on
        if thinking is not None:
            thinking.finish(stopped=reply.finish_reason == "cancelled")
        answered = {"role": "assistant", "content": reply.text}
        if reply.reasoning:
            answered["reasoning_content"] = reply.reasoning  # for the template: most drop it from later prompts
        self.messages.append(answered)
        self.conv_model = reply.model
        self.status.update_values(state="", timings=reply.timings, ctx_used=reply.prompt_tokens + reply.timings.generated_tokens)
        if reply.dropped:
            self.notify(f"The {reply.dropped} oldest message(s) no longer fit the context and were left out.")
        self.save()

    def action_stop(self) -> None:
        if self.generating:
            self._cancel.set()

    def action_regenerate(self) -> None:
        if self._busy():
            return
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
            answer = self.query(".assistant").last()
            shown = list(self.view.children)
            at = shown.index(answer) if answer in shown else 0
            if at > 0 and shown[at - 1].has_class("thinking"):
                shown[at - 1].remove()
            answer.remove()
        if not self.messages:
            self.notify("Nothing to regenerate yet.")
            return
        self.start_answer()

    def action_copy_answer(self) -> None:
        last = next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), None)
        if last is None:
            self.notify("No answer to copy yet.")
            return
        self.copy_to_clipboard(last)
        self.notify("Copied the last answer.")

    def _busy(self) -> bool:
        if self.generating or self.loading:
            self.notify("Wait for the model (Esc stops an answer).", severity="warning")
            return True
        return False

    # -- conversations ------------------------------------------------------------------

    def conversation(self) -> Conversation:
        title = self.title_text or default_title(self.messages)
        model = self.conv_model or self.session.model_name
        return Conversation(self.conv_id, title, model, self.settings.system, list(self.messages))

    def save(self) -> None:
        if not self.messages:
            return
        c = self.conversation()
        try:
            try:
                self.conv_id = self.store.save(c.id, c.title, c.model, c.system, c.messages, version=self.conv_version)
            except ConversationConflictError as exc:  # another window changed it since: keep both
                self.title_text = f"{c.title} (copy)"
                self.conv_id = self.store.save(None, self.title_text, c.model, c.system, c.messages)
                self.notify(f"{exc}; this chat is saved as “{self.title_text}”", severity="warning")
            self.conv_version = self.store.known_version(self.conv_id)
        except Exception as exc:  # a full disk must not lose the chat on screen
            self.notify(f"could not save the conversation: {exc}", severity="error")

    async def action_new_chat(self) -> None:
        if self._busy():
            return
        self.messages, self.conv_id, self.title_text, self.conv_model = [], None, None, ""
        self.conv_version = None
        await self.view.remove_children()
        await self.view.mount(Markdown(WELCOME, id="welcome"))
        self.status.update_values(timings=None, ctx_used=0, state="")

    def action_history(self) -> None:
        async def chosen(cid: int | None) -> None:
            if cid is not None and not self._busy():
                await self.resume(cid)

        self.push_screen(Conversations(self.store), chosen)

    async def resume(self, cid: int) -> None:
        conv = self.store.load(cid)
        await self.action_new_chat()
        self.conv_id, self.title_text, self.messages = conv.id, conv.title, list(conv.messages)
        self.conv_version = conv.version
        self.conv_model = conv.model
        self.settings.system = conv.system
        for m in conv.messages:
            if m.get("reasoning_content"):  # the thinking before the answer, folded as it was shown
                self._clear_welcome()
                self.view.mount(ThinkingView(m["reasoning_content"], done=True))
            self.add_message(m["role"], m["content"])
        if conv.model and conv.model != self.session.model_name:
            self.notify(f"Saved with {conv.model}; Ctrl+O switches model.")

    # -- panels and commands ------------------------------------------------------------

    def action_settings(self) -> None:
        def applied(settings: ChatSettings | None) -> None:
            if settings is not None:
                self.settings = settings
                self.status.update_values(lookup=settings.lookup)
                self.notify("Settings applied to the next answer.")

        self.push_screen(SettingsPanel(self.settings), applied)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        self._cancel.set()  # the worker stops after its current step; then the app can end
        self.exit()


def run_chat(args, interactive: bool | None = None) -> int:
    """`localrun chat`: the app in a terminal; piped (stdin or stdout not a terminal),
    the line REPL, so `echo question | localrun chat MODEL` and scripts keep working."""
    settings = settings_from_args(args)  # bad flags fail before anything loads
    if interactive is None:
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if not interactive:
        return _run_piped(args)
    store = ConversationStore.open()
    app = None
    try:
        # --chat-template FILE replaces the template of every model this chat opens
        session = ChatSession(n_ctx=args.ctx, threads=args.threads, opener=ChatOpener.from_args(args),
                              kv_cache_type=getattr(args, "kv_cache_type", "f16"))
        app = ChatApp(session, settings, store, initial_model(args, store))
        app.run()
    finally:
        store.close()
        if app is not None:
            app.session.close()  # waits for an answer still being written (the session lock)
    if app.startup_error is not None:
        raise app.startup_error
    return app.return_code or 0


def _run_piped(args) -> int:
    from .repl import run_repl

    if args.model:
        model = resolve(args.model)
    else:  # the store only says which model; a piped chat saves nothing
        store = ConversationStore.open()
        try:
            model = initial_model(args, store)
        finally:
            store.close()
        if model is None:
            raise ModelNotFoundError("no model installed: pass a .gguf file or an MLX folder, or pull one")
    args.model = str(model[0])
    return run_repl(args)

