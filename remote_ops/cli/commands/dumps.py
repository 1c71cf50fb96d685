"""`remote-ops dumps status|verify|pull|audit|export|sync|compact|stats`: the hidden-state dumps on a host."""

from __future__ import annotations

from pathlib import Path

import click

from ...core import dumpcheck
from ...errors import UsageError, VerifyFailed
from ...workflows import dumps as dumps_mod
from . import _dumps_group, _dumps_stats
from ._options import (
    PathOption,
    app_options,
    choice_option,
    host_command,
    hosts_command,
    pattern_option,
    seconds_option,
)


@click.group("dumps")
def dumps_group() -> None:
    """Reconcile, check and pull the hidden-state dumps of a host.

    \b
    Examples:
      remote-ops dumps status --host gpu-node --samples 10000
      remote-ops dumps pull --host fleet                 # every host into one merged tree
      remote-ops dumps verify --host gpu-node            # headers on the host, no torch
      remote-ops dumps audit --host gpu-node --draft-config kimi-eagle3.json
      remote-ops dumps pull --host gpu-node --jobs 4
      remote-ops dumps sync --from 'fleet:!gpu-01' --to gpu-01   # host to host
      remote-ops dumps compact --host gpu-node --jobs 4    # pack finished files in place
    """


def _gb(n) -> str:
    """Bytes for humans: GB from 1 GB up, else MB."""
    if n is None:
        return "-"
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _render_recon(console, r: dumpcheck.Reconciliation) -> None:
    rows = [
        ["manifest rows (keys)", r.manifest_rows],
        ["files present", r.files_present],
        ["tokens", f"{r.tokens:,}"],
        ["bytes", f"{r.bytes:,} ({_gb(r.bytes)})"],
        ["hidden size", r.hidden_size or "-"],
        [
            "float bytes/token (FP8: 4*H+16)" if r.storage != "bf16" else "float bytes/token (4*H*2)",
            f"{r.float_bytes_per_token:,}" if r.float_bytes_per_token else "-",
        ],
        ["file bytes/token (observed)", r.file_bytes_per_token or "-"],
        ["partial spans", r.partial_rows],
        ["torn manifest lines", r.torn_lines],
    ]
    console.table(["dumps", ""], rows, title=f"Dumps in {r.dump_dir}")
    _list(console, "fail", "manifest rows with no file", r.missing_files)
    _list(console, "fail", "not a regular file (never opened, never pulled)", r.not_regular)
    _list(
        console,
        "fail",
        "size differs from the manifest",
        [f"{m['file']} ({m['size']} vs {m['manifest']})" for m in r.size_mismatches],
    )
    _list(console, "warn", "files missing from the manifest", r.unlisted_files)
    _list(console, "warn", "temp files (interrupted writes)", r.temp_files)
    _list(console, "warn", "torn manifest lines", r.torn)
    _list(console, "warn", "unsafe host names (a pull refuses them)", r.unsafe)


def _list(console, status: str, label: str, items: list[str], limit: int = 10) -> None:
    """`[status] label: N` and the first `limit` items, one a line; host names are shown, never
    obeyed (the console prints their control characters as `^[`, `^J`)."""
    if not items:
        return
    console.status(status, f"{label}: {len(items)}")
    for item in items[:limit]:
        console.say(f"    {item}", style="dim")
    if len(items) > limit:
        console.say(f"    ... {len(items) - limit} more", style="dim")


def _render_projection(console, p: dumpcheck.Projection) -> None:
    status = lambda ok: "info" if ok is None else ("ok" if ok else "fail")  # noqa: E731
    console.status(
        status(p.host_ok),
        f"host: {_gb(p.remaining_bytes)} still to write "
        f"({p.samples_done}/{p.samples_total or '?'} samples, {_gb(p.bytes_per_sample)}/sample, "
        f"{p.basis}), {_gb(p.host_free)} free",
    )
    console.status(status(p.local_ok), f"local: {_gb(p.local_needed)} to pull, {_gb(p.local_free)} free")


def _reconcile(app, spec):
    probe = dumps_mod.probe(app.remote(spec), spec.dump.dir)
    return probe, dumps_mod.reconcile_probe(probe, spec.dump.dir, spec.model.hidden_size)


