"""`dumps status|verify|pull --host GROUP`: every host's dumps as one tree with one merged manifest.

Each host is reconciled (and verified) on its own, `--forks` at a time; the
results are merged by dump key (`remote_ops.core.dumpcheck.merge_hosts`).  A key on two
hosts is a duplicate: reported, and pulled once, from the first host whose copy
verifies (header check with `verify`; size and sha256 on arrival with `pull`,
falling back to the next copy when one fails).  A host that cannot be reached
is reported and sets the exit code; the others go on.  A key whose only copies
were on hosts whose connection was lost during the pull is *not reached*
(exit 4), not "no good copy".  Each host's unsafe names (`core.hostpaths`:
absolute, `..`, control characters) are named `<host>:<name>: <reason>`,
never pulled, and fail the pull (exit 10).
"""

from __future__ import annotations

from pathlib import Path

from ...core import dumpcheck
from ...errors import Unreachable, VerifyFailed
from ...workflows import dumps as dumps_mod, fleet


def _each(app, hosts, forks, work):
    run = fleet.fan_out(hosts, work, forks=forks)
    for o in run.outcomes:
        if o.error is not None:
            app.console.error(f"{o.host}: {o.error.message}", o.error.hint)
    return run, {o.host: o.result for o in run.outcomes if o.error is None}


def _recon(app, spec):
    probe = dumps_mod.probe(app.remote(spec), spec.dump.dir)
    return 0, dumps_mod.reconcile_probe(probe, spec.dump.dir, spec.model.hidden_size)


def _host_rows(recons: dict) -> list[list]:
    return [
        [
            h,
            r.manifest_rows,
            r.files_present,
            len(r.missing_files),
            len(r.size_mismatches),
            r.torn_lines,
            f"{r.bytes / 1e6:,.1f} MB",
        ]
        for h, r in recons.items()
    ]


def _render_merged(console, merged: dumpcheck.FleetDumps, recons: dict) -> None:
    console.table(
        ["host", "rows", "files", "no file", "size differs", "torn", "bytes"],
        _host_rows(recons),
        title=f"dumps on {len(recons)} hosts",
    )
    doc = merged.to_dict()
    console.status(
        "ok" if not merged.conflicts else "fail",
        f"merged: {doc['keys']} distinct keys, {doc['bytes'] / 1e6:,.1f} MB, "
        f"{len(doc['duplicates'])} on more than one host, {len(merged.conflicts)} conflicting",
    )
    for key, hosts in list(doc["duplicates"].items())[:10]:
        console.say(f"    duplicate {key}: {', '.join(hosts)} (kept from {hosts[0]})", style="dim")


def group_status(app, hosts, forks) -> int:
    run, recons = _each(app, hosts, forks, lambda spec: _recon(app, spec))
    merged = dumpcheck.merge_hosts(recons)
    _render_merged(app.console, merged, recons)
    ok = all(r.ok for r in recons.values()) and not merged.conflicts
    app.console.emit(
        {"hosts": {h: r.to_dict() for h, r in recons.items()}, "merged": merged.to_dict(), **run.to_dict()}
    )
    return fleet.worst_exit([run.exit_code, 0 if ok else VerifyFailed.exit_code])


def group_verify(app, hosts, forks, sha: bool) -> int:
    """Each host's header check; a key is good when one copy passes (the kept one)."""

    def work(spec):
        _, recon = _recon(app, spec)
        report = dumps_mod.host_verify(app.remote(spec), spec.dump.dir, spec.model.hidden_size, check_sha=sha)
        return 0, (recon, report)

    run, done = _each(app, hosts, forks, work)
    recons = {h: v[0] for h, v in done.items()}
    bad = {h: {str(p["where"]) for p in dumpcheck.errors_of(v[1])} for h, v in done.items()}
    merged = dumpcheck.merge_hosts(recons, bad)
    _render_merged(app.console, merged, recons)
    broken = [k for k, copies in merged.copies.items() if all(str(r["file"]) in bad[h] for h, r in copies)]
    rescued = [
        k for k, copies in merged.copies.items() if k not in broken and any(str(r["file"]) in bad[h] for h, r in copies)
    ]
    app.console.status(
        "fail" if broken else "ok",
        f"host checks: {len(broken)} key(s) with no good copy, "
        f"{len(rescued)} duplicate(s) where one copy fails and another passes (the passing one is kept)",
    )
    result = {
        "merged": merged.to_dict(),
        "broken": broken,
        "rescued": rescued,
        "hosts": {h: {"reconciliation": v[0].to_dict(), "host_check": v[1]} for h, v in done.items()},
        **run.to_dict(),
    }
    missing = sum(len(r.missing_files) for r in recons.values())
    if broken or missing:
        raise VerifyFailed(
            f"{len(broken)} dump key(s) fail on every host that has them, {missing} manifest row(s) have no file",
            details=result,
        )
    app.console.emit(result)
    return run.exit_code


