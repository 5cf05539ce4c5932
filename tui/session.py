"""The model side of the chat, free of any UI: which model is open, how a conversation
becomes a prompt that fits the context, and one streamed answer that can be stopped.

`ChatSession.reply` runs on a worker thread (the Engine is not thread-safe, so the app
runs at most one engine call at a time, under `lock`). It drives the engine with
`start`/`step` rather than `generate` so a stop request is seen between every backend
step, prefill chunks included: Esc on a long prompt stops at once, not after it.

A thinking model's thinking comes apart from the answer (`Reply.reasoning`); the app
keeps it with the answer as the message's `reasoning_content`, and the template decides
whether later prompts show it (most drop earlier turns' thinking).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from localrun.engine import Engine, Timings
from localrun.errors import ContextExceededError, LocalrunError
from localrun.request import GenerationRequest

from .settings import ChatSettings


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    timings: Timings
    prompt_tokens: int
    dropped: int  # oldest messages left out of the prompt so it fits the context
    model: str  # the model that wrote it (a switch may be under way when the app reads this)
    reasoning: str = ""  # the thinking before (or between) the answer's parts


def display_name(path: Path) -> str:
    """A short name for a model given by path: the file or folder name."""
    return path.stem if path.suffix == ".gguf" else path.name


def resolve(name_or_path: str) -> tuple[Path, str]:
    """(path, display name) for what a user typed: an installed model's name or a path."""
    from localrun.store.local import resolve_model  # raises ModelNotFoundError with what to do

    path = Path(name_or_path).expanduser()
    if path.exists():
        return path, display_name(path)
    return Path(resolve_model(name_or_path)), name_or_path


class ChatSession:
    def __init__(
        self, n_ctx: int | None = None, threads: int | None = None, opener=Engine.open, kv_cache_type: str = "f16"
    ) -> None:
        self.kv_cache_type = kv_cache_type
        self.n_ctx = n_ctx
        self.threads = threads
        self.opener = opener
        self.engine: Engine | None = None
        self.model_name = ""
        self.model_path: Path | None = None
        self.lock = threading.Lock()  # held by whichever thread is using the engine

    def load(self, path: Path, name: str | None = None) -> None:
        """Unload the open model (its memory is freed first), then open `path`."""
        with self.lock:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
                self.model_name = ""
            threads = None if Path(path).is_dir() else self.threads  # MLX sizes its own thread pool
            self.engine = self.opener(path, n_ctx=self.n_ctx, threads=threads, kv_cache_type=self.kv_cache_type)
            self.model_path = Path(path)
            self.model_name = name or display_name(Path(path))

    def close(self) -> None:
        with self.lock:
            if self.engine is not None:
                self.engine.close()
                self.engine = None

    @property
    def quant(self) -> str:
        return self.engine.info.quant if self.engine is not None else ""

    def fit_prompt(
        self, messages: list[dict], system: str, reserve: int, template_kwargs: dict | None = None
    ) -> tuple[list[int], int]:
        """The chat prompt for `messages`, dropping the oldest turns until it leaves
        `reserve` tokens for the answer. Returns (tokens, messages dropped). The last
        message is never dropped: when it alone is too long, ContextExceededError.
        `template_kwargs` (enable_thinking, ...) are given to the template."""
        engine = self.engine
        head = [{"role": "system", "content": system}] if system else []
        reserve = max(1, min(reserve, engine.n_ctx // 4))
        start = 0
        while True:
            tokens = engine.chat_prompt(head + messages[start:], template_kwargs=template_kwargs)
            if len(tokens) + reserve <= engine.n_ctx or start >= len(messages) - 1:
                break
            # drop whole turns: through the next user message's answer, keep a user message first
            start += 1
            while start < len(messages) - 1 and messages[start]["role"] != "user":
                start += 1
        if len(tokens) >= engine.n_ctx:
            raise ContextExceededError(
                f"your message needs {len(tokens)} tokens but the context holds {engine.n_ctx};"
                " shorten it, or restart with a larger --ctx"
            )
        return tokens, start

    def reply(
        self,
        messages: list[dict],
        settings: ChatSettings,
        cancel: threading.Event,
        on_text: Callable[..., None],
    ) -> Reply:
        """Stream the answer to `messages` (ending with the user's turn) through
        `on_text(piece, timings so far, tool call deltas or None, thinking)` (the thinking
        only when there is some); stops early when `cancel` is set."""
        with self.lock:
            engine = self.engine
            if engine is None:
                raise LocalrunError("no model is open: pick one with Ctrl+O")
            reserve = settings.max_tokens or 256
            thinking = settings.reasoning
            tokens, dropped = self.fit_prompt(messages, settings.system, reserve, thinking["template_kwargs"])
            request = GenerationRequest(
                sampling=replace(settings.sampling),
                max_tokens=settings.max_tokens,
                lookup=settings.lookup,
                grammar=settings.grammar,
                **thinking,
            )
            gen = engine.start(tokens, request)
            parts: list[str] = []
            thoughts: list[str] = []
            try:
                while not gen.done:
                    if cancel.is_set():
                        break
                    ev = engine.step([gen]).get(gen.seq)
                    if ev is not None and ev.reasoning:
                        thoughts.append(ev.reasoning)
                        on_text(ev.text, replace(gen.timings), ev.tool_calls, ev.reasoning)
                        parts.append(ev.text)
                    elif ev is not None and (ev.text or ev.tool_calls):
                        parts.append(ev.text)
                        on_text(ev.text, replace(gen.timings), ev.tool_calls)
            finally:
                engine.release(gen)  # frees the slot; marks an unfinished generation cancelled
            reason = gen.finish_reason or "cancelled"
            return Reply("".join(parts), reason, replace(gen.timings), len(tokens), dropped, self.model_name,
                         "".join(thoughts))