@dumps_group.command("status")
@click.option(
    "--samples",
    type=int,
    default=None,
    help="samples the run will have in total (default: from the pulled extraction log)",
)
@hosts_command
def status_cmd(app, hosts, forks, samples) -> int:
    """Manifest vs files (counts, tokens, bytes, bytes/token) and disk projection. One round trip.

    A group: each host's counts and the merged view by dump key (duplicates, conflicts)."""
    if len(hosts) > 1:
        return _dumps_group.group_status(app, hosts, forks)
    spec = hosts[0]
    probe, recon = _reconcile(app, spec)
    total = samples or _total_from_log(spec.name)
    local_root = dumps_mod.local_dump_dir(spec.name)
    proj = dumpcheck.project(
        recon,
        total,
        probe.free_bytes,
        dumps_mod.local_free_bytes(local_root),
        dumps_mod.local_bytes(local_root),
        hidden_size=spec.model.hidden_size,
        storage=spec.dump.storage,
    )
    _render_recon(app.console, recon)
    _render_projection(app.console, proj)
    app.console.emit({"host": spec.name, "reconciliation": recon, "projection": proj})
    return 0 if recon.ok else VerifyFailed.exit_code


def _total_from_log(host_name: str) -> int | None:
    from ...core import logparse
    from ...workflows import logs as logs_mod

    path = logs_mod.local_log_dir(host_name) / "extraction.log"
    if not path.exists():
        return None
    with open(path, errors="replace") as fh:
        return logparse.parse_extraction(logparse.stream_lines(fh)).total


@dumps_group.command("verify")
@click.option(
    "--sha/--no-sha",
    default=False,
    show_default=True,
    help="also recompute every file's sha256 on the host (reads all bytes); a compacted file: "
    "the packed bytes' sha256 and the decoded file's, both recorded in its manifest line",
)
@hosts_command
def verify_cmd(app, hosts, forks, sha) -> int:
    """Reconcile, then check every file's header on the host with dumpfile.py (no torch).

    A compacted file (`<key>.hsz`, `dumps compact`) is decoded there: its header and ids
    are checked as the original's, and with --sha both sha256s are (the packed bytes'
    against the manifest's `sha256`, the decoded bytes' against `packed.source_sha256`).
    A group: every host checked; a key is good when one of its copies passes."""
    if len(hosts) > 1:
        return _dumps_group.group_verify(app, hosts, forks, sha)
    spec = hosts[0]
    _, recon = _reconcile(app, spec)
    _render_recon(app.console, recon)
    report = dumps_mod.host_verify(app.remote(spec), spec.dump.dir, spec.model.hidden_size, check_sha=sha)
    errors = dumpcheck.errors_of(report)
    app.console.status(
        "ok" if report.get("ok") else "fail",
        f"host check ({'headers + sha256' if sha else 'headers'}): {report.get('files')} files, {len(errors)} error(s)",
    )
    _list(app.console, "fail", "problems", [f"{p['where']}: {p['message']}" for p in errors])
    result = {"host": spec.name, "reconciliation": recon.to_dict(), "host_check": report}
    if errors or not recon.ok:  # the error document (--json) carries the whole result
        raise VerifyFailed(
            f"{len(errors)} dump file(s) failed the host check, "
            f"{len(recon.missing_files)} manifest row(s) have no file, "
            f"{len(recon.not_regular)} entr(y/ies) not a regular file",
            host=spec.name,
            details=result,
        )
    app.console.emit(result)
    return 0


