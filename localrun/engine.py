"""The engine: prompts in, streamed text out, the same for every backend.

A `Generation` (localrun/generation.py) is one sequence: its slot in the backend, its
token history, its sampler, its text stream. `Engine.step(gens)` advances several
generations with ONE backend decode: plan (`_plan`: what each generation feeds,
decoding ones first so a long prefill never starves them: their pending token, or a
chunk of the prompt within the backend's `n_batch`), draft (the model's `Speculator`
asks a decoding generation's proposer for tokens to verify when a draft is expected to
pay), decode, verify (each generation's rows become tokens: a prefill, a plain step, or
a speculative step whose drafts are kept while each is the token sampled) and observe
(the step's time prices the next drafts). `generate()` is the single-sequence loop over
`step`; a server schedules many generations over the same call.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from localrun.backends import open_backend
from localrun.backends.base import Backend, BackendOptions, BatchEntry, DecodeInterrupted, ModelInfo, common_prefix

from .prompt import chat_template as chat_template_module
from . import slots
from .errors import BadRequestError, CacheNotTrimmableError, ContextExceededError
from .generation import Completion, Event, Generation, GenerationFailed, Timings, failed_stage, step_failure
from .grammar.json_budget import CLOSING_RESERVE, BudgetTokens, budget_tokens, inside_string, narrow
from .grammar.head import constrained_row
from .grammar.matcher import GrammarMatcher
from .grammar.redraw import draw_allowed, redraws
from .grammar.tokenizer import build_tokenizer
from .prompt.healing import heal_back, healing_row
from .request import GenerationRequest, check_template_kwargs, prepare, request_or_options, with_thinking_aliases
from .store.local import resolve_model
from .sampling import Sampler, TokenText
from .speculation.draft_model import DRAFT_MAX, DraftModel, check_pair
from .speculation.proposer import StepShare
from .speculation.speculator import Speculator
from .textstream import StopMatcher
from .tools import ToolCallDelta, ToolFormat, collect_calls, history_messages, parse_tools
from .tools.model import ModelTools

__all__ = ["Completion", "Engine", "Event", "Generation", "GenerationFailed", "Timings"]

log = logging.getLogger("localrun.engine")


@dataclass
class _Feed:
    """One generation's part of a step: its batch entry, and the draft it carries."""

    gen: Generation
    entry: BatchEntry
    draft: list[int]
    filled: bool = False  # the draft is filler, not a proposal (speculation/shared_step.py)


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
        # drafts, their verification, and what the model's steps cost (localrun.speculation)
        self.speculator = Speculator(backend, self.token_text, self.info.stop_ids)

    @property
    def supports_tools(self) -> bool:
        """The chat template reads `tools`, so declared tools reach the model."""
        return self.tools.supported

    @property
    def tool_format(self) -> ToolFormat | None:
        return self.tools.format

    @classmethod
    def open(
        cls, path: str | Path, options: BackendOptions | None = None, chat_template: str | Path | None = None,
        draft: str | Path | None = None, draft_max: int = DRAFT_MAX, **fields,
    ) -> "Engine":
        """The model at `path` (a file, a folder, or a store name) loaded with `options`
        or its fields as keywords (BackendOptions: n_ctx, n_seq, n_batch, kv_cache_type,
        threads, cluster for RPC workers, trust_remote_code, ...).
        chat_template: a Jinja template FILE used instead of the model's own.
        draft: a smaller model of the same vocabulary that drafts for it (load_draft),
        at most `draft_max` tokens a step."""
        o = BackendOptions.of(options, **fields)  # a bad value fails before any model is read
        if o.n_ctx is not None and o.n_ctx < 16:
            raise BadRequestError(f"--ctx must be at least 16 tokens, got {o.n_ctx}")
        if draft_max < 1:
            raise BadRequestError(f"--draft-max must be at least 1, got {draft_max}")
        template = chat_template_module.load_template_file(chat_template) if chat_template is not None else None
        engine = cls(open_backend(resolve_model(str(path)), o), chat_template=template)
        if draft is not None:
            try:
                engine.load_draft(draft, draft_max, o)
            except BaseException:
                engine.close()
                raise
        return engine

    def load_draft(self, path: str | Path, draft_max: int = DRAFT_MAX, options: BackendOptions | None = None) -> None:
        """Load the model at `path` to draft for this one (speculative decoding with a
        smaller model of the same vocabulary; localrun.speculation.draft_model): every
        generation started from now on drafts with it where drafting pays. It gets this
        model's context, slots and batch, on this machine (never the --rpc workers).
        Raises DraftPairError when its vocabulary differs."""
        b = self.backend
        o = dataclasses.replace(options or BackendOptions(), n_ctx=b.n_ctx, n_seq=b.n_seq, n_batch=b.n_batch,
                                kv_cache_type=b.kv_cache_type, cluster=None)
        backend = open_backend(resolve_model(str(path)), o)
        try:
            check_pair(b, backend, Path(self.info.path).name, Path(backend.info.path).name)
        except BaseException:
            backend.close()
            raise
        if self.speculator.draft_model is not None:
            self.speculator.draft_model.close()
        model = DraftModel(backend, draft_max, Path(backend.info.path).name, target_vocab=self.info.n_vocab)
        try:
            model.measure(b, self.speculator.step_cost)
        except BaseException:
            backend.close()
            raise
        self.speculator.draft_model = model

    @property
    def draft_model(self) -> DraftModel | None:
        return self.speculator.draft_model

    def close(self) -> None:
        if self.speculator.draft_model is not None:
            self.speculator.draft_model.close()
            self.speculator.draft_model = None
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

    def chat_prompt(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=(), template_kwargs: dict | None = None
    ) -> list[int]:
        """The conversation as the model's template writes it. `tools` (Tool objects or
        OpenAI's list) reach the template as Hugging Face's `tools` variable; history with
        tool calls and results is normalised first (localrun.tools.history_messages).
        `template_kwargs`: more variables for the template (`enable_thinking`,
        `reasoning_effort`), checked as GenerationRequest checks them."""
        info = self.info
        tools = parse_tools(tools, "tools") if tools else ()
        self.tools.check(tools)
        extra = with_thinking_aliases(check_template_kwargs(template_kwargs))
        if tools:
            extra["tools"] = [t.template_dict() for t in tools]
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
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        request = prepare(self, request_or_options(request, options), tokens)
        heal = b""
        if request.token_healing and request.grammar is None and not request.tools:
            tokens, heal = heal_back(self.backend, self.token_text.index(int(self.info.n_vocab)), tokens)
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
        gen.heal = heal
        self.speculator.attach(gen, request.lookup)
        if request.tools:  # prepare() built and compiled it for this prompt: cache hits
            grammar = self.tools.grammar(request.tools, request.tool_choice, request.parallel_tool_calls, prompt=tokens)
            gen.matcher = GrammarMatcher(grammar, build_tokenizer(self.backend))
        elif request.grammar is not None:
            gen.matcher = GrammarMatcher(request.grammar, build_tokenizer(self.backend))
            gen.closes_json = request.grammar.kind == "json_schema"
        gen.has_tools = bool(request.tools)
        # the answer's parts: reasoning, content and calls (None: all of it is content)
        gen.reply = self.tools.output(request.tool_choice if request.tools else None,
                                      reasoning=request.reasoning_format != "none", tools=request.tools, prompt=tokens)
        if gen.reply is not None and request.grammar is not None and gen.reply.in_reasoning:
            # a request's grammar (JSON schema, GBNF, regex) holds the answer: a thinking
            # block the prompt opened (DeepSeek-R1's template) is closed at once, outside it
            gen.forced = self.backend.tokenize(gen.reply.closing(), add_special=False, parse_special=True)
            gen.forced_outside_grammar = True
        elif gen.reply is not None and request.reasoning_budget is not None:
            gen.reasoning_budget = request.reasoning_budget
            self._end_reasoning_if_spent(gen)  # a budget of 0 in a block the prompt opened
        gen.started(time.perf_counter())
        return gen

    @property
    def reasoning(self):
        """The model's reasoning format (localrun.tools.reasoning.ReasoningFormat), or None
        when its template shows no reasoning block."""
        return self.tools.reasoning

    def _end_reasoning_if_spent(self, g: Generation) -> None:
        """When g's reasoning has used its budget, queue the model's own end-of-reasoning
        marker (e.g. "</think>\n\n"): the next steps write it instead of sampling, and
        the answer follows."""
        r = g.reply
        if g.forced or not r.in_reasoning or g.reasoning_tokens < g.reasoning_budget or not r.end_of_reasoning:
            return
        # what is left of the marker: the model may have begun writing it
        marker = self.backend.tokenize(r.closing(), add_special=False, parse_special=True)
        if g.matcher is not None and marker and not g.matcher.allows(marker[0]):
            return  # the grammar holds the answer elsewhere: the budget cannot end it here
        g.forced = marker
        g.reasoning_budget = None  # spent: the marker's own tokens are not thinking

    @property
    def free_slots(self) -> int:
        return len(self._free)

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
        shared = {s: min(common_prefix(self.backend.kv_tokens(s), tokens), len(tokens) - 1) for s in self._free}
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
        gen.release_proposer()
        if not gen.done:
            gen.ended("cancelled")

    def step(self, gens: Sequence[Generation], budget: int | None = None) -> dict[int, Event]:
        """One backend decode across every unfinished generation; events keyed by seq.
        `budget` caps the tokens of this step (default and ceiling: the backend's n_batch).
        Plan (what each generation feeds: a chunk of its prompt, or its pending token) and
        draft (a decoding generation's proposer may add tokens to verify), one decode,
        then verify (each generation's rows become its tokens) and observe (the step's
        cost prices the next drafts)."""
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
        self.speculator.observe([f.entry for f in feeds], [f.gen for f in feeds], (now - t0) * 1000)
        if len(feeds) > 1 and any(f.draft and self.speculator.recomputes(f.gen) for f in feeds):
            # verifying decodes again, into the buffer the others' rows may live in
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
                ev = self._verify(g, f.draft, r, now, f.filled) if f.draft else self._plain_step(g, f.entry, r, now)
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
        g.failed(step_failure(exc, len(g.output), g.has_tools))
        if g.error.http_status >= 500:  # a bug: the traceback is for the log only
            log.error("a generation failed in its %s", failed_stage(exc), exc_info=exc)
        self.release(g)

    def _plan(self, live: list[Generation], budget: int | None) -> list[_Feed]:
        """What each generation feeds this step, within the token budget."""
        budget = self.backend.n_batch if budget is None else max(1, min(budget, self.backend.n_batch))
        feeds: list[_Feed] = []
        # the step as it is without drafts, which each draft is priced in (StepShare): a
        # token from each decoding generation, and the prompt chunks the budget leaves room for
        decoding = sum(1 for g in live if g.decoding)
        rows = min(budget, decoding + sum(len(g.pending) for g in live if not g.decoding))
        counts = slots.step_counts(live, budget, self.backend.n_seq) if len(live) > 1 else None
        plain_rows, plain_counts = max(rows, 1), tuple(counts or ())  # the step before any draft
        together = None  # several decoding streams: their drafts are chosen together (shared_step.py)
        if decoding > 1:
            share = StepShare(plain_rows, decoding, plain_counts, -1, self.backend.passes, plain_rows, plain_counts)
            gens = [g for g in live if g.decoding and g.max_tokens]
            together = self.speculator.draft_together(gens, budget - plain_rows, self.n_ctx, share)
            for g, exc in together[2] if together else ():
                self._fail(g, exc)
        later = decoding  # decoding generations not planned yet: each keeps its token in the step
        for g in live:
            if budget <= 0:
                break
            later -= g.decoding
            if together is not None and g.decoding:
                if g.done:  # its proposer failed above
                    continue
                draft = together[0].get(g.seq, [])[: max(0, budget - 1 - later)]
            else:
                try:
                    share = StepShare(max(rows, 1), max(decoding, 1), tuple(counts or ()), g.seq,
                                      self.backend.passes, plain_rows, plain_counts)
                    # A draft takes only the budget the later decoders leave: one that took it all
                    # left them out (4 streams, 16-token budget: two drafted, two waited a step).
                    room = budget - 1 - later
                    draft = self.speculator.draft(g, room, self.n_ctx, share) if g.decoding and g.max_tokens else []
                except Exception as exc:  # its proposer's draft: it ends alone, not in the step
                    self._fail(g, exc)
                    continue
            rows += len(draft)  # the next generation's draft joins a step this much wider
            if counts is not None:
                counts[g.seq] += len(draft)
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
            filled = together is not None and g.seq in together[1]
            feeds.append(_Feed(g, BatchEntry(g.seq, chunk, g.n_cached, wants), draft, filled))
            budget -= len(chunk)
        return feeds

    def _plain_step(self, g: Generation, fed: BatchEntry, rows, now: float) -> Event:
        """The row after the tokens fed gives the next token."""
        g.fed(len(fed.tokens))
        event = self._produce(g, rows[0], now)
        g.stepped(0, 0, 0)
        return event

    def _verify(self, g: Generation, draft: list[int], rows, now: float, filled: bool = False) -> Event | None:
        """A speculative step's rows as one event (None when no token came out): the
        speculator verifies them with this engine's own token choice (`filled`: filler)."""
        events = self.speculator.verify(g, draft, rows, now, self._produce, filled)
        return Event.joined(events) if events else None

    def _produce(self, g: Generation, raw_row, now: float, lead: float | None = None) -> Event | None:
        """Choose a token from one row (through the grammar's mask, if any) and emit it.
        With `lead` (greedy, a wide step's row): None when the choice is too close to call."""
        if g.forced:  # the end-of-reasoning marker the budget asked for: written, not sampled
            token = g.forced.pop(0)
            g.forced_writing = True
            try:
                event = self._accept(g, token, now)
            finally:
                g.forced_writing = False
            if g.sampler.params.n_probs and event.tokens:
                event.top_probs, event.token_probs = [[(token, 1.0)]], [1.0]
            return event
        if g.matcher is not None and lead is None and redraws(g):
            return self._accept(g, draw_allowed(g, raw_row), now)
        row = raw_row if g.matcher is None else self._constrain(g, raw_row)
        if g.heal:
            row = healing_row(self.token_text.index(int(self.info.n_vocab)), g.heal, row)
        n_probs = g.sampler.params.n_probs
        alternatives = g.sampler.top_probs(row, g.history, n_probs) if n_probs else None
        token = g.sampler.sample(row, g.history) if lead is None else self.speculator.clear_greedy(g, row, lead)
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
        """The row the sampler may draw from under the grammar (grammar.head), narrowed to
        what closes the JSON in time where max_tokens is near (grammar.json_budget)."""
        if g.closes_json and g.tokens_left <= CLOSING_RESERVE:
            pieces = self.token_text.pieces()
            inside = inside_string(b"".join(pieces[t] for t in g.output))
            narrowed = narrow(row, g.matcher.allowed_mask(), self.budget_tokens().preferred(inside))
            if narrowed is not None:
                row, left_out = narrowed
                g.cut_by_budget |= left_out
                return row
        return constrained_row(g.matcher, g.sampler, row, g.history)

    def _accept(self, g: Generation, token: int, now: float) -> Event:
        if not g.took(token, now):
            return self._finish(g, "stop")
        data = self.backend.token_bytes(token)
        if g.heal:  # the healed text was the prompt's: the answer's text goes on after it
            data, g.heal = (data[len(g.heal):], b"") if data.startswith(g.heal) else (b"", g.heal[len(data):])
        piece = g._utf8.feed(data)
        calls, reasoning = None, ""
        if g.reply is not None:  # stop strings apply to content only: never to reasoning, nor inside a call
            was_reasoning = g.reply.in_reasoning
            part = g.reply.feed(token, piece)
            piece, calls, reasoning = part.content, part.calls, part.reasoning
            if g.reasoning_budget is not None:
                g.reasoning_tokens += was_reasoning and g.reply.in_reasoning  # the markers do not count
                self._end_reasoning_if_spent(g)
        text, hit = g.stops.feed(piece)
        if hit:
            return self._finish(g, "stop", token, text, flush=False, reasoning=reasoning)
        if calls:  # content before a call is complete: what the stop matcher held goes out first
            text += g.stops.flush()
        calls = calls or None
        if g.matcher is not None and g.matcher.is_done():  # nothing but EOS may follow
            return self._finish(g, "stop", token, text, calls=calls, reasoning=reasoning)
        if len(g.output) >= g.max_tokens:
            return self._finish(g, "length", token, text, calls=calls, reasoning=reasoning)
        return Event(text, [token], tool_calls=calls, reasoning=reasoning)

    def finish(self, g: Generation, reason: str = "length") -> Event:
        """End a generation early (a time budget ran out): the last event, with any text
        the stop matcher and UTF-8 decoder still held."""
        return self._finish(g, reason)

    def _finish(
        self, g: Generation, reason: str, token: int | None = None, text: str = "", flush: bool = True,
        calls: list[ToolCallDelta] | None = None, reasoning: str = "",
    ) -> Event:
        if flush:
            tail = g._utf8.flush()
            if g.reply is not None:
                part = g.reply.finish(tail)
                tail, reasoning = part.content, reasoning + part.reasoning
                calls = (calls or []) + part.calls or None
            tail, hit = g.stops.feed(tail)
            text += tail + ("" if hit else g.stops.flush())
        g.ended(reason)
        self.release(g)
        return Event(text, [token] if token is not None else [], g.finish_reason, g.timings, tool_calls=calls,
                     reasoning=reasoning)

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
        thoughts: list[str] = []
        last = Event("", [], "length", Timings())
        for ev in self.generate(prompt, request, **options):
            parts.append(ev.text)
            thoughts.append(ev.reasoning)
            tokens.extend(ev.tokens)
            deltas.extend(ev.tool_calls or ())
            last = ev
        return Completion(
            "".join(parts), tokens, last.finish_reason or "length", last.timings or Timings(), collect_calls(deltas),
            "".join(thoughts),
        )

    def chat(self, messages: list[dict], request: GenerationRequest | None = None, **options) -> Iterator[Event]:
        """Stream the answer to `messages`; `tools=[...]`, `tool_choice=...` and
        `parallel_tool_calls=...` (or a request carrying them) render the tools with the
        model's template and hold its calls to them."""
        request = request_or_options(request, options)
        prompt = self.chat_prompt(messages, tools=request.tools, template_kwargs=request.template_kwargs)
        return self.generate(prompt, request)
