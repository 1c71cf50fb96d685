"""Workflows: check -> act -> verify over a `Remote` (or on this machine).

Each module drives the seam (`remote_ops.remote`, `remote_ops.engine`) with
commands built by the pure core (`remote_ops.core`) and parses the answers
there, returning result objects that `remote_ops.cli.commands` render.
"""
