#!/usr/bin/env bash
# Build the native llama.cpp tools from the very llama.cpp source that the installed
# llama-cpp-python vendors, so that benchmarks and parity tests compare localrun against
# the same kernels and not against some other llama.cpp.
#
#   bash scripts/build_llama_tools.sh            # every tool; prints the bin dir last
#   bash scripts/build_llama_tools.sh llama-quantize llama-perplexity   # just these
#   LOCALRUN_TOOLS=/some/dir bash scripts/build_llama_tools.sh
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bash ...     # skip asking the installed package
#
# scripts/setup.sh builds the two the parity tests run (llama-quantize and
# llama-perplexity); the benchmarks need llama-bench and llama-server: run it bare for those.
#
# The sdist of llama-cpp-python carries vendor/llama.cpp; we take it from PyPI with
# `pip download --no-binary :all:` (the only place the source can come from here),
# unpack it into a cache outside the repository and build CPU-only, statically
# linked, with -march=native. A second run finds the binaries and does nothing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then PY="$here/.venv/bin/python"; else PY=python3; fi
fi

VER="${LLAMA_CPP_PYTHON_VERSION:-}"
if [[ -z "$VER" ]]; then
    VER="$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')" || {
        echo "error: llama_cpp is not importable with $PY; install llama-cpp-python first" \
             "or set LLAMA_CPP_PYTHON_VERSION" >&2
        exit 1
    }
fi

tools="${LOCALRUN_TOOLS:-$HOME/.cache/localrun/tools}"
root="$tools/llama.cpp-$VER"
src="$root/src"
build="$root/build"
bin="$build/bin"
all_targets=(llama-bench llama-server llama-batched-bench llama-quantize llama-imatrix llama-perplexity)
if (( $# )); then
    targets=("$@")
    for t in "${targets[@]}"; do
        [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "error: unknown tool $t (one of: ${all_targets[*]})" >&2; exit 2; }
    done
else
    targets=("${all_targets[@]}")
fi

have_all() {
    local t
    for t in "${targets[@]}"; do [[ -x "$bin/$t" ]] || return 1; done
}

# ggml's AMX matmul segfaults on some Sapphire Rapids CPUs (the same upstream bug that
# scripts/setup.sh builds llama-cpp-python around), and GGML_NATIVE's -march=native turns
# it on: on x86-64 the tools are built without it, so that localrun and its peers run the
# same kernels. The flags are stamped into the build folder; a build made with other
# flags (an older run of this script) is thrown away rather than trusted.
flags=""
case "$(uname -m)" in
    x86_64|amd64) flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;;
esac
stamp="$build/.localrun-flags"
if [[ -d "$build" && "$(cat "$stamp" 2>/dev/null || echo none)" != "flags=$flags" ]]; then
    echo "rebuilding: $build was made with other compiler flags" >&2
    rm -rf "$build"
fi

if have_all; then
    echo "llama.cpp tools ${targets[*]} for llama-cpp-python $VER already built" >&2
    echo "$bin"
    exit 0
fi

mkdir -p "$root"
start=$(date +%s)

# 1. Source: unpack into a temporary sibling and rename it into place, so that an
#    interrupted unpack never leaves a half tree that a later run would trust.
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    tmp="$(mktemp -d "$root/.fetch.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    echo "fetching llama-cpp-python==$VER sdist ..." >&2
    "$PY" -m pip download --quiet --no-deps --no-binary :all: \
        -d "$tmp" "llama-cpp-python==$VER" >&2
    sdist="$(ls "$tmp"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n1)"
    [[ -n "$sdist" ]] || { echo "error: no sdist for llama-cpp-python==$VER" >&2; exit 1; }
    # Only the vendored llama.cpp is needed; the sdist's top dir is llama_cpp_python-VER.
    tar -xzf "$sdist" -C "$tmp" --wildcards '*/vendor/llama.cpp/*'
    vend="$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp)"
    [[ -f "$vend/CMakeLists.txt" ]] || { echo "error: sdist has no vendor/llama.cpp" >&2; exit 1; }
    rm -rf "$src"
    mv "$vend" "$src"
    rm -rf "$tmp"
    trap - EXIT
fi

# 2. Configure. Options come and go between llama.cpp versions (LLAMA_CURL is now
#    deprecated and ignored, LLAMA_OPENSSL and the UI switches are new), so each
#    optional switch is passed only when this source declares it.
opts=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
)
declares() { grep -q "option($1\b" "$src/CMakeLists.txt"; }
# curl / OpenSSL: HTTPS model download is not wanted, and keeps the build free of libs.
declares LLAMA_CURL && opts+=(-DLLAMA_CURL=OFF)
declares LLAMA_OPENSSL && opts+=(-DLLAMA_OPENSSL=OFF)
# The server's web UI would otherwise be built with npm or downloaded at build time;
# neither is possible offline, and the API endpoints do not need it.
declares LLAMA_BUILD_UI && opts+=(-DLLAMA_BUILD_UI=OFF)
declares LLAMA_USE_PREBUILT_UI && opts+=(-DLLAMA_USE_PREBUILT_UI=OFF)
declares LLAMA_BUILD_SERVER && opts+=(-DLLAMA_BUILD_SERVER=ON)
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)

[[ -n "$flags" ]] && opts+=("-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags")
if [[ ! -f "$build/CMakeCache.txt" ]]; then
    echo "configuring in $build: ${opts[*]}" >&2
    cmake -S "$src" -B "$build" "${gen[@]}" "${opts[@]}" >&2
    echo "flags=$flags" > "$stamp"
fi

# 3. Build only what we need; everything else in llama.cpp would double the time.
jobs="${JOBS:-2}"
echo "building ${targets[*]} with -j$jobs ..." >&2
cmake --build "$build" --config Release -j "$jobs" --target "${targets[@]}" >&2

have_all || { echo "error: build finished but binaries are missing in $bin" >&2; exit 1; }
echo "built in $(( $(date +%s) - start ))s: ${targets[*]/#/$bin/}" >&2
echo "$bin"
