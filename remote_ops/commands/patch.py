"""Commands: patch (being written)."""
commands: list = []
