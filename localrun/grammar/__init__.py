"""Constrained decoding through llguidance: every grammar localrun compiles (GBNF, Lark,
JSON schema, regex, tool calls) is made by `core.lark_spec` with localrun's options and
compiled under its limits (`core`); a model's vocabulary becomes llguidance's tokenizer
(`tokenizer`); one generation walks a grammar token by token (`matcher`); GBNF is
converted to Lark (`gbnf`); a JSON answer closes before max_tokens cuts it (`json_budget`);
a chain draws under a grammar without its full mask where it can (`head`, `redraw`).

Imports: the foundations (`localrun.errors`) only.
"""
