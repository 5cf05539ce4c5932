"""What the chat sends with every turn: sampler, output constraint, lookup, system
prompt, answer length. The settings panel edits it as text fields; `parse_form` turns
those strings back into a validated `ChatSettings` or raises `FieldError` naming the
field, so the panel can mark it and show the reason inline."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from localrun.errors import BadRequestError, LocalrunError
from localrun.sampling import PARAMETER, PARAMETERS, SamplingParams

# the panel's input for each kind of declared sampler parameter
_FORM_KINDS = {"int": "int", "float": "float", "strings": "json", "order": "order", "bias": "bias"}
# what an empty field means, shown in it
PLACEHOLDERS = {"seed": "random", "samplers": "default order", "logit_bias": "none",
                "max_tokens": "no limit", "grammar_path": "none: free text"}
GRAMMAR_KINDS = ("gbnf", "json-schema")


def sampler_fields() -> list[tuple[str, str, str]]:
    """(field, label, kind) for every sampler parameter the command line has too, in
    declaration order (localrun.sampling.PARAMETERS); kind in int/float/json/order/bias;
    the label is the declared one, else the flag."""
    return [(p.name, p.label or p.flag.lstrip("-"), _FORM_KINDS[p.kind]) for p in PARAMETERS if p.flag]


class FieldError(BadRequestError):
    """A value the panel rejected; `field` names the input to mark."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass
class ChatSettings:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: until the model stops or the context is full
    lookup: bool = True
    system: str = ""
    grammar_path: str = ""  # a GBNF or JSON-schema file; "" = free text
    grammar_kind: str = "gbnf"
    grammar: object | None = None  # the compiled localrun.grammar.core.Grammar, checked when set
    # a thinking model's controls (--reasoning-budget, --think/--no-think): GenerationRequest's
    # reasoning_budget and template_kwargs; the settings panel keeps them as they are
    reasoning: dict = field(default_factory=lambda: {"reasoning_budget": None, "template_kwargs": {}})

    def copy(self) -> "ChatSettings":
        return replace(self, sampling=replace(self.sampling), reasoning=dict(self.reasoning))


def load_grammar(path: str, kind: str):
    """The Grammar in `path` (GBNF or JSON schema); BadRequestError with the reason."""
    from localrun.grammar.core import Grammar

    if kind not in GRAMMAR_KINDS:
        raise FieldError("grammar_kind", f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise FieldError("grammar_path", f"cannot read the grammar file {path}: {reason}") from None
    try:
        return Grammar.from_gbnf(text) if kind == "gbnf" else Grammar.from_json_schema(text)
    except LocalrunError as exc:
        raise FieldError("grammar_path", f"{Path(path).name}: {exc}") from None


def settings_from_args(args) -> ChatSettings:
    """The `localrun chat` flags as settings; a bad flag fails before the model loads."""
    from localrun.sampling.flags import sampling_from_args

    from .thinking import reasoning_options

    if args.max_tokens is not None and args.max_tokens < 1:
        raise BadRequestError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    s = ChatSettings(sampling_from_args(args), args.max_tokens, bool(args.lookup), args.system or "")
    s.reasoning = reasoning_options(args)
    grammar_file = getattr(args, "grammar", None)
    schema_file = getattr(args, "json_schema", None)
    if grammar_file or schema_file:
        s.grammar_kind = "gbnf" if grammar_file else "json-schema"
        s.grammar_path = grammar_file or schema_file
        s.grammar = load_grammar(s.grammar_path, s.grammar_kind)
    return s


def form_values(s: ChatSettings) -> dict[str, str]:
    """Every field of the panel as the text its input shows."""
    p = s.sampling
    out: dict[str, str] = {}
    for name, _, kind in sampler_fields():
        v = getattr(p, name)
        if kind == "json":
            out[name] = json.dumps(v)
        elif kind == "order":
            out[name] = ";".join(v) if isinstance(v, (list, tuple)) else (v or "")
        elif kind == "bias":  # ids, then llama-server's text form (quoted: spaces matter)
            items = [f"{t}={b:g}" for t, b in v.items()]
            out[name] = ", ".join(items + [f"{json.dumps(t)}={b:g}" for t, b in p.logit_bias_text.items()])
        else:
            out[name] = "" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
    out["max_tokens"] = "" if s.max_tokens is None else str(s.max_tokens)
    out["grammar_path"] = s.grammar_path
    return out


def _number(name: str, text: str, kind: str):
    try:
        return int(text) if kind == "int" else float(text)
    except ValueError:
        what = "an integer" if kind == "int" else "a number"
        raise FieldError(name, f"{name} must be {what}, got {text!r}") from None


def _parse_field(name: str, kind: str, text: str):
    if kind == "json":
        try:
            v = json.loads(text) if text else []
        except json.JSONDecodeError:
            v = None
        if not isinstance(v, list) or not all(isinstance(b, str) for b in v):
            raise FieldError(name, f'{name} must be a JSON list of strings, e.g. ["\\n", ":"], got {text!r}')
        return v
    if kind == "order":
        return text or None
    if kind == "bias":
        return _parse_bias(name, text)
    if PARAMETER[name].optional and text.lower() in ("", "none", "random"):
        return None
    return _number(name, text, kind)


# ID=BIAS, or TEXT=BIAS for every token of TEXT; "TEXT" in quotes keeps its spaces and commas
_BIAS_ITEM = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|([^,="]+?))\s*=\s*([^,]+?)\s*(?:,|$)')


def _parse_bias(name: str, text: str) -> list[tuple[str, float]]:
    """The panel's comma-separated items as (key, bias) pairs; SamplingParams reads a key
    of digits as a token id, checks the rest and adds repeated keys up."""
    bias: list[tuple[str, float]] = []
    at = 0
    while text[at:].strip():
        m = _BIAS_ITEM.match(text, at)
        try:
            if m is None:
                raise ValueError
            key = json.loads(m[1]) if m[1] else m[2].strip()
            bias.append((key, float(m[3])))
        except ValueError:  # json.JSONDecodeError is a ValueError too
            item = text[at:].split(",")[0].strip()
            raise FieldError(name, f'logit bias takes ID=BIAS or TEXT=BIAS ("TEXT" keeps spaces), e.g. 15043=-5,'
                                   f' got {item!r}') from None
        at = m.end()
    return bias


def parse_form(values: dict[str, str], lookup: bool, system: str, grammar_kind: str) -> ChatSettings:
    """Settings from the panel's text; FieldError names the first bad field and why."""
    kwargs = {}
    for name, _, kind in sampler_fields():
        kwargs[name] = _parse_field(name, kind, values.get(name, "").strip())
    try:
        sampling = SamplingParams(**kwargs)
    except BadRequestError as exc:
        # SamplingParams names the field first ("top_p must be in (0, 1], got 1.5",
        # "dry_sequence_breakers[2] must be ...", "logit_bias: ...")
        first = re.split(r"[\s:\[]", str(exc), maxsplit=1)[0]
        known = {f.name for f in fields(SamplingParams)}
        raise FieldError(first if first in known else "", str(exc)) from None
    max_text = values.get("max_tokens", "").strip()
    max_tokens = None if max_text == "" else _number("max_tokens", max_text, "int")
    if max_tokens is not None and max_tokens < 1:
        raise FieldError("max_tokens", f"max_tokens must be at least 1 (or empty for no limit), got {max_tokens}")
    path = values.get("grammar_path", "").strip()
    # read again even when the path is unchanged: the user may have just edited the file
    grammar = load_grammar(path, grammar_kind) if path else None
    return ChatSettings(sampling, max_tokens, lookup, system, path, grammar_kind, grammar)
