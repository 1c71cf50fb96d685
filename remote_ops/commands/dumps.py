"""Commands: dumps (being written)."""
commands: list = []
