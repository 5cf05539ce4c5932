"""Speculative decoding by prompt lookup: drafts copied from the context, priced by the
step costs this machine measures, verified exactly by the engine.

- `speculative`: the per-generation draft controller, lookup's settings, acceptance and
  batch drift; `edits`: edits learned from what the model kept; `step_cost`: what a step
  of r rows costs here; `drift_cache`: the drift measurements kept between runs.

Imports: the foundations (`localrun.errors`), `localrun.sampling` (token text) and
`localrun.store` (where the drift cache lives); never the engine, the server or the UI.
"""