@dumps_group.command("pull")
@click.option("--jobs", type=int, default=2, show_default=True, help="concurrent ssh streams")
@click.option(
    "--dest",
    type=click.Path(path_type=Path),
    default=None,
    help="local dump dir (default <state>/hosts/<host>/dumps; a group: <state>/merged/dumps)",
)
@click.option(
    "--stall-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="abort a stream that delivers no byte for this many seconds",
)
@click.option(
    "--allow-missing",
    is_flag=True,
    help="exit 0 although manifest rows have no file on the host or manifest lines are torn "
    "(they are still named); corrupt files and unsafe host names always exit 10",
)
@hosts_command
def pull_cmd(app, hosts, forks, jobs, dest, stall_timeout, allow_missing) -> int:
    """Pull every manifest-listed file: resumable, sha256-verified, parallel, with progress.

    Uses the system ssh (AES-GCM) with the same host-key policy as every other
    command.  Verified files are kept; re-running continues partial files.
    Manifest rows with no file on the host, torn manifest lines, corrupt
    files and unsafe host names (absolute, `..`, control characters: never
    fetched, nothing written outside --dest) are named; the exit is 10 unless
    --allow-missing (which forgives the first two only).  Too little local
    space, checked before the first byte and caught during the pull, exits 14
    with the bytes needed and free; a connection lost or refused during the
    pull exits 4 ("connection lost"), and the next pull resumes its .part files.

    A group pulls every host into one tree with one merged manifest (records
    name their host); a key on several hosts is fetched once, from the first
    copy that verifies on arrival.
    """
    if len(hosts) > 1:
        return _dumps_group.group_pull(app, hosts, forks, jobs, dest, stall_timeout, allow_missing)
    spec = hosts[0]
    _, recon = _reconcile(app, spec)
    local_root = dest or dumps_mod.local_dump_dir(spec.name)
    items = dumps_mod.pull_items(recon, local_root)
    dumps_mod.check_pull_space(items, spec.name)  # before any output
    how = dumps_mod.PullSettings(app.ssh_config_path, jobs, stall_timeout)
    with app.console.progress(f"{spec.name}: dumps", total=sum(i.size for i in items)) as advance:
        report = dumps_mod.pull(app.target(spec), spec.dump.dir, items, how, local_root, advance)
    written = dumps_mod.write_pulled_manifests(recon, local_root, spec.name)
    problems = dumpcheck.pull_problems(recon, report.failed, report.unsafe)
    _render_pull(app.console, report, problems, allow_missing, local_root, written)
    result = {
        "host": spec.name,
        "dest": str(local_root),
        "pull": report.to_dict(),
        "missing_on_host": problems.missing,
        "problems": problems.to_dict(),
        "allow_missing": allow_missing,
    }
    if problems.blocking(allow_missing):
        raise VerifyFailed(_problem_sentence(problems), host=spec.name, details=result, hint=_pull_hint(problems))
    app.console.emit(result)
    return 0


def _render_pull(console, report, problems, allow_missing: bool, local_root: Path, written: int) -> None:
    bad = problems.blocking(allow_missing)
    console.status(
        "fail" if bad else ("warn" if problems.missing or problems.torn else "ok"),
        f"{report.fetched} fetched, {report.skipped} already here, {report.resumed} resumed, "
        f"{report.bytes / 1e6:,.1f} MB at {report.mb_per_s} MB/s -> {local_root} "
        f"({written} in local manifests)",
    )
    level = "warn" if allow_missing else "fail"
    _list(console, level, "manifest rows with no file on the host (not pulled)", problems.missing)
    _list(console, level, "torn manifest lines (their files are unknown)", problems.torn)
    _list(console, "fail", "corrupt or failed", problems.corrupt)
    _list(console, "fail", "unsafe host names (never pulled)", problems.unsafe)


def _pull_hint(p) -> str:
    hints = ["corrupt: re-run (verified files are kept, the rest are fetched again)"] if p.corrupt else []
    if p.unsafe:
        hints.append("unsafe: the host's dump dir holds names no pull writes; remove or rename them there")
    if p.missing or p.torn:
        hints.append("missing/torn: `dumps verify` on the host says more; --allow-missing accepts them")
    return "; ".join(hints)


def _problem_sentence(p) -> str:
    parts = [f"{len(p.corrupt)} file(s) failed to pull or verify"] if p.corrupt else []
    if p.unsafe:
        parts.append(f"{len(p.unsafe)} unsafe host name(s) refused, none fetched (each listed above)")
    if p.missing:
        parts.append(f"{len(p.missing)} manifest row(s) have no file on the host (first: {p.missing[0]})")
    if p.torn:
        parts.append(f"{len(p.torn)} manifest line(s) are torn (first: {p.torn[0]})")
    return "; ".join(parts)


# ============================================================================ dumps audit


