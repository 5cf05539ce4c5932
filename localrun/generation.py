"""One generation's state and what comes out of it: `Generation` (a sequence in a
backend slot, its history, sampler, grammar and text stream), the `Event`s it streams,
its `Timings`, and the `Completion` of a whole answer. The engine decides what a step
feeds and which tokens it keeps; a generation's state changes only through its own
methods here."""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LocalrunError
from .grammar.matcher import GrammarMatcher
from .sampling import Sampler
from .speculation.proposer import Proposer
from .textstream import StopMatcher, Utf8Stream
from .tools import ToolCall, ToolCallDelta
from .tools.reply import ReplyParser


class GenerationFailed(LocalrunError):
    """One generation's own work in a step (its grammar, sampler, stop strings, tool-call
    parsing, prompt-lookup draft) failed: that generation ends with this error, and the
    other generations of the step go on. 400 when the request's grammar is at fault
    (llguidance's parser hit one of its limits), else 500 (a bug, logged)."""

    http_status = 500


# The part of a generation each localrun module is, named in the error of a failure
# whose innermost localrun frame lies there. Read off the traceback so that no per-token
# call needs its own try block, and a new call site into the same module is named alike.
_STAGES = {
    "grammar": "grammar",
    "sampling": "sampler",
    "textstream": "stop strings",
    "tools": "tool-call parsing",
    "speculation": "speculative decoding",
}
_PACKAGE = Path(__file__).resolve().parent


def failed_stage(exc: BaseException) -> str:
    """Which part of a generation raised `exc`: "grammar", "sampler", ... or "step"."""
    stage = "step"
    for frame in traceback.extract_tb(exc.__traceback__):  # outermost first: the innermost decides
        try:
            first = Path(frame.filename).resolve().relative_to(_PACKAGE).parts[0]
        except ValueError:  # a frame outside localrun (llguidance, numpy) says nothing
            continue
        stage = _STAGES.get(first.removesuffix(".py"), "step")
    return stage


def step_failure(exc: BaseException, n_output: int, tool_calls: bool) -> GenerationFailed:
    """The one-line error that ends a generation whose own work raised `exc`."""
    stage = failed_stage(exc)
    detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if stage == "grammar":
        # llguidance's text: "token 81 is not allowed by the grammar: Parser Error: Current
        # row has 2073 items; max is 2000; consider ..." -> what the parser said
        detail = detail.split("Parser Error: ", 1)[-1]
        what = "the tool-call grammar" if tool_calls else "the grammar"
        err = GenerationFailed(
            f"{what}'s parser hit its limit ({detail}) after {n_output} generated tokens: simplify the grammar"
            " (ambiguous or deeply nested rules)"
        )
        err.http_status = 400
        return err
    if isinstance(exc, LocalrunError):  # already one clear line (a KV cut that failed, ...)
        err = GenerationFailed(str(exc))
        err.http_status = exc.http_status
        return err
    return GenerationFailed(f"generation failed: internal error in this request's {stage} (see the server log)")


@dataclass
class Timings:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV a previous request left in the slot
    prefill_ms: float = 0.0
    decode_tokens: int = 0  # tokens produced after the first one
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    generated_tokens: int = 0
    steps: int = 0  # backend steps that produced tokens (prompt lookup makes it < tokens)
    drafted: int = 0  # the one count of drafted tokens (the proposer keeps none)
    accepted: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tps(self) -> float:
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / (self.prefill_ms / 1000) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0


@dataclass
class Event:
    """A piece of streamed output; the last one has finish_reason and timings."""

    text: str  # content: a tool call's markup and the reasoning never appear here
    tokens: list[int]
    # "stop" (EOS or stop string) | "length" | "tool_calls" (ended normally after a call)
    finish_reason: str | None = None
    timings: Timings | None = None
    # with SamplingParams.n_probs > 0: per token, the n most likely (id, probability)
    top_probs: list[list[tuple[int, float]]] | None = None
    # with n_probs > 0: per token, the probability the model gave the token it produced
    token_probs: list[float] | None = None
    # with tools: the calls' pieces produced with this text (first delta of a call: id, name)
    tool_calls: list[ToolCallDelta] | None = None
    # the reasoning ("thinking") produced with this event, apart from the answer's text
    reasoning: str = ""

    @classmethod
    def joined(cls, events: list["Event"]) -> "Event":
        """Several tokens' events (one speculative step) as one."""
        if len(events) == 1:
            return events[0]
        last = events[-1]
        return cls(
            "".join(e.text for e in events),
            [t for e in events for t in e.tokens],
            last.finish_reason,
            last.timings,
            [p for e in events for p in (e.top_probs or [])] or None,
            [p for e in events for p in (e.token_probs or [])] or None,
            [d for e in events for d in (e.tool_calls or [])] or None,
            "".join(e.reasoning for e in events),
        )


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    timings: Timings
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


