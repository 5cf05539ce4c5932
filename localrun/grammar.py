"""Constrained decoding: one token-mask engine (llguidance) for every backend.

    tok = build_tokenizer(backend)                 # once per model; cached
    g = Grammar.from_json_schema({"type": "object"})  # or from_gbnf / from_regex / ...
    m = GrammarMatcher(g, tok)                     # one per generation
    row = m.apply(row)                             # disallowed tokens -> -inf
    m.accept(token)                                # after sampling
    m.is_done()                                    # nothing but EOS can follow

Why llguidance: its masks come from a token trie walked by a lazy lexer, ~0.1-0.2 ms
per token for JSON even on a 262k vocabulary, and it reads GBNF (via its Lark dialect),
JSON schema and regex. It needs only each token's bytes, so the tokenizer is built from the
backend seam (`token_bytes`, `is_control`) and is the same for llama.cpp and MLX.

A `Grammar` is tokenizer-free and validated when made, so a bad grammar fails before
any model work, as `BadRequestError` with one line naming line and column where the
source gives them. A `GrammarMatcher` holds per-generation state.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import BadRequestError

try:
    import llguidance as _llg
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
except ImportError as exc:  # pragma: no cover - depends on the install
    _llg = None
    _IMPORT_ERROR = exc


def _need_llg():
    if _llg is None:
        raise BadRequestError(f"grammars need llguidance ({_IMPORT_ERROR}); run: pip install llguidance")
    return _llg


# -- tokenizer ------------------------------------------------------------------------

# backend -> (special_names key, tokenizer); weak, so a dropped backend frees its entry
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, tuple[dict, Any]]" = weakref.WeakKeyDictionary()


class _Vocab:
    """The duck type `llguidance.TokenizerWrapper` reads. It holds the backend weakly:
    the cache maps backend -> tokenizer -> this, and a strong link would pin the backend."""

    def __init__(self, backend, tokens: list[bytes], specials: list[int], eos: int, bos: int | None) -> None:
        self._backend = weakref.ref(backend)
        self.tokens = tokens
        self.special_token_ids = specials
        self.eos_token_id = eos
        self.bos_token_id = bos

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance tokenizes a few strings (a probe, a grammar's forced prefix), as bytes
        backend = self._backend()
        if backend is None:
            return []
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return backend.tokenize(text, add_special=False, parse_special=False)


def build_tokenizer(backend, special_names: dict[int, str] | None = None):
    """An `llguidance.LLTokenizer` for the backend's vocabulary, cached per backend.

    Control tokens (and any token with no bytes) become llguidance "special" tokens: they
    never match grammar text, only an explicit reference such as `<|im_end|>` or
    `<[2]>` in a Lark grammar. Named references need `special_names` ({id: text}); when
    it is None the backend's optional `token_text(id)` supplies them, else only `<[id]>`
    works. EOS for the grammar is every id in `info.stop_ids` (or `info.eos_id`).
    Building costs ~0.3 s on a 49k vocabulary and 2-3 s on Gemma's 262k (2 busy cores).
    """
    llg = _need_llg()
    key = None if special_names is None else tuple(sorted(special_names.items()))
    hit = _TOKENIZERS.get(backend)
    if hit is not None and hit[0] == key:
        return hit[1]
    info = backend.info
    n = int(info.n_vocab)
    token_text = getattr(backend, "token_text", None) if special_names is None else None
    names = dict(special_names or {})
    specials: list[int] = []
    tokens: list[bytes] = []
    for t in range(n):
        piece = backend.token_bytes(t)
        # an empty non-control token would match anywhere without moving the parser:
        # make it special too, so only a grammar that names it can produce it
        if backend.is_control(t) or not piece:
            specials.append(t)
            name = names.get(t) or (token_text(t) if callable(token_text) else "")
            piece = b"\xff" + name.encode() if name else b""
        tokens.append(piece)
    eos = sorted(info.stop_ids) or ([info.eos_id] if info.eos_id is not None else [])
    if not eos:
        raise BadRequestError(f"{info.path} has no end-of-sequence token; grammars need one")
    vocab = _Vocab(backend, tokens, specials, eos[0], info.bos_id)
    tok = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n, eos_token=eos)
    _TOKENIZERS[backend] = (key, tok)
    return tok


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


def _line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def _blank_quoted(text: str) -> str:
    """GBNF text with literals, char classes and comments blanked (same offsets), so a
    search for a rule name finds references, not strings that happen to spell it."""
    return re.sub(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', lambda m: " " * len(m.group()), text)


_START_ALIAS = "st4rt"


def _gbnf_rules(text: str) -> dict[str, tuple[str, int]]:
    """Lark rule name (as llguidance's converter renames it, lower case) -> (GBNF name,
    offset of its definition)."""
    out = {}
    for m in re.finditer(r"(?m)^[ \t]*([A-Za-z0-9_-]+)[ \t]*::=", _blank_quoted(text)):
        name = m.group(1)
        lark = re.sub(r"([a-z])([A-Z])", r"\1_\2", name.replace("-", "_")).lower()
        out.setdefault({"root": "start", "start": _START_ALIAS}.get(name, lark), (name, m.start(1)))
    return out


def _place_in_gbnf(text: str, lark: str, line: int, col: int) -> str:
    """' at line L, column C (rule 'r')' in the GBNF source for an error that llguidance
    placed in the converted Lark, or "" when it cannot be traced back."""
    lark_lines = lark.splitlines()
    if not 0 < line <= len(lark_lines):
        return ""
    head = next((l for l in reversed(lark_lines[:line]) if re.match(r"\w+:", l)), "")
    rule = _gbnf_rules(text).get(head.split(":")[0].lower())
    if rule is None:
        return ""
    name, offset = rule
    # the Lark item at the error (`"a"{2,1}`, `/[z-a]/`) mostly appears verbatim in the GBNF
    item = lark_lines[line - 1][max(col - 1, 0):].split(" ")[0].strip("/")
    found = text.find(item, offset) if item else -1
    at_line, at_col = _line_col(text, found if found >= 0 else offset)
    return f" at line {at_line}, column {at_col} (rule '{name}')"


def _gbnf_to_lark(text: str) -> str:
    # the converter renames `root` to Lark's `start`: rename a user's own `start` first,
    # to a name of the same length so that every error offset stays right
    for m in re.finditer(r"(?<![\w-])start(?![\w-])", _blank_quoted(text)):
        text = text[: m.start()] + _START_ALIAS + text[m.end():]
    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as exc:
        line, col = _line_col(exc.pos.text, exc.pos.pos)
        what = str(exc)[: -len(f" at {exc.pos}")] or str(exc)
        if exc.pos.current() in ("<", "!"):
            what = ("token references (<...>, !<...>) are not supported in GBNF here;"
                    " write the grammar in Lark syntax (first line: %llguidance {}), where"
                    " <|name|>, <[id]> and <[^id]> work")
        raise BadRequestError(f"bad GBNF grammar at line {line}, column {col}: {what}") from None
    except Exception as exc:  # the converter's name checks raise a plain Exception
        msg = str(exc)
        m = re.match(r"Rule '([^']+)' not found", msg)
        if m:
            ref = re.search(rf"(?<![\w-]){re.escape(m.group(1))}(?![\w-])", _blank_quoted(text))
            if ref:
                line, col = _line_col(text, ref.start())
                name = "start" if m.group(1) == _START_ALIAS else m.group(1)
                raise BadRequestError(f"bad GBNF grammar at line {line}, column {col}: undefined rule '{name}'") from None
        if msg == "No 'root' rule found":
            msg = "no 'root' rule (the rule generation starts from)"
        raise BadRequestError(f"bad GBNF grammar: {msg}") from None


@dataclass(frozen=True)
class Grammar:
    """A validated grammar, independent of any tokenizer.

    kind: "gbnf" | "lark" | "json_schema" | "regex"; source: what the user gave;
    spec: llguidance's grammar text (what `LLMatcher` compiles).
    """

    kind: str
    source: str
    spec: str

    @classmethod
    def from_gbnf(cls, text: str) -> "Grammar":
        """llama.cpp GBNF (start rule `root`). Text whose first line is `%llguidance`
        is taken as llguidance Lark, as llama.cpp's own llguidance build does."""
        if re.match(r"\s*%llguidance\b", text):
            return cls.from_lark(text)
        llg = _need_llg()
        lark = _gbnf_to_lark(text)
        spec = llg.LLMatcher.grammar_from_lark(lark)
        err = llg.LLMatcher.validate_grammar(spec)
        if err:
            line, col, what = _lark_error(err)
            raise BadRequestError(f"bad GBNF grammar{_place_in_gbnf(text, lark, line, col)}: {what}")
        return cls("gbnf", text, spec)

    @classmethod
    def from_lark(cls, text: str) -> "Grammar":
        """llguidance's Lark dialect (start rule `start`; `<|name|>` / `<[id]>` tokens)."""
        spec = _need_llg().LLMatcher.grammar_from_lark(text)
        err = _llg.LLMatcher.validate_grammar(spec)
        if err:
            line, col, what = _lark_error(err)
            where = f" at line {line}, column {col}" if line else ""
            raise BadRequestError(f"bad Lark grammar{where}: {what}")
        return cls("lark", text, spec)

    @classmethod
    def from_json_schema(cls, schema: dict | str | bool) -> "Grammar":
        """JSON matching the schema (`True` or `{}`: any JSON value)."""
        llg = _need_llg()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise BadRequestError(
                    f"the JSON schema is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
                ) from None
        if not isinstance(schema, (dict, bool)):
            raise BadRequestError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        spec = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        err = llg.LLMatcher.validate_grammar(spec)
        if err:
            detail = _regex_detail(err)
            raise BadRequestError(f"bad JSON schema: {_first_line(err)}" + (f" {detail}" if detail else ""))
        return cls("json_schema", json.dumps(schema), spec)

    @classmethod
    def from_regex(cls, pattern: str) -> "Grammar":
        """Output that fully matches the pattern (Rust regex syntax; \\d means [0-9])."""
        llg = _need_llg()
        # keep \d \w \s ASCII, as users of JSON-schema style patterns expect
        spec = llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(pattern, 'dws')}/")
        err = llg.LLMatcher.validate_grammar(spec)
        if err:
            raise BadRequestError(f"bad regex {pattern!r}: {_regex_detail(err) or _first_line(err)}")
        return cls("regex", pattern, spec)

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object: OpenAI `response_format: {type: json_object}`, Ollama `format: "json"`."""
        return cls.from_json_schema({"type": "object"})


# -- matcher --------------------------------------------------------------------------


class GrammarMatcher:
    """One generation's position in a grammar.

    The engine, per step: `row = m.apply(row)` (or `m.allowed_mask()`), sample,
    `m.accept(token)`; finish when the token is a stop id or `m.is_done()`. EOS
    ids are allowed exactly where the grammar accepts. Speculation: `count_valid(draft)`
    says how much of a draft the grammar allows, `draft_masks(draft)` gives the mask
    of every verify row, and `rollback(n)` / `snapshot()` + `restore()` undo tokens.
    """

    def __init__(self, grammar: Grammar, tokenizer) -> None:
        llg = _need_llg()
        self.n_vocab = int(tokenizer.vocab_size)
        self._m = llg.LLMatcher(tokenizer, grammar.spec, log_level=0)
        if self._m.is_error():  # e.g. a `<|name|>` this vocabulary has no token for
            raise BadRequestError(f"the grammar does not compile for this model: {_first_line(self._m.get_error())}")
        self._words = np.empty((1, (self.n_vocab + 31) // 32), np.int32)
        self._mask: np.ndarray | None = None  # cached for the current state

    def allowed_mask(self) -> np.ndarray:
        """Bool array [n_vocab]: True where the token may come next. Do not modify it."""
        if self._mask is None:
            self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            # one bit per token, little-endian within each int32 word
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little", count=self.n_vocab)
            self._mask = bits.view(np.bool_)
        return self._mask

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A new float32 row equal to `logits` where allowed and -inf elsewhere (the
        backend's row is a view into its buffer, so it is not written)."""
        allowed = self.allowed_mask()
        idx = np.flatnonzero(allowed)
        if 2 * idx.size > self.n_vocab:  # free text: a dense select beats a big gather
            return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)
        # most masks are sparse (JSON punctuation, digits): copy just the allowed entries
        out = np.full(self.n_vocab, -np.inf, np.float32)
        out[idx] = logits[idx]
        return out

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, without a full mask (~1 us): lets the engine
        sample unconstrained first and mask only when the draw is rejected."""
        return self._m.validate_tokens([int(token)]) == 1

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed by the grammar: {self._m.get_error()}")
        self._mask = None

    def count_valid(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the grammar allows; the state is unchanged."""
        return self._m.validate_tokens([int(t) for t in tokens])

    def draft_masks(self, draft: Sequence[int]) -> np.ndarray:
        """Bool [len(draft)+1, n_vocab]: the mask before each draft token and after the
        last. Rows past the first disallowed draft token repeat its mask (a verifier stops there)."""
        out = np.empty((len(draft) + 1, self.n_vocab), np.bool_)
        done = 0
        for i in range(len(draft) + 1):
            out[i] = self.allowed_mask()
            if i == len(draft) or not self._m.validate_tokens([int(draft[i])]):
                out[i + 1:] = out[i]
                break
            self.accept(draft[i])
            done += 1
        self.rollback(done)
        return out

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens. (An EOS accepted after `is_done()` moved
        nothing and does not count; the generation has ended there anyway.)"""
        if n and not self._m.rollback(int(n)):
            raise ValueError(f"cannot roll back {n} tokens: {self._m.get_error()}")
        self._mask = None

    def snapshot(self) -> Any:
        """An opaque copy of the state (a ~2 us deep copy in llguidance)."""
        return self._m.deep_copy()

    def restore(self, snap: Any) -> None:
        self._m = snap.deep_copy()  # copy again: one snapshot may be restored twice
        self._mask = None

    def reset(self) -> None:
        self._m.reset()
        self._mask = None

    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar (EOS may come)."""
        return self._m.is_accepting()

    def is_done(self) -> bool:
        """Nothing but EOS can follow (or EOS was accepted): the engine should stop."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()
