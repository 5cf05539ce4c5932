"""Store commands: `ls`, `rm`, `show`, `ps`, `pull`, `fit`, `doctor`.

Registered by localrun.cli through `add_commands`; only os, sys and time load with
this module, so `localrun --help` stays instant. Every command takes `--models-dir`
(the same as LOCALRUN_MODELS).
"""

from __future__ import annotations

import os
import sys
import time

from localrun.errors import BadRequestError, LocalrunError, ModelNotFoundError


def _gb(n: float) -> str:
    from localrun.hardware import format_bytes

    return format_bytes(n)


def _table(rows: list[list[str]], out=None) -> None:
    out = out or sys.stdout
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def _budget(args):
    from localrun.quant.selector import Budget, memory_from_env

    if getattr(args, "memory", None) is not None:
        return Budget.from_gb(args.memory)
    return memory_from_env() or Budget.from_hardware()


def cmd_ls(args) -> int:
    from localrun.quant.selector import fit_verdict
    from localrun.store.local import list_models

    models = list_models()
    if not models:
        from localrun.store.local import models_dir

        print(f"no models yet in {models_dir()} (nor in the Hugging Face cache or LM Studio);"
              " get one with `localrun pull org/repo`")
        return 0
    from localrun.model.vocab import draft_pairs

    budget = _budget(args)
    drafts_for = draft_pairs(models)  # a smaller model of the same vocabulary: `--draft` for the bigger
    rows = [["NAME", "FORMAT", "QUANT", "SIZE", "FIT", "SOURCE", "DRAFTS FOR"]]
    for m in models:
        rows.append([m.name, m.format, m.quant, _gb(m.size_bytes), fit_verdict(m.path, args.ctx, args.kv_cache_type or "f16", budget),
                     m.source, ", ".join(drafts_for.get(m.name, ())) or "-"])
    _table(rows)
    return 0


def cmd_rm(args) -> int:
    import shutil

    from localrun.store.hub import verified_marker
    from localrun.model.formats import split_parts
    from localrun.store.local import find_models, models_dir

    matches = find_models(args.name)
    if not matches:
        raise ModelNotFoundError(f"{args.name} is not installed; see `localrun ls`")
    if ":" not in args.name and len(matches) > 1:
        names = ", ".join(m.name for m in matches)
        raise BadRequestError(f"{args.name} has several models installed ({names}); name one")
    for m in matches:
        if m.source != "localrun":
            where = "the Hugging Face cache (remove it with `hf cache delete`)" if m.source == "hf-cache" \
                else "LM Studio's folder (remove it in LM Studio)"
            raise BadRequestError(f"{m.name} lives in {where}; localrun only removes what it downloaded: {m.path}")
        if m.format == "mlx":
            shutil.rmtree(m.path)
        else:
            for p in split_parts(m.path) or [m.path]:
                p.unlink()
                verified_marker(p).unlink(missing_ok=True)  # `pull`'s record that the bytes were checked
        for folder in (m.path.parent if m.format == "gguf" else m.path, m.path.parent.parent):
            try:  # drop the repo and org folders when they are empty now
                if folder != models_dir() and folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
            except OSError:  # a folder something else just wrote into stays; the model is gone
                pass
        print(f"deleted {m.name}")
    return 0


def cmd_show(args) -> int:
    from localrun.store.local import model_facts

    facts = model_facts(args.model)
    facts.update(_draft_facts(facts["path"]))
    template = facts.pop("chat template", None)
    _table([[k, str(v)] for k, v in facts.items()])
    if template is not None:
        print("chat template:")
        lines = template.splitlines()
        shown = lines if args.template else lines[:12]
        for line in shown:
            print(f"  {line}")
        if len(shown) < len(lines):
            print(f"  ... {len(lines) - len(shown)} more lines (--template prints it all)")
    return 0


