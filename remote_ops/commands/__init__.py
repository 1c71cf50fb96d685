"""Click command groups, one module per area.  `remote_ops.cli` registers them.

Each module exposes `commands`: a list of click commands/groups.  Modules hold
only parsing and rendering; the work is in workflow/pure modules.
"""
