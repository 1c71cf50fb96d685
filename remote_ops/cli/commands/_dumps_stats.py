"""`remote-ops dumps stats`: the dumper's real cost on the host, beside SGLang's own forward time.

Registered on the `dumps` group by `dumps.py`; the host side is
`remote_ops.workflows.dumpercost`, the join and the share `remote_ops.core.dumpercost`.
"""

from __future__ import annotations

import click

from ...errors import ExitCode
from ._fleet import run_on_hosts
from ._options import hosts_command


@click.command("stats")
@hosts_command
def stats_cmd(app, hosts, forks) -> int:
    """The dumper's cost: capture() time per prefill step next to the forward time of the same steps.

    Reads each writer rank's stats.json under dump.dir (capture_steps, capture_steps_us, started)
    and the server's prefill log lines logged since the dumper started (SGLang 0.5.9+: a step's
    time is the previous line's #new-token over its input throughput).  The share is the mean
    capture time per step over the mean forward time per step, for the slowest rank, taken over
    the steps that started with requests waiting (busy); with fewer than 8 of those, over every
    step, which may include waits for requests: then a lower bound, and said so.  Read only.

    On the sandbox the figures are the stand-in's (a synchronous file write inside a CPU
    network's prefill), labelled STAND-IN: the real figure is the one on a GPU host.  Exit 13
    when no stats.json is found (the dumper never attached).
    """
    from ...workflows import dumpercost

    def work(spec):
        cost = dumpercost.cost(app.remote(spec), spec)
        return (ExitCode.NOT_FOUND if not cost.ranks else ExitCode.OK), cost

    return run_on_hosts(app, hosts, work, lambda console, spec, cost: _render(console, spec, cost), forks=forks)


def _render(console, spec, cost) -> None:
    tag = " (STAND-IN)" if cost.standin else ""
    if cost.ranks:
        console.table(
            ["rank", "state", "steps", "capture mean µs", "capture s", "calls", "tokens"],
            [
                [
                    r.rank,
                    r.state or "-",
                    "-" if r.steps is None else r.steps,
                    "-" if not r.steps else f"{(r.steps_us or 0) / r.steps:,.1f}",
                    "-" if r.steps_us is None else f"{r.steps_us / 1e6:,.3f}",
                    "-" if r.calls is None else r.calls,
                    f"{r.tokens:,}",
                ]
                for r in cost.ranks
            ],
            title=f"dumper capture() on {spec.name} (stats.json){tag}",
        )
    p = cost.prefill
    console.say(
        f"SGLang prefill lines since the dumper started: {p.lines} batch(es), {p.tokens:,} tokens; "
        f"{p.timed} timed, {p.busy} busy{tag}"
    )
    if cost.share is not None:
        console.status(
            "info",
            f"dumper overhead{tag}: {cost.share:.2%} of forward time "
            f"(capture {cost.mean_capture_us:,.1f} µs / forward {cost.mean_forward_us / 1000:,.2f} ms per step, "
            f"rank {cost.slowest_rank}, over {cost.basis} steps)",
            data=True,
        )
    for note in cost.notes:
        console.status("warn", note)
