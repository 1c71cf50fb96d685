"""Run a command's per-host work on the selected hosts and render the outcome once.

One host: the work runs inline; its result is rendered and emitted as the
command's own document, and an error reaches the CLI boundary unchanged.
Several hosts: `remote_ops.workflows.fleet.fan_out` runs them `--forks` at a time; each
host's result (or error) is rendered as it finishes, under the host's name;
then a per-host summary table, one JSON document (`{"hosts": [...],
"exit_code": N}`, each host with its result or error), and the worst host's
exit code.  A host's failure never stops the others.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ...workflows import fleet

Work = Callable[[Any], tuple[int, Any]]
Render = Callable[[Any, Any, Any], None]  # (console, host spec, result)


def run_on_hosts(
    app,
    hosts: list,
    work: Work,
    render: Render,
    *,
    forks: int = fleet.DEFAULT_FORKS,
    serial: int | None = None,
    keep_going: bool = False,
    document: Callable[[fleet.FleetRun], Any] | None = None,
    emit: Callable[[Any], None] | None = None,
) -> int:
    """`work(host) -> (exit code, result)` on every host; returns the exit code for the run.

    `document(run)` builds the JSON document instead of the defaults (a command whose
    document keeps one shape for one host and many: health); `emit` replaces
    `console.emit` (streams: `console.emit_line`, one JSON line per round)."""
    emit = emit or app.console.emit
    if len(hosts) == 1 and not serial:
        code, result = work(hosts[0])
        render(app.console, hosts[0], result)
        emit(document(fleet.FleetRun([fleet.HostOutcome(hosts[0].name, code, result)])) if document else result)
        return code
    by_name = {h.name: h for h in hosts}
    lock = threading.Lock()

    def done(outcome: fleet.HostOutcome) -> None:
        with lock:
            _render_outcome(app, by_name[outcome.host], outcome, render)

    def guarded(host):
        try:
            return work(host)
        except BaseException:
            app.forget(host.name)  # a broken connection is not reused by a later step
            raise

    if serial:
        run = fleet.rolling(hosts, guarded, serial=serial, forks=forks, keep_going=keep_going, on_done=done)
    else:
        run = fleet.fan_out(hosts, guarded, forks=forks, on_done=done)
    summarize(app.console, run)
    emit(document(run) if document else run.to_dict())
    return run.exit_code


def _render_outcome(app, spec, outcome: fleet.HostOutcome, render: Render) -> None:
    app.console.step(f"{outcome.host}: exit {outcome.exit_code} ({outcome.duration_s:.2f}s)")
    if outcome.error is not None:
        app.console.error(str(outcome.error), outcome.error.hint)
    elif outcome.result is not None:
        render(app.console, spec, outcome.result)


def summarize(console, run: fleet.FleetRun) -> None:
    """The per-host table: host, its own exit code, time, and its own verdict (`HostOutcome.verdict`)."""
    rows = [
        [
            o.host,
            "skipped" if o.skipped else o.exit_code,
            f"{o.duration_s:.2f}s",
            o.verdict,
        ]
        for o in run.outcomes
    ]
    console.table(
        ["host", "exit", "time", "result"],
        rows,
        title=f"{len(run.outcomes)} hosts, {sum(o.failed for o in run.outcomes)} failed",
    )
