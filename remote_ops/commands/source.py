"""Commands: source (being written)."""
commands: list = []
