"""GBNF (llama.cpp's grammar syntax) to llguidance's Lark, in linear time.

llguidance ships a GBNF converter; around it, this module keeps every step linear in the
grammar's length (a request's grammar is untrusted input): the literal/class scanner
that finds rule references, the rename of a user's own `start` rule, and the marks of
terminal rules that the converter's own fixpoint would set one pass per rule. It also
places a Lark error back at its line and column in the GBNF source.
"""

from __future__ import annotations

import re
from collections import defaultdict

from ..errors import BadRequestError

try:
    from llguidance.gbnf_to_lark import GbnfToLarkError, GrammarParser, RuleRefNode, resolve
except ImportError:  # pragma: no cover - grammar.py reports the missing install
    GbnfToLarkError = GrammarParser = RuleRefNode = resolve = None

def line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


# the body of a "literal" or a [class]: escaped pairs and plain characters, possessive
# (nothing after it can make it give characters back)
_BODY = {'"': re.compile(r'(?:\\.|[^"\\])*+'), "[": re.compile(r"(?:\\.|[^\]\\])*+")}
_CLOSER = {'"': '"', "[": "]"}
_OPENER = re.compile(r'["\[#]')


def blank_quoted(text: str) -> str:
    r"""GBNF text with literals, char classes and comments blanked (same offsets), so a
    search for a rule name finds references, not strings that happen to spell it.

    One pass: what the regex `"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*` matches, each
    match blanked, where re.sub on that regex is quadratic on unclosed openers (it rescans
    to the end from each of 40,000 `[`: 60-90 s here). A body that cannot close fails at
    the same place f (the end, or a backslash before a newline) from every opener of its
    kind before f, as all of them read the same escape pairs from there on; so once one
    fails, the others up to f are skipped: each character is scanned once per kind.
    """
    pieces: list[str] = []
    done = pos = 0
    fails_before = {'"': 0, "[": 0}  # an opener of this kind before here cannot close
    while (m := _OPENER.search(text, pos)) is not None:
        start, kind = m.start(), m.group()
        if kind == "#":
            end = text.find("\n", start)
            end = len(text) if end < 0 else end
        elif start < fails_before[kind]:
            pos = start + 1
            continue
        else:
            end = _BODY[kind].match(text, start + 1).end()
            if not text.startswith(_CLOSER[kind], end):
                fails_before[kind] = end
                pos = start + 1
                continue
            end += 1
        pieces += (text[done:start], " " * (end - start))
        done = pos = end
    pieces.append(text[done:])
    return "".join(pieces)


_START_ALIAS = "st4rt"
_START_REF = re.compile(r"(?<![\w-])start(?![\w-])")


def _lark_rule_name(name: str) -> str:
    """A GBNF rule's name as llguidance's converter writes it in Lark (lower case)."""
    special = {"root": "start", "start": _START_ALIAS}.get(name)
    return special or re.sub(r"([a-z])([A-Z])", r"\1_\2", name.replace("-", "_")).lower()


def _gbnf_rules(text: str) -> dict[str, tuple[str, int]]:
    """Lark rule name (as llguidance's converter renames it, lower case) -> (GBNF name,
    offset of its definition). One scan of the text; each name converted once."""
    out: dict[str, tuple[str, int]] = {}
    for m in re.finditer(r"(?m)^[ \t]*([A-Za-z0-9_-]+)[ \t]*::=", blank_quoted(text)):
        out.setdefault(_lark_rule_name(m.group(1)), (m.group(1), m.start(1)))
    return out


def place_in_gbnf(text: str, lark: str, line: int, col: int) -> str:
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
    at_line, at_col = line_col(text, found if found >= 0 else offset)
    return f" at line {at_line}, column {at_col} (rule '{name}')"


def _rename_start(text: str) -> str:
    """The converter renames `root` to Lark's `start`: a user's own `start` becomes a
    name of the same length first, so every error offset stays right. One pass."""
    cuts = [m.start() for m in _START_REF.finditer(blank_quoted(text))]
    if not cuts:
        return text
    pieces, done = [], 0
    for at in cuts:
        pieces += (text[done:at], _START_ALIAS)
        done = at + len("start")
    pieces.append(text[done:])
    return "".join(pieces)


def _mark_terminal_rules(rules: dict) -> None:
    """Set `rule_is_terminal` (the rule becomes a Lark token: it names only other such
    rules and literals) where llguidance's `resolve` would, in linear time. `resolve`
    re-walks every rule until a pass marks nothing; a chain of rules defined head first
    marks one per pass, which is quadratic (4.7 s on 64 KiB). With every mark preset, its
    first pass marks nothing and it stops. Same least fixpoint, so the same marks."""
    users: dict[str, list[str]] = defaultdict(list)
    waiting: dict[str, int] = {}  # rule -> names it uses that are not yet known terminal
    for name, rule in rules.items():
        used: set[str] = set()
        stack = [rule.alternatives]
        while stack:
            node = stack.pop()
            if isinstance(node, RuleRefNode):
                used.add(node.name)
            else:
                stack.extend(node.children())
        waiting[name] = len(used)
        for other in used:
            users[other].append(name)
    ready = [name for name, n in waiting.items() if n == 0]
    while ready:
        name = ready.pop()
        if name == "root":  # becomes Lark's `start` rule, which is never a token
            continue
        rules[name].rule_is_terminal = True
        for user in users[name]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)


def gbnf_to_lark_text(text: str) -> str:
    text = _rename_start(text)
    try:
        rules = GrammarParser().parse(text)
        _mark_terminal_rules(rules)
        resolve(rules)
    except GbnfToLarkError as exc:
        line, col = line_col(exc.pos.text, exc.pos.pos)
        what = str(exc)[: -len(f" at {exc.pos}")] or str(exc)
        if exc.pos.current() in ("<", "!"):
            raise BadRequestError(
                f"bad GBNF grammar at line {line}, column {col}: token references (<...>, !<...>) are not"
                " supported in GBNF here; write the grammar in Lark syntax (first line: %llguidance {}),"
                " where <|name|>, <[id]> and <[^id]> work"
            ) from None
        raise BadRequestError(f"bad GBNF grammar at line {line}, column {col}: {what}") from None
    except RecursionError:  # the converter descends once per nested group
        raise BadRequestError("bad GBNF grammar: groups nested too deeply; use fewer levels of parentheses") from None
    except Exception as exc:  # the converter's name checks raise a plain Exception
        msg = str(exc)
        m = re.match(r"Rule '([^']+)' not found", msg)
        if m:
            ref = re.search(rf"(?<![\w-]){re.escape(m.group(1))}(?![\w-])", blank_quoted(text))
            if ref:
                line, col = line_col(text, ref.start())
                name = "start" if m.group(1) == _START_ALIAS else m.group(1)
                raise BadRequestError(f"bad GBNF grammar at line {line}, column {col}: undefined rule '{name}'") from None
        if msg == "No 'root' rule found":
            msg = "no 'root' rule (the rule generation starts from)"
        raise BadRequestError(f"bad GBNF grammar: {msg}") from None
    # rules in source order (`resolve` numbered them so); a multi-line rule stands apart
    texts = [str(r) for r in sorted(rules.values(), key=lambda r: r.order)]
    # no %llguidance line: grammar.lark_spec adds localrun's options to every grammar
    return "\n".join(t + "\n" if "\n" in t else t for t in texts) + "\n"
