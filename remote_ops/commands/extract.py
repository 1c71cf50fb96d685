"""`remote-ops extract start|status|stop`: the extraction client on a host."""
from __future__ import annotations

import click

from .. import extract as extract_mod
from ._options import host_command
from .logs import _render_extraction


@click.group("extract")
def extract_group() -> None:
    """Run the extraction client on a host: every sample once through /generate (max_new_tokens=1).

    \b
    Examples:
      remote-ops extract start --host gpu-node --dataset samples.jsonl --concurrency 16
      remote-ops extract status --host gpu-node
      remote-ops extract stop --host gpu-node

    The dataset is JSONL, one {"id": ..., "input_ids": [...]} per line.  A
    restarted run skips samples already done (the client's own manifest).
    """


def _render(console, st: extract_mod.ExtractStatus) -> None:
    console.status("ok" if st.running else "info",
                   f"client {'running, pid ' + str(st.pid) if st.running else 'not running'}; "
                   f"{st.manifest_ok} samples in the client manifest")
    _render_extraction(console, st.summary)
    if st.missing:
        console.status("warn", f"{len(st.missing)} sample(s) produced no dump file "
                       f"(first: {st.missing[0]})")


@extract_group.command("start")
@click.option("--dataset", required=True, metavar="PATH",
              help="local JSONL file (uploaded) or a path on the host")
@click.option("--concurrency", type=int, default=8, show_default=True, help="requests in flight")
@click.option("--retries", type=int, default=5, show_default=True, help="retries per sample (backoff)")
@click.option("--limit", type=int, default=None, help="only the first N samples")
@click.option("--server-url", default=None, help="default http://127.0.0.1:<server.port> on the host")
@host_command
def start_cmd(app, host, dataset, concurrency, retries, limit, server_url) -> int:
    """Start (or resume) the client, detached on the host."""
    spec = app.host(host)
    st = extract_mod.start(app.remote(spec), spec, dataset, concurrency=concurrency, retries=retries,
                           limit=limit, server_url=server_url)
    _render(app.console, st)
    app.console.emit(st)
    return 0


@extract_group.command("status")
@host_command
def status_cmd(app, host) -> int:
    """Is the client running; progress, rate, ETA; samples without a dump file."""
    spec = app.host(host)
    st = extract_mod.status(app.remote(spec), spec)
    _render(app.console, st)
    app.console.emit(st)
    return 0


@extract_group.command("stop")
@click.option("--wait", "wait_s", type=float, default=60.0, show_default=True,
              help="seconds to let in-flight requests finish before SIGKILL")
@host_command
def stop_cmd(app, host, wait_s) -> int:
    """Stop the client by its recorded PID (SIGTERM, then SIGKILL at the deadline)."""
    spec = app.host(host)
    st = extract_mod.stop(app.remote(spec), spec, wait_s)
    _render(app.console, st)
    app.console.emit(st)
    return 0


commands = [extract_group]
