"""Click command groups, one module per area.  `remote_ops.cli.main` registers them.

Each module exposes `commands`: a list of click commands/groups.  A command
module parses options, calls a workflow (`remote_ops.workflows.deploy`, `.container`,
`.health`, `.patching`, ...) and renders its result; deciding and acting on
hosts belongs in those workflow and pure modules.  Not yet everywhere:
`commands/dumps.py` still orchestrates the pull and `commands/health.py` the
per-host fan-out (issue 12, item 3, moves them to workflows).
"""
