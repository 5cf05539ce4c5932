"""One generation request, typed and bounded: what every entry point builds (the three
HTTP dialects, `localrun run`, the chat app, the Python API) and `Engine.start` takes.

    req = GenerationRequest(sampling=SamplingParams(temperature=0), max_tokens=64, stop=["\\n\\n"])
    req = prepare(engine, req)          # tokenizer and vocabulary work; a server runs it off the loop
    gen = engine.start(tokens, req)     # slot, KV trim, grammar matcher: nothing that grows with the request

Two steps, because they run in different places on a server. A `GenerationRequest` is
checked when it is made, so a bad field is a 400 before any model is touched.
`prepare(engine, request)` does the work that needs the model and grows with the
request's size or the vocabulary (text logit-bias keys tokenized, logit-bias ids checked
against the vocabulary, DRY's sequence breakers resolved, the grammar's tokenizer built,
every grammar compiled for it with its first mask) in a worker thread, so the scheduler
thread, which every stream of a model shares, only finds cache hits. `Engine.start`
prepares a request itself when its caller has not; on a prepared request that costs a
few dictionary look-ups.

Bounds, each a `BadRequestError` whose message starts with the field's name:

- `stop`: at most `MAX_STOP_STRINGS` = 16 strings of at most `MAX_STOP_CHARS` = 256
  characters. OpenAI allows 4; llama-server sets no limit, and the clients we serve
  (editors, chat front ends) send a handful. The stop matcher compares every stop string
  with the held tail of the text at every token, inside the step every stream of the
  model shares; at 16 x 256 (stops of 'a'/'b' fed random 'a'/'b' text, the matcher's
  worst case) that measured ~15 us a token.
- `max_tokens`: None (to the end of the context) or 0..`MAX_TOKENS_LIMIT` = 2**31 - 1,
  llama.cpp's int32 (llama-server's n_predict); the engine cuts it to the context anyway.
- `ignore_eos`: true or false.
- `lookup`: true, false or a `LookupConfig` (Python callers).
- `grammar`: a compiled `Grammar` or None; its source is capped where it is read, at
  `MAX_GRAMMAR_CHARS` = 262,144 characters (GBNF text, regex, or the JSON schema as
  JSON): a JSON schema for a dozen tools is a few tens of kilobytes, and llguidance's
  compile time grows with the grammar.
- `t_max_predict_ms` (llama-server's editor time budget; the scheduler enforces it): None
  or a finite number of milliseconds up to `MAX_T_MAX_PREDICT_MS` = 86,400,000 (a day);
  0 or less means no limit, as in llama-server.
- `reasoning_budget` (issue 50): None (unlimited) or 0..`MAX_TOKENS_LIMIT` tokens of
  reasoning, after which the engine writes the model's own end-of-thinking marker.
- `reasoning_format`: "auto" (reasoning apart from the answer, in `Event.reasoning`) or
  "none" (the raw text, reasoning markup and all, in the answer).
- `template_kwargs` (llama-server's `chat_template_kwargs`, e.g. `enable_thinking`):
  a JSON object of at most `MAX_TEMPLATE_KWARGS_BYTES` = 16 KiB whose keys are not the
  variables localrun itself gives the template (`messages`, `tools`, ...): a template
  reads a handful of flags, and the whole object is checked on the event loop.
- `n_indent` (llama.vim's indentation cut; the scheduler enforces it):
  0..`MAX_N_INDENT` = 1024 columns; no code indents deeper, and 1024 already cuts at
  every later line.

Bounds on the rest of a server request, checked by `localrun.server.fields` and the
dialects where the field is read, with the dialect's own name:

- `messages`: at most `MAX_MESSAGES` = 8192 (each message costs its chat template a few
  tokens of its own, so more would not fit even a 32k context; the cap bounds the checks
  that run on the event loop); a message's `content` given as parts: at most
  `MAX_CONTENT_PARTS` = 256 text parts; a `role`: at most `MAX_ROLE_CHARS` = 64 characters.
- `response_fields` (llama-server): at most `MAX_RESPONSE_FIELDS` = 64 names of at most
  `MAX_FIELD_NAME_CHARS` = 256 characters.
- a prompt given as token ids (OpenAI's `prompt`, Ollama's `context`): at most
  `MAX_PROMPT_TOKENS` = 1,048,576 ids (no model's context holds more), checked before
  the ids are scanned on the event loop; each id is then checked against the model's
  vocabulary with the prompt, off the loop.
- `input_extra` (llama.vim's context chunks): at most `MAX_INPUT_EXTRA` = 256 chunks
  (llama.vim's ring buffer holds 16 by default).
- `top_logprobs` / `logprobs` / `n_probs`: at most `MAX_TOP_LOGPROBS` = 20, OpenAI's
  limit and `SamplingParams`' own (`MAX_N_PROBS`): each one is a Python object per
  generated token in the answer. Read under each dialect's name, so the 400 names it.

The sampler's own bounds (logit-bias entries, DRY breakers, `samplers`, every number)
are `SamplingParams`' (localrun.sampling.declare).

Tool calls (issue 15): `tools` (Tool objects, or OpenAI's list, parsed by
`localrun.tools.parse_tools` with its bounds: 128 tools, 64 KiB a schema, 256 KiB in all),
`tool_choice` (None means "auto" when tools are given) and `parallel_tool_calls` sit next
to `grammar`, as the constraint they compile to, so they cannot be combined with one.
`prepare` builds the call grammar (cached per model and tool set) and compiles it for the
model's tokenizer, so a tool set the model cannot take fails before any answer starts.

Grammar compiles (issue 49): `prepare` compiles every grammar (GBNF, Lark, JSON schema,
regex, the call grammar) for the model's tokenizer and builds its first mask, within
llguidance's limits and `COMPILE_BUDGET_S` = 5 s (localrun.grammar.core) of compile time; a
compile past either is a 400 naming the field ('grammar', 'json_schema', 'regex' or
'tools'). Engine.start then copies the ready start state.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from .errors import BadRequestError, client_integer
from .grammar.core import COMPILE_BUDGET_S, Grammar
from .grammar.matcher import GrammarMatcher
from .grammar.tokenizer import build_tokenizer
from .sampling import SamplingParams
from .sampling.declare import MAX_N_PROBS
from .speculation.lookup import LookupConfig
from .tools import Tool, ToolChoice, parse_tool_choice, parse_tools

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_GRAMMAR_CHARS = 1 << 18
MAX_T_MAX_PREDICT_MS = 86_400_000
MAX_N_INDENT = 1024
MAX_TEMPLATE_KWARGS_BYTES = 1 << 14
REASONING_FORMATS = ("auto", "none")
# the variables localrun itself gives a chat template: a request cannot replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "bos_token", "eos_token", "add_generation_prompt"})

MAX_MESSAGES = 8192
MAX_CONTENT_PARTS = 256
MAX_ROLE_CHARS = 64
MAX_RESPONSE_FIELDS = 64
MAX_FIELD_NAME_CHARS = 256
MAX_INPUT_EXTRA = 256
MAX_PROMPT_TOKENS = 1 << 20
MAX_TOP_LOGPROBS = MAX_N_PROBS  # the sampler's own cap on n_probs, checked under each dialect's name

# the field a grammar of each kind came from, as far as prepare() knows it (a server's
# dialect names its own field, e.g. response_format, when it compiles the source)
_GRAMMAR_FIELD = {"gbnf": "grammar", "lark": "grammar", "json_schema": "json_schema", "regex": "regex"}


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one generation asks for besides its prompt, validated when made.

    `stop` is kept as a tuple and `lookup` as a `LookupConfig` (True/False become
    `LookupConfig(enabled=...)`), so two requests asking the same thing compare equal."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: to the end of the context
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    lookup: LookupConfig = field(default_factory=LookupConfig)
    grammar: Grammar | None = None  # the output constraint (not with tools: they make their own)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None  # None: "auto" when there are tools
    parallel_tool_calls: bool = True
    reasoning_budget: int | None = None  # tokens of reasoning before the engine ends it
    reasoning_format: str = "auto"  # "none": reasoning markup stays in the answer's text
    template_kwargs: dict = field(default_factory=dict)  # extra chat-template variables
    # token healing: the prompt's last text tokens are taken off and the answer's first
    # tokens must write their text again, which the answer's text does not repeat (a
    # fill-in-the-middle prompt, whose cursor may cut a word's token: server/fim.py;
    # prompt/healing.py says how far). Not with a grammar or tools.
    token_healing: bool = False
    # limits the server's scheduler enforces (llama-server's fields); the engine ignores them
    t_max_predict_ms: float | None = None
    n_indent: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise BadRequestError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        object.__setattr__(self, "max_tokens", _max_tokens(self.max_tokens))
        object.__setattr__(self, "stop", _stops(self.stop))
        if not isinstance(self.ignore_eos, bool):
            raise BadRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        object.__setattr__(self, "lookup", _lookup(self.lookup))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise BadRequestError(f"grammar must be a compiled Grammar, got {type(self.grammar).__name__}")
        tools = self.tools
        if not (isinstance(tools, tuple) and all(isinstance(t, Tool) for t in tools)):
            tools = parse_tools(tools, "tools")
        object.__setattr__(self, "tools", tools)
        object.__setattr__(self, "tool_choice", parse_tool_choice(self.tool_choice, tools, "tool_choice"))
        if not isinstance(self.token_healing, bool):
            raise BadRequestError(f"token_healing must be true or false, got {self.token_healing!r}")
        if not isinstance(self.parallel_tool_calls, bool):
            raise BadRequestError(f"parallel_tool_calls must be true or false, got {self.parallel_tool_calls!r}")
        if tools and self.grammar is not None:
            raise BadRequestError("'grammar' cannot be combined with 'tools' (nor response_format / json_schema / format)")
        object.__setattr__(self, "reasoning_budget", _reasoning_budget(self.reasoning_budget))
        if self.reasoning_format not in REASONING_FORMATS:
            raise BadRequestError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {self.reasoning_format!r}")
        object.__setattr__(self, "template_kwargs", check_template_kwargs(self.template_kwargs))
        object.__setattr__(self, "t_max_predict_ms", _time_budget(self.t_max_predict_ms))
        object.__setattr__(self, "n_indent", _n_indent(self.n_indent))

    @classmethod
    def of(cls, **options) -> "GenerationRequest":
        """From keyword options, as the Python API spells them: sampling, max_tokens,
        stop, ignore_eos, lookup, grammar, tools, tool_choice, parallel_tool_calls (None
        for any of them means its default)."""
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in options.items() if v is not None})


def _count(v, name: str, most: int, kind: str = "an integer") -> int:
    """`v` as an integer in 0..most; the errors start with the field's name and say it
    must be `kind`."""
    n = client_integer(v)
    if n is None:
        raise BadRequestError(f"{name} must be {kind}, got {v!r}")
    if not 0 <= n <= most:
        raise BadRequestError(f"{name} must be in 0..{most}, got {n}")
    return n


def _max_tokens(v) -> int | None:
    return None if v is None else _count(v, "max_tokens", MAX_TOKENS_LIMIT)


def _stops(v) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)):
        raise BadRequestError(f"stop must be a string or a list of strings, got {type(v).__name__}")
    if len(items) > MAX_STOP_STRINGS:
        raise BadRequestError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise BadRequestError(f"stop[{i}] must be a string, got {type(s).__name__}")
        if len(s) > MAX_STOP_CHARS:
            raise BadRequestError(f"stop[{i}] must be at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return tuple(s for s in items if s)  # an empty stop string would end every answer at once


def _lookup(v) -> LookupConfig:
    if isinstance(v, LookupConfig):
        return v
    if not isinstance(v, bool):
        raise BadRequestError(f"lookup must be true or false, got {v!r}")
    return LookupConfig(enabled=v)


def _reasoning_budget(v) -> int | None:
    return None if v is None else _count(v, "reasoning_budget", MAX_TOKENS_LIMIT, "an integer number of tokens")


def check_template_kwargs(v) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequestError(f"chat_template_kwargs must be a JSON object, got {type(v).__name__}")
    try:
        size = len(json.dumps(v, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        raise BadRequestError("chat_template_kwargs must hold only JSON values (strings, numbers, booleans, null, lists, objects)") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise BadRequestError(f"chat_template_kwargs must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON, got {size}")
    taken = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(v))
    if taken:
        raise BadRequestError(f"chat_template_kwargs cannot set {', '.join(taken)}: localrun gives the template those itself")
    return dict(v)


def with_thinking_aliases(kwargs: dict) -> dict:
    """`enable_thinking` (the name every dialect's switch arrives under) also under the
    names other templates read: `thinking` (Granite 3.x; DeepSeek-V3.1's own template,
    where llama.cpp's copy maps enable_thinking itself) and, when off, ByteDance Seed-OSS's
    `thinking_budget: 0`. A name the caller set stays as set; one a template does not
    read changes nothing."""
    if "enable_thinking" not in kwargs:
        return kwargs
    on = kwargs["enable_thinking"]
    return {"thinking": on, **({"thinking_budget": 0} if on is False else {}), **kwargs}


def _time_budget(v) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequestError(f"t_max_predict_ms must be a finite number of milliseconds, got {v!r}")
    if v > MAX_T_MAX_PREDICT_MS:
        raise BadRequestError(f"t_max_predict_ms must be at most {MAX_T_MAX_PREDICT_MS} (a day), got {v}")
    return float(v)


def _n_indent(v) -> int:
    return _count(v, "n_indent", MAX_N_INDENT)


# -- preparing a request for one model ------------------------------------------------


def prepare(engine, request: GenerationRequest, prompt=None) -> GenerationRequest:
    """`request` ready for `engine.start` to take in O(1): what needs the model's
    tokenizer or vocabulary is done here, and what is cached per model is warmed. A server
    calls this in a worker thread; calling it again on its result is cheap (cache hits).
    `engine` is an `Engine` (its backend, info and token_text); `prompt`: the prompt's
    token ids, whose end says whether the template opened or closed a reasoning block
    (the call grammar allows one or not; see localrun.tools.model)."""
    sampling = prepare_sampling(engine, request.sampling)
    grammar = request.grammar
    if request.tools:
        # built once per model, tool set and reasoning state; raises ToolsUnsupportedError
        # without tool support
        grammar = engine.tools.grammar(request.tools, request.tool_choice, request.parallel_tool_calls, prompt=prompt)
    if grammar is not None:
        info = engine.info
        if info.eos_id is None and not info.stop_ids:
            raise BadRequestError("this model has no end-of-sequence token, so it cannot follow a grammar")
        tokenizer = build_tokenizer(engine.backend)  # built once per model (seconds on a large vocabulary)
        where = "tools" if request.tools else _GRAMMAR_FIELD.get(grammar.kind, "grammar")
        try:
            # every grammar, the request's own and the tools' call grammar, is compiled for
            # the tokenizer here with its first mask (on the compile thread, within
            # llguidance's limits and COMPILE_BUDGET_S; cached on the Grammar), so that
            # Engine.start on the scheduler thread only copies a ready start state
            grammar.compile(tokenizer, budget_s=COMPILE_BUDGET_S)
            GrammarMatcher(grammar, tokenizer)  # a compile error (over a limit, a token this vocabulary lacks) is a 400 here
            if grammar.kind == "json_schema" and not request.tools:
                engine.budget_tokens()  # the vocabulary's closing tokens, read once per model (json_budget)
        except BadRequestError as exc:
            raise BadRequestError(f"'{where}': {exc}") from None
    if request.token_healing and grammar is None:
        engine.token_text.index(int(engine.info.n_vocab))  # built once per model (~0.2 s on 262k tokens)
    return request if sampling is request.sampling else dataclasses.replace(request, sampling=sampling)


def prepare_sampling(engine, p: SamplingParams) -> SamplingParams:
    """Text logit-bias keys turned into token ids (llama-server's rule: every token of the
    text, tokenized as plain text, gets the bias), every id checked against the
    vocabulary (an id past it once failed every stream of the model), and DRY's sequence
    breakers resolved into the model's cache."""
    n_vocab = int(engine.info.n_vocab)
    p = p.with_text_bias(lambda text: engine.backend.tokenize(text, add_special=False, parse_special=False))
    p.check_vocab(n_vocab)
    if p.dry_on and "dry" in p.order:
        # the Sampler asks the same shared TokenText for these on its first DRY step, where
        # it is then a cache hit instead of a scan of the vocabulary per breaker
        engine.token_text.breakers(p.dry_sequence_breakers, n_vocab)
    return p


def request_or_options(request: GenerationRequest | None, options: dict) -> GenerationRequest:
    """`Engine.start`'s two spellings: a GenerationRequest, or its fields as keywords."""
    if request is None:
        return GenerationRequest.of(**options)
    if options:
        raise TypeError(f"pass a GenerationRequest or keyword options, not both (got {', '.join(sorted(options))})")
    if not isinstance(request, GenerationRequest):
        raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
    return request

