#!/usr/bin/env bash
# Install the coding agents the tests and scripts/bench/bench_agents.py drive against
# `localrun serve`: Claude Code and Codex CLI, from npm, pinned, into
# ${XDG_CACHE_HOME:-~/.cache}/localrun/agents/VERSIONS (outside the clone; a second run takes
# no time). Prints the folder holding their executables (node_modules/.bin).
# Needs Node.js >= 18 with npm. The packages carry their native binaries for Linux x64/arm64
# and macOS as optional dependencies, so no install script has to run.
set -euo pipefail
CLAUDE_CODE=${CLAUDE_CODE_VERSION:-2.1.332}
CODEX=${CODEX_VERSION:-0.171.0}
root="${XDG_CACHE_HOME:-$HOME/.cache}/localrun/agents/claude-code-$CLAUDE_CODE-codex-$CODEX"
if ! command -v npm >/dev/null 2>&1; then
  echo "error: npm is not installed; install Node.js 18 or newer (with npm) to run the coding agents" >&2
  exit 1
fi
if [ ! -x "$root/node_modules/.bin/claude" ] || [ ! -x "$root/node_modules/.bin/codex" ]; then
  rm -rf "$root.partial" && mkdir -p "$root.partial"
  (cd "$root.partial" && echo '{"private": true}' > package.json \
     && npm install --silent --no-audit --no-fund "@anthropic-ai/claude-code@$CLAUDE_CODE" "@openai/codex@$CODEX" >&2)
  rm -rf "$root" && mv "$root.partial" "$root"  # an install cut short leaves nothing behind
fi
"$root/node_modules/.bin/claude" --version >/dev/null
"$root/node_modules/.bin/codex" --version >/dev/null
echo "$root/node_modules/.bin"
