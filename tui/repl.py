"""`localrun chat`: a plain line REPL until the Textual app replaces it.

Each line you type is a user turn; the answer streams back; the conversation is kept
and re-templated every turn. `/clear` starts over, `/exit` (or Ctrl-D) leaves. A thinking
model's thinking goes to stderr (thinking.py) and is kept with its answer as the
message's `reasoning_content`, for the template to show or drop in later turns.
"""

from __future__ import annotations

import sys


def run_repl(args, stdin=sys.stdin, stdout=sys.stdout) -> int:
    from localrun.generation import print_timings
    from localrun.sampling.flags import sampling_from_args
    from localrun.commands.draft import draft_options
    from localrun.engine import Engine
    from localrun.errors import LocalrunError
    from localrun.request import GenerationRequest

    from .thinking import ThinkingOut, reasoning_options

    thinking = reasoning_options(args)
    request = GenerationRequest(sampling=sampling_from_args(args), max_tokens=args.max_tokens, lookup=args.lookup,
                                **thinking)
    kv = getattr(args, "kv_cache_type", "f16")
    with Engine.open(args.model, n_ctx=args.ctx, threads=args.threads, kv_cache_type=kv,
                     chat_template=getattr(args, "chat_template", None),
                     trust_remote_code=getattr(args, "trust_remote_code", False),
                     cluster=getattr(args, "cluster", None), **draft_options(args)) as engine:
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
            parts, thoughts, last = [], [], None
            out = ThinkingOut()
            try:
                prompt = engine.chat_prompt(system + history, template_kwargs=thinking["template_kwargs"])
                for ev in engine.generate(prompt, request):
                    out.write(ev.reasoning)
                    if ev.text:
                        out.end()
                    stdout.write(ev.text)
                    stdout.flush()
                    parts.append(ev.text)
                    thoughts.append(ev.reasoning)
                    last = ev
            except LocalrunError as exc:  # e.g. the conversation outgrew the context
                out.end()
                history.pop()
                print(f"error: {exc} (/clear starts over)", file=sys.stderr)
                continue
            out.end()
            stdout.write("\n\n")
            answer = {"role": "assistant", "content": "".join(parts)}
            if any(thoughts):
                answer["reasoning_content"] = "".join(thoughts)
            history.append(answer)
            if args.verbose and last is not None and last.timings:
                print_timings(last.timings)
    return 0
