"""Commands: sandbox (being written)."""
commands: list = []