def _render_audit(console, result) -> None:
    rows = [[c.name, c.status, c.reason] for c in result.checks]
    console.table(["check", "status", "what"], rows, title=f"Dump audit of {result.host}")
    for c in result.checks:
        samples = c.data.get("samples") or []
        if c.status == "fail" and samples:
            _list(
                console,
                "fail",
                f"{c.name}: samples",
                [f"#{s['position']} {s['id']} {s['key']}: {s['message']}" for s in samples],
            )
    srv = result.serving
    console.say(
        f"  layer ids judged for {srv.engine} {srv.version} ({srv.how}): "
        f"{srv.convention.words if srv.convention else 'no convention known'}",
        style="dim",
    )


@dumps_group.command("audit")
@click.option("--samples", type=click.IntRange(min=1), default=64, show_default=True, help="dumps to audit")
@click.option("--seed", type=int, default=0, show_default=True, help="which dumps the stratified draw picks")
@click.option(
    "--draft-config",
    type=PathOption("file"),
    default=None,
    metavar="FILE",
    help="a local drafter config.json (read before connecting; missing: exit 2): its "
    "eagle_config.eagle_aux_hidden_state_layer_ids must give the dumps' layers",
)
@click.option(
    "--serving-sglang",
    default=None,
    metavar="VERSION",
    help="the SGLang release that will serve the drafter (default: the host's sglang.version)",
)
@host_command
def audit_cmd(app, host, samples, seed, draft_config, serving_sglang) -> int:
    """Check sampled dumps against what the served model computes, ON the host (nothing pulled).

    Runs in a throwaway container of the served image (dump, model, extraction and
    dataset dirs read-only, no network, no pull).  N dumps of the extraction run
    (seeded, stratified over the run in manifest order), each: 3 aux states + the
    final state at the model's hidden size and the sample's token count; NaN/Inf
    counts; token ids equal to the dataset's and a loss mask joining by key;
    argmax(lm_head . final state[last]) equal to the token the server generated
    (lm_head read alone through the safetensors index; a match only after the
    model's final RMSNorm means PRE-norm finals); the layer ids the dumps record
    against the drafter config and the numbering of the SGLang release that will
    serve it.  Exit 0 when every check passes, 10 otherwise (a table names the
    failed checks and samples)."""
    from ...workflows import audit as audit_mod

    draft = audit_mod.load_draft_config(draft_config) if draft_config else None  # before connecting
    spec = app.host(host)
    result = audit_mod.audit(
        app.remote(spec), spec, samples=samples, seed=seed, draft=draft, serving_version=serving_sglang
    )
    _render_audit(app.console, result)
    doc = result.to_dict()
    if not result.ok:
        names = ", ".join(c.name for c in result.failed)
        raise VerifyFailed(
            f"dumps audit: {len(result.failed)} check(s) failed: {names}",
            host=spec.name,
            hint="each failed check names its samples above (--json: checks[].samples)",
            details=doc,
        )
    app.console.emit(doc)
    return 0


# ============================================================================ dumps export (drafter tail)
# `dumps export --format specforge`: the dumps -> SpecForge 0.2 offline feature files, on the host.


def _render_export(console, report: dict) -> None:
    probe = report["disk_copy_probe"]
    ratio = report.get("ratio_to_disk")
    console.status(
        "ok" if not report["failed"] else "fail",
        f"{report['exported']} exported ({report.get('split_samples', 0)} stitched from chunked-prefill "
        f"spans), {report['skipped_done']} already done, "
        f"{report['missing_count']} without a dump, {len(report['failed'])} failed -> {report['out']}",
    )
    console.say(
        f"  export: {_gb(report['bytes_read'])} read in {report['seconds']:.1f}s = "
        f"{report['mb_per_s'] or '-'} MB/s ({report['jobs']} streams); disk copy probe in the same run: "
        f"{probe['mb_per_s'] or '-'} MB/s over {_gb(probe['bytes'])}; "
        f"ratio {f'{ratio:.0%}' if ratio else '-'}"
    )
    _list(
        console,
        "warn",
        "samples without a full dump",
        [f"#{m['index']} {m['id']}: {m['reason']}" for m in report["missing"]],
    )
    _list(console, "fail", "failed", [f"#{f['index']} {f['file']}: {f['reason']}" for f in report["failed"]])