def group_pull(app, hosts, forks, jobs, dest, stall_timeout, allow_missing) -> int:
    """Pull every key once into one tree; a copy that fails on arrival is fetched from the next host
    (`workflows.dumps.pull_merged`)."""
    run, recons = _each(app, hosts, forks, lambda spec: _recon(app, spec))
    merged = dumpcheck.merge_hosts(recons)
    local_root = Path(dest) if dest else dumps_mod.merged_dump_dir()
    first = [i for v in dumps_mod.merged_items(merged, local_root, {}).values() for i in v]
    dumps_mod.check_pull_space(first, "group")
    how = dumps_mod.PullSettings(app.ssh_config_path, jobs, stall_timeout)
    with app.console.progress(f"{len(recons)} hosts: dumps", total=sum(i.size for i in first)) as advance:
        pulled = dumps_mod.pull_merged(merged, local_root, hosts, app.target, how, forks=forks, advance=advance)
    return _pull_result(app, run, recons, merged, pulled, local_root, allow_missing)


def _unsafe(recons: dict, reports: dict) -> list[str]:
    """Every host's refused names, `<host>:<name>: <reason>` (probe, manifest, transfer)."""
    refused = [f"{h}:{e}" for h, r in recons.items() for e in r.unsafe]
    for host, pulls in reports.items():
        refused += [f"{host}:{u['file']}: {u['reason']}" for p in pulls for u in p.get("unsafe", [])]
    return list(dict.fromkeys(refused))


def _pull_result(app, run, recons, merged, pulled: dumps_mod.GroupPull, local_root, allow_missing) -> int:
    kept, unreached, lost_hosts, reports = pulled.kept, pulled.unreached, pulled.lost_hosts, pulled.reports
    seconds, written = pulled.seconds, pulled.written
    _render_merged(app.console, merged, recons)
    nbytes = sum(int(r.get("bytes", 0)) for v in reports.values() for r in v)
    lost = sorted(set(merged.copies) - set(kept) - set(unreached))
    missing = [f"{h}:{m}" for h, r in recons.items() for m in r.missing_files]
    torn = [f"{h}:{t}" for h, r in recons.items() for t in r.torn]
    unsafe = _unsafe(recons, reports)
    app.console.status(
        "fail" if lost or unreached or unsafe else "ok",
        f"{len(kept)} keys kept, {len(lost)} with no good copy, {len(unreached)} not reached (connection lost), "
        f"{nbytes / 1e6:,.1f} MB fetched in "
        f"{seconds:.2f}s ({nbytes / 1e6 / seconds if seconds else 0:,.1f} MB/s aggregate) -> "
        f"{local_root} ({written} in the merged manifest)",
    )
    _list(app.console, "unsafe host names (never pulled)", unsafe)
    result = {
        "dest": str(local_root),
        "merged": merged.to_dict(),
        "kept_from": kept,
        "no_good_copy": lost,
        "not_reached": unreached,
        "connection_lost": lost_hosts,
        "unsafe": unsafe,
        "missing_on_host": missing,
        "torn": torn,
        "pulls": reports,
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "allow_missing": allow_missing,
        **run.to_dict(),
    }
    if lost or unsafe or (not allow_missing and (missing or torn)):
        raise VerifyFailed(
            f"{len(lost)} key(s) had no copy that verified; {len(unsafe)} unsafe host name(s) refused; "
            f"{len(missing)} manifest row(s) with no file, {len(torn)} torn line(s)",
            details=result,
            hint="re-run (verified files are kept); --allow-missing accepts missing/torn rows; "
            "unsafe names must be removed or renamed on their host",
        )
    if unreached:
        raise Unreachable(
            f"connection lost during the pull from {', '.join(lost_hosts)}: {len(unreached)} key(s) not fetched",
            hint="re-run when the host answers: verified files are kept and .part files resume",
            details={**result, "reason": "connection_lost"},
        )
    app.console.emit(result)
    return run.exit_code


def _list(console, label: str, items: list[str], limit: int = 10, level: str = "fail") -> None:
    if items:
        console.status(level, f"{label}: {len(items)}")
        for item in items[:limit]:
            console.say(f"    {item}", style="dim")
        if len(items) > limit:
            console.say(f"    ... {len(items) - limit} more", style="dim")


# --------------------------------------------------------------------------- dumps sync


