"""`remote-ops render --host PATTERN`: print the Dockerfile deploy would build (stdout)."""

from __future__ import annotations

import click

from ._fleet import run_on_hosts
from ._options import hosts_command


@click.command("render")
@hosts_command
def render_cmd(app, hosts, forks) -> int:
    """Print the rendered Dockerfile for each host on stdout (no SSH).

    The target file shas in its labels (the host's patch spec, which must be named
    in its inventory: render makes no SSH connection) are computed locally from the
    released SGLang file of the inventory's version, patched: what deploy
    builds from a pristine checkout.
    """
    from ...workflows import deploy

    def work(spec):
        return 0, {"host": spec.name, "image": deploy.image_ref(spec), "dockerfile": deploy.render_for_host(spec)}

    return run_on_hosts(app, hosts, work, _show, forks=forks)


def _show(console, _spec, doc: dict) -> None:
    """The Dockerfile is the command's data: stdout (the JSON document carries it with --json)."""
    if not console.json_mode:
        console.out(doc["dockerfile"])


commands = [render_cmd]