@dataclass
class Generation:
    seq: int
    prompt: list[int]
    sampler: Sampler
    max_tokens: int
    stops: StopMatcher
    stop_ids: frozenset[int]
    history: list[int] = field(default_factory=list)  # prompt + generated, in order
    n_cached: int = 0  # how many of history's tokens the backend's KV holds
    output: list[int] = field(default_factory=list)
    proposer: Proposer | None = None  # where its drafts come from (None: it never drafts)
    exact_greedy: bool = False  # greedy drafts verified within the model's batch drift (LookupConfig)
    matcher: GrammarMatcher | None = None
    # splits the answer into reasoning, content and calls (None: all of it is content)
    reply: ReplyParser | None = None
    has_tools: bool = False  # the request declared tools (its grammar is the call grammar)
    # reasoning_budget: tokens of reasoning allowed (None: no limit); reasoning_tokens: spent;
    # forced: tokens written next instead of sampled (the end-of-reasoning marker)
    reasoning_budget: int | None = None
    reasoning_tokens: int = 0
    forced: list[int] = field(default_factory=list)
    # the forced tokens close a thinking block the prompt opened, ahead of a request's own
    # grammar (which holds the answer, not the thinking): the matcher does not see them
    forced_outside_grammar: bool = False
    forced_writing: bool = False  # the token being taken is a forced one
    # token healing (GenerationRequest.token_healing): the text taken off the prompt's end,
    # what of it the answer has yet to write again (and not repeat in its text)
    heal: bytes = b""
    # a grammar over a whole-vocabulary chain (grammar/redraw.py): steps left that mask
    # at once, and how many the next stretch of refused redraws sets
    masked_steps_left: int = 0
    mask_backoff: int = 1
    finish_reason: str | None = None
    timings: Timings = field(default_factory=Timings)
    # why it ended early when its own work failed in a step (finish_reason is then "error")
    error: GenerationFailed | None = None
    # the next step feeds the pending token alone: a greedy token that a wide step could
    # not decide exactly (see speculation.drift.BatchDrift)
    plain_next: bool = False
    # a JSON-schema answer (json_budget): its last tokens only close what is open, and
    # when that narrowed a choice, it ends as cut by max_tokens ("length")
    closes_json: bool = False
    cut_by_budget: bool = False
    _utf8: Utf8Stream = field(default_factory=Utf8Stream)
    _t_start: float = 0.0
    _t_first: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending(self) -> list[int]:
        return self.history[self.n_cached :]

    @property
    def decoding(self) -> bool:
        """Past its prompt: the next step feeds one token (plus any draft)."""
        return len(self.history) - self.n_cached == 1

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - len(self.output)

    def started(self, now: float) -> None:
        """Its prompt was handed to the engine: time to first token counts from here."""
        self._t_start = now

    def moved_to(self, seq: int) -> None:
        """Its KV was copied to another slot (to keep busy slots together)."""
        self.seq = seq

    def fed(self, n: int) -> None:
        """The backend's KV now holds n more of the history's tokens."""
        self.n_cached += n

    def redo_alone(self, n_cached: int) -> None:
        """Cut back to n_cached, and feed the next token without a draft: its row from a
        wide step was too close to call exactly."""
        self.n_cached = n_cached
        self.plain_next = True

    def may_draft(self) -> bool:
        """Whether this step may carry a draft (once per `redo_alone`, it may not)."""
        if self.plain_next:
            self.plain_next = False
            return False
        if self.forced:  # tokens already decided need no draft
            return False
        return self.proposer is not None

    def forgot(self) -> None:
        """The KV could not be cut back (an MLX rotating window) and was cleared: the next
        steps read the history again, and drafting, which needs the cut, stops."""
        self.n_cached = 0
        self.release_proposer()
        self.proposer = None

    def prompt_read(self, now: float) -> None:
        self.timings.prefill_ms = (now - self._t_start) * 1000

    def took(self, token: int, now: float) -> bool:
        """Count one produced token's time; the token joins the output unless it ends the
        turn (then False)."""
        t = self.timings
        if not self.output:
            self._t_first = now
            t.ttft_ms = t.prefill_ms = (now - self._t_start) * 1000
        else:
            t.decode_tokens = len(self.output)
            t.decode_ms = (now - self._t_first) * 1000
        if token in self.stop_ids:  # the end-of-turn token itself is not output
            return False
        if self.matcher is not None and not (self.forced_outside_grammar and self.forced_writing):
            self.matcher.accept(token)
        self.output.append(token)
        self.history.append(token)
        t.generated_tokens = len(self.output)
        return True

    def stepped(self, drafted: int, accepted: int, judged: int) -> None:
        """A decode step that produced tokens: its draft's verdict, counted once. `judged`
        drafts were decided (fewer than drafted when a row was left to a one-row step)."""
        t = self.timings
        t.steps += 1
        t.drafted += drafted
        t.accepted += accepted
        if self.proposer is not None:
            self.proposer.record(judged, accepted)

    def release_proposer(self) -> None:
        """It drafts no more: its proposer gives back what it holds. The proposer stays, to
        hear the verdict on the draft of the step that ended the generation."""
        if self.proposer is not None:
            self.proposer.release()

    def failed(self, error: GenerationFailed) -> None:
        """Its own work failed in a step: it ends here, with `error` for its client."""
        self.error = error
        self.finish_reason = "error"

    def ended(self, reason: str) -> None:
        if reason == "stop" and self.reply is not None and self.reply.made_calls and self.stops.matched is None:
            reason = "tool_calls"
        if reason == "stop" and self.cut_by_budget:
            reason = "length"
        self.finish_reason = reason


def print_timings(timings: Timings, out=None) -> None:
    """The lines `ollama run --verbose` users know (on stderr unless `out` is given)."""
    out = sys.stderr if out is None else out
    print(f"prompt eval count:    {timings.prompt_tokens} token(s)", file=out)
    print(f"prompt eval rate:     {timings.prefill_tps:.2f} tokens/s", file=out)
    print(f"eval count:           {timings.generated_tokens} token(s)", file=out)
    print(f"eval rate:            {timings.decode_tps:.2f} tokens/s", file=out)
    print(f"time to first token:  {timings.ttft_ms:.2f} ms", file=out)
    if timings.drafted:
        print(f"draft acceptance:     {timings.accepted}/{timings.drafted} ({100 * timings.acceptance:.0f}%)", file=out)
        print(f"tokens per step:      {timings.tokens_per_step:.2f}", file=out)