def _draft_facts(path: str) -> dict:
    """`show`'s rows on speculative decoding: the installed models of the same vocabulary
    this one drafts for (smaller) or that draft for it (bigger)."""
    from pathlib import Path

    from localrun.model.vocab import draft_pairs
    from localrun.store.local import StoredModel, list_models

    models = list_models()
    me = next((m for m in models if Path(m.path) == Path(path)), None)
    if me is None:  # a path outside the store: compare it with what is installed
        from localrun.quant.selector import weights_bytes

        me = StoredModel(name=path, path=Path(path), format="", quant="", size_bytes=weights_bytes(path), source="path")
        models.append(me)
    pairs = draft_pairs(models)
    drafted_by = [m.name for m in models if me.name in pairs.get(m.name, ())]
    return {"drafts for": ", ".join(pairs.get(me.name, ())) or "-", "drafted by": ", ".join(drafted_by) or "-"}


def server_url() -> str:
    host = os.environ.get("LOCALRUN_HOST") or "127.0.0.1:11435"
    return (host if "://" in host else f"http://{host}").rstrip("/")


def cmd_ps(args) -> int:
    import httpx

    url = server_url()
    try:
        r = httpx.get(f"{url}/api/ps", timeout=5)
        r.raise_for_status()
        models = r.json().get("models", [])
    except httpx.ConnectError:
        raise LocalrunError(f"no localrun server is running at {url}; start one with `localrun serve`") from None
    except (httpx.HTTPError, ValueError) as exc:
        raise LocalrunError(f"the server at {url} did not answer /api/ps properly: {exc}") from None
    if not models:
        print("no models loaded")
        return 0
    rows = [["NAME", "SIZE", "GPU MEMORY", "UNTIL"]]
    for m in models:
        rows.append([str(m.get("name") or m.get("model")), _gb(m.get("size") or 0), _gb(m.get("size_vram") or 0),
                     str(m.get("expires_at") or "-")])
    _table(rows)
    return 0


