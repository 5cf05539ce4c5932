"""`localrun chat`: a plain line REPL until the Textual app replaces it.

Each line you type is a user turn; the answer streams back; the conversation is kept
and re-templated every turn. `/clear` starts over, `/exit` (or Ctrl-D) leaves.
"""

from __future__ import annotations

import sys


def run_repl(args, stdin=sys.stdin, stdout=sys.stdout) -> int:
    from localrun.generation import print_timings
    from localrun.sampling.flags import sampling_from_args
    from localrun.engine import Engine
    from localrun.errors import LocalrunError

    sampling = sampling_from_args(args)
    kv = getattr(args, "kv_cache_type", "f16")
    with Engine.open(args.model, n_ctx=args.ctx, threads=args.threads, kv_cache_type=kv,
                     chat_template=getattr(args, "chat_template", None),
                     trust_remote_code=getattr(args, "trust_remote_code", False)) as engine:
        system = [{"role": "system", "content": args.system}] if args.system else []
        history: list[dict] = []
        interactive = stdin.isatty()
        while True:
            if interactive:
                stdout.write(">>> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/bye"):
                break
            if text == "/clear":
                history = []
                continue
            history.append({"role": "user", "content": text})
            parts, last = [], None
            try:
                prompt = engine.chat_prompt(system + history)
                for ev in engine.generate(prompt, sampling=sampling, max_tokens=args.max_tokens, lookup=args.lookup):
                    stdout.write(ev.text)
                    stdout.flush()
                    parts.append(ev.text)
                    last = ev
            except LocalrunError as exc:  # e.g. the conversation outgrew the context
                history.pop()
                print(f"error: {exc} (/clear starts over)", file=sys.stderr)
                continue
            stdout.write("\n\n")
            history.append({"role": "assistant", "content": "".join(parts)})
            if args.verbose and last is not None and last.timings:
                print_timings(last.timings)
    return 0
