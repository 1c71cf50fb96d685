"""`remote-ops deploy --host PATTERN [--dry-run] [--diff] [--yes] [--serial N]`: the whole job, idempotent."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from ._fleet import run_on_hosts
from ._options import ask_or_refuse, hosts_command, seconds_option

if TYPE_CHECKING:
    from ...workflows.deploy import DeployResult

#: default of --build-timeout, seconds (the workflow's BUILD_TIMEOUT_S; a test keeps them equal).
#: Written here so that loading this module imports no workflow: deploy opens its
#: connections first and imports the deploy package while the handshakes run.
BUILD_TIMEOUT_S = 3600.0


@click.command("deploy")
@click.option("--dry-run", is_flag=True, help="print the plan and every diff; change nothing")
@click.option("--diff", "show_diff", is_flag=True, help="print the diffs (implied by --dry-run)")
@click.option("--yes", "-y", is_flag=True, help="do not ask before changing the host")
@click.option("--why", default="deploy", show_default=True, help="reason stored in the lock and audit log")
@seconds_option("--healthy-timeout", help="seconds to wait for healthy (default: inventory server.healthy_timeout_s)")
@click.option(
    "--build-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=BUILD_TIMEOUT_S,
    show_default=True,
    help="seconds the image build may take",
)
@click.option(
    "--serial",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="rolling: N hosts at a time; after a batch with a failure the rest are skipped",
)
@click.option("--keep-going", is_flag=True, help="with --serial: go on after a failed batch")
@hosts_command(speculate=True)
def deploy_cmd(
    app,
    hosts,
    forks,
    dry_run: bool,
    show_diff: bool,
    yes: bool,
    why: str,
    healthy_timeout: float | None,
    build_timeout: float,
    serial: int | None,
    keep_going: bool,
) -> int:
    """Preflight, lock, check, push, patch, verify, build, start, wait, record, unlock.

    \b
    Only what is out of date is done: a re-run with nothing changed reports
    "up to date" without rebuilding or restarting.  Example:
      remote-ops deploy --host 10.1.230.174 --dry-run

    \b
    Every remote command runs under --command-timeout; the build under
    --build-timeout, the wait under --healthy-timeout.  An error, SIGINT,
    SIGTERM or SIGHUP releases the host lock and writes the run record with
    the failed step (exit 130 / 143 / 129 for the signals).  A lock left by a
    lost connection: `remote-ops unlock --host H`.

    \b
    Many hosts: --forks at a time, or --serial N in rolling batches:
      remote-ops deploy --host fleet --yes --serial 2
    """
    if len(hosts) > 1 and not dry_run and not yes:
        _confirm_many(hosts)
    app.preconnect(hosts[: serial or forks])  # the handshakes overlap the deploy package's import
    one = len(hosts) == 1

    def work(spec):
        with app.console.counter(f"{spec.name}: build", "steps") if one else _no_bar() as bar:
            return 0, _deploy_one(
                app, spec, dry_run, show_diff, yes or not one, why, healthy_timeout, build_timeout, bar
            )

    return run_on_hosts(app, hosts, work, lambda *_: None, forks=forks, serial=serial, keep_going=keep_going)


class Deployed:
    """A host's deploy result plus how its patch spec was chosen (the command's JSON document)."""

    def __init__(self, result: DeployResult, derivation) -> None:
        self.result, self.derivation = result, derivation

    def to_dict(self) -> dict:
        return {**self.result.to_dict(), "patch_spec": self.derivation.to_dict() if self.derivation else None}


@contextmanager
def _no_bar():
    """Many hosts at once: no build bar (a terminal shows one live display at a time)."""
    yield None


def _deploy_one(app, spec, dry_run, show_diff, yes, why, healthy_timeout, build_timeout, bar=None) -> Deployed:
    """One host's deploy: preview and confirm (unless --yes), deploy, show diffs and the summary.
    `bar` (one host, on a terminal): the build's Dockerfile step, n of total, as it starts."""
    from ...workflows import deploy as deploy_mod, patching

    remote = app.remote(spec)
    events = _events(app.console, spec.name, bar)
    app.console.step(f"deploy {spec.name} ({remote.target.display}, host key {remote.host_key_fingerprint})")
    if spec.serving.engine == "sglang":
        spec, derivation = patching.bind_host(remote, spec)
        app.console.say(f"patch spec: {derivation} -> {spec.sglang.target_file}")
    else:
        from ...serving import serving_for

        derivation = None
        app.console.say(serving_for(spec).NO_PATCH)
    if not dry_run and not yes:
        preview = deploy_mod.deploy(remote, spec, dry_run=True, events=deploy_mod.Events())
        if not preview.up_to_date:
            _confirm(app, spec, preview)
    result = deploy_mod.deploy(
        remote,
        spec,
        dry_run=dry_run,
        events=events,
        why=why,
        healthy_timeout_s=healthy_timeout,
        build_timeout_s=build_timeout,
    )
    if dry_run or show_diff:
        for name, text in result.diffs.items():
            app.console.step(f"{spec.name} diff: {name}")
            app.console.text_block(text)  # the plan's diffs are data (stdout)
    _summary(app, result)
    return Deployed(result, derivation)


def _events(console, host: str, bar):
    """Deploy's console events; with a `bar`, each build output line that starts a Dockerfile
    step (`core.buildsteps`) also moves it: "build (steps) 3/9 RUN pip install ..."."""
    from ...core.buildsteps import step
    from ._deploy_events import ConsoleEvents

    class WithBuildSteps(ConsoleEvents):
        def line(self, stream: str, text: str) -> None:
            super().line(stream, text)
            found = step(text)
            if found is not None:
                bar(found.n, found.total, note=found.instruction[:60])

    return (WithBuildSteps if bar is not None else ConsoleEvents)(console, host)


def _confirm_many(hosts) -> None:
    """Many hosts without --yes: ask once for all (stdin must be a terminal)."""
    names = ", ".join(h.name for h in hosts)
    ask_or_refuse(
        f"deploy to {len(hosts)} hosts ({names})? Proceed?",
        f"deploy would change up to {len(hosts)} hosts ({names}); re-run with --yes (or --dry-run to see the plans)",
    )


def _confirm(app, spec, preview) -> None:
    """Ask before changing a host (stdin must be a terminal); --yes skips."""
    todo = ", ".join(f"{k} ({v})" for k, v in preview.plan.get("reasons", {}).items())
    ask_or_refuse(
        f"{spec.name}: {todo}. Proceed?",
        f"deploy would change {spec.name}: {todo}; re-run with --yes (or --dry-run to see the diff)",
        host=spec.name,
    )


def _summary(app, r: DeployResult) -> None:
    if r.dry_run:
        word = "up to date (nothing to do)" if r.up_to_date else "dry run: nothing was changed"
    else:
        word = "up to date" if r.up_to_date else "deployed"
    app.console.step(
        f"{r.host}: {word} - {r.image} in {r.wall_s:.2f}s, {r.round_trips} round trips"
        + (f"; record {r.record}" if r.record else "")
    )


commands = [deploy_cmd]
