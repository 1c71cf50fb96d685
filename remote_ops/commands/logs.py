"""Commands: logs (being written)."""
commands: list = []
