from .cli.launch import run

run()