def _export_progress(advance, name: str):
    """Progress events from the host exporter -> the progress line."""

    def on_event(event: dict) -> None:
        if event.get("event") == "progress":
            advance(0, f"{name}: export {event.get('files', 0)}/{event.get('total', '?')} files")

    return on_event


@dumps_group.command("export")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["specforge"]),
    default="specforge",
    show_default=True,
    help="SpecForge 0.2 offline EAGLE-3 files: rows_<g>-<g+2000>/data_<idx>.ckpt",
)
@click.option(
    "--dataset",
    default=None,
    metavar="PATH",
    type=PathOption("file", host_ok=True),
    help="prepared JSONL (with loss_mask) the extraction used: a local file (uploaded; missing: exit 2) "
    "or host:PATH (default <logs.dir>/extract/dataset.jsonl on the host)",
)
@click.option("--out", default=None, metavar="DIR", help="output dir on the host (default <dump.dir>-specforge)")
@click.option("--jobs", type=int, default=4, show_default=True, help="files converted in parallel")
@click.option("--limit", type=int, default=None, help="only the first N samples still to do")
@click.option(
    "--probe-mb",
    type=int,
    default=1024,
    show_default=True,
    help="source bytes copied first to measure the disk (0: no probe)",
)
@click.option("--mask-all", is_flag=True, help="dataset has no loss_mask: every token counts")
@click.option(
    "--convert-prenorm",
    is_flag=True,
    help="the dumps hold pre-norm finals: apply the model's final RMSNorm (weight and eps from the "
    "checkpoint) to each hidden_state while exporting",
)
@click.option(
    "--accept-prenorm",
    is_flag=True,
    help="export pre-norm finals as they are (SpecForge's TargetHead will apply lm_head to them alone)",
)
@click.option("--no-fsync", is_flag=True, hidden=True, help="tests only")
@click.option(
    "--dry-run",
    is_flag=True,
    help="report what would be exported (reads the manifest and dataset); write nothing but an uploaded dataset",
)
@host_command
def export_cmd(
    app, host, fmt, dataset, out, jobs, limit, probe_mb, mask_all, convert_prenorm, accept_prenorm, no_fsync, dry_run
) -> int:
    """Convert the dumps to SpecForge's offline format ON the host: streaming, sha256-verified, resumable.

    First a few dumps' final states are checked against the server's tokens (`dumps
    audit`'s token check): pre-norm finals are refused (exit 9, contract_mismatch)
    unless --convert-prenorm or --accept-prenorm; where that check cannot run (no
    served container, no generated tokens) the export goes on and says so."""
    from ...workflows import export as export_mod

    if convert_prenorm and accept_prenorm:
        raise click.UsageError("--convert-prenorm and --accept-prenorm exclude each other")
    spec = app.host(host)
    remote = app.remote(spec)
    out = out or export_mod.default_out(spec)
    norm = export_mod.final_norm_decision(remote, spec, convert=convert_prenorm, accept=accept_prenorm)
    plain = norm["action"] == "as_is" and norm["verdict"] == "post-norm"
    app.console.status("ok" if plain else "warn", f"final states: {norm['said']}")
    on_host = export_mod.place_dataset(
        remote, spec, dataset.path if dataset else None, out, local=bool(dataset and not dataset.on_host)
    )
    cmd = export_mod.export_command(
        spec.dump.dir,
        on_host,
        out,
        jobs=jobs,
        limit=limit,
        probe_mb=probe_mb,
        mask_all=mask_all,
        fsync=not no_fsync,
        plan_only=dry_run,
        convert_prenorm=spec.model.path if norm["action"] == "convert" else None,
    )
    if dry_run:
        plan = export_mod.run_export(remote, cmd).final
        app.console.status(
            "info",
            f"would export {plan['todo']} samples ({_gb(plan['bytes_to_read'])}, "
            f"{plan['tokens']:,} tokens) -> {out}; {plan['skipped_done']} already done, "
            f"{plan['missing_count']} without a full dump",
        )
        app.console.emit(
            {"host": spec.name, "dry_run": True, "dataset": on_host, "command": cmd, "final_states": norm, **plan}
        )
        return 0
    with app.console.progress(f"{spec.name}: export", total=None) as advance:
        run = export_mod.run_export(remote, cmd, on_event=_export_progress(advance, spec.name))
    report = run.final
    _render_export(app.console, report)
    result = {"host": spec.name, "format": fmt, "dataset": on_host, "final_states": norm, **report}
    if report["failed"]:
        raise VerifyFailed(
            f"{len(report['failed'])} sample(s) failed to export",
            host=spec.name,
            hint="re-run: exported samples are kept, failed ones are tried again",
            details=result,
        )
    app.console.emit(result)
    return 0


