"""The CLI's subcommands beyond `run` and `chat`, each a module with `add_commands(sub)`
that `localrun.cli` loads: `serve`, the store's (`ls`, `rm`, `show`, `ps`, `pull`, `fit`, `doctor`),
`rpc` (`rpc-worker` and the `--rpc` flags) and `mlx_ring` (`mlx-ring`, `mlx-worker`).

Imports: anything below (the engine, the server, the store, the model, the cluster);
nothing imports a command module but `localrun.cli`.
"""
