"""The Responses dialect's items: `input` items read into chat messages, and the
engine's events rendered as output items and the stream's events.

Input: messages (text parts only: images and files are a 400), `function_call` and
`custom_tool_call` (consecutive calls are one assistant turn with its text), their
outputs (tool messages), `reasoning` items (their `reasoning_text` becomes the next
assistant turn's `reasoning_content`, for the template to show or drop; a summary or
`encrypted_content` is another model's and is dropped), and items of hosted tools this
server never runs (dropped, logged). Each error names the
field: `'input[3].content[0].text' must be a string`.

Output, as OpenAI streams it (each event with a rising `sequence_number`):

    response.created, response.in_progress
    thinking: response.output_item.added (reasoning), response.content_part.added
            (reasoning_text), response.reasoning_text.delta..., response.reasoning_text.done,
            response.content_part.done, response.output_item.done
    text:   response.output_item.added (message), response.content_part.added,
            response.output_text.delta..., response.output_text.done,
            response.content_part.done, response.output_item.done
    a call: response.output_item.added (function_call, empty arguments),
            response.function_call_arguments.delta..., .done, response.output_item.done
            (a custom tool: response.custom_tool_call_input.delta... / .done)
    end:    response.completed | response.incomplete (max_output_tokens), with the whole
            response; response.failed for an error after the stream began

A whole (non-streamed) answer runs the same `Reply` and drops the events, so `create`
and a stream's final response hold the same items by construction.

A custom tool is declared to the model as a function taking one string, `input`; its
call's arguments arrive as JSON text (`{"input": "..."}`) in fragments, and `InputText`
decodes the string's characters as they come, holding back an escape (`\\u00e9`, a
surrogate pair) until it is whole."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets

from ..errors import BadRequestError
from ..request import MAX_CONTENT_PARTS, MAX_MESSAGES
from ..tools import ToolCallDelta
from ..tools.history import MAX_CALLS_PER_MESSAGE as MAX_CALLS_PER_TURN, arguments_json
from .fields import Body, _show, objects

log = logging.getLogger("localrun.server")

# which declared tool a flat name is: (kind "function" | "custom", the client's name, namespace or None)
ToolNames = dict[str, tuple[str, str, str | None]]

_INPUT_OPENING = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
NOT_TEXT_PARTS = ("input_image", "input_file", "input_audio", "image_url")
NOT_READ = "[{kind} left out: this server reads text only]"
# items of OpenAI-hosted tools a client may send back from an earlier (OpenAI) answer:
# this server never made them and runs none of those tools, so they only drop out
HOSTED_ITEMS = {
    "web_search_call", "file_search_call", "computer_call", "computer_call_output", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output", "compaction",
}
NS_SEPARATOR = "__"
MAX_ID_CHARS = 256  # call ids and names in history: only the template reads them


def flat_name(ns: str, name: str) -> str:
    """A namespaced tool's name as the model sees it: `<namespace>__<name>`, held to the
    tool-name rule (other characters become `_`; a long one is cut and keeps a hash)."""
    joined = re.sub(r"[^A-Za-z0-9_-]", "_", f"{ns}{NS_SEPARATOR}{name}")
    if len(joined) <= 64:
        return joined
    digest = hashlib.sha256(f"{ns}\0{name}".encode()).hexdigest()[:8]
    return f"{joined[:55]}_{digest}"


# -- input items ----------------------------------------------------------------------


def read_input(b: Body) -> tuple[list[dict], list[dict] | None]:
    """`instructions` + `input` as chat messages; also the same with every system message
    joined at the head (None when that is no different)."""
    head = [b.str("instructions")] if b.str("instructions") else []
    raw = b.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    elif raw is None:
        raw = []
    elif isinstance(raw, list):
        raw = b.list("input", most=MAX_MESSAGES)
    else:
        raise BadRequestError(f"'input' must be a string or a list of items, got {_show(raw)}")
    msgs: list[dict] = []
    thought = ""  # a reasoning item's text, waiting for the assistant turn it preceded
    for i, item in enumerate(raw):
        if isinstance(item, dict) and item.get("type") == "reasoning":
            thought += _reasoning_text(Body(item, f"input[{i}]."), f"input[{i}]")
            continue
        _item(item, f"input[{i}]", msgs)
        if thought and _is_assistant_item(item):  # _item put it in msgs[-1], alone or with the turn's calls
            earlier = msgs[-1].get("reasoning_content")
            msgs[-1]["reasoning_content"] = f"{earlier}\n\n{thought}" if earlier else thought
        thought = ""  # thinking belongs to the assistant item right after it, or to none
    while msgs and msgs[0]["role"] == "system":  # the head's system messages join the instructions
        head.append(msgs.pop(0)["content"])
    lead = [{"role": "system", "content": "\n\n".join(head)}] if head else []
    if not msgs:
        raise BadRequestError("'input' must hold at least one message or tool output")
    later = [m["content"] for m in msgs if m["role"] == "system"]
    merged = None
    if later:
        merged = [{"role": "system", "content": "\n\n".join(head + later)}] + [m for m in msgs if m["role"] != "system"]
    return lead + msgs, merged


def _item(item, at: str, msgs: list[dict]) -> None:
    if not isinstance(item, dict):
        raise BadRequestError(f"'{at}' must be an input item object, got {_show(item)}")
    it = Body(item, f"{at}.")
    kind = it.str("type", "message" if "role" in item else None)
    if kind is None:
        raise BadRequestError(f"'{at}' needs a 'type' (or a 'role', for a message)")
    if kind == "message":
        role = it.str("role", required=True)
        if role not in ROLES:
            raise BadRequestError(f"'{at}.role' must be user, assistant, system or developer, got {_show(role)}")
        msgs.append({"role": ROLES[role], "content": _text(it, "content", at)})
    elif kind in ("function_call", "custom_tool_call"):
        call_id = _short(it, "call_id", at)
        name = _short(it, "name", at)
        ns = it.str("namespace")
        model_name = flat_name(ns, name) if ns else name
        if kind == "function_call":
            arguments = _arguments(it.str("arguments", "{}"), f"{at}.arguments")
        else:
            arguments = {"input": it.str("input", "")}
        call = {"id": call_id, "type": "function", "function": {"name": model_name, "arguments": arguments}}
        if msgs and msgs[-1]["role"] == "assistant":  # one turn: its text and its calls
            calls = msgs[-1].setdefault("tool_calls", [])
            if len(calls) >= MAX_CALLS_PER_TURN:
                raise BadRequestError(f"'{at}': one turn may hold at most {MAX_CALLS_PER_TURN} consecutive calls")
            calls.append(call)
        else:
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        msgs.append({"role": "tool", "tool_call_id": _short(it, "call_id", at),
                     "content": _text(it, "output", at, tool_output=True)})
    elif kind == "item_reference":
        raise BadRequestError(f"'{at}': this server is stateless and stores no items; send the item itself")
    elif kind in HOSTED_ITEMS:
        log.info("/v1/responses: dropping a %s item (%s): this server runs no hosted tools", kind, at)
    else:
        raise BadRequestError(
            f"'{at}.type' {_show(kind)} is not an input item this server reads (message, function_call, "
            "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)"
        )


def _is_assistant_item(item: dict) -> bool:
    kind = item.get("type", "message" if "role" in item else None)
    return kind in ("function_call", "custom_tool_call") or (kind == "message" and item.get("role") == "assistant")


def _reasoning_text(it: Body, at: str) -> str:
    """A reasoning item's own text (its `reasoning_text` parts); a summary or sealed
    `encrypted_content` says nothing this model wrote."""
    texts = []
    for j, part in enumerate(it.list("content", most=MAX_CONTENT_PARTS) or []):
        where = f"{at}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            raise BadRequestError(f"'{where}' must be a reasoning_text part, got {_show(part)}")
        texts.append(Body(part, f"{where}.").str("text", required=True))
    return "".join(texts)


def _short(it: Body, key: str, at: str) -> str:
    v = it.str(key, required=True)
    if not 0 < len(v) <= MAX_ID_CHARS:
        raise BadRequestError(f"'{at}.{key}' must be 1..{MAX_ID_CHARS} characters")
    return v


def _text(it: Body, key: str, at: str, tool_output: bool = False) -> str:
    """A message's content or a tool output: a string, or a list of text parts. In a tool's
    output an image or file part (Codex's view_image) becomes NOT_READ, so the agent's
    session goes on; in a message it is a 400."""
    v = it.get(key, "")
    if isinstance(v, str):
        return v
    parts = it.list(key, most=MAX_CONTENT_PARTS)
    texts = []
    for where, part in objects(parts, f"{at}.{key}", "a content part object"):
        kind = part.get("type")
        if kind in NOT_TEXT_PARTS and tool_output:
            texts.append(NOT_READ.format(kind=kind))
            continue
        if kind in NOT_TEXT_PARTS:
            raise BadRequestError(f"'{where}' is an {kind} part: this server reads text only")
        if kind == "refusal":
            texts.append(Body(part, f"{where}.").str("refusal", ""))
            continue
        if kind not in TEXT_PARTS:
            raise BadRequestError(f"'{where}.type' must be input_text or output_text, got {_show(kind)}")
        texts.append(Body(part, f"{where}.").str("text", required=True))
    return "".join(texts)


def _arguments(text: str, at: str) -> dict:
    value = arguments_json(text, at)
    if not isinstance(value, dict):
        raise BadRequestError(f"'{at}' must be the JSON text of an object, got {_show(value)}")
    return value



# -- output items ---------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class InputText:
    """The decoded `input` string of a custom tool call whose arguments' JSON text
    (`{"input": "..."}`) arrives in fragments: `feed` returns the characters that are
    now whole. Text before the string's opening quote is read as it comes (the call
    grammar lays it out as json.dumps does, but any spacing is accepted); the closing
    quote ends it, and whatever follows is not input."""

    def __init__(self) -> None:
        self.head = ""  # the arguments' text before the string opens
        self.opened = False
        self.closed = False
        self.pending = ""  # an escape not yet whole (starts with a backslash)
        self.text: list[str] = []

    def feed(self, fragment: str) -> str:
        rest = fragment
        if not self.opened:
            self.head += rest
            m = _INPUT_OPENING.match(self.head)
            if m is None:
                return ""
            self.opened = True
            rest = self.head[m.end():]
        out: list[str] = []
        i = 0
        while i < len(rest) and not self.closed:
            c = rest[i]
            i += 1
            if self.pending:
                self.pending += c
                decoded, again = self._escape()
                if decoded is not None:
                    out.append(decoded)
                if again:  # what followed a lone surrogate is read as text again
                    rest, i = again + rest[i:], 0
                continue
            if c == "\\":
                self.pending = c
            elif c == '"':
                self.closed = True
            else:
                out.append(c)
        piece = "".join(out)
        self.text.append(piece)
        return piece

    def _escape(self) -> tuple[str | None, str]:
        """(the pending escape's text once it is whole, else None; text to read again)."""
        p = self.pending
        if len(p) < 2:
            return None, ""
        if p[1] != "u":
            self.pending = ""
            return (json.loads(f'"{p}"') if p[1] in '"\\/bfnrt' else "\ufffd"), ""
        if len(p) < 6:
            return None, ""
        if not _HEX4.fullmatch(p[2:6]):
            self.pending = ""
            return "\ufffd", ""
        high = int(p[2:6], 16)
        if not 0xD800 <= high < 0xDC00:  # one code unit is one character
            self.pending = ""
            return (chr(high) if not 0xDC00 <= high < 0xE000 else "\ufffd"), ""
        # a high surrogate: the second half of its pair must follow as \\uDCxx
        if len(p) < 12 and not (len(p) >= 7 and p[6] != "\\" or len(p) >= 8 and p[7] != "u"):
            return None, ""
        low = int(p[8:12], 16) if len(p) >= 12 and _HEX4.fullmatch(p[8:12]) else -1
        self.pending = ""
        if not 0xDC00 <= low < 0xE000:  # a lone high surrogate is no character
            return "\ufffd", p[6:]
        return chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)), ""

    def value(self) -> str:
        return "".join(self.text)


