"""`remote-ops hosts`: list the inventory, or the hosts a pattern names (no SSH)."""

from __future__ import annotations

import click

from ...core import secrets
from ._options import app_options, pattern_option


@click.command("hosts")
@pattern_option(
    "--host",
    "pattern",
    help="list only the hosts this pattern names (Ansible patterns: 'fleet:&rack-2:!gpu-03'); default: all",
)
@pattern_option("--limit", help="narrow the list")
@app_options
def hosts_cmd(app, pattern: str | None, limit: str | None) -> None:
    """List the hosts (and groups) of the inventory.

    With --host/--limit, list the hosts a host command given the same
    pattern would work on, as `ansible PATTERN --list-hosts` does; nothing
    connects.

    \b
      remote-ops hosts
      remote-ops hosts --host 'fleet:&rack-2:!gpu-03' --json
    """
    inv = app.inventory()
    chosen = app.select(pattern, all_hosts=not pattern, limit=limit) if pattern or limit else list(inv.hosts.values())
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
        for h in chosen
    ]
    app.console.table(["host", "address", "user", "port", "gpus", "sglang", "patch spec", "groups", "file"], rows)
    if not rows:
        app.console.say("no hosts: add a YAML file under ./inventory or pass --inventory")
    elif inv.groups and not (pattern or limit):
        group_rows = [
            [g, ",".join(members), ",".join(inv.children.get(g, ())), ",".join(inv.group_sources.get(g, ()))]
            for g, members in inv.groups.items()
        ]
        app.console.table(["group", "hosts", "children", "defined in"], group_rows)
    app.console.emit(
        {
            "hosts": [secrets.mask_data(h.model_dump(mode="json")) for h in chosen],
            "groups": {k: list(v) for k, v in inv.groups.items()},
            "children": {k: list(v) for k, v in inv.children.items()},
            "sources": list(inv.sources),
        }
    )


commands = [hosts_cmd]
