"""`remote-ops container start|stop|restart|status --host PATTERN`: the SGLang container's lifecycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from ...workflows import container as ctr, deploy, hostlock
from ._fleet import run_on_hosts
from ._options import hosts_command

if TYPE_CHECKING:
    from ...engine.types import ContainerInfo


def _show(console, spec, view: "ContainerView") -> None:
    """One status line per host (the command's data, stdout); the document is emitted by run_on_hosts."""
    info = view.info
    if view.doc.get("dry_run"):
        return
    if info is None:
        console.status("fail", f"{spec.name}: container {spec.container.name} does not exist", data=True)
    else:
        health = f", {info.health}" if info.health else ""
        console.status(
            "ok" if info.running else "warn",
            f"{spec.name}: {info.name} {info.status}{health}, image {info.image_ref} "
            f"({info.image_id[:19]}), restarts {info.restart_count}" + (", OOM-killed" if info.oom_killed else ""),
            data=True,
        )


@dataclass
class ContainerView:
    """One host's JSON document and the inspect result it came from (for the human view)."""

    doc: dict
    info: ContainerInfo | None = None

    def to_dict(self) -> dict:
        return self.doc


def _info_doc(spec, info) -> ContainerView:
    return ContainerView({"host": spec.name, "container": info.to_dict() if info else None}, info)


@click.group("container")
def container_group() -> None:
    """Start, stop, restart or show the SGLang container (built by `deploy`)."""


#: `stop` and `restart`: how long the container has between SIGTERM and SIGKILL
_grace_option = click.option("--grace", type=int, default=30, show_default=True, help="seconds before SIGKILL")


def _lifecycle(app, hosts, forks: int, action: str, grace: int, dry_run: bool, diff: bool) -> int:
    return run_on_hosts(
        app, hosts, lambda spec: (0, _lifecycle_one(app, spec, action, grace, dry_run, diff)), _show, forks=forks
    )


def _lifecycle_one(app, spec, action: str, grace: int, dry_run: bool, diff: bool) -> ContainerView:
    """Run (or, with --dry-run, show) start/stop/restart on one host; --diff shows the state change.

    A real run holds the host lock (exit 9 while a deploy or another change holds
    it, nothing touched); a dry run only reads."""
    from ...workflows import patching

    if action == "start" and not spec.sglang.patch:  # the image tag names the patch: derive the spec
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
    for c in commands:  # a dry run's plan is its data (stdout); what ran is progress (stderr)
        line = f"{spec.name}: {'would run' if dry_run else 'ran'}: {c}"
        app.console.text_block(line) if dry_run else app.console.say(line)
    if diff:
        was = f"{before.status} ({before.image_id[:19]})" if before else "absent"
        app.console.text_block(
            f"--- container {spec.container.name}: {was}\n+++ after {action}: "
            + (
                f"{after.status} ({after.image_id[:19]})"
                if after and not dry_run
                else "(not run)"
                if dry_run
                else "absent"
            )
        )
    if dry_run:
        return ContainerView(
            {
                "host": spec.name,
                "dry_run": True,
                "commands": commands,
                "container": before.to_dict() if before else None,
            }
        )
    return _info_doc(spec, after)


def lifecycle_options(fn):
    fn = click.option("--diff", is_flag=True, help="show the container's state before and after")(fn)
    return click.option("--dry-run", is_flag=True, help="print the docker commands; change nothing")(fn)


@container_group.command("start")
@lifecycle_options
@hosts_command
def start_cmd(app, hosts, forks, dry_run: bool, diff: bool) -> int:
    """Start the container; if it does not exist, run it from the deployed image."""
    return _lifecycle(app, hosts, forks, "start", 30, dry_run, diff)


@container_group.command("stop")
@_grace_option
@lifecycle_options
@hosts_command
def stop_cmd(app, hosts, forks, grace: int, dry_run: bool, diff: bool) -> int:
    """Stop the container (it keeps its settings; `start` resumes it).  Stopped already: no-op."""
    return _lifecycle(app, hosts, forks, "stop", grace, dry_run, diff)


@container_group.command("restart")
@_grace_option
@lifecycle_options
@hosts_command
def restart_cmd(app, hosts, forks, grace: int, dry_run: bool, diff: bool) -> int:
    """Restart the container in place."""
    return _lifecycle(app, hosts, forks, "restart", grace, dry_run, diff)


@container_group.command("status")
@hosts_command
def status_cmd(app, hosts, forks) -> int:
    """Show the container's state, health, image and restart count (exit 13 if absent)."""

    def work(spec):
        info = ctr.status(app.remote(spec), spec)
        return (0 if info is not None else 13), _info_doc(spec, info)

    return run_on_hosts(app, hosts, work, _show, forks=forks)


commands = [container_group]