@dumps_group.command("sync")
@pattern_option(
    "--from", "from_", required=True, help="the source hosts (a pattern as --host takes, e.g. 'fleet:!gpu-01')"
)
@pattern_option(
    "--to",
    "to",
    metavar="HOST",
    required=True,
    help="the destination host: it fetches every source's dumps into its own dump dir",
)
@click.option(
    "--dest-address",
    default=None,
    metavar="ADDR",
    help="the address the sources see the destination connect from (their key's from=; default: its inventory address)",
)
@choice_option(
    "--compress",
    choices=["none", "zstd"],
    default="none",
    help="compress in transit (rsync's zstd, level 1); only pays on a link slower than the compressor",
)
@seconds_option("--bwlimit", metavar="MB/S", help="cap each source's transfer at this many MB/s")
@click.option(
    "--stall-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="rsync gives up when no byte moves for this many seconds",
)
@click.option(
    "--transfer-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=7 * 24 * 3600.0,
    show_default=True,
    help="deadline of the whole transfer, in seconds",
)
@click.option("--forks", type=click.IntRange(min=1), default=16, show_default=True, help="hosts worked on at once")
@click.option(
    "--allow-missing",
    is_flag=True,
    help="manifest rows with no file on their source (or torn lines) are a warning, not exit 10",
)
@click.option("--dry-run", is_flag=True, help="say what would move, from where; grant and move nothing")
@app_options
def sync_cmd(
    app, from_, to, dest_address, compress, bwlimit, stall_timeout, transfer_timeout, forks, allow_missing, dry_run
) -> int:
    """Bring the sources' dumps to one host, host to host: no dump byte passes through here.

    The destination runs rsync over ssh to each source, with a key made for
    this sync only, allowed on each source by one authorized_keys line
    (restrict, from= the destination, command= a read-only rrsync of the dump
    dir), removed afterwards, also after a failure (the next sync to this
    destination removes what a killed one left); each grant and revoke edits
    the file under a lock and reads it back.  The sources' host keys come
    from this machine's known_hosts: nothing is accepted on first use.  Every
    file is checked against its source manifest's sha256 on the destination
    and recorded in its manifest with its source host; a corrupt or torn file
    is fetched again and never counted.  A key with different content on two
    hosts is a conflict: named, never moved (exit 10).  Rows with no file on
    their source are named and exit 10 (--allow-missing: a warning); a row
    whose file is a FIFO, symlink or device is never moved (exit 10).  A
    symlinked dump dir is resolved once on its host and used by its target.
    Re-running resumes and moves nothing twice.  See docs/sync.md.
    """
    from ...core.syncplan import check_address
    from ...workflows.sync import SyncOptions

    if dest_address is not None:
        try:
            dest_address = check_address(dest_address)
        except ValueError as exc:
            raise UsageError(f"--dest-address: {exc}") from None
    dests = app.select(to)
    if len(dests) != 1:
        shown = ", ".join(h.name for h in dests[:5]) + (", ..." if len(dests) > 5 else "")
        raise UsageError(
            f"--to {to!r} names {len(dests)} hosts ({shown}); `dumps sync` fetches into one destination host",
            hint="name one host with --to; the sources go in --from (a pattern or group)",
        )
    dest = dests[0]
    sources = [h for h in app.select(from_) if h.name != dest.name]
    if not sources:
        raise UsageError(f"--from {from_!r} selects no host other than the destination {dest.name}")
    opts = SyncOptions(dest_address, compress, bwlimit, stall_timeout, transfer_timeout, forks)
    return _dumps_group.group_sync(app, sources, dest, opts, dry_run, allow_missing)


# ============================================================================ dumps compact


