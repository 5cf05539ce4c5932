"""Reasoning ("thinking") controls as each dialect spells them, read into one shape.

    OpenAI chat   reasoning_effort none|minimal|low|medium|high|xhigh, chat_template_kwargs {...},
                  reasoning_format none|auto|deepseek, thinking_budget_tokens / reasoning_budget N
    Responses     reasoning: {effort}
    Ollama        think: true | false | "low" | "medium" | "high"
    Anthropic     thinking: {type: enabled, budget_tokens} | {type: adaptive} | {type: disabled},
                  output_config: {effort}

Each becomes a `Reasoning`: a budget (tokens of thinking before the engine ends it), a
format ("auto": reasoning apart from the answer; "none": the raw text), and variables for
the chat template (`enable_thinking`, `reasoning_effort`: the names the templates of
Qwen3, DeepSeek-R1, GLM, gpt-oss and Granite read; a template that reads neither ignores
them). What a request leaves unset falls back to the server's `--reasoning-budget` /
`--reasoning-format`, then to the model's own behaviour.

An effort level of "none" turns thinking off (`enable_thinking: false`), as OpenAI's
"none" means; "minimal" is "low" and "xhigh" is "high" for templates, which know three
levels (gpt-oss's `Reasoning: low|medium|high`). A request's own `chat_template_kwargs`
win over what an effort level implies. Values and bounds are checked here with the
dialect's field names, and again by GenerationRequest (`check_template_kwargs`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import BadRequestError, client_integer
from ..request import MAX_TOKENS_LIMIT
from .fields import Body, _show

# OpenAI's effort levels (chat's reasoning_effort, Responses' reasoning.effort)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# what a template is told for each level; "none" turns thinking off instead
TEMPLATE_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
OLLAMA_THINK_LEVELS = ("low", "medium", "high")
# llama-server's --reasoning-format values; "deepseek" is its name for reasoning apart
FORMATS = {"auto": "auto", "deepseek": "auto", "none": "none"}
# Anthropic's output_config.effort (an effort level of the whole answer): read as the
# reasoning effort where the template takes one; an unknown level changes nothing
ANTHROPIC_EFFORT = {"low": "low", "medium": "medium", "high": "high", "max": "high"}
NO_LIMIT = -1  # llama-server's spelling of "no reasoning budget"


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning controls; None means "not said here"."""

    budget: int | None = None  # tokens of thinking; NO_LIMIT says "unlimited" over a server default
    format: str | None = None  # "auto" | "none"
    template_kwargs: dict = field(default_factory=dict)

    def over(self, defaults: "Reasoning") -> "Reasoning":
        """These controls, with what they leave unset taken from `defaults` (the server's)."""
        return Reasoning(
            self.budget if self.budget is not None else defaults.budget,
            self.format or defaults.format,
            {**defaults.template_kwargs, **self.template_kwargs},
        )

    def request_fields(self) -> dict:
        """GenerationRequest's keyword arguments for these controls."""
        budget = None if self.budget is None or self.budget == NO_LIMIT else self.budget
        return {"reasoning_budget": budget, "reasoning_format": self.format or "auto",
                "template_kwargs": dict(self.template_kwargs)}

    def raw(self) -> "Reasoning":
        """For a prompt without the chat template (/completion, /v1/completions, FIM, raw
        generate): the text comes back as the model wrote it, as llama-server's raw routes do."""
        return replace(self, format="none")


NO_REASONING = Reasoning()


def budget_value(v, where: str) -> int | None:
    """A reasoning budget in tokens: 0..MAX_TOKENS_LIMIT, or -1 for no limit (llama-server's
    --reasoning-budget -1); `where` names the field in the error."""
    if v is None:
        return None
    n = client_integer(v)
    if n is None:
        raise BadRequestError(f"{where} must be an integer number of tokens, got {_show(v)}")
    if not NO_LIMIT <= n <= MAX_TOKENS_LIMIT:
        raise BadRequestError(f"{where} must be -1 (no limit) or 0..{MAX_TOKENS_LIMIT} tokens, got {n}")
    return n


