"""Benchmarks against localrun's peers (llama.cpp's own tools, llama-cpp-python, mlx-lm)
and measurement instruments: scripts, not timed tests. Each prints a table (most also
write JSON) and says in its docstring what it measures. Run one from the repository's
root as a module:

    .venv/bin/python -m scripts.bench.bench --quick
    .venv/bin/python -m scripts.bench.bench_lookup --quick
    .venv/bin/python -m scripts.bench.check_json_whitespace --help
"""
