"""`remote-ops container start|stop|restart|status --host H`: the SGLang container's lifecycle."""
from __future__ import annotations

import click

from .. import container as ctr
from .. import deploy, hostlock
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


def _lifecycle(app, host: str, action: str, grace: int, dry_run: bool, diff: bool) -> None:
    """Run (or, with --dry-run, show) start/stop/restart; --diff shows the state change.

    A real run holds the host lock (exit 9 while a deploy or another change holds
    it, nothing touched); a dry run only reads."""
    from .. import patching

    spec = app.host(host)
    if action == "start" and not spec.sglang.patch:      # the image tag names the patch: derive the spec
        spec = patching.bind_host(app.remote(spec), spec)[0]
    image = deploy.image_ref(spec) if action == "start" else None
    remote = app.remote(spec)
    if dry_run:
        commands, before, after = ctr.lifecycle(remote, spec, action, image=image, grace_s=grace, dry_run=True)
    else:
        with hostlock.held(remote, spec, f"container {action}"):
            commands, before, after = ctr.lifecycle(remote, spec, action, image=image, grace_s=grace)
    if not commands:
        app.console.status("ok", f"{spec.name}: nothing to do ({action}: container already in that state)")
    for c in commands:
        app.console.say(f"{'would run' if dry_run else 'ran'}: {c}")
    if diff:
        was = f"{before.status} ({before.image_id[:19]})" if before else "absent"
        app.console.say(f"--- container {spec.container.name}: {was}\n+++ after {action}: "
                        + (f"{after.status} ({after.image_id[:19]})" if after and not dry_run
                           else "(not run)" if dry_run else "absent"))
    if dry_run:
        app.console.emit({"host": spec.name, "dry_run": True, "commands": commands,
                          "container": before.to_dict() if before else None})
    else:
        _show(app, spec, after)


def lifecycle_options(fn):
    fn = click.option("--diff", is_flag=True, help="show the container's state before and after")(fn)
    return click.option("--dry-run", is_flag=True, help="print the docker commands; change nothing")(fn)


@container_group.command("start")
@lifecycle_options
@host_command
def start_cmd(app, host: str, dry_run: bool, diff: bool) -> None:
    """Start the container; if it does not exist, run it from the deployed image."""
    _lifecycle(app, host, "start", 30, dry_run, diff)


@container_group.command("stop")
@click.option("--grace", type=int, default=30, show_default=True, help="seconds before SIGKILL")
@lifecycle_options
@host_command
def stop_cmd(app, host: str, grace: int, dry_run: bool, diff: bool) -> None:
    """Stop the container (it keeps its settings; `start` resumes it).  Stopped already: no-op."""
    _lifecycle(app, host, "stop", grace, dry_run, diff)


@container_group.command("restart")
@click.option("--grace", type=int, default=30, show_default=True, help="seconds before SIGKILL")
@lifecycle_options
@host_command
def restart_cmd(app, host: str, grace: int, dry_run: bool, diff: bool) -> None:
    """Restart the container in place."""
    _lifecycle(app, host, "restart", grace, dry_run, diff)


@container_group.command("status")
@host_command
def status_cmd(app, host: str) -> int:
    """Show the container's state, health, image and restart count (exit 13 if absent)."""
    spec = app.host(host)
    info = ctr.status(app.remote(spec), spec)
    _show(app, spec, info)
    return 0 if info is not None else 13


commands = [container_group]
