"""What a model file is: GGUF headers read and validated by localrun's own parser, the
facts the rest of localrun needs about a model (architecture, context, tools, FIM
tokens), and llama.cpp's names for quant types.

- `gguf_header` (bounded reading), `gguf_check` (validation before llama.cpp reads a
  file), `facts` (model facts of a GGUF or an MLX folder), `fim_names`, `formats`.

Imports: the foundations (`localrun.errors`) and `localrun.tools.formats`; never the
backends, the engine, the store or anything above them.
"""
