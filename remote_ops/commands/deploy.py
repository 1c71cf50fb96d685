"""Commands: deploy (being written)."""
commands: list = []
