"""Chat history with tool calls and tool results, normalised for the model's template.

Clients send the same history in several shapes; Hugging Face templates read one:

    OpenAI   {"role": "assistant", "content": null,
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "f", "arguments": "{\\"x\\": 1}"}}]}
             {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    Ollama   {"role": "assistant", "content": "",
              "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}
             {"role": "tool", "tool_name": "f", "content": "42"}
    template {"role": "assistant", "content": "",
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "f", "arguments": {"x": 1}}}]}
             {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "42"}

Arguments become an object (templates `tojson` them: a string would be shown quoted),
content null becomes "", and a tool result gets the `name` of the call it answers (found
by `tool_call_id` among earlier calls, or Ollama's `tool_name`), which several templates
print. Normalising a normalised history changes nothing.
"""

from __future__ import annotations

from ..errors import BadRequestError, parse_client_json

MAX_CALLS_PER_MESSAGE = 128  # as many calls as a request may declare tools (MAX_TOOLS)
MAX_HISTORY_NAME_CHARS = 256  # names in history come from elsewhere; only the template reads them


def history_messages(messages: list[dict]) -> list[dict]:
    """`messages` with tool calls and results in the template's shape (see the module's
    docstring); other keys pass through. Malformed tool fields are a BadRequestError
    naming them, e.g. `messages[3].tool_calls[0].function.arguments`."""
    if not isinstance(messages, list):
        return messages  # chat_template.validate_messages says what is wrong
    names_by_id: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        if m.get("content") is None and ("content" in m or m.get("tool_calls") is not None):
            m["content"] = ""
        calls = m.get("tool_calls")
        if calls is not None:
            m["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]", names_by_id) for j, c in enumerate(_calls(calls, i))]
            if not m["tool_calls"]:
                del m["tool_calls"]  # an empty list makes some templates print an empty call block
        if m.get("role") == "tool":
            _tool_result(m, i, names_by_id)
        out.append(m)
    return out


def _calls(calls, i: int) -> list:
    if not isinstance(calls, list):
        raise BadRequestError(f"'messages[{i}].tool_calls' must be a list of calls, got {type(calls).__name__}")
    if len(calls) > MAX_CALLS_PER_MESSAGE:
        raise BadRequestError(f"'messages[{i}].tool_calls' may hold at most {MAX_CALLS_PER_MESSAGE} calls, got {len(calls)}")
    return calls


def _call(call, at: str, names_by_id: dict[str, str]) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise BadRequestError(f"'{at}' must be an object with a 'function' object holding name and arguments")
    fn = call["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_HISTORY_NAME_CHARS:
        raise BadRequestError(f"'{at}.function.name' must be a string of 1..{MAX_HISTORY_NAME_CHARS} characters")
    arguments = _arguments(fn.get("arguments"), f"{at}.function.arguments")
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    call_id = call.get("id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise BadRequestError(f"'{at}.id' must be a string")
        out = {"id": call_id, **out}
        names_by_id[call_id] = name
    return out


def arguments_json(text: str, at: str):
    """The JSON value of a call's arguments text ({} for none), a client's mistake in it
    named by `at`, the field it came in."""
    if not text.strip():
        return {}
    return parse_client_json(
        text, lambda exc: f"'{at}' is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
        f"'{at}' nests too deeply")


def _arguments(value, at: str):
    """The arguments as an object: OpenAI sends JSON text, Ollama an object."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = arguments_json(value, at)
    if not isinstance(value, dict):
        raise BadRequestError(f"'{at}' must be a JSON object (or its text), got {type(value).__name__}")
    return value


def _tool_result(m: dict, i: int, names_by_id: dict[str, str]) -> None:
    for key in ("tool_call_id", "tool_name", "name"):
        v = m.get(key)
        if v is not None and (not isinstance(v, str) or len(v) > MAX_HISTORY_NAME_CHARS):
            raise BadRequestError(f"'messages[{i}].{key}' must be a string of at most {MAX_HISTORY_NAME_CHARS} characters")
    name = m.get("name") or m.pop("tool_name", None) or names_by_id.get(m.get("tool_call_id") or "")
    m.pop("tool_name", None)
    if name:
        m["name"] = name