class _Meter:
    """Per-source bytes, rate and time left, as one progress line (the bar counts all sources)."""

    def __init__(self, totals: dict[str, int]) -> None:
        import time

        self._now = time.monotonic
        self.totals, self.done = totals, {h: 0 for h in totals}
        self.t0, self._shown = self._now(), 0.0

    def add(self, host: str, n: int) -> str | None:
        """Count `n` bytes; the new description at most twice a second, else None."""
        self.done[host] = self.done.get(host, 0) + n
        now = self._now()
        if now - self._shown < 0.5:
            return None
        self._shown = now
        return self.describe(now - self.t0)

    def describe(self, seconds: float) -> str:
        parts = []
        for h, total in self.totals.items():
            done = self.done.get(h, 0)
            rate = done / seconds if seconds > 0 else 0.0
            eta = f"{(total - done) / rate:,.0f}s" if rate > 0 and done < total else "-"
            parts.append(f"{h} {done / 1e6:,.1f}/{total / 1e6:,.1f} MB {rate / 1e6:,.1f} MB/s ETA {eta}")
        return "; ".join(parts)


def group_sync(app, sources, dest, opts, dry_run: bool, allow_missing: bool = False) -> int:
    """`dumps sync`: check, then (unless --dry-run) grant, move on the hosts, revoke
    (`workflows.sync`); the summary on stderr, one JSON document with --json.  Rows missing on a
    source (or torn lines) fail the run (exit 10) unless `allow_missing`; rows that are not
    regular files, conflicts, unsafe names and files that failed sha256 always do."""
    from ...workflows import sync as sync_mod

    sync_mod.check_addresses(sources, dest, app.target, opts)  # before anything connects
    checked = sync_mod.check(sources, dest, app.remote, opts.forks)
    plan = checked.plan
    _render_sync_plan(app.console, checked, dry_run)
    if dry_run:
        for host, err in checked.host_errors.items():
            app.console.error(f"{host}: {err.message}", err.hint)
        doc = {
            "dry_run": True,
            "plan": plan.to_dict(),
            "dump_dirs": checked.dirs,
            "missing_on_source": checked.rows.missing,
            "not_regular_on_source": checked.rows.not_regular,
            "torn": checked.rows.torn,
            "unsafe": checked.rows.unsafe,
            "allow_missing": allow_missing,
            "errors": {h: e.to_dict() for h, e in checked.host_errors.items()},
        }
        verdict = _sync_verdict(app.console, checked, {}, allow_missing)
        worst = fleet.worst_exit(
            [VerifyFailed.exit_code if verdict else 0, *(e.exit_code for e in checked.host_errors.values())]
        )
        if verdict is not None:
            if worst == VerifyFailed.exit_code:
                raise VerifyFailed(verdict[0], details=doc, hint=verdict[1])
            app.console.error(verdict[0], verdict[1])  # a host's error is the worse exit code
        app.console.emit(doc)
        return worst
    totals = {h: plan.source_bytes(h) for h, recs in plan.moves.items() if recs}
    meter = _Meter(totals)
    with app.console.progress(f"sync -> {dest.name}", total=sum(totals.values())) as advance:

        def progress(host: str, n: int) -> None:
            advance(n, description=meter.add(host, n))

        result = sync_mod.sync(sources, dest, checked, app.remote, app.target, opts, _serialised(progress))
    return _sync_result(app, result, allow_missing)


def _serialised(fn):
    import threading

    lock = threading.Lock()

    def call(*args):
        with lock:
            fn(*args)

    return call


def _render_sync_plan(console, checked, dry_run: bool) -> None:
    plan = checked.plan
    doc = plan.to_dict()
    verb = "would move" if dry_run else "to move"
    console.status(
        "info",
        f"{verb}: {doc['files']} file(s), {doc['bytes'] / 1e6:,.1f} MB -> {plan.dest}; "
        f"{doc['already_on_dest']} already there, {len(doc['duplicates'])} on several sources (moved once), "
        f"{len(plan.conflicts)} conflicting",
    )
    for host, per in doc["per_source"].items():
        console.say(f"    {host}: {per['files']} file(s), {per['bytes'] / 1e6:,.1f} MB", style="dim")
    _render_resolved(console, checked)
    _list(
        console,
        "conflicting keys (never moved)",
        [
            f"{c['key']}: " + ", ".join(f"{x['host']} sha256 {str(x['sha256'])[:12]}" for x in c["copies"])
            for c in plan.conflicts
        ],
    )


def _render_resolved(console, checked) -> None:
    """Name each host whose dump dir is a symlink, with the path used (its target)."""
    for host, real in checked.dirs.items():
        configured = checked.configured.get(host)
        if configured and real != configured.rstrip("/"):
            console.say(f"    {host}: dump dir {configured} -> {real} (a symlink: the resolved path is used)")


#: How many paths each source's problem rows name on stderr (all are in --json).
SHOWN = 5


