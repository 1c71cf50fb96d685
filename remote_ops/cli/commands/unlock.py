"""`remote-ops unlock --host PATTERN [--force] [--dry-run]`: show the host lock's holder and release it."""

from __future__ import annotations

import click

from ...errors import Refused
from ...workflows import hostlock
from ._fleet import run_on_hosts
from ._options import hosts_command


@click.command("unlock")
@click.option("--force", is_flag=True, help="release the lock even if its holder may still be running")
@click.option("--dry-run", is_flag=True, help="show the holder and what would be done; change nothing")
@hosts_command
def unlock_cmd(app, hosts, forks, force: bool, dry_run: bool) -> int:
    """Show who holds the host lock (who, client host, PID, when, why) and release it.

    \b
    Without --force only a lock proved stale is released: its holder ran on
    this machine and that PID is gone ("stale lock: holder PID N is gone"),
    or one remote shell held it and that PID is gone on the host.
    --force releases any lock.  Every release is appended to the host's
    audit log.  Exit 0 released (or no lock), 9 refused (holder may be alive).

    \b
      remote-ops unlock --host gpu-node
      remote-ops unlock --host gpu-node --force
    """
    return run_on_hosts(app, hosts, lambda spec: (0, _unlock(app, spec, force, dry_run)), lambda *_: None, forks=forks)


def _unlock(app, spec, force: bool, dry_run: bool) -> dict:
    """One host: show the holder, release a stale (or --force) lock; the command's document."""
    remote = app.remote(spec)
    holder = hostlock.read(remote, spec)
    if holder is None:
        app.console.status("ok", f"{spec.name}: no lock held ({spec.lock_dir})")
        return {"host": spec.name, "lock_dir": spec.lock_dir, "held": False, "released": False}
    stale = hostlock.stale_reason(holder, hostlock.this_client(), hostlock.pid_alive)
    app.console.say(f"{spec.name}: {spec.lock_dir} held by {holder.describe()}" + (f" ({stale})" if stale else ""))
    if not stale and not force:
        raise Refused(
            f"lock {spec.lock_dir} is held by {holder.describe()}; its holder may still be running "
            "(not provably stale from here)",
            host=spec.name,
            hint=f"if that run is gone, `remote-ops unlock --host {spec.name} --force`",
            details={"reason": "lock_held", "lock": holder.to_dict()},
        )
    doc = {
        "host": spec.name,
        "lock_dir": spec.lock_dir,
        "held": True,
        "holder": holder.to_dict(),
        "stale": stale,
        "forced": force and not stale,
        "released": not dry_run,
    }
    if dry_run:
        app.console.status("info", "dry run: would release the lock and write it to the audit log")
    else:
        hostlock.release_held(remote, spec, holder, forced=force and not stale, reason=stale)
        app.console.status(
            "ok",
            f"released {spec.lock_dir} ("
            + ("forced" if force and not stale else stale or "")
            + f"); recorded in {spec.audit_log}",
        )
    return doc


commands = [unlock_cmd]
