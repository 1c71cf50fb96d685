"""Click command groups, one module per area.  `remote_ops.cli.main` registers them.

Each module exposes `commands`: a list of click commands/groups.  A command
module parses options, calls a workflow (`remote_ops.workflows.deploy`, `.container`,
`.health`, `.patching`, ...) and renders its result; deciding and acting on
hosts belongs in those workflow and pure modules: no command module calls a
connection's `run`/`put`/`get` or imports the transfer (tests/test_layers.py).
"""
