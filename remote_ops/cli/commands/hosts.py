"""`remote-ops hosts`: list the inventory."""

from __future__ import annotations

import click

from ...core import secrets
from ._options import app_options


@click.command("hosts")
@app_options
def hosts_cmd(app) -> None:
    """List the hosts (and groups) of the inventory."""
    inv = app.inventory()
    rows = [
        [
            h.name,
            h.address or "(ssh_config)",
            h.user or "",
            h.port or "",
            h.gpus.count,
            h.sglang.version,
            h.sglang.patch or "(from config.json)",
            ",".join(h.groups),
            h.source,
        ]
        for h in inv.hosts.values()
    ]
    app.console.table(["host", "address", "user", "port", "gpus", "sglang", "patch spec", "groups", "file"], rows)
    if not rows:
        app.console.say("no hosts: add a YAML file under ./inventory or pass --inventory")
    app.console.emit(
        {
            "hosts": [secrets.mask_data(h.model_dump(mode="json")) for h in inv.hosts.values()],
            "groups": {k: list(v) for k, v in inv.groups.items()},
            "sources": list(inv.sources),
        }
    )


commands = [hosts_cmd]
