"""One model's tool and reasoning machinery: its call format and reasoning format (both
from the template), which of their markers its vocabulary holds as control tokens, its
call grammars (cached per tool set), and the per-answer parser the engine feeds every
generated token through.

    mt = ModelTools(backend, template)      # once per model (Engine.__init__)
    mt.format, mt.supported, mt.reasoning   # CallFormat | None, bool, ReasoningFormat | None
    g = mt.grammar(tools, choice, parallel, prompt=tokens)    # cached: agents resend the same tools
    p = mt.output(choice, reasoning=True, tools=tools, prompt=tokens)   # per answer: a ReplyParser
    piece = p.feed(token, text)             # ReplyPiece(reasoning, content, calls)

`prompt` (the prompt's token ids, or its text) tells whether the prompt left the model
inside a reasoning block, or after an empty one (thinking off: then no block is parsed
nor allowed); without it the template's default is assumed.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Sequence

from ..grammar.core import Grammar
from .calls import new_call_id
from .constraint import call_grammar
from .formats import CallFormat, HarmonyFormat, ToolFormat, detect_format
from .reasoning import HARMONY_REASONING, ReasoningFormat, detect_reasoning
from .reply import ReplyParser, answer_parser
from .spec import Tool, ToolChoice, ToolsUnsupportedError

# Distinct (tools, choice, parallel, reasoning opened) grammars kept per model. An editor's
# agent sends one tool set with two or three choices; each entry holds its compiled matcher
# (a few MB at most for the largest tool sets), so a handful of clients fit.
GRAMMAR_CACHE_SIZE = 16
PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to see a reasoning block opened there


class ModelTools:
    def __init__(self, backend, template: str | None) -> None:
        self.backend = backend
        self.format: CallFormat | None = detect_format(template)
        self.reasoning: ReasoningFormat | None = detect_reasoning(template)
        if isinstance(self.format, HarmonyFormat):
            self.reasoning = HARMONY_REASONING
        markers = (self.format.markers if self.format else ()) + (self.reasoning.markers if self.reasoning else ())
        self.markers: dict[str, int] = _control_markers(backend, markers)
        self._grammars: "OrderedDict[tuple, Grammar]" = OrderedDict()
        self._lock = threading.Lock()  # prepare() runs in worker threads

    @property
    def supported(self) -> bool:
        return self.format is not None

    def check(self, tools: tuple[Tool, ...]) -> None:
        if tools and self.format is None:
            raise ToolsUnsupportedError()

    def reasoning_state(self, prompt: Sequence[int] | str | None) -> str:
        """Where the prompt leaves the model: "open" (inside a reasoning block, as
        DeepSeek-R1's `<think>\\n`), "closed" (after an empty block: thinking turned off),
        "maybe" (the answer may open one) or "none" (no block format to split)."""
        r = self.reasoning
        if r is None or r is HARMONY_REASONING:
            return "none"
        if prompt is None:
            return "open" if r.opens_in_prompt else "maybe"
        tail = prompt if isinstance(prompt, str) else self._tail_text(prompt)
        return "open" if r.opened_by(tail) else "closed" if r.closed_by(tail) else "maybe"

    def reasoning_open(self, prompt: Sequence[int] | str | None) -> bool:
        return self.reasoning_state(prompt) == "open"

    def grammar(self, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool,
                prompt: Sequence[int] | str | None = None) -> Grammar:
        """The call grammar for this model (see constraint.py), built once per key."""
        self.check(tools)
        state = self.reasoning_state(prompt)
        key = (tools, choice, parallel, state)
        with self._lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
        fmt, reasoning = self.format, self.reasoning
        if state == "closed":  # thinking was turned off in the prompt: no block may open
            fmt = dataclasses.replace(fmt, think=False) if isinstance(fmt, ToolFormat) else fmt
            reasoning = None
        grammar = call_grammar(fmt, tools, choice, parallel, self.markers, reasoning, state == "open")
        with self._lock:
            grammar = self._grammars.setdefault(key, grammar)  # a racing thread's copy wins
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def output(self, choice: ToolChoice | None, reasoning: bool = True, tools: tuple[Tool, ...] = (),
               prompt: Sequence[int] | str | None = None, new_id=new_call_id):
        """The parser of one answer. `reasoning` True: reasoning split out; False: left in
        the content as written (reasoning_format "none").
        `tools`: the request's tools (XML formats type each parameter by its schema).
        None when there is nothing to split: no call can come and the model has no
        reasoning format (or it stays in the content)."""
        calls = self.format is not None and choice is not None and choice.mode != "none"
        harmony = isinstance(self.format, HarmonyFormat)
        ids = {i: m for m, i in self.markers.items()}
        control = frozenset(self.markers)
        state = self.reasoning_state(prompt)
        split = reasoning and state in ("open", "maybe")
        if not calls and not split and not harmony:
            return None
        fmt = self.format if calls or harmony else None
        answer = answer_parser(fmt, tools if calls else (), control, new_id, raw_reasoning=not reasoning)
        return ReplyParser(answer, self.reasoning if split else None, state == "open", ids,
                           end_of_reasoning=self.reasoning.end_of_reasoning if self.reasoning else "")

    def _tail_text(self, tokens: Sequence[int]) -> str:
        """The prompt's last tokens as text, control tokens spelled out (`<think>`)."""
        out = []
        for t in list(tokens)[-PROMPT_TAIL_TOKENS:]:
            if self.backend.is_control(t):
                out.append(self.backend.token_text(t))
            else:
                out.append(self.backend.token_bytes(t).decode("utf-8", errors="replace"))
        return "".join(out)


def _control_markers(backend, markers: tuple[str, ...]) -> dict[str, int]:
    """The markers that this vocabulary holds as one control token."""
    out = {}
    for marker in dict.fromkeys(markers):
        ids = backend.tokenize(marker, add_special=False, parse_special=True)
        if len(ids) == 1 and backend.is_control(ids[0]):
            out[marker] = int(ids[0])
    return out
