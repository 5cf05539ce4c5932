#!/usr/bin/env bash
# Set up (see setup.sh) and chat with the default small model, SmolLM2-135M-Instruct.
# Pass another model path as the first argument to chat with it instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODELS=${LOCALRUN_TEST_MODELS:-$HOME/.cache/localrun/test-models}
exec .venv/bin/localrun chat "${1:-$MODELS/smollm2-135m-instruct-q4_1.gguf}" "${@:2}"