def _per_source(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        host, _, rest = item.partition(":")
        out.setdefault(host, []).append(rest)
    return out


def _name_rows(console, level: str, what: str, items: list[str], dirs: dict[str, str]) -> None:
    """`[fail] N <what> on HOST (dump dir D)`, then its first paths, `... M more`, per source."""
    for host, rows in _per_source(items).items():
        console.status(level, f"{len(rows)} {what} on {host} (dump dir {dirs.get(host, '?')})")
        for row in rows[:SHOWN]:
            console.say(f"    {row}", style="dim")
        if len(rows) > SHOWN:
            console.say(f"    ... {len(rows) - SHOWN} more (all in --json)", style="dim")


def _first(items: list[str]) -> str:
    """`lab1: rank0/a, rank0/b, ... (N more); lab2: ...`: the first paths of each source."""
    parts = []
    for host, rows in _per_source(items).items():
        more = f", ... {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
        parts.append(f"{host}: {', '.join(rows[:SHOWN])}{more}")
    return "; ".join(parts) or "none"


def _sync_verdict(console, checked, failed: dict[str, str], allow_missing: bool) -> tuple[str, str] | None:
    """Name on stderr what makes a sync's data incomplete or wrong; (message, hint) of the exit-10
    error it makes, or None.  The hint speaks only of the causes found."""
    rows = checked.rows
    torn, unsafe = rows.torn, rows.unsafe
    level = "warn" if allow_missing else "fail"
    _name_rows(console, level, "manifest row(s) missing", rows.missing, checked.dirs)
    _name_rows(
        console, "fail", "entr(y/ies) not a regular file (never opened, never moved)", rows.not_regular, checked.dirs
    )
    _list(console, "torn manifest lines (never moved)", torn, level=level)
    _list(console, "files that failed verification", [f"{k}: {v}" for k, v in failed.items()])
    _list(console, "unsafe host names (never moved)", unsafe)
    causes, hints = [], []
    if failed:
        causes.append(f"{len(failed)} file(s) failed verification")
        hints.append(
            "a file that failed sha256 on arrival was fetched again and still differs from its source manifest: "
            "check the source's copy (`dumps verify --host SOURCE --sha`), then re-run"
        )
    if checked.plan.conflicts:
        causes.append(f"{len(checked.plan.conflicts)} conflicting key(s)")
        hints.append("conflicts: the same key with different content on two hosts; remove the wrong copy, then re-run")
    if unsafe:
        causes.append(f"{len(unsafe)} unsafe name(s)")
        hints.append("unsafe names must be removed or renamed on their host")
    if rows.not_regular:
        causes.append(f"{len(rows.not_regular)} entr(y/ies) not a regular file ({_first(rows.not_regular)})")
        hints.append(
            "a FIFO, symlink or device in a dump dir is never read: replace it by the dump file, or remove it "
            "(and its manifest row)"
        )
    if not allow_missing and (rows.missing or torn):
        causes.append(
            f"{len(rows.missing)} row(s) missing on their source ({_first(rows.missing)}), {len(torn)} torn line(s)"
        )
        hints.append("rows missing: restore the files (or fix dump.dir), or --allow-missing to accept them")
    if not causes:
        return None
    return ", ".join(causes), "; ".join(hints)


def _sync_result(app, result, allow_missing: bool = False) -> int:
    doc = result.to_dict()
    doc["allow_missing"] = allow_missing
    checked = result.checked
    errors = {**checked.host_errors, **result.errors}
    errors.update({f"{h} (revoke)": e for h, e in result.revoke_failures.items()})
    worst = fleet.worst_exit([e.exit_code for e in errors.values()]) if errors else 0
    raised = next((e for e in errors.values() if e.exit_code == worst), None)
    for host, err in errors.items():
        if err is not raised:  # the one raised is rendered once, at the CLI boundary
            app.console.error(f"{host}: {err.message}", err.hint)
    for host, why in result.revoke_errors.items():
        if host not in result.revoke_failures:
            app.console.warn(
                f"{host}: transfer key not removed ({why}); the next dumps sync to this destination removes it"
            )
    rows = checked.rows
    fails = errors or result.failed or checked.plan.conflicts or rows.not_regular or doc["unsafe"]
    incomplete = rows.missing or doc["torn"]
    app.console.status(
        "fail" if fails or (incomplete and not allow_missing) else "warn" if incomplete else "ok",
        f"{result.moved} file(s), {result.bytes / 1e6:,.1f} MB moved host to host in {result.seconds:.2f}s "
        f"({doc['mb_per_s']:,.1f} MB/s), verified on {checked.plan.dest}; "
        f"{len(result.failed)} failed, {len(checked.plan.conflicts)} conflicting",
    )
    verdict = _sync_verdict(app.console, checked, result.failed, allow_missing)
    if raised is not None:
        raised.details = {**(raised.details or {}), "sync": doc}
        raise raised
    if verdict is not None:
        raise VerifyFailed(verdict[0], details=doc, hint=verdict[1])
    app.console.emit(doc)
    return 0
