"""A tool call as the dialects see it: whole (`ToolCall`) or streamed (`ToolCallDelta`)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass


@dataclass
class ToolCallDelta:
    index: int  # which call of the answer (0-based)
    id: str | None = None  # on a call's first delta only: "call_" + 24 hex digits
    name: str | None = None  # on a call's first delta only
    arguments: str = ""  # the next fragment of the arguments' JSON text


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def arguments_obj(self):
        return json.loads(self.arguments)


def collect_calls(deltas) -> list[ToolCall]:
    """Whole calls from a stream's deltas (a non-streamed answer's `tool_calls`)."""
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            ids[d.index] = d.id
        if d.name is not None:
            names[d.index] = d.name
        args.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(ids.get(i, ""), names.get(i, ""), "".join(args[i])) for i in sorted(args)]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
