"""Commands: container (being written)."""
commands: list = []
