"""Commands: facts (being written)."""
commands: list = []
