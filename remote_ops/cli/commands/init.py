"""`remote-ops init [--dir DIR] [--host ADDRESS] [--accept-new] [--force]`: start an inventory."""

from __future__ import annotations

from pathlib import Path

import click

from ...errors import HostKeyUnknown
from ...workflows import init as flow
from ._options import app_options


@click.command("init")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="where to write the inventory (default ~/.config/remote-ops/inventory, found from any directory)",
)
@click.option("--host", "host", metavar="[USER@]ADDRESS[:PORT]", default=None, help="the GPU host to put in it")
@click.option("--accept-new", is_flag=True, help="record the host's key without asking (ssh's accept-new)")
@click.option("--force", is_flag=True, help="overwrite inventory files that exist")
@app_options
def init_cmd(app, directory: Path | None, host: str | None, accept_new: bool, force: bool) -> None:
    """Write a commented inventory from the shipped example.

    \b
    The default directory is the user's config directory
    ($XDG_CONFIG_HOME/remote-ops/inventory, else ~/.config/remote-ops/inventory),
    which every command finds when there is no --inventory,
    $REMOTE_OPS_INVENTORY or ./inventory.  Existing files are never
    overwritten without --force (exit 9).  With --host, the example host
    gets that address and the host's key is fetched (no login), its
    fingerprint shown, and it is recorded in DIR/known_hosts only when
    confirmed (or with --accept-new, as ssh -o StrictHostKeyChecking=accept-new).
    Exit 0 written, 2 a --host that is not [USER@]ADDRESS[:PORT] (checked before any
    lookup), 6 key not accepted, 4 host unreachable, 9 files exist.

    \b
      remote-ops init
      remote-ops init --host root@10.1.230.174 --accept-new
      remote-ops init --dir ./inventory --force
    """
    from ...core.rawinv import user_inventory_dir

    directory = directory or user_inventory_dir()
    flow.check_directory(directory)
    target = flow.parse_target(host) if host else None
    files = flow.plan(directory, target)
    flow.refuse_overwrite(files, force)
    key = flow.scan_key(target) if target else None
    if key is not None and target is not None:
        app.console.say(f"{key.known_name}: {key.key_type} key fingerprint is {key.fingerprint}")
        if not accept_new and not _confirm(key.known_name):
            raise HostKeyUnknown(
                f"host key of {key.known_name} ({key.fingerprint}) not accepted; nothing written",
                host=target.address,
                hint="compare the fingerprint out of band (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub on the "
                "host), then answer yes or pass --accept-new",
                details={"offered": key.fingerprint},
            )
    written = flow.write(files)
    known_hosts = directory / flow.KNOWN_HOSTS
    if key is not None and not flow.already_known(known_hosts, key.known_hosts_line()):
        key.record(known_hosts)
    for path in written:
        app.console.say(f"wrote {path}")
    app.console.status("ok", f"inventory in {directory}: check it with `remote-ops inventory check`", data=True)
    app.console.emit(
        {
            "dir": str(directory),
            "files": [str(p) for p in written],
            "host_key": None
            if key is None
            else {"known_hosts": str(known_hosts), "host": key.known_name, "fingerprint": key.fingerprint},
        }
    )


def _confirm(name: str) -> bool:
    """Ask on the terminal, as ssh does; no terminal (or no answer) means no."""
    try:
        return click.confirm(f"record the key of {name}?", default=False, err=True)
    except click.Abort:
        return False


commands = [init_cmd]
