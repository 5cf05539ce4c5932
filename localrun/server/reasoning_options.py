"""`localrun serve`'s reasoning flags: the defaults every request gets unless it says
otherwise (a request's own budget, format or template variables win). Only argparse is
imported here, so `localrun --help` stays instant.

    add_reasoning_flags(parser)             # in the serve command's parser
    build_app(..., reasoning=reasoning_defaults(args))
"""

from __future__ import annotations

import argparse


def add_reasoning_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reasoning (thinking models)")
    g.add_argument("--reasoning-budget", type=int, default=None, metavar="N",
                   help="end a model's thinking after N tokens (its own end-of-thinking marker is written and"
                   " the answer follows); 0 answers at once, -1 = no limit (default); a request's"
                   " thinking_budget_tokens / thinking.budget_tokens wins")
    g.add_argument("--reasoning-format", choices=("auto", "none"), default=None,
                   help="auto: reasoning apart from the answer (reasoning_content, thinking, ...; default);"
                   " none: the raw text, <think> and all, in the answer; a request's reasoning_format wins")


def reasoning_defaults(args: argparse.Namespace):
    """The flags as the server's default `Reasoning`; a bad value is one error line."""
    from .reasoning import Reasoning, budget_value

    budget = getattr(args, "reasoning_budget", None)
    return Reasoning(budget_value(budget, "--reasoning-budget"), getattr(args, "reasoning_format", None))
