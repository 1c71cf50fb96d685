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
    restarted run skips samples already done, judged by their dump key (the
    token ids), never by id: a new dataset that reuses ids gets new dumps.
    """


def _render(console, st: extract_mod.ExtractStatus) -> None:
    console.status("ok" if st.running else "info",
                   f"client {'running, pid ' + str(st.pid) if st.running else 'not running'}; "
                   f"{st.manifest_ok}/{st.dataset_total} samples of the current dataset done"
                   + (f" (dataset {st.dataset_id})" if st.dataset_id else ""))
    if st.reused_ids:
        console.status("warn", f"{st.reused_ids} sample id(s) of this dataset were done earlier with other "
                       f"token ids: sent again as new samples (new dumps, nothing skipped)")
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
@click.option("--wait", "wait_s", type=float, default=None, metavar="SECONDS",
              help="wait until the run finishes (progress every few seconds), at most SECONDS")
@click.option("--dry-run", is_flag=True, help="show what would be uploaded and run; change nothing")
@click.option("--diff", "show_plan", is_flag=True, help="also show that plan when starting")
@host_command
def start_cmd(app, host, dataset, concurrency, retries, limit, server_url, wait_s, dry_run, show_plan) -> int:
    """Start (or resume) the client, detached on the host."""
    spec = app.host(host)
    remote = app.remote(spec)
    kwargs = dict(concurrency=concurrency, retries=retries, limit=limit, server_url=server_url)
    if dry_run or show_plan:
        plan = extract_mod.plan_start(remote, spec, dataset, **kwargs)
        _render_plan(app.console, plan, dry_run)
        if dry_run:
            app.console.emit({"host": spec.name, "dry_run": True, **plan})
            return 0
    st = extract_mod.start(remote, spec, dataset, **kwargs)
    if wait_s is not None:
        st = extract_mod.wait_finished(remote, spec, wait_s,
                                       on_status=lambda s: _render_progress(app.console, s))
    _render(app.console, st)
    app.console.emit(st)
    return 0


def _render_plan(console, plan: dict, dry_run: bool) -> None:
    verb = "would" if dry_run else "will"
    if plan["already_running"]:
        console.status("warn", "a client is already running: start would be refused")
    console.say(f"{verb} upload the client: {'yes (changed)' if plan['upload_client'] else 'no (same sha256)'}")
    console.say(f"{verb} upload the dataset to {plan['dataset_on_host']}: "
                f"{'yes (changed)' if plan['upload_dataset'] else 'no'}")
    console.say(f"{verb} run: {plan['command']}")


def _render_progress(console, st) -> None:
    s = st.summary
    rate = f", {s.rate_tokens_s:,.0f} tokens/s" if s.rate_tokens_s else ""
    console.say(f"extraction: {s.done}/{s.total if s.total is not None else '?'} samples, {s.tokens:,} tokens"
                f"{rate}, {s.errors} errors ({'running' if st.running else s.state})")


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
@click.option("--dry-run", is_flag=True, help="show whether a client would be stopped; change nothing")
@click.option("--diff", "show_plan", is_flag=True, help="show the client's state before stopping")
@host_command
def stop_cmd(app, host, wait_s, dry_run, show_plan) -> int:
    """Stop the client by its recorded PID (SIGTERM, then SIGKILL at the deadline).  Not running: no-op."""
    spec = app.host(host)
    if dry_run or show_plan:
        before = extract_mod.status(app.remote(spec), spec)
        app.console.say(("would stop" if dry_run else "stopping") + f" pid {before.pid}" if before.running
                        else "no client running: nothing to stop")
        if dry_run:
            app.console.emit({"host": spec.name, "dry_run": True, "running": before.running, "pid": before.pid})
            return 0
    st = extract_mod.stop(app.remote(spec), spec, wait_s)
    _render(app.console, st)
    app.console.emit(st)
    return 0


commands = [extract_group]
