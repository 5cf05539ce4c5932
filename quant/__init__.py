"""Making and judging model files: everything `localrun convert`, `quantize`,
`imatrix` and `quality` do, and the fit-to-memory selector.

- cli.py: those commands (argparse only at import, so `localrun --help` stays instant)
- convert: hf_to_gguf.py (Hugging Face safetensors -> GGUF F16, tokenizer via
  hf_tokenizer.py), gguf_to_mlx.py (GGUF -> MLX folder, tokenizer via gguf_tokenizer.py)
- quantize: quantize_gguf.py (ggml's kernels through ggml_lib.py, per-tensor types from
  recipe.py, GGUF rewriting through gguf_io.py), quantize_mlx.py (mlx-lm's)
- imatrix.py / imatrix_file.py: importance matrices, computed in llama.cpp, in its file layout
- quality.py (+ eval_text.py): perplexity and KL divergence of a quant against its source
- selector.py: will a model fit this machine, and which quant and context to run
- atomic.py: outputs written whole or not at all, and durably

The tables the runtime reads (quant names, file types, KV cache types) live in the core,
`localrun/model/formats.py`. This folder may use the core and `localrun.backends`' public
names; the backends never import from here (tests/test_packaging.py checks). Its modules load
lazily so that `import localrun.quant` stays cheap: the heavy dependencies (gguf, mlx,
tokenizers) load on first use.
"""

from __future__ import annotations

__all__ = ["convert_gguf_to_mlx"]


def __getattr__(name: str):
    if name == "convert_gguf_to_mlx":
        from .gguf_to_mlx import convert_gguf_to_mlx

        return convert_gguf_to_mlx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
