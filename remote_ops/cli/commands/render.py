"""`remote-ops render --host PATTERN`: print the Dockerfile deploy would build (stdout)."""

from __future__ import annotations

import click

from ._fleet import run_on_hosts
from ._options import PathOption, hosts_command


@click.command("render")
@click.option(
    "--sglang-checkout",
    "checkout",
    type=PathOption("dir"),
    envvar="REMOTE_OPS_SGLANG_CHECKOUT",
    default=None,
    metavar="DIR",
    help="a local SGLang checkout to read the released file from, used for the hosts whose "
    "version it is [env REMOTE_OPS_SGLANG_CHECKOUT]",
)
@hosts_command
def render_cmd(app, hosts, forks, checkout) -> int:
    """Print the rendered Dockerfile for each host on stdout (no SSH).

    The target file shas in its labels (the host's patch spec, which must be named
    in its inventory: render makes no SSH connection) are computed locally from the
    released SGLang file of the inventory's version, patched: what deploy builds
    from a pristine checkout.  That file is read offline first: from --sglang-checkout
    when it is that release, else from the cached wheel; only then is the wheel
    downloaded from the package index (REMOTE_OPS_INDEX_URL, default PyPI; a bar on
    a terminal).  An index that cannot be reached is exit 15, naming the variable.
    """
    from ... import wheels
    from ...workflows import deploy

    sources = {v: _fetch_once(app, wheels, v, checkout) for v in dict.fromkeys(h.sglang.version for h in hosts)}

    def work(spec):
        doc = {"host": spec.name, "image": deploy.image_ref(spec), "source": sources[spec.sglang.version]}
        return 0, {**doc, "dockerfile": deploy.render_for_host(spec, checkout)}

    return run_on_hosts(app, hosts, work, _show, forks=forks)


def _fetch_once(app, wheels, version: str, checkout) -> dict:
    """Where `version`'s files come from (`wheels.locate`); a wheel not here yet is downloaded
    now, once per version, before the hosts are rendered (a bar on a terminal)."""
    where = wheels.locate(version, checkout)
    if where.kind == "index":
        with app.console.transfer(f"sglang {version} wheel") as update:
            path = wheels.fetch_sglang_wheel(version, on_progress=update)
        where = wheels.Located("downloaded wheel", path, version)
    app.console.say(f"sglang {version}: {where.kind} {where.path}", style="dim")
    return where.to_dict()


def _show(console, _spec, doc: dict) -> None:
    """The Dockerfile is the command's data: stdout (the JSON document carries it with --json)."""
    if not console.json_mode:
        console.out(doc["dockerfile"])


commands = [render_cmd]
