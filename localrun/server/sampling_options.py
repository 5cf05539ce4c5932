"""`localrun serve`'s sampling flags, as llama-server's: the values every request gets for
the sampler fields it leaves out, in every dialect (a request's own value wins). Only
argparse and the sampler declarations (which the CLI's parser imports anyway) are
imported here, so `localrun --help` stays instant.

    add_sampling_defaults_flags(parser)     # in the serve command's parser
    build_app(..., sampling=sampling_defaults(args))
"""

from __future__ import annotations

import argparse

# (flags, SamplingParams field, argparse type, metavar, help): llama-server's flag names;
# --temp also answers to `localrun run`'s --temperature
_FLAGS = (
    (("--temp", "--temperature"), "temperature", float, "T", "0 = greedy; default 0.8"),
    (("--top-k",), "top_k", int, "N", "0 or -1 = off; default 40"),
    (("--top-p",), "top_p", float, "P", "1 = off; default 0.95"),
    (("--min-p",), "min_p", float, "P", "0 = off; default 0.05"),
    (("--seed",), "seed", int, "N", "-1 = a random one per request (default)"),
)


def add_sampling_defaults_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling defaults",
        "values for the requests that leave the field out, in every dialect (Ollama: 'options'); a request's own"
        " value wins. --temp 0 makes answers repeatable for clients that send no temperature (Codex CLI)",
    )
    for flags, name, kind, metavar, text in _FLAGS:
        g.add_argument(*flags, dest=f"default_{name}", type=kind, default=None, metavar=metavar, help=text)


def sampling_defaults(args: argparse.Namespace) -> dict:
    """The flags given, as SamplingParams fields (a seed of -1: None, a random one); a
    value out of its parameter's range is one error line naming the flag."""
    from ..errors import BadRequestError
    from ..sampling.params import PARAMETER

    out = {}
    for flags, name, _, _, _ in _FLAGS:
        value = getattr(args, f"default_{name}", None)
        if value is None:
            continue
        spec = PARAMETER[name]
        try:
            out[name] = spec.check(value)
        except BadRequestError:
            means = "an integer 0..2**64-1, or -1 for a random one" if name == "seed" else spec.means
            raise BadRequestError(f"{flags[0]} must be {means}, got {value}") from None
    if out.get("seed") is not None and out["seed"] < 0:
        out["seed"] = None  # llama-server's -1, as a request's
    return out
