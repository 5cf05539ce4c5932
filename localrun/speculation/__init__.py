"""Speculative decoding: drafts from a proposer, priced by the step costs this machine
measures, verified exactly, so that the output is the one decoding without them gives.

- `speculator`: the per-model `Speculator` the engine's step goes through (plan -> draft
  -> verify -> observe): step costs, acceptance, batch drift, turn marks, verification.
- `proposer`: the `Proposer` seam, where a generation's drafts come from;
  `shared_step`: the drafts of a step several decoding streams share, chosen together.
- `lookup`: prompt lookup, the first proposer (`LookupProposer`, `LookupConfig`, the
  n-gram index and the acceptance per match length); `edits`: the edits it learns.
- `step_cost`: what a step of r rows costs here; `drift`: how far a wide step's rows
  stray from one-row steps' (`BatchDrift`); `drift_cache`: that drift kept between runs.

Imports: the foundations (`localrun.errors`), `localrun.backends.base` (the decode a
verification repeats), `localrun.store` (where the drift cache lives); never the engine
core, the server or the UI. A generation reaches it as an argument (duck-typed).
"""
