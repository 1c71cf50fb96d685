"""Commands: render (being written)."""
commands: list = []
