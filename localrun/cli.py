"""`localrun` command line. Subcommands import their heavy modules only when run, so
`localrun --help` answers at once. A LocalrunError becomes one line on stderr."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import LocalrunError


def _add_constraints(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("constrained output (one of)").add_mutually_exclusive_group()
    g.add_argument("--grammar", metavar="FILE", help="a GBNF grammar file (llama.cpp syntax)")
    g.add_argument("--json-schema", metavar="FILE", help="a JSON schema file the answer must validate against")
    g.add_argument("--regex", metavar="PATTERN", help="a regular expression the whole answer must match")
    g.add_argument("--json", action="store_true", help="any JSON object")


def _add_thinking(p: argparse.ArgumentParser, run: bool = False) -> None:
    g = p.add_argument_group("thinking models")
    g.add_argument("--reasoning-budget", type=int, default=None, metavar="N",
                   help="end the model's thinking after N tokens and let it answer (0: answer at once;"
                   " default: no limit)")
    g.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="turn the model's thinking on or off where its template can (enable_thinking;"
                   " default: the template's own)")
    if run:
        g.add_argument("--hide-thinking", action="store_true",
                       help="leave the thinking out (default: written to stderr, dimmed on a terminal)")


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise LocalrunError(f"cannot read the {what} file {path}: {exc.strerror}") from exc


def grammar_from_args(args: argparse.Namespace):
    """The Grammar the flags ask for, or None."""
    if not (args.grammar or args.json_schema or args.regex or args.json):
        return None
    from .grammar.core import Grammar

    if args.grammar:
        return Grammar.from_gbnf(_read_text(args.grammar, "grammar"))
    if args.json_schema:
        return Grammar.from_json_schema(_read_text(args.json_schema, "JSON schema"))
    if args.regex:
        return Grammar.from_regex(args.regex)
    return Grammar.json_object()


def _add_model(p: argparse.ArgumentParser, optional: bool = False) -> None:
    what = "a .gguf file, an MLX model folder, or an installed name org/repo[:QUANT]"
    if optional:
        p.add_argument("model", nargs="?", default=None,
                       help=what + " (default: the last one used, else the best installed one, else a picker)")
    else:
        p.add_argument("model", help=what)
    p.add_argument("--ctx", type=int, default=None, help="context size in tokens (default: min(4096, trained))")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--kv-cache-type", choices=("f16", "q8_0", "q4_0"), default="f16",
                   help="KV cache element type: q8_0 holds about half of f16's memory per token, q4_0 a quarter"
                   " (default f16)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default: to the end of the context)")
    p.add_argument("--verbose", action="store_true", help="print timings to stderr")
    p.add_argument("--no-lookup", dest="lookup", action="store_false", help="turn prompt-lookup speculative decoding off")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template used instead of the model's own (e.g. one with tool support)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="load an MLX model whose config asks to run Python code shipped with it (model_file,"
                   " auto_map); that code runs with your rights (default: such models are refused)")
    from .commands.draft import add_draft_flags
    from .commands.rpc import add_rpc_flags

    add_rpc_flags(p)  # --rpc, --tensor-split
    add_draft_flags(p)  # --draft, --draft-max


def cmd_run(args: argparse.Namespace) -> int:
    from .engine import Engine
    from .generation import print_timings
    from .request import GenerationRequest
    from .sampling.flags import sampling_from_args
    from localrun.tui.thinking import ThinkingOut, reasoning_options

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise LocalrunError("no prompt: pass one as an argument or on stdin")
    # every flag is checked (and a grammar compiled) before the model loads
    thinking = reasoning_options(args)
    request = GenerationRequest(
        sampling=sampling_from_args(args), max_tokens=args.max_tokens, stop=args.stop,
        lookup=args.lookup, grammar=grammar_from_args(args), **thinking,
        # a raw prompt skips the template: its answer is the raw text, thinking markup and all
        reasoning_format="none" if args.raw else "auto",
    )
    from .commands.draft import check_draft_flags, draft_options
    from .commands.rpc import apply_rpc_flags

    check_draft_flags(args)
    cluster = apply_rpc_flags(args)  # --rpc workers: probed and registered before the model loads
    with Engine.open(args.model, cluster=cluster, n_ctx=args.ctx, threads=args.threads, kv_cache_type=args.kv_cache_type,
                     chat_template=args.chat_template, trust_remote_code=args.trust_remote_code,
                     **draft_options(args)) as engine:
        if args.raw:
            tokens = engine.tokenize(prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            tokens = engine.chat_prompt(messages, template_kwargs=thinking["template_kwargs"])
        last = None
        thoughts = ThinkingOut(sys.stderr, hidden=args.hide_thinking)
        for ev in engine.generate(tokens, request):
            thoughts.write(ev.reasoning)
            if ev.text or ev.tool_calls:
                thoughts.end()
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            last = ev
        thoughts.end()
        sys.stdout.write("\n")
        if args.verbose and last is not None and last.timings is not None:
            print_timings(last.timings)
            print_attention(engine.backend)
    return 0


def print_attention(backend) -> None:
    """Which attention kernel a llama.cpp model answered with, and the timing it rests on."""
    choice = getattr(backend, "flash_attn", None)
    if choice is None:  # MLX: one kernel
        return
    timing = getattr(backend, "attention_timing", None)
    said = timing.explain(getattr(backend, "n_seq", 1)) if timing else f"flash attention {choice}"
    print(f"attention:            {said}", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> int:
    from localrun.tui.app import run_chat  # the Textual app; the line REPL when piped

    if args.chat_template:  # a broken file is one error line before the app starts
        from .prompt.chat_template import load_template_file

        load_template_file(args.chat_template)
    from .commands.draft import check_draft_flags
    from .commands.rpc import apply_rpc_flags

    check_draft_flags(args)
    args.cluster = apply_rpc_flags(args)  # every GGUF the chat opens splits over them
    return run_chat(args)


# Modules that add their own subcommands (`add_commands(subparsers)`); each imports only
# argparse at load time, so `localrun --help` stays instant.
COMMAND_MODULES = ["localrun.quant.cli", "localrun.commands.serve", "localrun.commands.store", "localrun.commands.rpc",
                   "localrun.commands.mlx_ring"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localrun", description="Run language models on your own machine.")
    parser.add_argument("--version", action="version", version=f"localrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from .sampling.flags import add_sampling_flags

    run = sub.add_parser("run", help="answer one prompt, streamed to stdout")
    _add_model(run)
    run.add_argument("prompt", nargs="?", default=None, help="the prompt (read from stdin when omitted)")
    run.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    run.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    add_sampling_flags(run)
    _add_constraints(run)
    _add_thinking(run, run=True)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="chat with a model in the terminal")
    _add_model(chat, optional=True)
    add_sampling_flags(chat)
    _add_thinking(chat)
    g = chat.add_argument_group("constrained output (one of; also set in the chat's settings)")
    g = g.add_mutually_exclusive_group()
    g.add_argument("--grammar", metavar="FILE", help="a GBNF grammar file (llama.cpp syntax)")
    g.add_argument("--json-schema", metavar="FILE", help="a JSON schema file every answer must validate against")
    chat.set_defaults(func=cmd_chat)

    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except LocalrunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `localrun run ... | head` closed the pipe: not an error
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
