"""A thinking model's thinking in the terminal front ends (`localrun run`, the piped chat)
and the flags that control it; free of Textual, so `localrun run` does not load it.

The answer goes to stdout and the thinking to stderr, so `localrun run ... | next` pipes
only the answer. On a terminal the thinking is dimmed, and a line break ends it before
the answer, which then starts on its own line when both streams share the screen."""

from __future__ import annotations

import sys

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingOut:
    """Writes thinking pieces to `stream` as they come (nothing when `hidden`)."""

    def __init__(self, stream=None, hidden: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.hidden = hidden
        self.dim = _is_terminal(self.stream)
        self.open = False  # thinking written and not yet ended by a line break

    def write(self, piece: str) -> None:
        if self.hidden or not piece:
            return
        if not self.open:
            self.open = True
            if self.dim:
                self.stream.write(DIM)
        self.stream.write(piece)
        self.stream.flush()

    def end(self) -> None:
        """The answer begins (or the reply ended): close the thinking's line."""
        if not self.open:
            return
        self.open = False
        self.stream.write((RESET if self.dim else "") + "\n")
        self.stream.flush()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def reasoning_options(args) -> dict:
    """`--reasoning-budget N` and `--think/--no-think` as GenerationRequest keyword
    arguments (reasoning_budget, template_kwargs); -1 means no budget, as on `serve`."""
    budget = getattr(args, "reasoning_budget", None)
    think = getattr(args, "think", None)
    from localrun.server.reasoning import budget_value

    budget = budget_value(budget, "--reasoning-budget")
    return {"reasoning_budget": None if budget is None or budget < 0 else budget,
            "template_kwargs": {} if think is None else {"enable_thinking": think}}
