"""The repository's scripts (not installed with localrun).

At the top, what a user runs: setup.sh, test.sh, chat.sh, build_llama_tools.sh,
install_agents.sh, and the test-data fetchers fetch_test_models.py, fetch_grammars.py and
fetch_templates.py (the last two share llama_sdist.py; plain scripts:
`python scripts/fetch_test_models.py` works from anywhere).

In rooms, run as modules from the repository's root (`python -m scripts.ROOM.NAME`, or
`.venv/bin/python -m ...`), so that they import one another as packages:

    bench/    benchmarks against peers, and measurement instruments
    lookup/   prompt-lookup research instruments
"""
