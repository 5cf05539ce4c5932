"""Models on this machine and where they come from: the local store (`local`: names,
folders, listing, resolving a name to a file) and the Hugging Face Hub (`hub`: `pull`,
resumable verified downloads, choosing a quant).

Imports: the foundations, `localrun.model` and `localrun.quant` (the selector's fit
arithmetic); never the engine, the server or the UI.
"""
