"""`remote-ops container start|stop|restart|status --host H`: the SGLang container's lifecycle."""
from __future__ import annotations

import click

from .. import container as ctr
from .. import deploy
from ._options import host_command


def _show(app, spec, info) -> None:
    """One status line (stderr) + the inspect summary as JSON (stdout with --json)."""
    if info is None:
        app.console.status("fail", f"{spec.name}: container {spec.container.name} does not exist")
    else:
        health = f", {info.health}" if info.health else ""
        app.console.status("ok" if info.running else "warn",
                           f"{spec.name}: {info.name} {info.status}{health}, image {info.image_ref} "
                           f"({info.image_id[:19]}), restarts {info.restart_count}"
                           + (", OOM-killed" if info.oom_killed else ""))
    app.console.emit({"host": spec.name, "container": info.to_dict() if info else None})


@click.group("container")
def container_group() -> None:
    """Start, stop, restart or show the SGLang container (built by `deploy`)."""


@container_group.command("start")
@host_command
def start_cmd(app, host: str) -> None:
    """Start the container; if it does not exist, run it from the deployed image."""
    spec = app.host(host)
    remote = app.remote(spec)
    _show(app, spec, ctr.start(remote, spec, deploy.image_ref(spec)))


@container_group.command("stop")
@click.option("--grace", type=int, default=30, show_default=True, help="seconds before SIGKILL")
@host_command
def stop_cmd(app, host: str, grace: int) -> None:
    """Stop the container (it keeps its settings; `start` resumes it)."""
    spec = app.host(host)
    _show(app, spec, ctr.stop(app.remote(spec), spec, grace))


@container_group.command("restart")
@click.option("--grace", type=int, default=30, show_default=True, help="seconds before SIGKILL")
@host_command
def restart_cmd(app, host: str, grace: int) -> None:
    """Restart the container in place."""
    spec = app.host(host)
    _show(app, spec, ctr.restart(app.remote(spec), spec, grace))


@container_group.command("status")
@host_command
def status_cmd(app, host: str) -> int:
    """Show the container's state, health, image and restart count (exit 13 if absent)."""
    spec = app.host(host)
    info = ctr.status(app.remote(spec), spec)
    _show(app, spec, info)
    return 0 if info is not None else 13


commands = [container_group]
