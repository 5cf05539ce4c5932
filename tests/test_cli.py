"""The `localrun` command as a user runs it: a real process, real models."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest


def localrun(*args, stdin: str | None = None, timeout: int = 300):
    return subprocess.run(
        [sys.executable, "-m", "localrun", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(proc) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_version_and_help():
    from localrun import __version__

    v = localrun("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"localrun {__version__}"
    h = localrun("--help")
    assert h.returncode == 0 and "run" in h.stdout and "chat" in h.stdout and "convert" in h.stdout
    r = localrun("run", "--help")
    for flag in ("--system", "--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--ctx", "--verbose"):
        assert flag in r.stdout


@pytest.mark.parametrize("fmt", ["gguf", "mlx"])
def test_run_answers_name_three_colors(fmt, request):
    model = request.getfixturevalue("smollm2_gguf" if fmt == "gguf" else "smollm2_mlx")
    p = localrun("run", model, "Name three colors.", "--temperature", "0", "--max-tokens", "24", "--verbose")
    assert p.returncode == 0, p.stderr
    assert sum(c in p.stdout.lower() for c in ("red", "blue", "green", "yellow")) >= 2, p.stdout
    for line in ("prompt eval rate:", "eval rate:", "time to first token:"):
        assert line in p.stderr
    assert "Traceback" not in p.stderr


def counts(proc) -> tuple[int, int]:
    """--verbose's prompt and answer token counts."""
    lines = {line.split(":")[0]: int(line.split()[-2]) for line in proc.stderr.splitlines() if "count:" in line}
    return lines["prompt eval count"], lines["eval count"]


def test_run_reads_the_prompt_from_stdin_and_honours_options(smollm2_gguf, llama_engine):
    """Each option acts: --system and the stdin text are the prompt; --max-tokens and --ctx
    end the answer; --temperature 0 is greedy; --seed fixes a hot answer and another seed
    changes it; --top-k 1, --top-p 0.01 and --min-p 1 each cut a hot draw to the greedy token."""
    system, question = "You are a poet.", "Describe the sky at night."
    asked = [{"role": "user", "content": question}]
    n_prompt = len(llama_engine.chat_prompt([{"role": "system", "content": system}, *asked]))
    assert n_prompt != len(llama_engine.chat_prompt(asked))  # so the count shows the system line was used
    # --no-lookup: one token a decode in every run, so greedy and cut-to-greedy runs see the same logits
    base = ["run", smollm2_gguf, "--system", system, "--no-lookup", "--verbose"]
    hot = ["--temperature", "2", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--max-tokens", "8"]  # later flags win
    argv = {
        "greedy": [*base, "--temperature", "0", "--max-tokens", "8"],
        "ctx": [*base, "--temperature", "0", "--ctx", n_prompt + 5],  # no --max-tokens: to the end of the context
        "seed 1": [*base, *hot, "--seed", "1"],
        "seed 1 again": [*base, *hot, "--seed", "1"],
        "seed 2": [*base, *hot, "--seed", "2"],
        "top-k": [*base, *hot, "--seed", "1", "--top-k", "1"],
        "top-p": [*base, *hot, "--seed", "1", "--top-p", "0.01"],
        "min-p": [*base, *hot, "--seed", "1", "--min-p", "1"],
    }
    with ThreadPoolExecutor(4) as pool:  # a process each, a few at once
        procs = dict(zip(argv, pool.map(lambda a: localrun(*a, stdin=question), argv.values())))
    for name, p in procs.items():
        assert p.returncode == 0, (name, p.stderr)
    out = {name: p.stdout for name, p in procs.items()}
    assert counts(procs["greedy"]) == (n_prompt, 8)
    assert counts(procs["ctx"]) == (n_prompt, 5)
    assert out["seed 1"] == out["seed 1 again"] != out["seed 2"]
    assert out["seed 1"] != out["greedy"]
    assert out["top-k"] == out["top-p"] == out["min-p"] == out["greedy"]


def test_missing_model_is_one_line(tmp_path):
    err = one_line_error(localrun("run", tmp_path / "nope.gguf", "hi"))
    assert "no model at" in err


def test_not_a_model_is_one_line(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    assert "not a GGUF file" in one_line_error(localrun("run", f, "hi"))
    d = tmp_path / "folder"
    d.mkdir()
    (d / "readme.md").write_text("x")
    assert "not an MLX model folder" in one_line_error(localrun("run", d, "hi"))


def test_truncated_gguf_is_rejected_before_llama_cpp(tmp_path, smollm2_gguf):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        bad.write_bytes(src.read(5000))
    assert "malformed GGUF" in one_line_error(localrun("run", bad, "hi"))


def test_prompt_over_the_context_is_one_line(smollm2_gguf):
    err = one_line_error(localrun("run", smollm2_gguf, "word " * 400, "--ctx", "128"))
    assert "context" in err


def test_bad_sampling_value_is_one_line(smollm2_gguf):
    assert "top_p" in one_line_error(localrun("run", smollm2_gguf, "hi", "--top-p", "1.5"))


def test_logit_bias_by_text_from_the_cli(smollm2_gguf):
    args = ["run", smollm2_gguf, "The capital of France is", "--temperature", "0", "--max-tokens", "6", "--raw"]
    assert "Paris" in localrun(*args).stdout
    banned = localrun(*args, "--logit-bias", " Paris=-100")
    assert banned.returncode == 0 and banned.stdout.strip() and "Paris" not in banned.stdout
    assert "--logit-bias" in one_line_error(localrun(*args, "--logit-bias", "Paris"))


def test_chat_repl_keeps_the_conversation(smollm2_gguf):
    p = localrun("chat", smollm2_gguf, "--temperature", "0", "--max-tokens", "12", "--verbose",
                 stdin="My name is Ada.\nWhat is my name?\n/exit\nnever read\n")
    assert p.returncode == 0, p.stderr
    answers = [a for a in p.stdout.split("\n\n") if a.strip()]
    assert len(answers) == 2
    counts = [int(line.split()[3]) for line in p.stderr.splitlines() if line.startswith("prompt eval count")]
    evals = [int(line.split()[2]) for line in p.stderr.splitlines() if line.startswith("eval count")]
    # the second turn's prompt carries the first question and answer
    assert counts[1] >= counts[0] + evals[0] + 5, p.stderr


def test_convert_rejects_unknown_target(smollm2_gguf, tmp_path):
    assert "--to gguf" in one_line_error(localrun("convert", smollm2_gguf, "--to", "gguf", "-o", tmp_path / "x"))


def test_top_n_sigma_flag_parses_and_bad_values_are_one_line(smollm2_gguf):
    from localrun.cli import build_parser
    from localrun.sampling.flags import sampling_from_args

    args = build_parser().parse_args(["run", "model.gguf", "--top-n-sigma", "1.5", "--samplers", "top_n_sigma;temp"])
    p = sampling_from_args(args)
    assert p.top_n_sigma == 1.5 and p.order == ("logit_bias", "top_n_sigma", "temperature")
    assert build_parser().parse_args(["chat", "--top-n-sigma", "-1"]).top_n_sigma == -1.0
    # refused while the flags are read, before the model loads
    assert "top_n_sigma" in one_line_error(localrun("run", smollm2_gguf, "hi", "--top-n-sigma", "2e6"))
    assert "dry_sequence_breakers[0]" in one_line_error(localrun("run", smollm2_gguf, "hi", "--dry-sequence-breaker", "x" * 41))
