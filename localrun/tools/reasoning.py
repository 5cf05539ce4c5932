"""How a model marks its reasoning ("thinking"), detected from its chat template.

    think     <think>...</think>            Qwen3, QwQ, DeepSeek-R1, GLM-4.5+, Kimi-K2-Thinking, Granite 3.3
    mistral   [THINK]...[/THINK]            Magistral, Ministral-3 reasoning
    seed      <seed:think>...</seed:think>  Seed-OSS
    harmony   <|channel|>analysis<|message|>...<|end|>   gpt-oss (its answer parser reads the
              channels itself: harmony.py)

Some templates open the block in the generation prompt (DeepSeek-R1 distills, Qwen3.5,
GLM-4.7 end it with `<think>\\n`), and some close an empty one there when thinking is off
(Qwen3's `enable_thinking=false` renders `<think>\\n\\n</think>\\n\\n`). Which of these a
prompt did is read from the prompt itself (`opened_by`); the template's text only gives
the default (`opens_in_prompt`), for callers without the prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WS = " \t\r\n"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # opens the reasoning block
    end: str  # closes it
    opens_in_prompt: bool = False  # the template's generation prompt (by default) ends inside the block
    # what the engine writes to end the reasoning early (a reasoning budget ran out)
    close: str = ""

    @property
    def end_of_reasoning(self) -> str:
        return self.close or self.end

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end)

    def opened_by(self, prompt_tail: str) -> bool:
        """The prompt (its last characters) leaves the model inside a reasoning block: the
        last start marker stands after the last end marker, with nothing but spacing after
        it (`...<think>\\n` yes; `<think>\\n\\n</think>\\n\\n` no; a plain prompt no)."""
        text = prompt_tail.rstrip(_WS)
        if not text.endswith(self.start.rstrip(_WS)):
            return False
        return text.rfind(self.start.rstrip(_WS)) > text.rfind(self.end)

    def closed_by(self, prompt_tail: str) -> bool:
        """The prompt ends with a closed block (`<think>\n\n</think>\n\n`: thinking was
        turned off), so the answer starts after the reasoning."""
        return prompt_tail.rstrip(_WS).endswith(self.end)


THINK = ReasoningFormat("think", "<think>", "</think>", close="</think>\n\n")
MISTRAL_THINK = ReasoningFormat("mistral", "[THINK]", "[/THINK]")
SEED_THINK = ReasoningFormat("seed", "<seed:think>", "</seed:think>", close="</seed:think>\n")
HARMONY_REASONING = ReasoningFormat(
    "harmony", "<|channel|>analysis<|message|>", "<|end|>",
    close="<|end|><|start|>assistant<|channel|>final<|message|>",
)

# quoted string literals of a Jinja template: the texts it may print
_LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"")


def detect_reasoning(template: str | None) -> ReasoningFormat | None:
    """The template's reasoning format (None: the model does not reason in a block)."""
    if not template:
        return None
    if "<|channel|>" in template and "analysis" in template:
        return HARMONY_REASONING
    for fmt in (SEED_THINK, MISTRAL_THINK, THINK):
        if fmt.start in template and fmt.end in template:
            opens = _prompt_opens(template, fmt)
            return ReasoningFormat(fmt.name, fmt.start, fmt.end, opens, fmt.close) if opens else fmt
    return None


def _prompt_opens(template: str, fmt: ReasoningFormat) -> bool:
    """The generation prompt (the template after its last `add_generation_prompt`) prints
    the start marker on its own, not as part of an empty block (`<think>\\n` yes,
    `<think>\\n\\n</think>` no): the default when thinking is on."""
    at = template.rfind("add_generation_prompt")
    if at < 0:
        return False
    tail = template[at:]
    for m in _LITERAL.finditer(tail):
        literal = m.group(1) if m.group(1) is not None else m.group(2)
        if fmt.start in literal and fmt.end not in literal:
            return True
    # a marker written as template text, outside any literal ({%- endif %}<think>)
    plain = _LITERAL.sub("", tail)
    return fmt.start in plain and fmt.end not in plain
