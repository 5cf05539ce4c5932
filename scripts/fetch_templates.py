#!/usr/bin/env python3
"""Copy llama.cpp's chat templates (models/templates/*.jinja) into the test-model cache,
where tests/test_tool_formats*.py and tests/test_reply_parser*.py read the tool-call and
reasoning formats of today's model families from them.

    python scripts/fetch_templates.py     # prints the folder it filled

The files come from the llama-cpp-python sdist of the installed version (it vendors
llama.cpp), as scripts/fetch_grammars.py takes the grammars: an unpacked copy in
~/.cache/localrun/tools/llama.cpp-<ver>/src is reused, otherwise `pip download
--no-binary :all:` fetches the sdist into a temporary folder. They land in
${LOCALRUN_TEST_MODELS:-~/.cache/localrun/test-models}/templates, outside the clone. A
second run finds them all and downloads nothing. (The fetching is llama_sdist.py's, shared
with fetch_grammars.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from llama_sdist import VendoredFiles, fetch

# the templates the tests read (each names a model family's call or reasoning format)
NEEDED = (
    "Qwen3-Coder.jinja", "Qwen3.5-4B.jinja", "GLM-4.6.jinja", "GLM-4.7-Flash.jinja", "openai-gpt-oss-120b.jinja",
    "Kimi-K2-Instruct.jinja", "moonshotai-Kimi-K2.jinja", "Kimi-K2-Thinking.jinja",
    "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "llama-cpp-deepseek-r1.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja", "unsloth-mistral-Devstral-Small-2507.jinja",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja", "ibm-granite-granite-3.3-2B-Instruct.jinja",
    "ibm-granite-granite-4.0.jinja", "Qwen-Qwen3-0.6B.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "ByteDance-Seed-OSS.jinja", "Qwen-QwQ-32B.jinja",
)


def _lacks(folder: Path) -> str:
    missing = [name for name in NEEDED if not (folder / name).is_file()]
    return f"{folder} lacks {', '.join(missing)}" if missing else ""


TEMPLATES = VendoredFiles("templates", "chat templates", "models/templates", lambda name: name in NEEDED, _lacks)


def main() -> int:
    return fetch(TEMPLATES)


if __name__ == "__main__":
    sys.exit(main())