class Reply:
    """One answer's output items, built from the engine's events; each method returns the
    stream events it produced (dicts with `type` and a rising `sequence_number`)."""

    def __init__(self, names: ToolNames, response: dict) -> None:
        self.names = names
        self.response = response  # the response object's other fields (id, model, tools, ...)
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written (a message or a call)
        self.held = ""  # text that is only whitespace so far: dropped if a call comes first
        self.inputs: dict[int, InputText] = {}  # output index -> a custom call's decoder
        self.calls: dict[int, int] = {}  # the engine's call index -> output index
        self.seq = 0

    # -- the stream's events ---------------------------------------------------------

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def snapshot(self, status: str, usage: dict | None = None, details: dict | None = None, error=None) -> dict:
        return {**self.response, "status": status, "output": self.output, "output_text": self.output_text(),
                "incomplete_details": details, "usage": usage, "error": error}

    def output_text(self) -> str:
        return "".join(part["text"] for item in self.output if item["type"] == "message" for part in item["content"])

    def start(self) -> list[dict]:
        head = self.snapshot("in_progress")
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    # -- engine events ---------------------------------------------------------------

    def feed(self, text: str, deltas: list[ToolCallDelta] | None, reasoning: str = "") -> list[dict]:
        out: list[dict] = []
        if reasoning:
            out += self._reasoning(reasoning)
        if text:
            out += self._text(text)
        for d in deltas or ():
            if d.id is not None:
                out += self._close("completed")
                out += self._call(d)
            if d.arguments:
                out += self._arguments(d)
        return out

    def _text(self, text: str) -> list[dict]:
        if self.open is None or self.open["type"] != "message":
            if not (self.held + text).strip():  # whitespace before a call is no message
                self.held += text
                return []
            text, self.held = self.held + text, ""
            out = self._close("completed") + self._open_message()
        else:
            out = []
        index = len(self.output) - 1
        self.open["content"][0]["text"] += text
        out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=index,
                              content_index=0, delta=text, logprobs=[]))
        return out

    def _reasoning(self, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out = self._close("completed") + self._open_reasoning()
        index = len(self.output) - 1
        self.open["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=index,
                              content_index=0, delta=text))
        return out

    def _open_reasoning(self) -> list[dict]:
        item = {"type": "reasoning", "id": new_id("rs"), "status": "in_progress", "summary": [], "content": []}
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        part = {"type": "reasoning_text", "text": ""}
        item["content"].append(part)
        return [self.event("response.output_item.added", output_index=index, item={**item, "content": []}),
                self.event("response.content_part.added", item_id=item["id"], output_index=index,
                           content_index=0, part=dict(part))]

    def _open_message(self) -> list[dict]:
        item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return [self.event("response.output_item.added", output_index=index, item={**item, "content": []}),
                self.event("response.content_part.added", item_id=item["id"], output_index=index,
                           content_index=0, part=dict(part))]

    def _call(self, d: ToolCallDelta) -> list[dict]:
        kind, name, namespace = self.names.get(d.name or "", ("function", d.name or "", None))
        if kind == "custom":
            item = {"type": "custom_tool_call", "id": new_id("ctc"), "call_id": d.id, "name": name, "input": ""}
            self.inputs[len(self.output)] = InputText()
        else:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": d.id, "name": name,
                    "arguments": "", "status": "in_progress"}
        if namespace is not None:
            item["namespace"] = namespace
        self.held = ""
        self.output.append(item)
        self.open = item
        self.calls[d.index] = len(self.output) - 1
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _arguments(self, d: ToolCallDelta) -> list[dict]:
        index = self.calls.get(d.index)
        if index is None:  # a fragment of a call never named: the engine does not send one
            return []
        item = self.output[index]
        if item["type"] == "custom_tool_call":
            piece = self.inputs[index].feed(d.arguments)
            if not piece:
                return []
            item["input"] += piece
            return [self.event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                               delta=piece)]
        item["arguments"] += d.arguments
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=d.arguments)]

    def _close(self, status: str) -> list[dict]:
        """Finish the open item: its done events, then output_item.done."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        elif item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"], name=item["name"]))
        else:
            out.append(self.event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                  input=item["input"]))
        if "status" in item:
            item["status"] = status
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(self, finish_reason: str | None, usage: dict) -> list[dict]:
        """The last events: the open item done, then response.completed or, when the answer
        ran into max_output_tokens, response.incomplete."""
        truncated = finish_reason == "length"
        out: list[dict] = []
        if all(item["type"] == "reasoning" for item in self.output):
            # an answer with no call is a message, even an empty or all-whitespace one (or
            # none at all: thinking that ran into max_output_tokens)
            out += self._close("incomplete" if truncated else "completed")
            out += self._open_message()
            self.open["content"][0]["text"] = self.held
            if self.held:
                out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=len(self.output) - 1, content_index=0, delta=self.held,
                                      logprobs=[]))
            self.held = ""
        out += self._close("incomplete" if truncated else "completed")
        details = {"reason": "max_output_tokens"} if truncated else None
        final = self.snapshot("incomplete" if truncated else "completed", usage, details)
        out.append(self.event("response.incomplete" if truncated else "response.completed", response=final))
        return out

    def fail(self, message: str) -> list[dict]:
        """A failure after the stream began: the open item ends incomplete, then response.failed."""
        out = self._close("incomplete")
        failed = self.snapshot("failed", error={"code": "server_error", "message": message})
        out.append(self.event("response.failed", response=failed))
        return out


def sse_event(ev: dict) -> bytes:
    """One event as OpenAI writes it: its type as the SSE event name, the object as data."""
    return f"event: {ev['type']}\ndata: ".encode() + json.dumps(ev, ensure_ascii=False).encode() + b"\n\n"
