"""Commands: health (being written)."""
commands: list = []
