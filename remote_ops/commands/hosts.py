"""Commands: hosts (being written)."""
commands: list = []
