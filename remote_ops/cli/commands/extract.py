"""`remote-ops extract start|status|stop`: the extraction client on a host, or sharded over a group.

A group (`--host GROUP`, `--all`) splits the samples not yet dumped across its
hosts (see `remote_ops.workflows.extract`: done-ness is the union of the hosts' manifests
by dump key, plus the local record of hosts no longer selected); each host runs
its own client against its own server on its own shard file.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import click

from ...core import extractplan
from ...errors import CommandTimedOut, Refused, StaleMount, UsageError
from ...workflows import extract as extract_mod, fleet, hostlock
from ._fleet import _render_outcome as _fleet_render_outcome, run_on_hosts, summarize
from ._options import hosts_command, path_option, server_url_option, wait_option
from .logs import _render_extraction


@click.group("extract")
def extract_group() -> None:
    """Run the extraction client on a host: every sample once through /generate (max_new_tokens=1).

    \b
    Examples:
      remote-ops extract start --host gpu-node --dataset samples.jsonl --concurrency 16
      remote-ops extract start --host fleet --dataset samples.jsonl      # split over the group
      remote-ops extract start --host 'fleet,!gpu-03' --dataset samples.jsonl --restart   # gpu-03 died
      remote-ops extract status --host gpu-node
      remote-ops extract stop --host gpu-node

    The dataset is JSONL, one {"id": ..., "input_ids": [...]} per line: UTF-8,
    no key twice, token ids integers 0..2147483647, an optional "loss_mask" of
    0/1 per id.  A local file is checked before anything is sent or locked (a
    bad line: exit 3, FILE:LINE).  A restarted run skips samples already done,
    judged by their dump key (the token ids), never by id: a new dataset that
    reuses ids gets new dumps.  A full dump disk is named in `extract status`
    ("no space left on DIR: N free, M needed"); the client waits for room.
    """


def _render(console, st: extractplan.ExtractStatus) -> None:
    console.status(
        "ok" if st.running else "info",
        f"client {'running, pid ' + str(st.pid) if st.running else 'not running'}; "
        f"{st.manifest_ok}/{st.dataset_total} samples of the current dataset done"
        + (f" (dataset {st.dataset_id})" if st.dataset_id else ""),
    )
    if st.reused_ids:
        console.status(
            "warn",
            f"{st.reused_ids} sample id(s) of this dataset were done earlier with other "
            f"token ids: sent again as new samples (new dumps, nothing skipped)",
        )
    _render_extraction(console, st.summary)
    if st.summary.no_space:
        console.status(
            "fail",
            f"{st.summary.no_space['message']} (since {st.summary.no_space['since']}; "
            "the client waits, and goes on once there is room)",
        )
    if st.missing:
        console.status("warn", f"{len(st.missing)} sample(s) produced no dump file (first: {st.missing[0]})")
    if st.fatal:
        console.status(
            "fail",
            f"the client stopped at {st.fatal.get('since', '?')}: {st.fatal.get('says') or st.fatal.get('cause')} "
            "(nothing more is sent; fix it, then `extract start` again: what is done is kept)",
        )
    elif not st.running and st.summary.state == "finished" and st.summary.failed:
        console.status("fail", f"{st.outcome()[1]} (the log says why; a re-run retries them)")


class _StartCommand(click.Command):
    """`extract start --limit N` (N digits) is the old spelling of `--max-samples N`: accepted, with a note."""

    def parse_args(self, ctx, args):
        args = list(args)
        for i, arg in enumerate(args[:-1]):
            if arg == "--limit" and args[i + 1].isdigit():
                click.echo(
                    "note: `extract start --limit N` is now `--max-samples N` (--limit narrows the "
                    "hosts, as in every command)",
                    err=True,
                )
                args[i] = "--max-samples"
        return super().parse_args(ctx, args)


@extract_group.command("start", cls=_StartCommand)
@path_option(
    "--dataset",
    required=True,
    host_ok=True,
    help="local JSONL file (checked, uploaded; split across the hosts of a group), or host:PATH for a "
    "file already on the host (one host)",
)
@click.option("--concurrency", type=int, default=8, show_default=True, help="requests in flight per host")
@click.option("--retries", type=int, default=5, show_default=True, help="retries per sample (backoff)")
@click.option("--max-samples", type=int, default=None, help="only the first N samples of the dataset")
@server_url_option
@wait_option("wait until the run finishes (progress every few seconds), at most SECONDS")
@click.option(
    "--restart", is_flag=True, help="group: stop running clients first (gracefully), then re-split what is left"
)
@click.option("--dry-run", is_flag=True, help="show what would be uploaded and run; change nothing")
@click.option("--diff", "show_plan", is_flag=True, help="also show that plan when starting")
@hosts_command
def start_cmd(
    app, hosts, forks, dataset, concurrency, retries, max_samples, server_url, wait_s, restart, dry_run, show_plan
) -> int:
    """Start (or resume) the client, detached on each host; a group splits the samples not yet dumped.

    A local dataset is checked here first, before any connection, upload or lock: a
    missing file is exit 2, a bad line exit 3 naming FILE:LINE.  host:PATH names a file
    on the host (checked there; one host only).

    The preflight (one round trip, --dry-run too) refuses with exit 9 and starts nothing
    when the host's dump dir is missing or not writable, or when its server container
    still mounts a dump dir that was removed and made again since it started (its dumps
    would never reach the host; `stale_mount`, naming the identity the container recorded
    and the dir's now): `remote-ops deploy` recreates the container.  A group is refused
    before anything is split, started or stopped when any host's mount is stale."""
    on_host = dataset.on_host
    local = Path(dataset.path)
    if not on_host:
        extract_mod.check_dataset(local)
    ledger = None if on_host else extract_mod.load_ledger(_dataset_id(local))
    others = set((ledger or {}).get("hosts", {})) - {h.name for h in hosts}
    if len(hosts) == 1 and not others:
        kwargs = dict(
            concurrency=concurrency,
            retries=retries,
            limit=max_samples,
            server_url=server_url,
            dataset_checked=True,
            local_dataset=not on_host,
        )
        return _start_one(app, hosts[0], dataset.path, kwargs, wait_s, dry_run, show_plan)
    if on_host:
        raise UsageError(
            f"a group start splits a local dataset file; {dataset} is a file on the host",
            hint="copy the dataset here, or start each host on its own file",
        )
    kwargs = dict(concurrency=concurrency, retries=retries, server_url=server_url, dataset_checked=True)
    return _start_sharded(app, hosts, forks, local, max_samples, kwargs, wait_s, restart, dry_run, ledger)


def _dataset_id(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _start_one(app, spec, dataset, kwargs, wait_s, dry_run, show_plan) -> int:
    remote = app.remote(spec)
    if dry_run or show_plan:
        plan = extract_mod.plan_start(remote, spec, dataset, **kwargs)
        _render_plan(app.console, plan, dry_run)
        if dry_run:
            app.console.emit({"host": spec.name, "dry_run": True, **plan})
            return 0
    with hostlock.held(remote, spec, "extract start"):  # the start only; --wait below just reads
        st = extract_mod.start(remote, spec, dataset, **kwargs)
    if wait_s is not None:
        with app.console.counter(f"{spec.name}: extraction", "samples") as bar:
            st = extract_mod.wait_finished(remote, spec, wait_s, on_status=_progress(app.console, bar))
    _render(app.console, st)
    app.console.emit(st)
    return st.outcome()[0] if wait_s is not None else 0  # --wait: no success with samples missing


def _start_sharded(app, hosts, forks, local: Path, max_samples, kwargs, wait_s, restart, dry_run, ledger) -> int:
    """Union the hosts' done keys (+ the record of absent hosts), split the rest, start one client each."""
    samples = extractplan.read_samples(local, max_samples)
    ledger = ledger or extractplan.new_ledger(_dataset_id(local), samples)
    ledger["keys"] = list(dict.fromkeys(s.key for s in samples))
    names = [h.name for h in hosts]
    keys = _probe_group(app, hosts, forks, restart and not dry_run)
    done = set().union(*keys.values()) | extractplan.absent_done(ledger, names)
    shards = extractplan.split_pending(samples, done, names)
    plan = {
        "dataset_id": ledger["dataset_id"],
        "samples": len(samples),
        "done": sum(1 for s in samples if s.key in done),
        "shards": {n: len(v) for n, v in shards.items()},
        "counted_from_record": sorted(set(ledger["hosts"]) - set(names)),
    }
    _render_split(app.console, plan, dry_run)
    if dry_run:
        app.console.emit({"dry_run": True, **plan})
        return 0
    extract_mod.record_seen(ledger, keys, shards)  # before any start: a dead host's work stays counted

    def work(spec):
        remote = app.remote(spec)
        with hostlock.held(remote, spec, "extract start"):
            return 0, extract_mod.start_shard(remote, spec, shards[spec.name], **kwargs)

    run = fleet.fan_out(
        hosts,
        work,
        forks=forks,
        on_done=lambda o: _fleet_render_outcome(app, None, o, lambda console, _spec, st: _render(console, st)),
    )
    summarize(app.console, run)
    if wait_s is not None and run.exit_code == 0:
        return _wait_group(app, hosts, forks, wait_s, plan)
    app.console.emit({**plan, **run.to_dict()})
    return run.exit_code


def _probe_group(app, hosts, forks, restart: bool) -> dict[str, set[str]]:
    """Every host's done keys.  Any unreadable host, or one whose server container mounts a stale
    dump dir (read in the same round trip), stops the start before anything changes (--dry-run
    too); running clients are refused, or with --restart stopped gracefully and read again."""
    run = fleet.fan_out(hosts, lambda spec: (0, extract_mod.probe_group_host(app.remote(spec), spec)), forks=forks)
    stale = [o.error for o in run.outcomes if isinstance(o.error, StaleMount)]
    bad = [o for o in run.outcomes if o.error is not None and not isinstance(o.error, StaleMount)]
    if stale and not bad:
        raise extract_mod.group_stale_mount(stale)
    if bad:
        err = bad[0].error  # its own type and exit code (e.g. unreachable: 4)
        assert err is not None
        err.message = f"cannot read the manifest of {', '.join(o.host for o in bad)}: {err.message}"
        err.hint = (
            f"leave it out to re-split without it (e.g. --host 'GROUP,!{bad[0].host}'): "
            f"what the local record last saw done there stays counted"
        )
        raise err
    keys = {o.host: o.result[1] for o in run.outcomes}
    running = [h for h in hosts if dict((o.host, o.result[0]) for o in run.outcomes)[h.name]]
    if running and not restart:
        raise Refused(
            f"an extraction client is running on {', '.join(h.name for h in running)}: a split needs them stopped",
            hint="--restart stops them gracefully first (in-flight requests finish), "
            "or remote-ops extract stop --host ...",
        )
    if running:
        keys.update(_stop_and_read(app, running, forks))
    return keys


def _stop_and_read(app, hosts, forks) -> dict[str, set[str]]:
    def work(spec):
        remote = app.remote(spec)
        with hostlock.held(remote, spec, "extract stop"):
            extract_mod.stop(remote, spec)
        return 0, extract_mod.probe_done(remote, spec)[1]

    run = fleet.fan_out(hosts, work, forks=forks)
    for o in run.outcomes:
        if o.error is not None:
            raise o.error
    return {o.host: o.result for o in run.outcomes}


def _render_split(console, plan: dict, dry_run: bool) -> None:
    console.say(
        f"dataset {plan['dataset_id']}: {plan['samples']} samples, {plan['done']} already dumped "
        f"(by dump key, over the hosts"
        + (f" and the record of {', '.join(plan['counted_from_record'])}" if plan["counted_from_record"] else "")
        + ")"
    )
    console.table(
        ["host", "shard"],
        [[h, n] for h, n in plan["shards"].items()],
        title=("would split" if dry_run else "split") + " of the samples not yet dumped",
    )


def _wait_group(app, hosts, forks, wait_s: float, plan: dict) -> int:
    """Poll the group until no client runs: on a terminal a bar (samples done over the group,
    the summed samples/s, the slowest host's ETA), else a line per round; then each host."""
    deadline = time.monotonic() + wait_s
    waited = 0.0  # each later status waits up to 2 s on every host for its client to exit
    with app.console.counter(f"{len(hosts)} hosts: extraction", "samples") as bar:
        while True:
            fs, run = _group_status(app, hosts, forks, waited)
            waited = 2.0
            if app.console.live():
                bar(fs.done, fs.total, fs.rate_samples_s, fs.eta_s, f"{len(fs.running)} running")
            else:
                _render_progress_group(app.console, fs)
            if not fs.running:
                break
            if time.monotonic() + 2 > deadline:
                raise CommandTimedOut(
                    f"extraction still running after {wait_s:g}s (it goes on; `extract status` follows it)",
                    command="extract start --wait",
                    timeout=wait_s,
                )
    _render_group(app, fs, run)
    app.console.emit({**plan, **fs.to_dict()})
    if run.exit_code:
        return run.exit_code
    codes = {o.result[0].outcome()[0] for o in run.outcomes if o.error is None}  # no success with samples missing
    return 7 if 7 in codes else max(codes, default=0)


def _render_plan(console, plan: dict, dry_run: bool) -> None:
    verb = "would" if dry_run else "will"
    if plan["already_running"]:
        console.status("warn", "a client is already running: start would be refused")
    console.say(f"{verb} upload the client: {'yes (changed)' if plan['upload_client'] else 'no (same sha256)'}")
    console.say(
        f"{verb} upload the dataset to {plan['dataset_on_host']}: {'yes (changed)' if plan['upload_dataset'] else 'no'}"
    )
    console.say(f"{verb} run: {plan['command']}")


def _progress(console, bar):
    """What `--wait` shows of each status: on a terminal a bar (samples done/total, samples/s and
    the ETA from the client's log); otherwise, a line per status (`_render_progress`)."""

    def show(st) -> None:
        s = st.summary
        if console.live():
            note = "running" if st.running else s.state
            bar(s.done, s.total, s.rate_samples_s, s.eta_s, f"{note}, {s.errors} errors" if s.errors else note)
        else:
            _render_progress(console, st)

    return show


def _render_progress(console, st) -> None:
    s = st.summary
    rate = f", {s.rate_tokens_s:,.0f} tokens/s" if s.rate_tokens_s else ""
    console.say(
        f"extraction: {s.done}/{s.total if s.total is not None else '?'} samples, {s.tokens:,} tokens"
        f"{rate}, {s.errors} errors ({'running' if st.running else s.state})"
    )


@extract_group.command("status")
@hosts_command
def status_cmd(app, hosts, forks) -> int:
    """Is the client running; progress, rate, ETA; samples without a dump file.  A group: merged."""
    if len(hosts) == 1:
        spec = hosts[0]
        st = extract_mod.status(app.remote(spec), spec)
        _render(app.console, st)
        app.console.emit(st)
        return 0
    fs, run = _group_status(app, hosts, forks)
    _render_group(app, fs, run)
    app.console.emit(fs)
    return run.exit_code


def _group_status(app, hosts, forks, wait_s: float = 0.0):
    """Each host's status and done keys (one round trip each, after waiting up to `wait_s` on the
    host for its client to exit), merged with the local record."""
    run = fleet.fan_out(
        hosts, lambda spec: (0, extract_mod.status_with_keys(app.remote(spec), spec, wait_s)), forks=forks
    )
    ok = {o.host: o.result for o in run.outcomes if o.error is None}
    ledger = extract_mod.latest_ledger([h.name for h in hosts])
    fs = extractplan.merge_status(
        ledger,
        {n: r[0] for n, r in ok.items()},
        {n: r[1] for n, r in ok.items()},
        [o.host for o in run.outcomes if o.error is not None],
    )
    if ledger:
        extract_mod.record_seen(ledger, {n: r[1] for n, r in ok.items()})
    return fs, run


def _render_group(app, fs, run) -> None:
    for o in run.outcomes:
        if o.error is not None:
            app.console.error(f"{o.host}: {o.error.message}", o.error.hint)
        else:
            app.console.step(o.host)
            _render(app.console, o.result[0])
    eta = "-" if fs.eta_s is None else f"{fs.eta_s:,.0f}s"
    app.console.status(
        "ok" if fs.done == fs.total and not fs.unreachable else "info",
        f"group: {fs.done}/{fs.total} samples done by dump key, {len(fs.running)} client(s) running, "
        f"{fs.rate_samples_s:,.1f} samples/s, {fs.rate_tokens_s:,.0f} tokens/s, ETA {eta}",
    )
    if fs.last_seen:
        app.console.status("info", f"counted as last seen (not selected): {', '.join(fs.last_seen)}")
    if fs.duplicates:
        app.console.status(
            "warn",
            f"{fs.duplicates} dump key(s) done on more than one host "
            f"(content-keyed: the same file; `dumps pull --host GROUP` keeps the one that verifies)",
        )


def _render_progress_group(console, fs) -> None:
    console.say(
        f"extraction: {fs.done}/{fs.total} samples over {len(fs.hosts)} hosts, "
        f"{fs.rate_tokens_s:,.0f} tokens/s, {len(fs.running)} running"
    )


@extract_group.command("stop")
@wait_option("seconds to let in-flight requests finish before SIGKILL", default=60.0, metavar=None)
@click.option("--dry-run", is_flag=True, help="show whether a client would be stopped; change nothing")
@click.option("--diff", "show_plan", is_flag=True, help="show the client's state before stopping")
@hosts_command
def stop_cmd(app, hosts, forks, wait_s, dry_run, show_plan) -> int:
    """Stop the client by its recorded PID (SIGTERM, then SIGKILL at the deadline).  Not running: no-op."""
    return run_on_hosts(
        app,
        hosts,
        lambda spec: _stop_one(app, spec, wait_s, dry_run, show_plan),
        lambda console, _spec, r: _render(console, r) if isinstance(r, extractplan.ExtractStatus) else None,
        forks=forks,
    )


def _stop_one(app, spec, wait_s, dry_run, show_plan):
    if dry_run or show_plan:
        before = extract_mod.status(app.remote(spec), spec)
        app.console.say(
            ("would stop" if dry_run else "stopping") + f" pid {before.pid}"
            if before.running
            else "no client running: nothing to stop"
        )
        if dry_run:
            return 0, {"host": spec.name, "dry_run": True, "running": before.running, "pid": before.pid}
    with hostlock.held(app.remote(spec), spec, "extract stop"):
        return 0, extract_mod.stop(app.remote(spec), spec, wait_s)


commands = [extract_group]
