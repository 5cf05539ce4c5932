#!/usr/bin/env python3
"""Copy llama.cpp's example grammars (grammars/*.gbnf) into the test-model cache, where
tests/test_grammar.py compiles every one of them.

    python scripts/fetch_grammars.py     # prints the folder it filled

The files come from the llama-cpp-python sdist of the installed version (it vendors
llama.cpp): an unpacked copy in ~/.cache/localrun/tools/llama.cpp-<ver>/src is reused,
otherwise `pip download --no-binary :all:` fetches the sdist into a temporary folder.
They land in ${LOCALRUN_TEST_MODELS:-~/.cache/localrun/test-models}/grammars, outside the
clone. A second run finds them all and downloads nothing. (The fetching is
llama_sdist.py's, shared with fetch_templates.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from llama_sdist import VendoredFiles, fetch


def _lacks(folder: Path) -> str:
    return "" if any(folder.glob("*.gbnf")) else f"no .gbnf files in {folder}"


GRAMMARS = VendoredFiles("grammars", "grammars", "grammars", lambda name: name.endswith(".gbnf"), _lacks)


def main() -> int:
    return fetch(GRAMMARS)


if __name__ == "__main__":
    sys.exit(main())
