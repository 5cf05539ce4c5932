"""Small pieces of llguidance Lark that every call format's grammar is made of."""

from __future__ import annotations

import json

from ..grammar.core import json_schema_layout
from .spec import JSON_LAYOUT

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
TEXT = "/(?s:.*)/"
WS = "/[ \\t\\r\\n]*/"


def regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


class Literals:
    """Lark items for literal text; a marker the vocabulary holds as one control token
    becomes a reference to that token by id (`<[151657]>`), which only it can match."""

    def __init__(self, control: dict[str, int]) -> None:
        self.control = control

    def __call__(self, text: str) -> str:
        items: list[str] = []
        rest = text
        while rest:
            hits = [(rest.find(m), -len(m), m) for m in self.control if m in rest]
            if not hits:
                items.append(json.dumps(rest))
                break
            at, _, marker = min(hits)
            if at:
                items.append(json.dumps(rest[:at]))
            items.append(f"<[{self.control[marker]}]>")
            rest = rest[at + len(marker):]
        return " ".join(items)

    def is_token(self, marker: str) -> bool:
        return marker in self.control


def json_value(schema) -> str:
    """A JSON value held to `schema`, laid out as json.dumps writes it (JSON_LAYOUT)."""
    return f"%json {json.dumps(json_schema_layout(schema, JSON_LAYOUT))}"


def raw_string_regex(schema: dict) -> str:
    """A regex for a string parameter written as raw text (no quotes, no escapes): its
    length bounds where the schema gives them."""
    lo = schema.get("minLength", 0)
    hi = schema.get("maxLength")
    lo = lo if isinstance(lo, int) and lo >= 0 else 0
    if isinstance(hi, int) and hi >= lo:
        return f"/(?s:.{{{lo},{hi}}})/"
    return f"/(?s:.{{{lo},}})/" if lo else TEXT


def string_only(schema) -> bool:
    """Every value the schema allows is a string: written as raw text in XML formats."""
    if not isinstance(schema, dict):
        return False
    if "enum" in schema:
        return bool(schema["enum"]) and all(isinstance(v, str) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], str)
    return schema.get("type") == "string"


def xml_value_rules(rule: str, schema, end: str, end_is_token: bool = False) -> list[str]:
    """Rules for `rule`: one parameter's value followed by `end` (a Lark item) that closes
    it. A string parameter is raw text up to the first `end` (a lazy lexeme: the text
    cannot hold `end`; a control token ends any text), or one of its enum values; any
    other value is JSON held to its schema (a number parameter is a bare number, an object
    a JSON object)."""
    lazy = "" if end_is_token else "[lazy]"
    if not isinstance(schema, dict) or not schema:
        schema = {}
    if string_only(schema):
        values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if values is not None:
            return [f"{rule}: ({' | '.join(json.dumps(v) for v in values)}) {end}"]
        terminal = rule.upper() + "_TEXT"
        return [f"{rule}{lazy}: {terminal} {end}", f"{terminal}: {raw_string_regex(schema)}"]
    if not schema:  # an undeclared parameter: raw text, read back as JSON where it spells some
        terminal = rule.upper() + "_TEXT"
        return [f"{rule}{lazy}: {terminal} {end}", f"{terminal}: {TEXT}"]
    return [f"{rule}: {json_value(schema)} {end}"]


def with_definitions(sub, root: dict):
    """A property's schema with the root's `$defs`/`definitions`, so a `$ref` in it still
    resolves when it is compiled on its own."""
    if not isinstance(sub, dict):
        return sub
    extra = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in sub}
    return {**sub, **extra} if extra else sub
