"""The engine: prompts in, streamed text out, the same for every backend.

A `Generation` (localrun/generation.py) is one sequence: its slot in the backend, its
token history, its sampler, its text stream. `Engine.step(gens)` advances several
generations with ONE backend decode, in two moves: `_plan` says what each generation
feeds (decoding ones first, so a long prefill never starves them: their pending token,
plus a prompt-lookup draft when one is expected to pay; generations still reading
their prompt, a chunk of it, within the backend's `n_batch`), then each generation's
rows are read by a prefill, a plain step (one row, one token) or a speculative step
(a row per draft token, kept while each is the token sampled). `generate()` is the
single-sequence loop over `step`; a server schedules many generations over the same
call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from localrun.backends import open_backend
from localrun.backends.base import DEFAULT_N_BATCH, Backend, BatchEntry, DecodeInterrupted, ModelInfo

from .prompt import chat_template as chat_template_module
from . import slots
from .lookup import drift_cache
from .errors import BadRequestError, CacheNotTrimmableError, ContextExceededError
from .generation import Completion, Event, Generation, GenerationFailed, Timings, failed_stage, step_failure
from .grammar.core import GrammarMatcher, build_tokenizer
from .grammar.json_budget import CLOSING_RESERVE, BudgetTokens, budget_tokens, inside_string, narrow
from .request import GenerationRequest, prepare, request_or_options
from .store.local import resolve_model
from .sampling import Sampler, TokenText
from .lookup.speculative import Acceptance, DraftController, margin_change
from .lookup.step_cost import StepCost
from .textstream import StopMatcher
from .tools import ToolCallDelta, ToolFormat, collect_calls, history_messages, parse_tools
from .tools.model import ModelTools

__all__ = ["Completion", "Engine", "Event", "Generation", "GenerationFailed", "Timings"]

log = logging.getLogger("localrun.engine")


def _exact_greedy(g: Generation) -> bool:
    """Whether g's drafts are verified under the closeness rule (LookupConfig.exact_greedy)."""
    return g.sampler.params.greedy and g.lookup is not None and g.lookup.cfg.exact_greedy


@dataclass
class _Feed:
    """One generation's part of a step: its batch entry, and the draft it carries."""

    gen: Generation
    entry: BatchEntry
    draft: list[int]


