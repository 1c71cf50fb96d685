"""`remote-ops render --host H`: print the Dockerfile deploy would build (stdout)."""
from __future__ import annotations

import click

from .. import deploy
from ._options import host_command


@click.command("render")
@host_command
def render_cmd(app, host: str) -> None:
    """Print the rendered Dockerfile for HOST on stdout (no SSH).

    The target file shas in its labels (the host's patch spec, which must be named
    in its inventory: render makes no SSH connection) are computed locally from the
    released SGLang file of the inventory's version, patched: what deploy
    builds from a pristine checkout.
    """
    spec = app.host(host)
    text = deploy.render_for_host(spec)
    if app.console.json_mode:
        app.console.emit({"host": spec.name, "image": deploy.image_ref(spec), "dockerfile": text})
    else:
        app.console.out(text)


commands = [render_cmd]