@dumps_group.command("compact")
@click.option(
    "--jobs",
    type=click.IntRange(min=1, max=64),
    default=2,
    show_default=True,
    help="files packed at once (worker processes on the host, each one core)",
)
@click.option("--limit", type=click.IntRange(min=0), default=None, help="pack at most N files this pass")
@click.option(
    "--nice",
    "niceness",
    type=click.IntRange(min=0, max=19),
    default=10,
    show_default=True,
    help="niceness of the pass on the host",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=7 * 24 * 3600.0,
    show_default=True,
    help="deadline of the pass, in seconds (the host's process ends with it; a re-run resumes)",
)
@click.option("--no-fsync", is_flag=True, hidden=True, help="tests only")
@click.option("--crash-at", type=click.Choice(["packed", "renamed", "appended", "removed"]), hidden=True)
@click.option("--dry-run", is_flag=True, help="say which files would be packed and their bytes; change nothing")
@host_command
def compact_cmd(app, host, jobs, limit, niceness, timeout, no_fsync, crash_at, dry_run) -> int:
    """Pack the host's finished dump files in place, losslessly: `<key>.safetensors` -> `<key>.hsz`.

    Runs ON the host with its python3 (stdlib only), niced, off the serving process, and
    may run while extraction goes on: a file is taken only once the last manifest line
    of its key names it, at that size and sha256 (files being written, files not yet
    listed and files a newer line replaced are never touched).  Per file: packed to a
    temp file (format v2: each bf16 exponent coded against its channel's median,
    Huffman-coded, sign and mantissa stored; dumper/FORMAT.md "Packed files"), fsynced, decoded from disk and compared with the original by sha256, renamed,
    a new manifest line appended, then the original removed.  Killed at any moment, a
    re-run resumes: every key stays readable through its last manifest line.  Every
    reader (`dumps verify`, `audit`, `export`, `sync`, `pull`, `status`) takes both
    forms; `dumps verify --sha` checks the packed file's sha256 and the decoded one's.
    Exit 10 when a file could not be packed (its sha256 differs from the manifest, or
    it does not decode): such files are left as they are."""
    from ...workflows import compact as compact_mod

    spec = app.host(host)
    remote = app.remote(spec)
    opts = compact_mod.CompactOptions(
        jobs=jobs, limit=limit, dry_run=dry_run, fsync=not no_fsync, nice=niceness, crash_at=crash_at
    )
    with app.console.progress(f"{spec.name}: compact", total=None) as advance:

        def on_event(event: dict) -> None:
            advance(0, f"{spec.name}: compact {event.get('compacted', 0)}/{event.get('total', '?')} files")

        report = compact_mod.compact(remote, spec.dump.dir, opts, timeout=timeout, on_event=on_event)
    counts = report["counts"]
    doc = {"host": spec.name, **report}
    if dry_run:
        app.console.status(
            "info",
            f"would pack {counts.get('would_compact', 0)} file(s) ({_gb(report['bytes_before'])}) in "
            f"{report['dump_dir']}; would remove {counts['leftovers_removed']} original(s) left by a killed pass",
        )
        app.console.emit(doc)
        return 0
    kept = report.get("kept")
    app.console.status(
        "ok" if report["ok"] else "fail",
        f"{counts['compacted']} file(s) packed: {_gb(report['bytes_before'])} -> {_gb(report['bytes_after'])}"
        f"{f' ({kept:.1%} kept)' if kept else ''} in {report['seconds']:.1f}s "
        f"({report.get('mb_per_s') or '-'} MB/s, {report['jobs']} job(s)); "
        f"{counts['leftovers_removed']} leftover original(s) and {counts['temp_removed']} temp file(s) removed",
    )
    _list(app.console, "warn", "left as they are", [f"{x['file']}: {x['why']}" for x in report["skipped"]])
    _list(app.console, "fail", "failed", [f"{x['file']}: {x['why']}" for x in report["failed"]])
    if not report["ok"]:
        raise VerifyFailed(
            f"dumps compact: {counts.get('failed', len(report['failed']))} file(s) could not be packed",
            host=spec.name,
            hint="they are left as they are; `dumps verify --sha` says what is wrong with them",
            details=doc,
        )
    app.console.emit(doc)
    return 0


dumps_group.add_command(_dumps_stats.stats_cmd)  # dumps stats: the dumper's cost

commands = [dumps_group]