class _Bar:
    """A one-line progress bar on stderr; plain start/finish lines when stderr is not a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.start = time.monotonic()
        self.name = None

    def __call__(self, name: str, done: int, total: int) -> None:
        now = time.monotonic()
        if name != self.name:
            self.name, self.start = name, now
            if not self.tty:
                print(f"downloading {name} ({_gb(total)})", file=sys.stderr)
        if not self.tty or (now - self.last < 0.2 and done < total):
            return
        self.last = now
        rate = done / max(now - self.start, 1e-3)
        width = 30
        filled = int(width * done / max(total, 1))
        print(f"\r{name[-40:]:40} [{'#' * filled}{'.' * (width - filled)}] {100 * done / max(total, 1):5.1f}%"
              f" {_gb(done)}/{_gb(total)} {_gb(rate)}/s ", end="" if done < total else "\n", file=sys.stderr,
              flush=True)


def cmd_pull(args) -> int:
    from localrun.store.hub import pull
    from localrun.commands.rpc import with_workers

    budget, _ = with_workers(args, _budget(args))  # --rpc: the workers' free memory counts too
    try:
        plan, path = pull(args.name, n_ctx=args.ctx, budget=budget, kv_type=args.kv_cache_type, progress=_Bar(),
                          announce=lambda msg: print(msg, file=sys.stderr), allow_unverified=args.allow_unverified)
    except KeyboardInterrupt:
        print("\ninterrupted: the same `localrun pull` resumes where this one stopped", file=sys.stderr)
        raise
    print(f"{plan.name} -> {path}")
    return 0


def _fit_rows(args):
    """(ModelShape, [(quant, size)], where) for a local model or a Hub repo."""
    from pathlib import Path

    from localrun.quant.selector import model_shape, weights_bytes
    from localrun.store.local import find_models, parse_name

    target = Path(args.model).expanduser()
    if target.exists():
        from localrun.store.local import gguf_quant, mlx_quant

        quant = mlx_quant(target) if target.is_dir() else gguf_quant(target)
        return model_shape(target), [(quant, weights_bytes(target))], str(target)
    if parse_name(args.model) is None:
        raise ModelNotFoundError(f"no model at {target}: give a model path, an installed name or a Hub repo")
    installed = find_models(args.model)
    if installed and not args.hub:
        return (model_shape(installed[0].path), [(m.quant, m.size_bytes) for m in installed],
                "installed (--hub lists the repo's quants)")
    from localrun.store.hub import list_repo, remote_shape, variants

    repo = parse_name(args.model)[0]
    revision, files = list_repo(repo)
    ggufs = [v for v in variants(files) if v.format == "gguf"]
    if not ggufs:
        raise ModelNotFoundError(f"{repo} has no GGUF quants to compare")
    shape = remote_shape(repo, revision, min(ggufs, key=lambda v: v.size).files[0])
    return shape, [(v.quant, v.size) for v in ggufs], f"{repo} on the Hub"


def cmd_fit(args) -> int:
    from localrun.model.formats import quality_rank
    from localrun.quant.selector import choose
    from localrun.commands.rpc import print_fit_split, with_workers

    shape, quants, where = _fit_rows(args)
    local = _budget(args)
    if args.draft is not None:  # the draft model's weights and KV come out of the memory first
        from localrun.quant.selector import without_draft
        from localrun.store.local import resolve_model

        local, draft = without_draft(local, resolve_model(args.draft), args.ctx, args.kv_cache_type or "f16")
        print(f"draft model: {draft.explain()}; the rest is the model's")
    budget, workers = with_workers(args, local)  # --rpc: each worker's free memory, asked from its device
    choice = choose(shape, quants, args.ctx, budget, args.kv_cache_type)
    rows = [["", "QUANT", "SIZE", "KV", "NEEDS", "VERDICT"]]
    for est in sorted(choice.estimates, key=lambda e: -quality_rank(e.quant)):
        picked = choice.pick is not None and est.quant == choice.pick.quant
        shown = choice.pick if picked else est  # the pick may use another KV type or context
        rows.append(["*" if picked else "", shown.quant, _gb(shown.weights), f"{shown.kv_type} @ {shown.n_ctx}",
                     _gb(shown.total), shown.verdict])
    print(f"{shape.architecture}, {shape.n_layer} layers, trained context {shape.n_ctx_train} ({where})")
    _table(rows)
    if choice.pick is None:
        print(f"nothing fits: {choice.note}")
        return 1
    print(f"pick: {choice.pick.explain()} ({choice.note})")
    if workers and not print_fit_split(args, shape, choice.pick, workers, local.vram or local.ram):
        return 1
    return 0


def backend_report() -> list[tuple[str, str]]:
    """(backend, what works) rows for `localrun doctor`; imports each runtime to see."""
    rows: list[tuple[str, str]] = []
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
        builds = ["CPU"]
        if "CUDA" in info:
            builds.append("CUDA")
        if "METAL" in info.upper():
            builds.append("Metal")
        offload = bool(llama_cpp.llama_supports_gpu_offload())
        if offload and llama_cpp.llama_supports_rpc():  # llama.cpp counts RPC as offload: ask for a real GPU
            from localrun.cluster.rpc import local_gpus

            offload = bool(local_gpus())
        rows.append(("llama.cpp", f"llama-cpp-python {llama_cpp.__version__}: {'+'.join(builds)} build"
                                  f"{', GPU offload' if offload else ', no GPU offload'}"))
    except Exception as exc:  # not installed or failed to load its shared library
        rows.append(("llama.cpp", f"unusable: {exc}"))
    try:
        from localrun.cluster.rpc import availability

        rows.append(("rpc", availability()[1]))
    except Exception as exc:
        rows.append(("rpc", f"unusable: {exc}"))
    try:
        import mlx.core as mx

        metal = bool(mx.metal.is_available())
        rows.append(("mlx", f"mlx {getattr(mx, '__version__', '?')}: {'Metal' if metal else 'CPU only'}"
                            f" (default device {mx.default_device()})"))
    except Exception as exc:
        rows.append(("mlx", f"unusable: {exc}"))
    return rows


def flash_attention_rows() -> list[list[str]]:
    """What the llama.cpp backend timed on this machine (backends/attention_timing.py)."""
    from localrun.backends.attention import FLASH_ATTN_ENV

    forced = os.environ.get(FLASH_ATTN_ENV)
    if forced:
        return [["flash attn", f"{FLASH_ATTN_ENV}={forced} decides for every model"]]
    try:
        from localrun.backends.attention_timing import remembered
        timed = remembered()
    except Exception as exc:  # llama.cpp unusable: its row above says why
        return [["flash attn", f"unknown: {exc}"]]
    if not timed:
        return [["flash attn", "timed per model at its first load on the CPU (none yet)"]]
    return [["flash attn", f"{name}: {t.explain()}"] for name, t in timed]


def cmd_doctor(args) -> int:
    from localrun.hardware import probe
    from localrun.store.local import hf_cache_dir, lmstudio_dirs, models_dir

    hw = probe()
    rows = [["os", f"{hw.os} ({hw.machine})"],
            ["cpu", f"{hw.cpu_name or 'unknown'}: {hw.cpu_physical} cores, {hw.cpu_logical} threads"],
            ["simd", " ".join(hw.simd) or "unknown"],
            ["ram", f"{_gb(hw.ram_available)} available of {_gb(hw.ram_total)}"]]
    for gpu in hw.gpus:
        label = "metal working set" if gpu.kind == "metal" else "free"
        rows.append(["gpu", f"{gpu.name} ({gpu.kind}): {_gb(gpu.free_bytes)} {label} of {_gb(gpu.total_bytes)}"])
    if not hw.gpus:
        rows.append(["gpu", "none found (no NVIDIA driver or Apple GPU): models run on the CPU"])
    for name, state in backend_report():
        rows.append([name, state])
    rows += flash_attention_rows()
    rows += [["models", str(models_dir())], ["hf cache", str(hf_cache_dir())],
             ["lm studio", os.pathsep.join(str(p) for p in lmstudio_dirs())],
             ["hub", _hub_endpoint()]]
    _table(rows)
    return 0


def _hub_endpoint() -> str:
    from localrun.store.hub import endpoint

    return endpoint()


def _with_models_dir(func):
    def run(args):
        if getattr(args, "models_dir", None):
            os.environ["LOCALRUN_MODELS"] = args.models_dir
        return func(args)

    return run


def _memory_flags(p) -> None:
    p.add_argument("--ctx", type=int, default=None, help="context the model must hold (default: min(4096, trained))")
    p.add_argument("--memory", type=float, default=None, metavar="GB",
                   help="judge against this much free memory (CPU) instead of probing the machine")
    p.add_argument("--kv-cache-type", choices=("f16", "q8_0", "q4_0"), default=None,
                   help="KV cache element type (default f16; the selector may propose q8_0 when unset)")


def add_commands(sub) -> None:
    from localrun.commands.rpc import add_rpc_flags

    def cmd(name, func, help_text):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--models-dir", default=None, help="the models folder (default: $LOCALRUN_MODELS or the data folder)")
        p.set_defaults(func=_with_models_dir(func))
        return p

    p = cmd("ls", cmd_ls, "list installed models with their fit on this machine")
    _memory_flags(p)
    p = cmd("rm", cmd_rm, "delete a downloaded model")
    p.add_argument("name", help="org/repo:QUANT (or org/repo when only one is installed)")
    p = cmd("show", cmd_show, "architecture, parameters, context, quant, template and capabilities of a model")
    p.add_argument("model", help="a name from `localrun ls` or a path")
    p.add_argument("--template", action="store_true", help="print the whole chat template")
    cmd("ps", cmd_ps, "models loaded by a running `localrun serve`")
    p = cmd("pull", cmd_pull, "download a model from the Hugging Face Hub (the best quant that fits, unless named)")
    p.add_argument("name", help="org/repo or org/repo:QUANT")
    p.add_argument("--allow-unverified", action="store_true",
                   help="download files the Hub gives no hash for (their bytes cannot be checked)")
    _memory_flags(p)
    add_rpc_flags(p)
    p = cmd("fit", cmd_fit, "which quants of a model fit this machine")
    p.add_argument("model", help="a path, an installed name, or a Hub repo org/repo")
    p.add_argument("--hub", action="store_true", help="list the Hub repo's quants even when some are installed")
    _memory_flags(p)
    add_rpc_flags(p)
    p.add_argument("--draft", metavar="MODEL", default=None,
                   help="a draft model to load beside it (run/serve --draft): its memory is counted first")
    cmd("doctor", cmd_doctor, "hardware, usable backends and model folders")


__all__ = ["add_commands", "server_url"]
