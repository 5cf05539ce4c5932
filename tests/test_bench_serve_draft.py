"""The pure parts of scripts/bench/bench_serve_draft.py: the server commands and the table."""

from __future__ import annotations

from scripts.bench.bench_serve_draft import NATIVE, VARIANTS, main, servers, summarize


def test_each_server_runs_the_same_target_and_only_the_drafting_ones_the_draft(tmp_path):
    class A:
        target, draft, threads, parallel, ctx, llama_server = "t.gguf", "d.gguf", 2, 4, 512, "/x/llama-server"
    cmds = servers(A)
    assert tuple(cmds) == VARIANTS
    for name, cmd in cmds.items():
        assert "t.gguf" in cmd and ("d.gguf" in cmd) == name.endswith("+draft")
    assert cmds[f"{NATIVE}+draft"][-2:] == ["--spec-draft-n-max", "8"]
    assert cmds[NATIVE][cmds[NATIVE].index("-c") + 1] == "2048"  # llama-server splits -c over its slots


def test_ratios_are_medians_over_rounds_and_a_missing_run_leaves_a_gap():
    runs = {"localrun": {1: [{"tps": 10.0}, {"tps": 12.0}]}, "localrun+draft": {1: [{"tps": 11.0}, {"tps": 11.0}]},
            NATIVE: {1: [{"tps": 10.0}]}, f"{NATIVE}+draft": {1: [{"error": "boom"}]}}
    (row,) = summarize(runs, [1])
    assert row["localrun"] == 11.0 and row["localrun draft/off"] == 1.0
    assert row[f"{NATIVE}+draft"] is None and row["draft: localrun/server"] is None


def test_missing_model_files_are_one_error(tmp_path, capsys):
    try:
        main(["--target", str(tmp_path / "none.gguf")])
    except SystemExit as e:
        assert e.code == 2
    assert "none.gguf not found" in capsys.readouterr().err
