"""Commands: extract (being written)."""
commands: list = []