class Engine:
    def __init__(self, backend: Backend, chat_template: str | None = None) -> None:
        """`chat_template`: Jinja text that replaces the model's own (--chat-template)."""
        self.backend = backend
        self.info: ModelInfo = backend.info
        self.n_ctx = backend.n_ctx
        self._free = list(range(backend.n_seq))
        # DRY's breakers, resolved once per model; and lookup's edits that mirror a bracket
        self.token_text = TokenText.from_backend(backend)
        self._budget_tokens: BudgetTokens | None = None
        self.chat_template = chat_template or self.info.chat_template or chat_template_module.fallback_template(
            lambda text: len(backend.tokenize(text, add_special=False, parse_special=True)) == 1
        )
        self.tools = ModelTools(backend, self.chat_template)  # call format, markers, call grammars
        self.step_cost = StepCost()  # what a wider speculative step costs on this model
        self.acceptance = Acceptance()  # what this model's drafts have done lately, per match length
        self._turn_marks: dict[int, bool] = {}  # token -> a control or end-of-generation token
        self.drift = drift_cache.recall(backend)  # how far a wide step's rows stray from one-row steps'

    @property
    def supports_tools(self) -> bool:
        """The chat template reads `tools`, so declared tools reach the model."""
        return self.tools.supported

    @property
    def tool_format(self) -> ToolFormat | None:
        return self.tools.format

    @classmethod
    def open(
        cls,
        path: str | Path,
        n_ctx: int | None = None,
        n_seq: int = 1,
        threads: int | None = None,
        n_batch: int = DEFAULT_N_BATCH,
        kv_cache_type: str | None = None,
        chat_template: str | Path | None = None,
        trust_remote_code: bool = False,
    ) -> "Engine":
        """kv_cache_type: "f16" (None means f16), "q8_0" or "q4_0", the KV cache's element type.
        chat_template: a Jinja template FILE used instead of the model's own.
        trust_remote_code: let an MLX folder whose config names its own Python code load."""
        from localrun.backends import check_kv_cache_type

        if n_ctx is not None and n_ctx < 16:
            raise BadRequestError(f"--ctx must be at least 16 tokens, got {n_ctx}")
        kv_cache_type = check_kv_cache_type(kv_cache_type)  # before any model is read
        template = chat_template_module.load_template_file(chat_template) if chat_template is not None else None
        return cls(
            open_backend(
                resolve_model(str(path)), n_ctx=n_ctx, n_seq=n_seq, threads=threads, n_batch=n_batch, kv_cache_type=kv_cache_type,
                trust_remote_code=trust_remote_code,
            ),
            chat_template=template,
        )

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- text <-> tokens ---------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_special=add_special, parse_special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.backend.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools=()) -> list[int]:
        """The conversation as the model's template writes it. `tools` (Tool objects or
        OpenAI's list) reach the template as Hugging Face's `tools` variable; history with
        tool calls and results is normalised first (localrun.tools.history_messages)."""
        info = self.info
        tools = parse_tools(tools, "tools") if tools else ()
        self.tools.check(tools)
        extra = {"tools": [t.template_dict() for t in tools]} if tools else {}
        text = chat_template_module.render(
            self.chat_template, history_messages(messages), info.bos_text, info.eos_text, add_generation_prompt, **extra
        )
        # Templates that write the BOS themselves must not get a second one.
        has_bos = bool(info.bos_text) and text.startswith(info.bos_text)
        return self.tokenize(text, add_special=not has_bos)

    # -- generation --------------------------------------------------------------

    def start(
        self, prompt: str | Sequence[int], request: GenerationRequest | None = None, **options
    ) -> Generation:
        """Begin one generation: a free slot (the one whose KV shares the longest prefix
        with the prompt), its KV cut to that prefix, a sampler and a grammar matcher.
        `request` says what to generate; Python callers may give its fields as keywords
        instead (`sampling=..., max_tokens=...`). A request from `prepare` costs only
        cache hits here; an unprepared one is prepared now (a server prepares off its
        scheduler thread, which every stream of the model shares)."""
        request = prepare(self, request_or_options(request, options))
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.check_prompt(tokens, request.max_tokens)
        if not self._free:
            raise RuntimeError("every sequence slot is busy")
        room = self.n_ctx - len(tokens)
        seq, n_keep = self._pick_slot(tokens)
        try:
            self.backend.kv_trim(seq, n_keep)
        except CacheNotTrimmableError:  # an MLX rotating window: read the whole prompt afresh
            n_keep = 0
        except Exception:  # a real failure reaches the caller, and the slot stays free
            self._free.append(seq)
            raise
        if not n_keep:
            self.backend.kv_clear(seq)
        gen = Generation(
            seq=seq,
            prompt=tokens,
            sampler=Sampler(request.sampling, self.token_text),
            max_tokens=room if request.max_tokens is None else min(request.max_tokens, room),
            stops=StopMatcher(list(request.stop)),
            stop_ids=frozenset() if request.ignore_eos else self.info.stop_ids,
            history=list(tokens),
            n_cached=n_keep,
            timings=Timings(prompt_tokens=len(tokens), cached_tokens=n_keep),
        )
        if request.lookup.enabled:
            gen.lookup = DraftController(request.lookup, self.step_cost, self.acceptance, answer_start=len(tokens),
                                         spelling=self.token_text,
                                         control=self.turn_marks(tokens))
        if request.tools:  # prepare() built and compiled it: cache hits
            grammar = self.tools.grammar(request.tools, request.tool_choice, request.parallel_tool_calls)
            gen.matcher = GrammarMatcher(grammar, build_tokenizer(self.backend))
            gen.calls = self.tools.output(request.tool_choice)
        elif request.grammar is not None:
            gen.matcher = GrammarMatcher(request.grammar, build_tokenizer(self.backend))
            gen.closes_json = request.grammar.kind == "json_schema"
        gen.started(time.perf_counter())
        return gen

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def turn_marks(self, tokens: Sequence[int]) -> frozenset[int]:
        """The control and end-of-generation tokens among `tokens` (a chat template's turn
        marks), which prompt lookup never drafts (see DraftController.draft)."""
        marks, distinct = self._turn_marks, set(tokens)
        # each token is asked once per engine: a 6,000-token prompt took ~1 ms the first
        # time, 0.15 ms after (Qwen2.5; every distinct token asked each time: 1.3 ms)
        for t in distinct.difference(marks):
            marks[t] = t in self.info.stop_ids or self.backend.is_control(t)
        return frozenset(t for t in distinct if marks[t])

    def check_prompt(self, tokens: Sequence[int], max_tokens: int | None = None) -> None:
        """Every check `start` makes on a prompt, for callers that must refuse a request
        before they answer it (a server before its first streamed byte)."""
        if not tokens:
            raise BadRequestError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise ContextExceededError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx};"
                " shorten the prompt or raise --ctx"
            )
        bad = [t for t in tokens if not 0 <= t < self.info.n_vocab]
        if bad:
            raise BadRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.info.n_vocab - 1})")
        if max_tokens is not None and max_tokens < 0:
            raise BadRequestError(f"max_tokens must be >= 0, got {max_tokens}")

    def _pick_slot(self, tokens: list[int]) -> tuple[int, int]:
        """A free slot for `tokens` and how many of its cached tokens to keep: the slot
        whose KV shares the longest prefix with them, or, on a backend that batches only
        neighbouring slots, the one that keeps the busy slots together (with the longest
        cached prefix copied there when that saves enough reading; see slots.py). At
        least the last prompt token is always fed again (its logits start the answer).
        A cache that cannot be cut back that far (an MLX rotating window) makes `kv_trim`
        refuse, and `start` falls back to a fresh slot."""
        shared = {s: min(_common_prefix(self.backend.kv_tokens(s), tokens), len(tokens) - 1) for s in self._free}
        # where neighbours do not matter, no slot counts as busy: place() then simply
        # picks the longest prefix and never copies
        busy = set(range(self.backend.n_seq)).difference(self._free) if self.backend.batches_neighbours_only else ()
        seq, source = slots.place(self._free, busy, shared)
        if source is not None:
            self.backend.kv_copy(source, seq, shared[source])
            shared[seq] = shared[source]
        self._free.remove(seq)
        return seq, shared[seq]

    def _gather(self, gens: Sequence[Generation]) -> None:
        """Move one generation into a free slot when that joins the busy slots into fewer
        runs (others finished around it): each run costs the step a forward pass."""
        if not self.backend.batches_neighbours_only or not self._free:
            return
        by_seq = {g.seq: g for g in gens}
        step = slots.move({s: g.max_tokens - len(g.output) for s, g in by_seq.items()}, self._free)
        if step is None:
            return
        src, dst = step
        g = by_seq[src]
        self.backend.kv_copy(src, dst, g.n_cached)
        self._free.remove(dst)
        self._free.append(src)  # its KV stays there for a later prompt that shares it
        g.moved_to(dst)

    def release(self, gen: Generation) -> None:
        """Give the generation's slot back; its KV stays for the next prompt that shares
        a prefix with it."""
        if gen.seq not in self._free:
            self._free.append(gen.seq)
        if not gen.done:
            gen.ended("cancelled")

    def step(self, gens: Sequence[Generation], budget: int | None = None) -> dict[int, Event]:
        """One backend decode across every unfinished generation; events keyed by seq.
        `budget` caps the tokens of this step (default and ceiling: the backend's n_batch).
        A generation reading its prompt feeds a chunk of it (a prefill); a decoding one
        feeds its pending token (a plain step), plus a draft when prompt lookup expects
        one to pay (a speculative step)."""
        live = [g for g in gens if not g.done]
        self._gather(live)
        live.sort(key=lambda g: not g.decoding)  # a decoder's one token must not wait behind a prefill
        feeds = self._plan(live, budget)
        if not feeds:
            return {}
        t0 = time.perf_counter()
        try:
            rows = self.backend.decode([f.entry for f in feeds])
        except DecodeInterrupted:  # someone (a hung-up client) stopped it: nothing advanced
            return {}
        now = time.perf_counter()
        if len(feeds) == 1 and feeds[0].gen.decoding and feeds[0].entry.n_logits:
            self.step_cost.observe(len(feeds[0].entry.tokens), (now - t0) * 1000,
                                   drafting=feeds[0].gen.lookup is not None)
        if len(feeds) > 1 and self.drift.calibrating and any(f.draft and _exact_greedy(f.gen) for f in feeds):
            # a calibrating step decodes again, into the buffer the others' rows may live in
            rows = [np.array(r) for r in rows]
        events: dict[int, Event] = {}
        for f, r in zip(feeds, rows):
            g = f.gen
            try:
                if not f.entry.n_logits:  # a prompt chunk, or the whole prompt for max_tokens 0
                    g.fed(len(f.entry.tokens))
                    if not g.max_tokens and not g.pending:
                        g.prompt_read(now)
                        events[g.seq] = self._finish(g, "length")
                    continue
                ev = self._speculative_step(g, f.draft, r, now) if f.draft else self._plain_step(g, f.entry, r, now)
            except Exception as exc:  # its own grammar, sampler or stop strings: it ends alone
                self._fail(g, exc)
                continue
            if ev is not None:
                events[g.seq] = ev
        return events

    def _fail(self, g: Generation, exc: Exception) -> None:
        """End g because its own work in a step raised `exc` (llguidance's parser hit a
        limit after its mask allowed the token, a sampler bug): g.error says what failed,
        its slot is free again, and the step's other generations are untouched. Its slot's
        KV holds only tokens the backend really decoded there, so a later prompt may still
        reuse its prefix."""
        g.failed(step_failure(exc, len(g.output), g.calls is not None))
        if g.error.http_status >= 500:  # a bug: the traceback is for the log only
            log.error("a generation failed in its %s", failed_stage(exc), exc_info=exc)
        self.release(g)

    def _plan(self, live: list[Generation], budget: int | None) -> list[_Feed]:
        """What each generation feeds this step, within the token budget."""
        budget = self.backend.n_batch if budget is None else max(1, min(budget, self.backend.n_batch))
        feeds: list[_Feed] = []
        for g in live:
            if budget <= 0:
                break
            try:
                draft = self._draft(g, budget - 1) if g.decoding and g.max_tokens else []
            except Exception as exc:  # its prompt-lookup draft: it ends alone, not in the step
                self._fail(g, exc)
                continue
            pending = g.pending
            if not g.decoding and g.max_tokens:
                # The prompt's last token is read alone, as it is when a cached prefix covers
                # the rest: a row can depend on the batch's shape (kernels), and the first
                # token must not depend on whether the prompt was cached.
                pending = pending[:-1]
            chunk = pending[:budget] + draft
            last = len(chunk) == len(g.pending) + len(draft)
            # max_tokens 0 reads the prompt into the slot and stops: no logits needed
            wants = 1 + len(draft) if last and g.max_tokens else 0
            feeds.append(_Feed(g, BatchEntry(g.seq, chunk, g.n_cached, wants), draft))
            budget -= len(chunk)
        return feeds

    def _draft(self, g: Generation, room: int) -> list[int]:
        """Prompt-lookup draft for a decoding generation, within every limit it has."""
        if not g.may_draft():
            return []
        k = min(room, g.tokens_left - 1, self.n_ctx - len(g.history) - 1)
        return g.lookup.draft(g.history, k) if k > 0 else []

    def _plain_step(self, g: Generation, fed: BatchEntry, rows, now: float) -> Event:
        """The row after the tokens fed gives the next token."""
        g.fed(len(fed.tokens))
        event = self._produce(g, rows[0], now)
        g.stepped(0, 0, 0)
        return event

    def _speculative_step(self, g: Generation, draft: list[int], rows, now: float) -> Event | None:
        """Rows for the pending token and each draft token: each row is sampled exactly as
        a plain step would, and a draft is kept while it is the token sampled; the KV of
        what was not kept is trimmed. Asked for (`LookupConfig.exact_greedy`), under
        greedy sampling a row from this wide step is trusted only where its choice leads
        by more than the model's measured batch drift (speculative.BatchDrift); the first
        row that does not is left to a one-row step. Returns None when no token came out
        (the very first row was left)."""
        base = g.n_cached  # where the pending token sits
        exact = _exact_greedy(g)
        lead = None  # the lead a greedy token needs in a wide step's row
        if exact and self.drift.calibrating:
            rows = self._recompute_alone(g, draft, rows)  # exact: rows of one-row steps
            if rows is None:
                return None
        elif exact and self.drift.margin > 0:
            lead = self.drift.margin
        events: list[Event] = []
        kept, unsure = 0, False
        for i in range(len(draft) + 1):
            event = self._produce(g, rows[i], now, lead)
            if event is None:
                unsure = True
                break
            events.append(event)
            if g.done or i == len(draft) or event.tokens[-1:] != [draft[i]]:
                break
            kept += 1
        if unsure:  # the row of position base + i is recomputed alone next step
            g.redo_alone(base + len(events))
        else:
            g.fed(1 + kept)
        if g.n_cached < base + 1 + len(draft) and not g.done:
            try:
                self.backend.kv_trim(g.seq, g.n_cached)
            except CacheNotTrimmableError:  # an MLX rotating window: read the history again
                self.backend.kv_clear(g.seq)
                g.forgot()
        if not events:
            return None
        # a row left to a one-row step costs what a rejection there would (the rows after it
        # are thrown away), so the draft's judge counts it as one
        g.stepped(len(draft), kept, min(kept + 1, len(draft)) if unsure else len(draft))
        return Event.joined(events)

    @staticmethod
    def _clear_greedy(g: Generation, row: np.ndarray, lead: float) -> int | None:
        """The greedy token of a wide step's row, or None when it leads the runner-up by
        no more than `lead` (a one-row step might choose otherwise)."""
        adjusted = g.sampler.adjusted(row, g.history)
        best = int(np.argmax(adjusted))
        before = adjusted[:best].max(initial=-np.inf)
        after = adjusted[best + 1 :].max(initial=-np.inf)
        return best if adjusted[best] - max(before, after) > lead else None

    def _recompute_alone(self, g: Generation, draft: list[int], wide_rows) -> list[np.ndarray] | None:
        """Decode the pending token and the draft again one row at a time (the rows a
        plain run would see), measuring on the way how far the wide step's rows strayed
        from them: how much the top-two margin of each row changed."""
        base = g.n_cached
        wide_rows = np.array(wide_rows)  # a backend's rows may live in a buffer the next decode reuses
        try:
            self.backend.kv_trim(g.seq, base)
            alone = []
            for j, token in enumerate([g.history[base]] + draft):
                row = np.array(self.backend.decode([BatchEntry(g.seq, [token], base + j, 1)])[0][0])
                self.drift.observe(margin_change(wide_rows[j], row))
                alone.append(row)
            if not self.drift.calibrating:
                drift_cache.remember(self.backend, self.drift)
            return alone
        except DecodeInterrupted:  # nothing is decided this step; the KV goes back to the pending token
            self.backend.kv_trim(g.seq, base)
            return None
        except CacheNotTrimmableError:  # no cut, no recomputing: the wide rows it is
            return wide_rows

    def _produce(self, g: Generation, raw_row, now: float, lead: float | None = None) -> Event | None:
        """Choose a token from one row (through the grammar's mask, if any) and emit it.
        With `lead` (greedy, a wide step's row): None when the choice is too close to call."""
        row = raw_row if g.matcher is None else self._constrain(g, raw_row)
        n_probs = g.sampler.params.n_probs
        alternatives = g.sampler.top_probs(row, g.history, n_probs) if n_probs else None
        token = g.sampler.sample(row, g.history) if lead is None else self._clear_greedy(g, row, lead)
        if token is None:
            return None
        event = self._accept(g, token, now)
        if alternatives is not None and event.tokens:
            event.top_probs = [alternatives]
            # the drawn token is nearly always among the alternatives (same raw scale): a
            # second softmax over the vocabulary only when it is not
            known = dict(alternatives)
            event.token_probs = [known[token] if token in known else g.sampler.token_prob(row, token)]
        return event

    def budget_tokens(self) -> BudgetTokens:
        """json_budget.budget_tokens for this model's vocabulary, built on first use
        (`prepare` warms it off the scheduler thread for a JSON-schema request)."""
        if self._budget_tokens is None:
            ends = self.info.stop_ids | ({self.info.eos_id} if self.info.eos_id is not None else set())
            self._budget_tokens = budget_tokens(self.token_text.pieces(int(self.info.n_vocab)), ends)
        return self._budget_tokens

    def _constrain(self, g: Generation, row):
        """The row the sampler may draw from under the grammar. The full mask costs up to
        ~15 ms on a 262k vocabulary (free text inside a JSON string), so where the chain
        only needs the best few allowed ids (greedy, or top-k first) those are found by
        checking the ranked head one id at a time (~1 us each): the row comes back as is
        when the head's best ids are all allowed, else with only the needed ids kept.
        The full mask runs when the head holds too few allowed ids, or when per-token
        probabilities over every allowed token are asked for (n_probs)."""
        m, s = g.matcher, g.sampler
        if g.closes_json and g.tokens_left <= CLOSING_RESERVE:  # see json_budget
            pieces = self.token_text.pieces()
            inside = inside_string(b"".join(pieces[t] for t in g.output))
            narrowed = narrow(row, m.allowed_mask(), self.budget_tokens().preferred(inside))
            if narrowed is not None:
                row, left_out = narrowed
                g.cut_by_budget |= left_out
                return row
        head = None if s.params.n_probs else s.grammar_head(row, g.history)
        if head is None:
            return m.apply(row)
        ranked, need = head
        keep = []
        for t in ranked.tolist():
            if m.allows(t):
                keep.append(t)
                if len(keep) == need:
                    break
        if len(keep) < need:
            return m.apply(row)
        if keep == ranked[:need].tolist():
            return row
        out = np.full(row.shape[0], -np.inf, np.float32)
        out[keep] = row[keep]
        return out

    def _accept(self, g: Generation, token: int, now: float) -> Event:
        if not g.took(token, now):
            return self._finish(g, "stop")
        piece = g._utf8.feed(self.backend.token_bytes(token))
        calls = None
        if g.calls is not None:  # stop strings apply to content only, never inside a call
            piece, calls = g.calls.feed(token, piece)
        text, hit = g.stops.feed(piece)
        if hit:
            return self._finish(g, "stop", token, text, flush=False)
        if calls:  # content before a call is complete: what the stop matcher held goes out first
            text += g.stops.flush()
        calls = calls or None
        if g.matcher is not None and g.matcher.is_done():  # nothing but EOS may follow
            return self._finish(g, "stop", token, text, calls=calls)
        if len(g.output) >= g.max_tokens:
            return self._finish(g, "length", token, text, calls=calls)
        return Event(text, [token], tool_calls=calls)

    def finish(self, g: Generation, reason: str = "length") -> Event:
        """End a generation early (a time budget ran out): the last event, with any text
        the stop matcher and UTF-8 decoder still held."""
        return self._finish(g, reason)

    def _finish(
        self, g: Generation, reason: str, token: int | None = None, text: str = "", flush: bool = True,
        calls: list[ToolCallDelta] | None = None,
    ) -> Event:
        if flush:
            tail = g._utf8.flush()
            if g.calls is not None:
                tail, more = g.calls.finish(tail)
                calls = (calls or []) + more or None
            tail, hit = g.stops.feed(tail)
            text += tail + ("" if hit else g.stops.flush())
        g.ended(reason)
        self.release(g)
        return Event(text, [token] if token is not None else [], g.finish_reason, g.timings, tool_calls=calls)

    def generate(
        self, prompt: str | Sequence[int], request: GenerationRequest | None = None, **options
    ) -> Iterator[Event]:
        """Stream one generation: a GenerationRequest, or its fields as keywords
        (sampling, max_tokens, stop, ignore_eos, lookup, grammar)."""
        gen = self.start(prompt, request, **options)
        try:
            if gen.done:
                yield Event("", [], gen.finish_reason, gen.timings)
                return
            while not gen.done:
                ev = self.step([gen]).get(gen.seq)
                if gen.error is not None:  # its own work failed in the step: the caller gets why
                    raise gen.error
                if ev is not None:
                    yield ev
        finally:
            self.release(gen)

    def complete(
        self, prompt: str | Sequence[int], request: GenerationRequest | None = None, **options
    ) -> Completion:
        parts: list[str] = []
        tokens: list[int] = []
        deltas: list[ToolCallDelta] = []
        last = Event("", [], "length", Timings())
        for ev in self.generate(prompt, request, **options):
            parts.append(ev.text)
            tokens.extend(ev.tokens)
            deltas.extend(ev.tool_calls or ())
            last = ev
        return Completion(
            "".join(parts), tokens, last.finish_reason or "length", last.timings or Timings(), collect_calls(deltas)
        )

    def chat(self, messages: list[dict], request: GenerationRequest | None = None, **options) -> Iterator[Event]:
        """Stream the answer to `messages`; `tools=[...]`, `tool_choice=...` and
        `parallel_tool_calls=...` (or a request carrying them) render the tools with the
        model's template and hold its calls to them."""
        request = request_or_options(request, options)
        return self.generate(self.chat_prompt(messages, tools=request.tools), request)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
