"""Reading request bodies: typed fields whose errors name the field, and the mapping of
each dialect's sampling parameters onto SamplingParams (so every sampler stage is
reachable over REST, under llama-server's names in every dialect)."""

from __future__ import annotations

import json
import math

from ..errors import BadRequestError
from ..grammar import Grammar
from ..sampling import SamplingParams

# SamplingParams fields a request may set under their own (llama-server) names
SAMPLING_FIELDS = (
    "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p", "typical_p",
    "xtc_probability", "xtc_threshold", "min_keep", "repeat_penalty", "repeat_last_n",
    "presence_penalty", "frequency_penalty", "mirostat", "mirostat_tau", "mirostat_eta",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
    "samplers", "seed",
)
# llama-server stage names with no counterpart here: accepted and left out of the order
_FOREIGN_STAGES = {"infill", "penalties_last", "top_n_sigma"}


class Body:
    """Typed access to a JSON object; `where` prefixes field names in errors ("options.")."""

    def __init__(self, data: dict, where: str = "") -> None:
        self.data = data
        self.where = where

    def _name(self, key: str) -> str:
        return f"'{self.where}{key}'"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default=None):
        v = self.data.get(key)
        return default if v is None else v

    def str(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        v = self.data.get(key)
        if v is None:
            if required:
                raise BadRequestError(f"{self._name(key)} is required")
            return default
        if not isinstance(v, str):
            raise BadRequestError(f"{self._name(key)} must be a string, got {_show(v)}")
        return v

    def int(self, key: str, default: int | None = None, lo: int | None = None) -> int | None:
        v = self.data.get(key)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadRequestError(f"{self._name(key)} must be an integer, got {_show(v)}")
        if lo is not None and v < lo:
            raise BadRequestError(f"{self._name(key)} must be >= {lo}, got {v}")
        return v

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
            return Body({}, f"{self.where}{key}.")
        if not isinstance(v, dict):
            raise BadRequestError(f"{self._name(key)} must be a JSON object, got {_show(v)}")
        return Body(v, f"{self.where}{key}.")

    def list(self, key: str, required: bool = False) -> list | None:
        v = self.data.get(key)
        if v is None:
            if required:
                raise BadRequestError(f"{self._name(key)} is required")
            return None
        if not isinstance(v, list):
            raise BadRequestError(f"{self._name(key)} must be a list, got {_show(v)}")
        return v


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, (bytes, bytearray)) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def sampling_params(body: Body, renames: dict[str, str] | None = None, n_probs: int = 0) -> SamplingParams:
    """SamplingParams from a body's fields. `renames` maps a dialect's names to ours
    (Ollama's options use ours for most; OpenAI has none beyond seed)."""
    values: dict = {}
    names = dict.fromkeys(SAMPLING_FIELDS, None)
    names.update(renames or {})
    for key, target in names.items():
        if not body.has(key):
            continue
        field = target or key
        if field == "samplers":
            values[field] = _samplers(body, key)
        elif field == "dry_sequence_breakers":
            values[field] = body.strings(key) or []
        elif field in ("top_k", "repeat_last_n", "mirostat", "dry_allowed_length", "dry_penalty_last_n", "min_keep", "seed"):
            values[field] = body.int(key)
        else:
            values[field] = body.float(key)
    if "seed" in values and values["seed"] is not None and values["seed"] < 0:
        values["seed"] = None  # llama-server's -1: a random seed
    bias = logit_bias(body, "logit_bias")
    try:
        return SamplingParams(logit_bias=bias, n_probs=n_probs, **values)
    except BadRequestError as exc:
        raise BadRequestError(f"{body.where}{exc}") from None


def _samplers(body: Body, key: str) -> list[str]:
    v = body.get(key)
    if isinstance(v, str):
        v = [s for s in v.replace(",", ";").split(";") if s]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise BadRequestError(f"'{body.where}{key}' must be a list of stage names, got {_show(v)}")
    return [s for s in v if s not in _FOREIGN_STAGES]


def logit_bias(body: Body, key: str) -> dict[int | str, float]:
    """OpenAI's {"id": bias} or llama-server's [[id, bias], ...], where an entry may also
    be text (its tokens get the bias); a bias of false bans the token."""
    v = body.get(key)
    if v is None:
        return {}
    pairs = v.items() if isinstance(v, dict) else v if isinstance(v, list) else None
    if pairs is None:
        raise BadRequestError(f"'{body.where}{key}' must be an object of token id -> bias, got {_show(v)}")
    out: dict[int | str, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadRequestError(f"'{body.where}{key}' entries must be [token id, bias] pairs, got {_show(pair)}")
        tok, bias = pair
        if isinstance(tok, str) and tok and not tok.lstrip("-").isdigit():
            tid = tok  # llama-server's text form: the engine biases the text's tokens
        else:
            try:
                tid = int(tok)
            except (TypeError, ValueError):
                raise BadRequestError(f"'{body.where}{key}' keys must be token ids or text, got {_show(tok)}") from None
        if bias is False:
            out[tid] = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise BadRequestError(f"'{body.where}{key}' values must be numbers, got {_show(bias)}")
        else:
            out[tid] = float(bias)
    return out


def grammar_from(body: Body) -> Grammar | None:
    """llama-server's `grammar` (GBNF) or `json_schema`, or OpenAI's `response_format`."""
    if body.has("grammar"):
        return Grammar.from_gbnf(body.str("grammar"))
    if body.has("json_schema"):
        return _schema(body.get("json_schema"), "json_schema")
    if body.has("response_format"):
        fmt = body.obj("response_format")
        kind = fmt.str("type", required=True)
        if kind == "text":
            return None
        if kind == "json_object":
            schema = fmt.get("schema")
            return _schema(schema, "response_format.schema") if schema is not None else Grammar.json_object()
        if kind == "json_schema":
            inner = fmt.obj("json_schema")
            schema = inner.get("schema")
            if schema is None:
                raise BadRequestError("'response_format.json_schema.schema' is required")
            return _schema(schema, "response_format.json_schema.schema")
        raise BadRequestError(f"'response_format.type' must be text, json_object or json_schema, got {_show(kind)}")
    return None


def _schema(schema, where: str) -> Grammar:
    if not isinstance(schema, (dict, bool)):
        raise BadRequestError(f"'{where}' must be a JSON schema object, got {_show(schema)}")
    try:
        return Grammar.from_json_schema(schema)
    except BadRequestError as exc:
        raise BadRequestError(f"'{where}': {exc}") from None


def messages(body: Body) -> list[dict]:
    """A chat's messages as {role, content} with text content (OpenAI's list-of-parts
    content is joined; images are refused: these models read text only)."""
    raw = body.list("messages", required=True)
    if not raw:
        raise BadRequestError("'messages' must hold at least one message")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequestError(f"'{where}' must be an object with role and content, got {_show(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequestError(f"'{where}.role' must be a non-empty string, got {_show(role)}")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
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
        out.append({"role": role, "content": content})
    return out
