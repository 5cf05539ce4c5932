"""The sampling flags of `localrun run` and `localrun chat`, one per parameter declared
with a flag (PARAMETERS), and the SamplingParams they give: shared by the CLI and the chat
app, which both read a parsed argparse namespace."""

from __future__ import annotations

import argparse

from localrun.errors import LocalrunError

from .bias import bias_item
from .params import PARAMETERS, SamplingParams

# a metavar for each repeatable kind of sampling flag
_METAVARS = {"strings": "TEXT", "bias": "ID=BIAS"}


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per sampler parameter declared with one (localrun.sampling.PARAMETERS):
    numbers take a value and show their default; lists repeat; `--samplers` takes names."""
    g = p.add_argument_group("sampling")
    for spec in PARAMETERS:
        if spec.flag is None:
            continue
        if spec.kind in ("int", "float"):
            text = f"{spec.help + '; ' if spec.help else ''}default {spec.default}"
            g.add_argument(spec.flag, dest=spec.name, type=int if spec.kind == "int" else float,
                           default=spec.default, help=text)
        elif spec.kind in _METAVARS:
            g.add_argument(spec.flag, dest=spec.name, action="append", default=None, metavar=_METAVARS[spec.kind],
                           help=spec.help)
        else:
            g.add_argument(spec.flag, dest=spec.name, default=None, help=spec.help)


def _logit_bias(items: list[str] | None) -> list[tuple[str, float]]:
    """--logit-bias ID=BIAS / TEXT=BIAS items as pairs; SamplingParams checks and adds them up."""
    pairs = []
    for item in items or []:
        try:
            pairs.append(bias_item(item))
        except ValueError:
            raise LocalrunError(f"--logit-bias takes ID=BIAS or TEXT=BIAS, e.g. 15043=-5, got {item!r}") from None
    return pairs


def sampling_from_args(args: argparse.Namespace):
    """SamplingParams from the sampling flags; a list flag not given keeps its default."""
    values = {}
    for spec in PARAMETERS:
        if spec.flag is None:
            continue
        value = getattr(args, spec.name)
        if spec.kind == "bias":
            value = _logit_bias(value)
        elif spec.kind == "strings" and value is None:
            continue
        values[spec.name] = value
    return SamplingParams(**values)
