"""`localrun serve`: the command line of the server."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

from ..errors import BadRequestError
from ..server.reasoning_options import add_reasoning_flags
from ..server.sampling_options import add_sampling_defaults_flags

DEFAULT_PORT = 11435


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server.app import build_app
    from ..server.keep_alive import parse_keep_alive
    from ..server.models import ModelManager, display_name
    from ..server.reasoning_options import reasoning_defaults
    from ..server.sampling_options import sampling_defaults
    from ..server.shutdown import BoundedServer

    reasoning = reasoning_defaults(args)  # a bad --reasoning-budget fails before any model loads
    sampling = sampling_defaults(args)  # as a bad --temp does
    if args.parallel < 1:
        raise BadRequestError(f"--parallel must be at least 1, got {args.parallel}")
    if args.ctx is not None and args.ctx < 16:
        raise BadRequestError(f"--ctx must be at least 16 tokens, got {args.ctx}")
    for m in args.model or []:
        _check_model(m, args.trust_remote_code)  # a wrong --model fails now, not at the first request
    if args.max_models < 1:
        raise BadRequestError(f"--max-models must be at least 1, got {args.max_models}")
    if args.batch < 16:
        raise BadRequestError(f"--batch must be at least 16 tokens, got {args.batch}")
    from .draft import check_draft_flags, draft_options
    from .rpc import apply_rpc_flags

    if args.rpc_timeout is not None and not args.rpc:
        raise BadRequestError("--rpc-timeout bounds calls to --rpc workers: add --rpc HOST:PORT, or drop it")
    check_draft_flags(args)
    cluster = apply_rpc_flags(args, announce=True)  # --rpc workers: probed once; every GGUF load splits over them
    if args.rpc_timeout is not None:
        from ..backends import remote

        remote.set_call_timeout(args.rpc_timeout)  # for every model hosted over the workers, as --rpc is
    aliases = [_parse_alias(a) for a in args.alias or []]
    for _, target in aliases:
        if target not in (args.model or []) and target not in {display_name(m) for m in args.model or []}:
            _check_model(target, args.trust_remote_code)  # an alias to nothing fails now, as a --model does
    manager = ModelManager(
        args.model or [], args.ctx, args.parallel, args.threads, args.queue, parse_keep_alive(args.keep_alive),
        args.batch, args.max_models, kv_cache_type=args.kv_cache_type, allow_paths=args.allow_paths,
        trust_remote_code=args.trust_remote_code, chat_template=args.chat_template, aliases=aliases,
        cluster=cluster, **draft_options(args),
    )
    _log_to_stderr(args.log_level)
    _announce_contexts(manager)
    app = build_app(manager, _is_loopback(args.host), args.cors_origin, args.api_key, args.max_body, args.host,
                    reasoning=reasoning, sampling=sampling)
    print(f"localrun serving on http://{args.host}:{args.port} (OpenAI /v1, Ollama /api, llama-server)",
          file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    server = BoundedServer(config, manager)  # SIGTERM / Ctrl+C end the generations; the exit is bounded
    server.run()
    return 0 if server.started else 3  # uvicorn has said why it could not start (a port in use, ...)


def _check_model(name: str, trust_remote_code: bool) -> None:
    """A --model must exist (a path or an installed name), be a file or folder, and not ask
    to run its own code unless allowed."""
    from ..store import local as store
    from ..backends.mlx import check_remote_code

    path = store.resolve_model(name)
    if path.is_dir():
        check_remote_code(path, trust_remote_code, "add --trust-remote-code if you trust it")


def _parse_alias(text: str) -> tuple[str, str]:
    """`--alias NAME=MODEL`: NAME may be a glob (claude-*, gpt-*)."""
    name, sep, target = text.partition("=")
    if not sep or not name.strip() or not target.strip():
        raise BadRequestError(f"--alias must be NAME=MODEL (e.g. 'claude-*=qwen2.5-coder'), got {text!r}")
    return name.strip(), target.strip()


def _announce_contexts(manager) -> None:
    """Print the context each --model will be served with, and why: an agent must be told
    the real window (see the README's Coding agents section)."""
    from ..store import local as store

    for display, spec in manager.configured.items():
        try:
            path = str(store.resolve_model(spec))
        except Exception:  # noqa: BLE001 -- checked by _check_model already; a listing never stops the server
            continue
        choice = manager.context_for(path)
        print(f"{display}: context {choice.n_ctx} tokens per request ({choice.why})", file=sys.stderr)


def _log_to_stderr(level: str = "info") -> None:
    """The server's own log lines (load, unload, internal errors with their traceback)."""
    log = logging.getLogger("localrun")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("localrun %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _rpc_timeout(text: str) -> float:
    """argparse type of --rpc-timeout: seconds above 0, or inf."""
    from ..backends.remote import parse_call_timeout

    try:
        return parse_call_timeout(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="serve models over HTTP (OpenAI, Ollama and llama-server APIs)")
    p.add_argument("--model", action="append", default=None, metavar="MODEL",
                   help="a .gguf file, an MLX folder or a store name (repeatable; the first is the default)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="what the server logs to stderr (default info: loads, unloads, internal errors)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--parallel", type=int, default=4, help="requests decoded together per model (default 4)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context size per request (default: the model's trained context, or the most of it that"
                   " fits this machine's memory with --parallel slots; printed at start)")
    p.add_argument("--alias", action="append", default=None, metavar="NAME=MODEL",
                   help="requests naming NAME get MODEL (repeatable; NAME may be a glob such as 'claude-*' or"
                   " 'gpt-*', for agents that send their own model names); listed in /v1/models and /api/tags")
    p.add_argument("--batch", type=int, default=256,
                   help="most tokens one step decodes (default 256): smaller lets a cancel or a new request"
                   " in sooner during a long prompt, larger reads prompts a little faster")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--kv-cache-type", choices=("f16", "q8_0", "q4_0"), default="f16",
                   help="KV cache element type of every loaded model: q8_0 holds about half of f16's memory"
                   " per token, q4_0 a quarter (default f16)")
    p.add_argument("--queue", type=int, default=64, help="requests that may wait for a slot before 503 (default 64)")
    p.add_argument("--max-models", type=int, default=3,
                   help="models loaded at once; the least recently used idle one makes room (default 3)")
    p.add_argument("--allow-paths", action="store_true",
                   help="let requests name any .gguf file or MLX model folder on this machine by its path"
                   " (default: only the --model models and installed models); whoever can reach the server"
                   " may then load any model file this user can read")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="load MLX models whose config asks to run Python code shipped with them (model_file,"
                   " auto_map); that code runs with this server's rights (default: such models are refused)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template used instead of every served model's own (as llama-server's"
                   " --chat-template-file), e.g. one that renders tools for a model whose template has none")
    add_reasoning_flags(p)
    add_sampling_defaults_flags(p)
    p.add_argument("--keep-alive", default="5m", help="unload a model idle this long (Ollama syntax; -1 = never)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="allow this browser origin (repeatable; default: localhost pages and VS Code webviews)")
    p.add_argument("--max-body", type=int, default=8 * 1024 * 1024, help="largest request body in bytes (413 beyond)")
    from .draft import add_draft_flags
    from .rpc import add_rpc_flags

    add_rpc_flags(p)
    add_draft_flags(p)
    p.add_argument("--rpc-timeout", type=_rpc_timeout, default=None, metavar="SECONDS",
                   help="with --rpc: a call to the model's process that gets no answer this long means a worker"
                   " hangs; the answers in flight end with an error naming it and the next request loads the"
                   " model again (default 120; inf: wait as long as a call takes)")
    p.set_defaults(func=cmd_serve)
