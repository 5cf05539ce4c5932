"""The model-making commands: `convert` (and, later, `quantize`, `imatrix`, `quality`).

Registered by localrun.cli through `add_commands`; this module imports only argparse
at load time so `localrun --help` stays instant."""

from __future__ import annotations

import argparse
import sys

from localrun.errors import LocalrunError


def cmd_convert(args: argparse.Namespace) -> int:
    if args.to != "mlx":
        raise LocalrunError(f"--to {args.to} is not supported yet; supported: mlx")
    from localrun.quant.gguf_to_mlx import convert_gguf_to_mlx

    out = convert_gguf_to_mlx(args.src, args.output, progress=lambda msg: print(msg, file=sys.stderr))
    print(out)
    return 0


def add_commands(sub) -> None:
    conv = sub.add_parser("convert", help="convert a model to another format")
    conv.add_argument("src", help="source model (a .gguf file)")
    conv.add_argument("--to", required=True, help="target format: mlx")
    conv.add_argument("-o", "--output", required=True, help="output folder (must not exist or be empty)")
    conv.set_defaults(func=cmd_convert)
