"""Constrained decoding: one token-mask engine (llguidance) for every backend.

    tok = build_tokenizer(backend)                 # once per model; cached (`tokenizer`)
    g = Grammar.from_json_schema({"type": "object"})  # or from_gbnf / from_regex / ... (here)
    g.compile(tok)                                 # optional: where blocking is fine
    m = GrammarMatcher(g, tok)                     # one per generation (`matcher`)
    row = m.apply(row)                             # disallowed tokens -> -inf
    m.accept(token)                                # after sampling
    m.is_done()                                    # nothing but EOS can follow

Why llguidance: its masks come from a token trie walked by a lazy lexer, ~0.1-0.2 ms
per token for JSON even on a 262k vocabulary, and it reads GBNF (via its Lark dialect),
JSON schema and regex. It needs only each token's bytes, so the tokenizer is built from the
backend seam (`token_bytes`, `is_control`) and is the same for llama.cpp and MLX.

A `Grammar` is tokenizer-free and validated when made, so a bad grammar fails before
any model work, as `BadRequestError` with one line naming line and column where the
source gives them. A `GrammarMatcher` (`matcher`) holds per-generation state.

Bounded work, since a grammar comes from a request: sources are size-capped (MAX_*
below) before any parsing; the GBNF pre-processing here is linear; llguidance compiles
under its limits (LEXER_FUEL ...) on a compile thread with a deep stack, tries the first
steps on a byte vocabulary while validating, and never walks ahead through fixed text.

One constructor: every grammar text localrun hands llguidance is made by `lark_spec`
(request GBNF, Lark, JSON schemas, regexes, json_object, the tool-call grammar, and
whatever a server dialect builds through these classmethods), which sets llguidance's
options (LLG_OPTIONS) after the request's text so a request can never set them; JSON
layouts (bounded whitespace) are set the same way by `json_schema_layout`.
tests/test_grammar_options.py scans the source tree for any other builder.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import BadRequestError, parse_client_json
from .gbnf import gbnf_to_lark_text, place_in_gbnf

try:
    import llguidance as _llg
except ImportError as exc:  # pragma: no cover - depends on the install
    _llg = None
    _IMPORT_ERROR = exc


def _need_llg():
    if _llg is None:
        raise BadRequestError(f"grammars need llguidance ({_IMPORT_ERROR}); run: pip install llguidance")
    return _llg


# -- limits ---------------------------------------------------------------------------
# Sizes are checked before any parsing. Real grammars sit far below them (llama.cpp's
# example grammars are 0.1-1.4 KiB); each cap is where the worst input of that size still
# validates in well under a second here (numbers in tests/test_grammar_limits.py).

MAX_GRAMMAR_BYTES = 128 * 1024  # GBNF or Lark source, UTF-8
MAX_REGEX_BYTES = 16 * 1024  # a `regex` constraint (a JSON schema's `pattern`s count in the schema)
MAX_SCHEMA_BYTES = 256 * 1024  # a JSON schema, serialized
MAX_SCHEMA_DEPTH = 100  # nested JSON objects/arrays in a schema (llguidance's parser stops at 128)

# llguidance's own budget (LLParserLimits; its unit of lexer work is "fuel"). The lexer
# is built lazily, at the first mask: validation builds it once on a byte vocabulary, so a
# grammar over LEXER_FUEL is refused then. With forcing off (LLG_OPTIONS below) nested
# repeats such as `a{1000}{1000}` cost ~0.1 ms a mask; the largest enum the size caps admit
# (20,000 entries, 250 KiB) validates in ~0.2 s at LEXER_FUEL.
LEXER_FUEL = 1_000_000  # building the lexer (~50k/ms): llguidance's default
STEP_LEXER_FUEL = 200_000  # lexer work per mask (~14 ms): llguidance's default
STEP_MAX_ITEMS = 50_000  # Earley items per mask (~2.5 ms): llguidance's default
MAX_LEXER_STATES = 50_000  # lexer states a compiled grammar may build, ~1-2 KiB each (default 250,000)

# llguidance's compiler recurses once per rule reference (a chain `a: b`, `b: c`, ... or
# of JSON-schema `$ref`s), using ~3 KiB of stack per level: a default 8 MiB thread stack
# overflows (a segfault: the whole server dies) near 2,800 levels, which 30 KiB of
# grammar reaches. Compiles run on threads with this stack instead; the largest chain the
# size caps admit (~15,000 levels) needs ~45 MiB. Address space only: pages are touched
# only as deep as a compile goes.
COMPILE_STACK_BYTES = 256 * 1024 * 1024
COMPILE_THREADS = 2

# llguidance "forces" text a grammar fixes: while one byte is possible it walks ahead and
# lets the model take only that text's canonical tokens. The walk has no limit: `R{10000}`
# with `R: /[a]{10000}/` (35 bytes) walks 10^8 bytes per mask, 2.9 s and 1.6 GB, on the
# decode thread. Every grammar here turns it off: each tokenization of fixed text is then
# allowed, as in llama.cpp's own grammar sampler, and as `GrammarMatcher.allows` (the
# engine's fast path, which never tokenizes forced text) accepted already. It is one of
# LLG_OPTIONS, which `lark_spec` sets on every grammar.

# Compiling for a model's tokenizer (and its first mask) runs in `request.prepare`, off
# the scheduler thread; a compile still running after this long (measured from when it
# starts on a compile thread) answers its request with a 400 naming the field. The
# limits above bound it already (the slowest legal compile measured ~0.3 s, a 256 KiB
# enum on a 262k vocabulary); this is the backstop for what they do not count.
COMPILE_BUDGET_S = 5.0


# -- llguidance's options: localrun's, never a request's --------------------------------

# A Lark grammar's `%llguidance {...}` lines set these; llguidance merges the lines in
# order, the last value of each key winning. `lark_spec` puts this line after all of a
# request's text, so it is always the last word; a request's own options line may only
# repeat these values (`%llguidance {}`, llama.cpp's "this is Lark" mark, is the usual
# one), else it is refused: `{"no_forcing": false}` turned the unbounded walk back on
# (a 58-byte grammar froze a server for ~100 s and took 13 GiB).
#   no_forcing: see above.
#   allow_invalid_utf8: false keeps every answer valid UTF-8 (true lets a grammar's
#     terminals match any bytes).
LLG_OPTIONS = {"no_forcing": True, "allow_invalid_utf8": False}
_OPTIONS_LINE = "%llguidance " + json.dumps(LLG_OPTIONS) + "\n"
_OPTIONS_MENTION = re.compile(r"%llguidance", re.I)
_JSON_SPACE = re.compile(r"\s*")
_MAX_OPTIONS_MENTIONS = 16  # a grammar needs at most one options line


def lark_spec(text: str, *, from_request: bool = True) -> str:
    """llguidance's grammar text for the Lark grammar `text`, with localrun's options: the
    one constructor every grammar localrun compiles goes through (tests/test_grammar_options.py
    fails on any other). `from_request`: `text` holds a request's Lark as written, whose
    `%llguidance` lines are checked (GBNF converted here, JSON and regexes spliced into
    localrun's own rules cannot hold a statement, and their strings may spell anything).
    The options line goes last, so line numbers in llguidance's errors are the text's own."""
    if from_request:
        _check_request_options(text)
    return _need_llg().LLMatcher.grammar_from_lark(f"{text}\n{_OPTIONS_LINE}")


def _check_request_options(text: str) -> None:
    """A BadRequestError for an `%llguidance {...}` in a request's Lark that sets anything
    other than LLG_OPTIONS' own values. Every mention is read, wherever it stands (a
    statement inside a nested `%lark {...}` block applies to that block, where the line
    `lark_spec` appends does not reach); one inside a string or comment that spells an
    options object is refused too, which costs nothing real. Text after a mention that is
    not a JSON object cannot be an options statement llguidance accepts."""
    decoder = json.JSONDecoder(object_pairs_hook=list)
    for n, m in enumerate(_OPTIONS_MENTION.finditer(text)):
        if n == _MAX_OPTIONS_MENTIONS:  # each is read to the end of its JSON: keep that work linear
            raise BadRequestError(f"bad Lark grammar: it mentions %llguidance over {_MAX_OPTIONS_MENTIONS} times")
        at = _JSON_SPACE.match(text, m.end()).end()
        if not text.startswith("{", at):
            continue
        try:
            pairs, _ = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):  # not an options object llguidance reads either
            continue
        bad = [(k, v) for k, v in pairs if not (k in LLG_OPTIONS and v is LLG_OPTIONS[k])]
        if bad:
            line = text.count("\n", 0, m.start()) + 1
            shown = json.dumps(dict(bad))
            raise BadRequestError(
                f"bad Lark grammar at line {line}: %llguidance may not set {shown[:80]}; localrun sets llguidance's"
                f" options itself ({json.dumps(LLG_OPTIONS)}): write %llguidance {{}} or leave the line out"
            )


# JSON output may put, between any two of its tokens, at most one newline and then up to
# 20 spaces or tabs: compact `{"a":1}` and pretty-printed output indented up to 20
# columns fit, as in llama.cpp's schema grammars (`space ::= | " " | "\n" [ \t]{0,20}`);
# runs of newlines do not (llguidance's default takes any whitespace, and a sampled
# answer could wander into blank lines until max_tokens cut it as invalid JSON).
# llguidance matches the pattern at most once at each place whitespace may stand.
JSON_WHITESPACE = r"[\n]?[ \t]{0,20}"
BOUNDED_JSON_LAYOUT = {"whitespace_pattern": JSON_WHITESPACE, "item_separator": ",", "key_separator": ":"}
# a schema's own `x-guidance` keeps only these (what the JSON may say, not how it is
# laid out); its layout keys (whitespace_flexible, whitespace_pattern, the separators,
# which are regexes) are localrun's
_SCHEMA_OWN_OPTIONS = ("coerce_one_of", "lenient", "json_allowed_escapes")


def json_schema_layout(schema: dict | bool, layout: dict | None = None) -> dict | bool:
    """`schema` with localrun's JSON options (llguidance reads them from the top-level
    `x-guidance` key): `layout` (BOUNDED_JSON_LAYOUT when None: bounded whitespace) replaces any
    layout the schema sets. `True` becomes `{}` so that it can carry them; `False` matches
    nothing and has no layout."""
    if schema is False:
        return schema
    schema = {} if schema is True else schema
    own = schema.get("x-guidance")
    options = {k: own[k] for k in _SCHEMA_OWN_OPTIONS if k in own} if isinstance(own, dict) else {}
    return {**schema, "x-guidance": {**options, **(BOUNDED_JSON_LAYOUT if layout is None else layout)}}


# -- compiling within the budget ------------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _limits():
    return _need_llg().LLParserLimits(
        initial_lexer_fuel=LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
        max_lexer_states=MAX_LEXER_STATES,
    )


def _on_compile_thread(fn: Callable, *args, budget_s: float | None = None):
    """fn(*args) on a thread with a COMPILE_STACK_BYTES stack; its result or its exception.
    The caller blocks meanwhile (llguidance releases the GIL while it compiles). With
    `budget_s`, a BadRequestError once fn has run that long (counted from when it starts,
    not from a wait in the pool's queue); fn runs on to its end, within llguidance's
    limits, and its result is dropped."""
    global _pool
    if threading.current_thread().name.startswith("grammar-compile"):
        return fn(*args)
    started = threading.Event()

    def run():
        started.set()
        return fn(*args)

    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        # the stack size is a process-wide setting read when a thread starts, and the pool
        # starts its threads inside submit(): set it only around that call
        before = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            future = _pool.submit(run)
        finally:
            threading.stack_size(before)
    if budget_s is None:
        return future.result()
    started.wait()
    try:
        return future.result(timeout=budget_s)
    except TimeoutError:
        raise BadRequestError(
            f"the grammar took over {budget_s:g} s to compile for this model (COMPILE_BUDGET_S): simplify it"
        ) from None


class _ByteVocab:
    """256 one-byte tokens and an EOS: spells any text, to try a grammar without a model."""

    tokens, special_token_ids, eos_token_id, bos_token_id = [bytes([b]) for b in range(256)] + [b""], [256], 256, None

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _byte_tokenizer():
    llg = _need_llg()
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab()), n_vocab=257, eos_token=[256])


# `<|name|>` and `<[id]>` name tokens of a model's vocabulary, which the byte probe lacks
_TOKEN_REF = re.compile(r"<\[|<\|")


def _compile_error(spec: str, probe: bool) -> str:
    """"" when llguidance compiles `spec` within the limits, else its error. With `probe`,
    also take two steps on the byte vocabulary: llguidance builds its lexer and first
    Earley rows lazily, so a grammar over LEXER_FUEL or a row limit, or one that matches
    no text, fails here rather than at the first decode step of a generation."""
    llg = _llg
    err = llg.LLMatcher.validate_grammar(spec, limits=_limits())
    if err or not probe:
        return err
    m = llg.LLMatcher(_byte_tokenizer(), spec, log_level=0, limits=_limits())
    for step in range(2):
        mask = m.compute_bitmask()
        if m.is_error():
            err = m.get_error()
            # nothing allowed, EOS included, before any text: no finite text fits
            return "the grammar matches no text" if step == 0 and err.startswith("NoExtension") else err
        bytes_allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:256])
        if not bytes_allowed.size:  # only EOS: the grammar is complete
            return ""
        m.consume_token(int(bytes_allowed[0]))
    return m.get_error()


def _budget_hint(err: str) -> str:
    """What to do, when llguidance's error is one of its limits."""
    if re.search(r"too (big|many|complex)|fuel|limit", _first_line(err), re.I):
        return (f" (over localrun.grammar.core's compile limits, such as LEXER_FUEL={LEXER_FUEL:,}:"
                " use fewer alternatives or smaller nested repeat counts)")
    return ""


def _check_size(text: str, limit: int, what: str, constant: str) -> None:
    n = len(text)
    if n * 4 > limit:  # a character is at most 4 UTF-8 bytes: count only when it matters
        n = len(text.encode("utf-8", "replace"))
    if n > limit:
        raise BadRequestError(f"the {what} is {n:,} bytes; the limit is {limit:,} ({constant}): shorten it")


# -- grammar sources --------------------------------------------------------------------

_AT = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")  # llguidance's Lark error prefix: line(column)


def _first_line(msg: str) -> str:
    return (msg.strip().splitlines() or ["invalid grammar"])[0]


def _regex_detail(msg: str) -> str:
    """Rust regex errors span lines (pattern, carets, `error: ...`); fold into one."""
    lines = msg.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("error: "):
            col = lines[i - 1].find("^") - 3 if i >= 2 else 0  # the pattern is indented 4
            return line[7:] + (f" (regex column {col})" if col > 0 else "")
    return ""


def _lark_error(msg: str) -> tuple[int, int, str]:
    """(line, column, one-line message) of a Lark validation error; 0s when unplaced."""
    head = _first_line(msg)
    at = _AT.match(head)
    detail = _regex_detail(msg)
    if at is None:
        return 0, 0, head + (f": {detail}" if detail and detail not in head else "")
    text = head[at.end():]
    if detail:
        text = text.split(" (in regex)")[0].split(": regex parse error")[0] + ": " + detail
    return int(at.group(1)), int(at.group(2)), text


_TOO_DEEP = (f"the JSON schema nests objects and arrays over {MAX_SCHEMA_DEPTH} deep (MAX_SCHEMA_DEPTH):"
             " flatten it, or name repeated parts in $defs and use $ref")


def _check_schema_shape(schema: Any) -> None:
    """Depth and node count of a parsed schema, walked without recursion (json.dumps
    recurses, and a schema 1,000 levels deep would end it in RecursionError)."""
    stack, nodes = [(schema, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1  # each serializes to at least one byte
        if nodes > MAX_SCHEMA_BYTES:
            raise BadRequestError(f"the JSON schema is over {MAX_SCHEMA_BYTES:,} bytes (MAX_SCHEMA_BYTES): shorten it")
        if isinstance(node, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise BadRequestError(_TOO_DEEP)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def _compile_matcher(spec: str, tokenizer) -> tuple[Any, np.ndarray | None]:
    """The start state for `tokenizer` and its mask (bool [n_vocab], read-only), built
    here so that no decode step builds the lexer or the first mask; no mask on an error."""
    m = _llg.LLMatcher(tokenizer, spec, log_level=0, limits=_limits())
    if m.is_error():
        return m, None
    n_vocab = int(tokenizer.vocab_size)
    words = np.empty((n_vocab + 31) // 32, np.int32)
    m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if m.is_error():
        return m, None
    mask = np.unpackbits(words.view(np.uint8), bitorder="little", count=n_vocab).view(np.bool_)
    mask.flags.writeable = False  # shared by every matcher of this grammar
    return m, mask


@dataclass(frozen=True)
class Grammar:
    """A validated grammar, independent of any tokenizer.

    kind: "gbnf" | "lark" | "json_schema" | "regex"; source: what the user gave;
    spec: llguidance's grammar text (what `LLMatcher` compiles).
    """

    kind: str
    source: str
    spec: str
    # id(tokenizer) -> (tokenizer, matcher compiled for it in its start state, that state's
    # mask); see compile()
    _compiled: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # a spec made anywhere but lark_spec would run without localrun's options
        if not (isinstance(self.spec, str) and self.spec.endswith(_OPTIONS_LINE)):
            raise ValueError("a Grammar's spec must be made by localrun.grammar.core.lark_spec (it sets llguidance's options)")

    @classmethod
    def from_gbnf(cls, text: str) -> "Grammar":
        """llama.cpp GBNF (start rule `root`). Text whose first line is `%llguidance`
        is taken as llguidance Lark, as llama.cpp's own llguidance build does."""
        _check_size(text, MAX_GRAMMAR_BYTES, "grammar", "MAX_GRAMMAR_BYTES")
        if re.match(r"\s*%llguidance\b", text):
            return cls.from_lark(text)
        lark = gbnf_to_lark_text(text)
        spec = lark_spec(lark, from_request=False)  # the converter writes no %llguidance line
        err = _on_compile_thread(_compile_error, spec, True)
        if err:
            line, col, what = _lark_error(err)
            raise BadRequestError(f"bad GBNF grammar{place_in_gbnf(text, lark, line, col)}: {what}{_budget_hint(err)}")
        return cls("gbnf", text, spec)

    @classmethod
    def from_lark(cls, text: str) -> "Grammar":
        """llguidance's Lark dialect (start rule `start`; `<|name|>` / `<[id]>` tokens).
        A grammar that names tokens skips the byte-vocabulary probe (the probe has none
        of a model's tokens); its lexer's budget is then met when a matcher is built.
        Its `%llguidance` lines may only say `{}` (see LLG_OPTIONS)."""
        _check_size(text, MAX_GRAMMAR_BYTES, "grammar", "MAX_GRAMMAR_BYTES")
        spec = lark_spec(text)
        err = _on_compile_thread(_compile_error, spec, _TOKEN_REF.search(text) is None)
        if err:
            line, col, what = _lark_error(err)
            where = f" at line {line}, column {col}" if line else ""  # the spec's lines are the text's
            raise BadRequestError(f"bad Lark grammar{where}: {what}{_budget_hint(err)}")
        return cls("lark", text, spec)

    @classmethod
    def from_json_schema(cls, schema: dict | str | bool, *, layout: dict | None = None) -> "Grammar":
        """JSON matching the schema (`True` or `{}`: any JSON value), laid out as `layout`
        says (llguidance's x-guidance keys; None: BOUNDED_JSON_LAYOUT, bounded whitespace), which
        replaces any layout in the schema's own `x-guidance`."""
        if isinstance(schema, str):
            _check_size(schema, MAX_SCHEMA_BYTES, "JSON schema", "MAX_SCHEMA_BYTES")
            schema = parse_client_json(
                schema,
                lambda exc: f"the JSON schema is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                _TOO_DEEP,
            )
        if not isinstance(schema, (dict, bool)):
            raise BadRequestError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        _check_schema_shape(schema)
        text = json.dumps(schema)
        _check_size(text, MAX_SCHEMA_BYTES, "JSON schema", "MAX_SCHEMA_BYTES")
        # JSON text cannot hold a Lark statement: its strings stay inside `%json {...}`
        spec = lark_spec(f"start: %json {json.dumps(json_schema_layout(schema, layout))}", from_request=False)
        err = _on_compile_thread(_compile_error, spec, True)
        if err:
            detail = _regex_detail(err)
            what = _AT.sub("", _first_line(err), count=1).removeprefix("failed to compile JSON schema: ")
            raise BadRequestError(f"bad JSON schema: {what}" + (f" {detail}" if detail else "") + _budget_hint(err))
        return cls("json_schema", text, spec)

    @classmethod
    def from_regex(cls, pattern: str) -> "Grammar":
        """Output that fully matches the pattern (Rust regex syntax; \\d means [0-9])."""
        _check_size(pattern, MAX_REGEX_BYTES, "regex", "MAX_REGEX_BYTES")
        llg = _need_llg()
        # keep \d \w \s ASCII, as users of JSON-schema style patterns expect; regex_to_lark
        # escapes "/" and newlines, so the pattern stays inside its /.../
        spec = lark_spec(f"start: /{llg.regex_to_lark(pattern, 'dws')}/", from_request=False)
        err = _on_compile_thread(_compile_error, spec, True)
        if err:
            shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
            raise BadRequestError(f"bad regex {shown!r}: {_regex_detail(err) or _first_line(err)}{_budget_hint(err)}")
        return cls("regex", pattern, spec)

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object: OpenAI `response_format: {type: json_object}`, Ollama `format: "json"`."""
        return cls.from_json_schema({"type": "object"})

    def compile(self, tokenizer, budget_s: float | None = None) -> None:
        """Compile for this tokenizer now, with the first mask (bounded by the limits above,
        on a compile thread; with `budget_s`, a BadRequestError past that many seconds), so
        that `GrammarMatcher(self, tokenizer)` then costs a copy. `request.prepare` calls
        it off the scheduler thread; without it, the first matcher compiles."""
        self._start_state(tokenizer, budget_s)

    def _start_state(self, tokenizer, budget_s: float | None = None):
        """(start matcher, its mask or None) for `tokenizer`, compiled once."""
        hit = self._compiled.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:  # an id can be reused by a new object
            hit = (tokenizer, *_on_compile_thread(_compile_matcher, self.spec, tokenizer, budget_s=budget_s))
            self._compiled[id(tokenizer)] = hit
        return hit[1], hit[2]
