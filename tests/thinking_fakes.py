"""A thinking model without a model: the scripted backend (tests/fakes.py) behind the real
engine and server, answering "<think>PLAN</think>ANSWER" after a ChatML template that
reads `enable_thinking`, `reasoning_effort` and an assistant's `reasoning_content`.

What the script writes depends on the prompt, so a test sees what reached the template:
with `enable_thinking: false` the prompt ends in an empty think block and the model
answers at once; a `reasoning_effort` is echoed in the thinking; an earlier turn's
`reasoning_content` shown by the template is echoed in the answer."""

from __future__ import annotations

import re

from fakes import EOS, ScriptedBackend
from localrun.engine import Engine

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}{% endif %}"
)
ASSISTANT = b"<|im_start|>assistant\n"
PLAN, ANSWER = "plan", "answer"
EMPTY_THINKING = "<think>\n\n</think>\n\n"  # what the template writes with enable_thinking false


def reply_for(prompt: str) -> str:
    """The model's whole reply to a rendered prompt (see the module docstring)."""
    tail = prompt.rsplit("<|im_start|>assistant\n", 1)[-1]
    earlier = re.findall(r"<think>(.+?)</think>", prompt.rsplit("<|im_start|>user", 1)[0])
    answer = ANSWER + (f" (after {earlier[-1]})" if earlier else "")
    if tail.startswith(EMPTY_THINKING):
        return answer
    effort = re.search(r"\[effort=(\w+)\]", tail)
    return f"<think>{PLAN}{'-' + effort.group(1) if effort else ''}</think>{answer}"


def thinking_script(hist: list[int]) -> int:
    """The next byte of `reply_for(prompt)`, the prompt being everything up to the last
    assistant header in the sequence."""
    data = bytes(t for t in hist if t < 256)
    at = data.rfind(ASSISTANT)
    head_end = at + len(ASSISTANT)
    # the generation prompt's own tail (an empty thinking block, "[effort=..]") belongs to the
    # prompt; the empty block is spaced as no answer writes it (the budget writes "</think>"
    # right after "<think>")
    prompt_end = head_end
    for extra in (re.escape(EMPTY_THINKING.encode()), rb"\[effort=\w+\]"):
        m = re.compile(extra).match(data, prompt_end)
        if m:
            prompt_end = m.end()
    reply = reply_for(data[:prompt_end].decode("utf-8", "replace")).encode()
    # what the prompt's tail already holds is not written again
    already = data[head_end:prompt_end].decode()
    if reply.decode().startswith(already):
        reply = reply[len(already):]
    written = data[prompt_end:]
    if b"</think>" in written and b"</think>" in reply:
        # the thinking ended (by the model, or by the engine's reasoning budget): the answer
        # follows from its start, past the spacing after the marker
        after = written.split(b"</think>", 1)[1].lstrip(b"\n")
        answer = reply.split(b"</think>", 1)[1]
        return answer[len(after)] if len(after) < len(answer) else EOS
    return reply[len(written)] if len(written) < len(reply) else EOS


class ThinkingEngine(Engine):
    """The real engine (its reply parser splits the thinking out: the template writes
    `<think>`), keeping every request it started (`requests`)."""

    def __init__(self, backend, chat_template: str | None = TEMPLATE) -> None:
        super().__init__(backend, chat_template)
        self.requests: list = []

    def start(self, prompt, request=None, **options):
        gen = super().start(prompt, request, **options)
        self.requests.append(request)
        return gen


def thinking_engine(n_ctx: int = 2048, n_seq: int = 2) -> ThinkingEngine:
    return ThinkingEngine(ScriptedBackend(thinking_script, n_ctx=n_ctx, n_seq=n_seq, n_batch=512))
