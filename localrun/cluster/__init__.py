"""A model too big for one machine: llama.cpp's RPC workers and devices (`rpc`: the C
glue, the worker list, availability and placement), used by the llama.cpp backend and
the hardware probe.

Imports: the foundations (`localrun.errors`, `localrun.hardware`).
"""
