"""Reading request bodies: typed fields whose errors name the field, the mapping of
each dialect's sampling parameters onto SamplingParams (so every sampler stage is
reachable over REST, under llama-server's names in every dialect), and the parts of a
GenerationRequest every dialect reads alike (stop, lookup, grammar, messages). The
bounds are localrun.request's."""

from __future__ import annotations

import json
import math

from ..errors import BadRequestError, client_integer
from ..grammar.core import Grammar
from ..request import MAX_CONTENT_PARTS, MAX_GRAMMAR_CHARS, MAX_MESSAGES, MAX_ROLE_CHARS, GenerationRequest
from ..sampling import PARAMETER, PARAMETERS, SamplingParams
from ..tools import parse_tool_choice, parse_tools

# SamplingParams fields a request may set under their own (llama-server) names: every
# declared sampler parameter a body carries (localrun.sampling.PARAMETERS)
SAMPLING_FIELDS = tuple(p.name for p in PARAMETERS if p.body)
# llama-server stage names with no counterpart here: accepted and left out of the order
_FOREIGN_STAGES = {"infill", "penalties_last"}


class Body:
    """Typed access to a JSON object; `where` prefixes field names in errors ("options.").
    `sampling`: the server's values for the sampler fields the body leaves out (serve's
    --temp, ...; `sampling_params` reads them), handed on to its objects (Ollama's options)."""

    def __init__(self, data: dict, where: str = "", sampling: dict | None = None) -> None:
        self.data = data
        self.where = where
        self.sampling = sampling or {}

    def _name(self, key: str) -> str:
        return f"'{self.where}{key}'"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default=None):
        v = self.data.get(key)
        return default if v is None else v

    def _given(self, key: str, required: bool):
        """The key's value, None when the body leaves it out (or sends null): a 400 when
        it is `required`."""
        v = self.data.get(key)
        if v is None and required:
            raise BadRequestError(f"{self._name(key)} is required")
        return v

    def str(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        v = self._given(key, required)
        if v is None:
            return default
        if not isinstance(v, str):
            raise BadRequestError(f"{self._name(key)} must be a string, got {_show(v)}")
        return v

    def int(self, key: str, default: int | None = None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.data.get(key)
        if v is None:
            return default
        n = client_integer(v)
        if n is None:
            raise BadRequestError(f"{self._name(key)} must be an integer, got {_show(v)}")
        if lo is not None and n < lo:
            raise BadRequestError(f"{self._name(key)} must be >= {lo}, got {n}")
        if hi is not None and n > hi:
            raise BadRequestError(f"{self._name(key)} must be <= {hi}, got {n}")
        return n

    def float(self, key: str, default: float | None = None) -> float | None:
        v = self.data.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise BadRequestError(f"{self._name(key)} must be a finite number, got {_show(v)}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.data.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise BadRequestError(f"{self._name(key)} must be true or false, got {_show(v)}")
        return v

    def strings(self, key: str) -> list[str] | None:
        """A string or a list of strings (OpenAI's `stop`)."""
        v = self.data.get(key)
        if v is None:
            return None
        if isinstance(v, str):
            return [v] if v else None
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise BadRequestError(f"{self._name(key)} must be a string or a list of strings, got {_show(v)}")
        return [s for s in v if s] or None

    def obj(self, key: str) -> "Body":
        v = self.data.get(key)
        if v is None:
            return Body({}, f"{self.where}{key}.", self.sampling)
        if not isinstance(v, dict):
            raise BadRequestError(f"{self._name(key)} must be a JSON object, got {_show(v)}")
        return Body(v, f"{self.where}{key}.", self.sampling)

    def list(self, key: str, required: bool = False, most: int | None = None) -> list | None:
        v = self._given(key, required)
        if v is None:
            return None
        if not isinstance(v, list):
            raise BadRequestError(f"{self._name(key)} must be a list, got {_show(v)}")
        if most is not None and len(v) > most:
            raise BadRequestError(f"{self._name(key)} may hold at most {most} items, got {len(v)}")
        return v


def objects(items: list, where: str, what: str):
    """Each item of a body's list with its place (`where[i]`, for errors), every one a JSON
    object: any other item is a 400 saying it must be `what`."""
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise BadRequestError(f"'{at}' must be {what}, got {_show(item)}")
        yield at, item


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, (bytes, bytearray)) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def sampling_params(body: Body, renames: dict[str, str] | None = None, n_probs: int = 0) -> SamplingParams:
    """SamplingParams from a body's fields, each read as its declaration's kind says; a
    field the body leaves out gets the server's default (`body.sampling`: serve's --temp,
    ...), else SamplingParams' own. SamplingParams checks the values and their bounds.
    `renames` maps a dialect's names to ours (none needs one today: Ollama's options use
    llama-server's names, and the dialect reads OpenAI's top_logprobs into `n_probs`
    itself)."""
    values: dict = dict(body.sampling)  # checked at startup; the body's own fields replace them
    names = dict.fromkeys(SAMPLING_FIELDS, None)
    names.update(renames or {})
    for key, target in names.items():
        if not body.has(key):
            continue
        spec = PARAMETER[target or key]
        if spec.kind == "int":
            values[spec.name] = body.int(key)
        elif spec.kind == "float":
            values[spec.name] = body.float(key)
        elif spec.kind == "strings":
            values[spec.name] = body.strings(key) or []
        elif spec.kind == "order":
            values[spec.name] = _samplers(body, key)
        else:  # logit bias: every form is parsed (and bounded) by localrun.sampling.bias
            values[spec.name] = body.get(key)
    if values.get("seed") is not None and values["seed"] < 0:
        values["seed"] = None  # llama-server's -1: a random seed
    try:
        return SamplingParams(n_probs=n_probs, **values)
    except BadRequestError as exc:
        raise BadRequestError(f"{body.where}{exc}") from None


def _samplers(body: Body, key: str) -> list[str]:
    v = body.get(key)
    if isinstance(v, str):
        v = [s for s in v.replace(",", ";").split(";") if s]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise BadRequestError(f"'{body.where}{key}' must be a list of stage names, got {_show(v)}")
    return [s for s in v if s not in _FOREIGN_STAGES]


def grammar_from(body: Body) -> Grammar | None:
    """llama-server's `grammar` (GBNF) or `json_schema`, or OpenAI's `response_format`.
    Compiling grows with the grammar: call it off the event loop (see `generation_request`)."""
    if body.has("grammar"):
        text = body.str("grammar")
        _check_grammar_size(len(text), "grammar")
        return Grammar.from_gbnf(text)
    if body.has("json_schema"):
        return schema_grammar(body.get("json_schema"), "json_schema")
    if body.has("response_format"):
        fmt = body.obj("response_format")
        kind = fmt.str("type", required=True)
        if kind == "text":
            return None
        if kind == "json_object":
            schema = fmt.get("schema")
            return schema_grammar(schema, "response_format.schema") if schema is not None else Grammar.json_object()
        if kind == "json_schema":
            inner = fmt.obj("json_schema")
            schema = inner.get("schema")
            if schema is None:
                raise BadRequestError("'response_format.json_schema.schema' is required")
            return schema_grammar(schema, "response_format.json_schema.schema")
        raise BadRequestError(f"'response_format.type' must be text, json_object or json_schema, got {_show(kind)}")
    return None


def schema_grammar(schema, where: str) -> Grammar:
    """The Grammar of a JSON schema given in a request's field `where`."""
    if not isinstance(schema, (dict, bool)):
        raise BadRequestError(f"'{where}' must be a JSON schema object, got {_show(schema)}")
    _check_grammar_size(len(json.dumps(schema)), where)
    try:
        return Grammar.from_json_schema(schema)
    except BadRequestError as exc:
        raise BadRequestError(f"'{where}': {exc}") from None


def _check_grammar_size(n_chars: int, where: str) -> None:
    if n_chars > MAX_GRAMMAR_CHARS:
        raise BadRequestError(f"'{where}' may be at most {MAX_GRAMMAR_CHARS} characters long, got {n_chars}")


def generation_request(
    fields: Body, sampling: SamplingParams, max_tokens: int | None, grammar: Grammar | None, **limits
) -> GenerationRequest:
    """The GenerationRequest every dialect builds: `fields` is where its `stop` and
    `lookup` live (the body, or Ollama's `options`); `limits` are llama-server's
    t_max_predict_ms, n_indent and ignore_eos. A dialect's builder compiles a grammar,
    so it runs in a worker thread (`await asyncio.to_thread(build_request, body)`)."""
    try:
        return GenerationRequest(
            sampling=sampling, max_tokens=max_tokens, stop=fields.strings("stop") or (),
            lookup=fields.bool("lookup", True), grammar=grammar, **limits,
        )
    except BadRequestError as exc:  # GenerationRequest names the field; say where it sits
        raise BadRequestError(f"{fields.where}{exc}") from None


def tool_fields(body: Body, constraints: tuple[str, ...]) -> dict:
    """`tools`, `tool_choice` and `parallel_tool_calls` as GenerationRequest keyword
    arguments (none when the body declares no tool). `constraints` are the dialect's own
    output-constraint fields (`grammar`, `response_format`, Ollama's `format`, ...): a
    call brings its own grammar, so one of them with tools is refused under its name.
    Compiles every tool's schema: call it off the event loop, like grammar_from."""
    raw = body.get("tools")
    if raw:
        for key in constraints:
            if _constrains(body, key):
                raise BadRequestError(f"'{key}' cannot be combined with 'tools': send one or the other")
    tools = parse_tools(raw, "tools")
    choice = parse_tool_choice(body.get("tool_choice"), tools, "tool_choice")  # "required" needs tools
    if not tools:
        return {}  # "auto" and "none" without tools: a plain chat
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.bool("parallel_tool_calls", True)}


def _constrains(body: Body, key: str) -> bool:
    """Whether a constraint field asks for one: unset, "" (Ollama's no format) and
    OpenAI's {"type": "text"} do not."""
    v = body.get(key)
    if v is None or v == "":
        return False
    return not (key == "response_format" and isinstance(v, dict) and v.get("type") == "text")


def messages(body: Body) -> list[dict]:
    """A chat's messages as {role, content} with text content (OpenAI's list-of-parts
    content is joined; images are refused: these models read text only), plus any
    tool_calls, tool_call_id, tool_name and name (Engine.chat_prompt normalises them)."""
    raw = body.list("messages", required=True, most=MAX_MESSAGES)
    if not raw:
        raise BadRequestError("'messages' must hold at least one message")
    out = []
    for where, m in objects(raw, "messages", "an object with role and content"):
        role = m.get("role")
        if not isinstance(role, str) or not role or len(role) > MAX_ROLE_CHARS:
            raise BadRequestError(
                f"'{where}.role' must be a string of 1..{MAX_ROLE_CHARS} characters, got {_show(role)}"
            )
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            if len(content) > MAX_CONTENT_PARTS:
                raise BadRequestError(
                    f"'{where}.content' may hold at most {MAX_CONTENT_PARTS} parts, got {len(content)}"
                )
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise BadRequestError(f"'{where}.content[{j}]' must be a text part; this server reads text only")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise BadRequestError(f"'{where}.content' must be a string, got {_show(content)}")
        if m.get("images"):
            raise BadRequestError(f"'{where}.images': this server reads text only")
        msg = {"role": role, "content": content}
        # tool calls and results travel as given; localrun.tools.history_messages checks them
        msg.update({k: m[k] for k in _TOOL_KEYS if m.get(k) is not None})
        thought = _history_reasoning(m, where) if role == "assistant" else ""
        if thought:
            msg["reasoning_content"] = thought
        out.append(msg)
    return out


_TOOL_KEYS = ("tool_calls", "tool_call_id", "tool_name", "name")
# an earlier answer's thinking, as clients hand it back: OpenAI-style (llama-server,
# LM Studio) and Ollama's
_REASONING_KEYS = ("reasoning_content", "thinking")


def _history_reasoning(m: dict, where: str) -> str:
    """An assistant message's earlier thinking, which reaches the template as the
    message's `reasoning_content` (templates that show earlier thinking read it; most
    drop it from past turns)."""
    for key in _REASONING_KEYS:
        v = m.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise BadRequestError(f"'{where}.{key}' must be a string, got {_show(v)}")
        return v
    return ""
