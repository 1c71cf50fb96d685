"""`remote-ops health`: tiered, read-only checks; exit code follows the worst result."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from ...paths import host_dir
from ._fleet import run_on_hosts
from ._options import hosts_command

if TYPE_CHECKING:
    from ...workflows.health import HostHealth


def _expected_image(spec) -> str | None:
    """The image ref deploy builds for this host (None when deploy can't tell); without importing
    the deploy package (~35 ms: health's start-up counts)."""
    from ...core import patchspec
    from ...errors import RemoteOpsError
    from ...workflows import container

    if spec.serving.engine == "vllm":
        from ...serving import vllm

        return vllm.image_ref(spec)
    if not spec.sglang.patch:  # a spec derived on the host: the tag is not known here
        return None
    try:
        return container.deploy_image(spec, patchspec.for_host(spec).hash)
    except RemoteOpsError:
        return None


def _check(app, spec, deep: bool) -> tuple[int, HostHealth]:
    """One host's tiers (never raises: a connection failure is its failing ssh check)."""
    from ...workflows import health as health_mod

    r = health_mod.check_host(
        app.remote, spec, deep=deep, expected_image=_expected_image(spec), state_dir=host_dir(spec.name)
    )
    return health_mod.exit_code([r]), r


def _document(run) -> dict:
    """The health document: `{"hosts": [HostHealth, ...]}` for one host or many (scripts read
    `hosts[i].checks`), each with its own integer `exit_code`, the command's exit code and the
    hosts that failed.  A host whose check raised (no HostHealth) is still listed, with its
    exit code and error."""
    from ...workflows import health as health_mod

    results = [o.result for o in run.outcomes if o.result is not None]
    return {
        "hosts": [o.result.to_dict() if o.result is not None else _no_result(o) for o in run.outcomes],
        "exit_code": health_mod.exit_code(results) if len(results) == len(run.outcomes) else run.exit_code,
        "failed": [o.host for o in run.outcomes if o.failed],
    }


def _no_result(outcome) -> dict:
    """A host's entry when its check raised instead of giving checks."""
    return {
        "host": outcome.host,
        "worst": "fail",
        "exit_code": outcome.exit_code,
        "error": outcome.error.to_dict() if outcome.error else None,
        "checks": [],
    }


def _drop_broken(app, results) -> None:
    """Forget the connections of hosts whose round failed at the SSH level, so the next
    watch round reconnects (under --connect-timeout) instead of reusing a dead one."""
    for r in results:
        if r.error_exit:
            app.forget(r.host)


def render(console, _spec, r: HostHealth) -> None:
    """One host's checks: the command's data (stdout; stderr with --json)."""
    console.status(r.worst, f"{r.host}: {r.worst} ({r.duration_s:.2f}s, {r.round_trips} round trips)", data=True)
    for c in r.checks:
        console.status(c.status, f"{r.host} {c.tier}/{c.name}: {c.reason}", data=True)


@click.command("health")
@click.option("--deep", is_flag=True, help="also run ONE one-token generation probe per host")
@click.option(
    "--watch",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="repeat every SECONDS (with --json: one compact JSON line per round)",
)
@click.option(
    "--watch-for",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    help="stop watching after this many seconds (a round started before then may end up to "
    "--connect-timeout + --command-timeout later)",
)
@hosts_command(speculate=True)
def health_cmd(app, hosts, forks, deep, watch, watch_for) -> int:
    """Check SSH, docker, GPUs, container, patch, SGLang endpoints and dumps.

    Cheap endpoints only (/model_info, /server_info, /v1/models); SGLang's
    /health runs a generation, so a generation probe runs only with --deep.
    Exit code: 0 ok, 11 worst was warn, 12 something failed; a host that
    cannot be reached 4, authenticated 5, or whose key is unknown/changed 6
    (the JSON still lists its ssh check).  Each probe is bounded by
    --command-timeout, so one hung probe fails alone.  Many hosts are checked
    --forks at a time, one connection each.
    """
    deadline = time.monotonic() + watch_for
    app.console.streaming = bool(watch)  # --json: JSON Lines, up to an error's last line
    app.preconnect(hosts[:forks])  # the handshakes overlap the imports below
    from ...workflows import health as health_mod

    emit = app.console.emit_line if watch else None
    while True:
        results: list[HostHealth] = []

        def work(spec, results=results):
            code, r = _check(app, spec, deep)
            results.append(r)
            return code, r

        run_on_hosts(app, hosts, work, render, forks=forks, document=_document, emit=emit)
        if not watch or time.monotonic() + watch >= deadline:
            return health_mod.exit_code(results)
        time.sleep(watch)
        _drop_broken(app, results)


commands = [health_cmd]
