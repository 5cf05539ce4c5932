"""Prompt-lookup research instruments: the task texts (lookup_tasks), what the controller
decided and why (trace_lookup), the plans replayed on measured step costs (replay_lookup,
record_drift), the step-by-step cost of lookup on and off (lookup_step_ledger), and how far
a wide step's rows stray from one-row steps (batch_drift); common holds what they share
(the test models by short name, the warm-up, the paired-ratio statistics). Run one from
the repository's root as a module:

    .venv/bin/python -m scripts.lookup.trace_lookup --model gemma --task edit
    .venv/bin/python -m scripts.lookup.replay_lookup --models smollm2

Their tests carry the pytest marker `research` (`-m "not research"` leaves them out).
"""
