"""ggml's C functions for localrun's own ctypes calls (the RPC registry, quantization, the
imatrix collector), found in the very libraries llama-cpp-python loaded: one loader.

Symbols are looked up through libllama's own handle: dlsym searches its dependencies, so
they come from the libggml copies llama.cpp uses. Opening a ggml library by path could
load a second, separate copy (the wheel ships libggml-base.so, .so.0 and .so.0.x as
separate files) with its own backend registry, abort hook and quantization tables.
Windows searches one DLL only: there ggml's DLLs, already loaded, are opened by name.

    row_size = function("ggml_row_size", ctypes.c_size_t, ctypes.c_int, ctypes.c_int64)
"""

from __future__ import annotations

import threading

from localrun.errors import BackendUnavailableError

_lock = threading.Lock()
_libs: list = []


def _libraries() -> list:
    with _lock:
        if not _libs:
            try:
                from llama_cpp import llama_cpp as low
            except ImportError as exc:  # not installed, or its shared library failed to load
                raise BackendUnavailableError(f"llama-cpp-python is unusable ({exc}): run scripts/setup.sh") from None
            _libs.append(low._lib)
        return _libs


def function(name: str, restype, *argtypes):
    """A new ctypes function object for ggml's `name` (llama_cpp's own prototypes, if it
    declares the symbol too, stay as they are)."""
    libs = _libraries()
    f = _find(libs, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


def _find(libs: list, name: str):
    for lib in libs:
        try:
            return lib[name]
        except AttributeError:
            continue
    with _lock:
        if len(libs) == 1:  # Windows: ggml's DLLs by name (the copies already loaded)
            from llama_cpp import llama_cpp as low
            from llama_cpp._ctypes_extensions import load_shared_library

            libs += [load_shared_library(n, low._base_path) for n in ("ggml", "ggml-base")]
            retry = True
        else:
            retry = False
    if retry:
        return _find(libs, name)
    raise AttributeError(f"{name} is not in this llama-cpp-python's libraries")