def format_value(v, where: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or v not in FORMATS:
        raise BadRequestError(f"{where} must be one of {', '.join(FORMATS)}, got {_show(v)}")
    return FORMATS[v]


def effort_kwargs(effort: str | None, where: str) -> dict:
    """The template variables of an OpenAI effort level."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise BadRequestError(f"{where} must be one of {', '.join(EFFORTS)}, got {_show(effort)}")
    if effort == "none":
        return {"enable_thinking": False}
    return {"enable_thinking": True, "reasoning_effort": TEMPLATE_EFFORT[effort]}


def openai_chat(b: Body) -> Reasoning:
    """/v1/chat/completions (and llama-server's names on it)."""
    kwargs = effort_kwargs(b.str("reasoning_effort"), "'reasoning_effort'")
    if b.has("chat_template_kwargs"):
        own = b.get("chat_template_kwargs")
        if not isinstance(own, dict):
            raise BadRequestError(f"'chat_template_kwargs' must be a JSON object, got {_show(own)}")
        kwargs.update(own)  # checked (size, JSON values, reserved names) by GenerationRequest
    budget = None
    for key in ("thinking_budget_tokens", "reasoning_budget"):
        if b.has(key):
            budget = budget_value(b.get(key), f"'{key}'")
    return Reasoning(budget, format_value(b.get("reasoning_format"), "'reasoning_format'"), kwargs)


def responses(b: Body) -> Reasoning:
    """/v1/responses: `reasoning: {effort, summary}` (a summary is not written: the
    reasoning item carries the whole text instead)."""
    r = b.obj("reasoning")
    r.str("summary")
    return Reasoning(template_kwargs=effort_kwargs(r.str("effort"), "'reasoning.effort'"))


def ollama(b: Body) -> Reasoning:
    """/api/chat and /api/generate: `think`."""
    think = b.get("think")
    if think is None:
        return NO_REASONING
    if isinstance(think, bool):
        return Reasoning(template_kwargs={"enable_thinking": think})
    if isinstance(think, str) and think in OLLAMA_THINK_LEVELS:
        return Reasoning(template_kwargs={"enable_thinking": True, "reasoning_effort": think})
    raise BadRequestError(f"'think' must be true, false, \"low\", \"medium\" or \"high\", got {_show(think)}")


ANTHROPIC_THINKING = ("enabled", "adaptive", "disabled")


def anthropic(b: Body) -> Reasoning:
    """/v1/messages: `thinking` and `output_config.effort`. Without `thinking` the model
    thinks as its template does by default (Anthropic's default is no thinking, but a
    local thinking model is made to think; `{type: disabled}` turns it off)."""
    kwargs: dict = {}
    effort = b.obj("output_config").get("effort")
    if isinstance(effort, str) and effort in ANTHROPIC_EFFORT:
        kwargs["reasoning_effort"] = ANTHROPIC_EFFORT[effort]
    if not b.has("thinking"):
        return Reasoning(template_kwargs=kwargs)
    t = b.obj("thinking")
    kind = t.str("type", required=True)
    if kind not in ANTHROPIC_THINKING:
        raise BadRequestError(f"'thinking.type' must be one of {', '.join(ANTHROPIC_THINKING)}; got {_show(kind)}")
    if kind == "disabled":
        return Reasoning(template_kwargs={**kwargs, "enable_thinking": False})
    budget = None
    if kind == "enabled":
        budget = t.int("budget_tokens", lo=0, hi=MAX_TOKENS_LIMIT)
        if budget is None:
            raise BadRequestError("'thinking.budget_tokens' is required when 'thinking.type' is \"enabled\"")
    return Reasoning(budget, None, {**kwargs, "enable_thinking": True})
