"""The model-making commands: `convert`, `quantize`, `imatrix`, `quality`.

Registered by localrun.cli through `add_commands`; this module imports only argparse
at load time so `localrun --help` stays instant. Results go to stdout, progress and
warnings to stderr."""

from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from localrun.errors import BadRequestError, LocalrunError


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Bar:
    """A one-line progress bar on a terminal; a line per tenth elsewhere (logs, CI)."""

    def __init__(self, label: str) -> None:
        self.label, self.tty, self.last = label, sys.stderr.isatty(), -1
        self.t0 = time.monotonic()

    def __call__(self, what: str, done: int, total: int) -> None:
        frac = done / max(1, total)
        if self.tty:
            fill = int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (30 - fill)}] {done}/{total} {what[:36]:<36}")
            if done >= total:
                sys.stderr.write(f"\n{self.label}: {time.monotonic() - self.t0:.1f} s\n")
            sys.stderr.flush()
        elif int(frac * 10) != self.last:
            self.last = int(frac * 10)
            _say(f"{self.label}: {100 * frac:.0f}% ({done}/{total})")


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise LocalrunError(f"cannot read the {what} file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise LocalrunError(f"the {what} file {path} is not UTF-8 text") from None
    if not text.strip():
        raise LocalrunError(f"the {what} file {path} is empty")
    return text


def _is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


# --- convert ---------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    src, out = Path(args.src).expanduser(), Path(args.output).expanduser()
    if args.to == "gguf":
        if args.bits is not None:
            raise BadRequestError("--bits applies to --to mlx; to quantize a GGUF use: localrun quantize OUT --type Q4_K_M")
        from localrun.quant.hf_to_gguf import convert_hf_to_gguf

        print(convert_hf_to_gguf(src, out, progress=_say))
        return 0
    from localrun.quant.gguf_to_mlx import convert_gguf_to_mlx

    if args.bits is None:
        print(convert_gguf_to_mlx(src, out, progress=_say))
        return 0
    from localrun.quant.quantize_mlx import quantize_mlx

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LocalrunError(f"{out} already exists and is not empty; choose another output path or remove it")
    # dequantize to float16 first (MLX cannot run GGML blocks), then quantize with mlx-lm
    stage = out.parent / f".{out.name}.f16-{secrets.token_hex(4)}"
    try:
        convert_gguf_to_mlx(src, stage, progress=_say)
        quantize_mlx(stage, out, bits=args.bits, group_size=args.group_size, progress=_say)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    print(out)
    return 0


# --- imatrix ---------------------------------------------------------------------


def cmd_imatrix(args: argparse.Namespace) -> int:
    from localrun.quant.imatrix import compute_imatrix
    from localrun.quant.imatrix_file import save_imatrix

    out = Path(args.output).expanduser()
    if out.exists() and not args.force:
        raise LocalrunError(f"{out} already exists; choose another -o path or pass --force")
    text = _read_text(args.calibration, "calibration")
    bar = _Bar("imatrix")
    im = compute_imatrix(
        args.model, text, chunk_size=args.chunk_size, max_chunks=args.max_chunks, threads=args.threads,
        dataset_name=Path(args.calibration).name, progress=lambda d, t: bar(f"chunk {d}", d, t),
    )
    save_imatrix(im, out)
    _say(f"{len(im)} matrices over {im.chunk_count} chunks of {im.chunk_size} tokens")
    print(out)
    return 0


# --- quantize --------------------------------------------------------------------


def _default_out(src: Path, tag: str, folder: bool = False) -> Path:
    """Next to the source, named by what it became: model-f16.gguf -> model-Q4_K_M.gguf."""
    stem = src.name[:-5] if src.name.endswith(".gguf") else src.name
    for old in ("-f32", "-f16", "-bf16", "-F32", "-F16", "-BF16"):
        stem = stem[: -len(old)] if stem.endswith(old) else stem
    return src.with_name(f"{stem}-{tag}" if folder else f"{stem}-{tag}.gguf")


def _quantize_mlx_cmd(args: argparse.Namespace, src: Path) -> int:
    from localrun.quant.quantize_mlx import quantize_mlx

    if args.type:
        raise BadRequestError("an MLX folder takes --bits (2, 3, 4, 5, 6, 8), not --type; "
                              "to make a GGUF first run: localrun convert DIR --to gguf")
    if args.imatrix or args.calibration:
        raise BadRequestError("--imatrix/--calibration apply to GGUF quantization only")
    out = Path(args.output).expanduser() if args.output else _default_out(src, f"{args.bits}bit", folder=True)
    quantize_mlx(src, out, bits=args.bits, group_size=args.group_size, recipe=args.recipe,
                 allow_requantize=args.allow_requantize, progress=_say)
    if args.no_quality:
        print(out)
        return 0
    if _mlx_is_fast():
        _report(src, out, args)
    else:
        # Off Apple silicon MLX runs on the CPU, and its quantized matmuls there take
        # seconds per token: the report would take hours, so it is left to the user.
        _say(f"quality report skipped: MLX runs on the CPU here; to measure anyway run: "
             f"localrun quality {out} --base {src}")
    print(out)
    return 0


def _mlx_is_fast() -> bool:
    import platform

    return sys.platform == "darwin" and platform.machine() == "arm64"


def cmd_quantize(args: argparse.Namespace) -> int:
    src = Path(args.src).expanduser()
    if not src.exists():
        raise LocalrunError(f"no model at {src}: give a .gguf file or a model folder")
    if args.bits is not None:
        if not src.is_dir():
            raise BadRequestError("--bits is for MLX model folders; for a GGUF choose --type (e.g. Q4_K_M)")
        return _quantize_mlx_cmd(args, src)
    if not args.type:
        raise BadRequestError("choose a quantization: --type TYPE for GGUF (e.g. Q4_K_M) or --bits N for MLX")
    from localrun.quant.recipe import file_type

    ft = file_type(args.type)  # an unknown name fails before any work
    out = Path(args.output).expanduser() if args.output else _default_out(src, ft.name)
    with tempfile.TemporaryDirectory(prefix="localrun-quantize-", dir=out.parent if out.parent.exists() else None) as work:
        gguf_src = src
        if src.is_dir():
            if not _is_hf_dir(src):
                raise BadRequestError(f"{src} is a folder without config.json and *.safetensors; "
                                      "give a .gguf file or a Hugging Face model folder")
            from localrun.quant.hf_to_gguf import convert_hf_to_gguf

            _say(f"converting {src.name} to GGUF F16 first")
            gguf_src = convert_hf_to_gguf(src, Path(work) / "source-f16.gguf", progress=_say)
        imatrix, im_path = _imatrix_for(args, gguf_src)
        from localrun.quant.quantize_gguf import quantize_gguf

        res = quantize_gguf(
            gguf_src, out, ft.name, imatrix=imatrix, imatrix_path=im_path,
            allow_requantize=args.allow_requantize, overwrite=args.force, threads=args.threads,
            progress=_Bar(f"quantize {ft.name}"), warn=_say,
        )
        mix = ", ".join(f"{n} x{c}" for n, c in sorted(res.types.items(), key=lambda kv: -kv[1]))
        _say(f"{res.path.name}: {res.size_bytes / 1e6:.1f} MB, {res.bits_per_weight:.2f} bits/weight ({mix})")
        if res.fallbacks:
            _say(f"{len(res.fallbacks)} tensors have rows their type's block does not divide and "
                 f"use a smaller block instead (first: {res.fallbacks[0]})")
        if not args.no_quality:
            _report(gguf_src, out, args)
    print(out)
    return 0


def _imatrix_for(args: argparse.Namespace, gguf_src: Path):
    if args.imatrix and args.calibration:
        raise BadRequestError("give --imatrix FILE or --calibration TEXT, not both")
    if args.imatrix:
        from localrun.quant.imatrix_file import load_imatrix

        return load_imatrix(args.imatrix), args.imatrix
    if args.calibration:
        from localrun.quant.imatrix import compute_imatrix

        text = _read_text(args.calibration, "calibration")
        bar = _Bar("imatrix")
        im = compute_imatrix(gguf_src, text, chunk_size=args.chunk_size, threads=args.threads,
                             dataset_name=Path(args.calibration).name,
                             progress=lambda d, t: bar(f"chunk {d}", d, t))
        return im, f"computed from {Path(args.calibration).name}"
    return None, None


def _report(base: Path, quant: Path, args: argparse.Namespace) -> None:
    from localrun.quant.eval_text import DEFAULT_EVAL_TEXT
    from localrun.quant.quality import compare, format_table, plot

    text = _read_text(args.eval_text, "evaluation") if args.eval_text else DEFAULT_EVAL_TEXT
    _say("measuring quality against the source (skip with --no-quality)")
    rows = compare(base, [quant], text, ctx=args.eval_ctx, threads=args.threads, progress=_say)
    _say(format_table(rows))
    if args.plot:
        _say(f"plot: {plot(rows, args.plot)}")


# --- quality ---------------------------------------------------------------------


def cmd_quality(args: argparse.Namespace) -> int:
    from localrun.quant.eval_text import DEFAULT_EVAL_TEXT
    from localrun.quant.quality import compare, format_table, plot

    for q in args.quants:
        if not Path(q).expanduser().exists():
            raise LocalrunError(f"no model at {q}")
    text = _read_text(args.text, "evaluation") if args.text else DEFAULT_EVAL_TEXT
    rows = compare(args.base, args.quants, text, ctx=args.ctx, max_chunks=args.max_chunks,
                   threads=args.threads, progress=_say)
    rows.sort(key=lambda r: r.size_bytes, reverse=True)
    print(format_table(rows))
    if args.plot:
        print(f"plot: {plot(rows, args.plot)}")
    return 0


# --- registration ----------------------------------------------------------------


def add_commands(sub) -> None:
    conv = sub.add_parser("convert", help="convert a model to another format")
    conv.add_argument("src", help="source model: a .gguf file (--to mlx) or a Hugging Face folder (--to gguf)")
    conv.add_argument("--to", required=True, choices=["mlx", "gguf"], help="target format")
    conv.add_argument("-o", "--output", required=True, help="output folder (mlx) or .gguf file (gguf)")
    conv.add_argument("--bits", type=int, default=None, help="--to mlx: quantize to this many bits on the way")
    conv.add_argument("--group-size", type=int, default=64, help="MLX quantization group size (default 64)")
    conv.set_defaults(func=cmd_convert)

    q = sub.add_parser("quantize", help="quantize a GGUF (--type) or an MLX folder (--bits)",
                       description="Quantize a model and report what it cost (perplexity, KL divergence).")
    q.add_argument("src", help="a F32/F16/BF16 .gguf, a Hugging Face safetensors folder, or an MLX folder")
    q.add_argument("--type", help="GGUF file type: Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_S, IQ4_XS, IQ3_XXS, ...")
    q.add_argument("-o", "--output", help="output path (default: next to the source, named by type)")
    q.add_argument("--imatrix", metavar="FILE", help="importance matrix GGUF (from `localrun imatrix` or llama-imatrix)")
    q.add_argument("--calibration", metavar="FILE", help="compute the importance matrix from this text first")
    q.add_argument("--chunk-size", type=int, default=512, help="tokens per calibration chunk (default 512)")
    q.add_argument("--allow-requantize", action="store_true", help="allow an already-quantized source")
    q.add_argument("--force", action="store_true", help="replace an existing output file")
    q.add_argument("--bits", type=int, default=None, help="MLX: 2, 3, 4, 5, 6 or 8")
    q.add_argument("--group-size", type=int, default=64, help="MLX group size: 32, 64 or 128 (default 64)")
    q.add_argument("--recipe", default=None, help="MLX mixed-precision recipe: mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6")
    q.add_argument("--no-quality", action="store_true", help="skip the quality report")
    q.add_argument("--eval-text", metavar="FILE", help="held-out text for the quality report (default: built in)")
    q.add_argument("--eval-ctx", type=int, default=128, help="tokens per quality chunk (default 128)")
    q.add_argument("--plot", metavar="PNG", help="also write a size-vs-KLD plot")
    q.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    q.set_defaults(func=cmd_quantize)

    im = sub.add_parser("imatrix", help="compute an importance matrix (llama.cpp's imatrix GGUF format)")
    im.add_argument("model", help="a .gguf model, ideally the F16/BF16 one you will quantize")
    im.add_argument("--calibration", required=True, metavar="FILE", help="calibration text (UTF-8)")
    im.add_argument("-o", "--output", required=True, help="output .gguf file")
    im.add_argument("--chunk-size", type=int, default=512, help="tokens per chunk (default 512)")
    im.add_argument("--max-chunks", type=int, default=None, help="stop after this many chunks")
    im.add_argument("--force", action="store_true", help="replace an existing output file")
    im.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    im.set_defaults(func=cmd_imatrix)

    qual = sub.add_parser("quality", help="perplexity and KL divergence of quants against their source")
    qual.add_argument("quants", nargs="+", help="quantized models (.gguf files or MLX folders)")
    qual.add_argument("--base", required=True, help="the source model they were made from")
    qual.add_argument("--text", metavar="FILE", help="held-out text (default: built in)")
    qual.add_argument("--ctx", type=int, default=128, help="tokens per chunk; the second half is scored (default 128)")
    qual.add_argument("--max-chunks", type=int, default=None, help="score at most this many chunks")
    qual.add_argument("--plot", metavar="PNG", help="write a size-vs-KLD plot")
    qual.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    qual.set_defaults(func=cmd_quality)
