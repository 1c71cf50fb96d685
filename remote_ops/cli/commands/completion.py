"""`remote-ops completion bash|zsh|fish`: print the shell's completion script (no inventory, no SSH)."""

from __future__ import annotations

import click

#: The environment variable click's completion protocol reads (`_<PROG>_COMPLETE`).
COMPLETE_VAR = "_REMOTE_OPS_COMPLETE"


@click.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion_cmd(shell: str) -> None:
    """Print the shell completion script for remote-ops on stdout.

    The script is click's (the same as `_REMOTE_OPS_COMPLETE=<shell>_source
    remote-ops`); each TAB then runs remote-ops, which completes commands,
    options and --host names (read from the inventory files without
    validating them).

    \b
    Install:
      remote-ops completion bash > ~/.local/share/bash-completion/completions/remote-ops
      remote-ops completion zsh > ~/.zfunc/_remote-ops      # with fpath+=(~/.zfunc) before compinit
      remote-ops completion fish > ~/.config/fish/completions/remote-ops.fish
    """
    from click.shell_completion import get_completion_class

    root = click.get_current_context().find_root()
    cls = get_completion_class(shell)
    assert cls is not None  # the Choice names only shells click knows
    click.echo(cls(root.command, {}, "remote-ops", COMPLETE_VAR).source())


commands = [completion_cmd]
