"""Prompts from messages: each model's own Jinja chat template (`chat_template`), rendered
in a sandbox whose time and output are bounded (`template_budget`).

Imports: the foundations (`localrun.errors`) only.
"""
