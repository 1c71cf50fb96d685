"""`remote-ops patch check|apply|verify|revert|status|drift`: the anchored SGLang patch."""

from __future__ import annotations

import click

from ...core import anchors
from ...errors import ExitCode, UsageError
from ...workflows import patching
from ._options import app_options, hosts_command
from .source import on_targets, target_options


@click.group("patch")
def patch_group() -> None:
    """Anchored patch of an SGLang model file (EAGLE-3 hidden-state dump hooks).

    \b
    Anchors are found in the syntax tree (class -> method -> statement):
      init block    right after `self.capture_aux_hidden_states = False`
                    in <ModelClass>.__init__
      forward hook  right after `if self.capture_aux_hidden_states:` unpack
                    in <ModelClass>.forward
    The file and class come from the patch spec (`patch specs`): the host's
    inventory `sglang.patch`, or derived from its model's config.json; for
    --local-file, the one class whose __init__ resets the flag (--model-class
    picks among several).
    0 or >1 matches, a wrong scope, a syntax error or an unvalidated SGLang
    version refuse (exit 9); a misplaced block fails verify (exit 10).
    """


# ----------------------------------------------------------------- rendering
def _listings(console, listings, data: bool = True) -> None:
    for listing in listings:
        console.text_block(listing.render(), data=data)


def render_check(console, report: patching.CheckReport, data: bool = True) -> None:
    """The check's evidence: its data for `patch check` (stdout), progress under apply (stderr)."""
    console.step(f"patch check {report.host}:{report.path}")
    version = report.sglang_version or "unknown"
    gate = (
        "validated"
        if report.version_validated
        else ("NOT validated, --force given" if report.forced else "NOT validated")
    )
    console.say(
        f"sha256 {report.sha256}  SGLang {version} ({report.version_source}; {gate})  patch state: {report.state}"
    )
    _listings(console, report.evidence, data)
    for a in report.anchors:
        console.status(
            "ok",
            f"anchor {a.block}: line {a.line} `{a.text}` in {a.scope}; "
            f"before it line {a.prev_line or '-'}, after it line {a.next_line or 'end of method'}",
        )
    if report.refusal:  # the verdict is data (stdout) for `patch check`, progress under apply
        console.status("fail", f"refused ({report.refusal['reason']}): {report.refusal['message']}", data=data)
    else:
        verdict = "the patch can be applied" if report.state != anchors.APPLIED else "already applied"
        console.status("ok", verdict, data=data)


def render_verify(console, result: patching.VerifyResult, data: bool = True) -> None:
    compiled = {True: "py_compile ok", False: "py_compile FAILED", None: "py_compile not run"}[result.compile_ok]
    console.say(f"sha256 {result.sha256}  {compiled}")
    _listings(console, result.evidence, data)
    for b in result.report.blocks:
        where_ = f"lines {b.region.begin}-{b.region.end}" if b.region else "not present"
        anchor = f"anchor line {b.anchor.line}" if b.anchor else "anchor not found"
        console.status("ok" if b.state == anchors.APPLIED else "fail", f"block {b.name}: {b.state}, {where_}, {anchor}")
    for f in result.report.findings:
        console.status("fail", f.message)


def _diff(console, diff: str) -> None:
    """The diff is the data (stdout: `patch apply --dry-run > x.diff`); "no changes" is a note."""
    if diff:
        console.text_block(diff)
    else:
        console.say("(no changes)")


# ------------------------------------------------------------------ commands
@patch_group.command("check")
@target_options
@click.option("--force", is_flag=True, help="override the SGLang version gate (only the version gate)")
@hosts_command(local_ok=True)
def check_cmd(app, hosts, forks, path, local_file, model_class, force) -> int:
    """Pre-check: find both anchors, show grep -n / sed -n evidence; change nothing."""

    def work(remote, target):
        report = patching.check(remote, target, force=force)
        render_check(app.console, report)
        report.raise_if_refused()
        return 0, report

    return on_targets(app, hosts, forks, path, local_file, work, model_class=model_class)


def change_options(verb: str):
    """--dry-run / --diff / --no-lock: what every command that writes the file takes."""

    def decorate(fn):
        fn = click.option("--no-lock", is_flag=True, help="do not take the host lock (the caller holds it)")(fn)
        fn = click.option("--diff", "show_diff", is_flag=True, help=f"also print the diff when {verb}")(fn)
        return click.option("--dry-run", is_flag=True, help="print the unified diff and change nothing")(fn)

    return decorate


@patch_group.command("apply")
@target_options
@click.option("--force", is_flag=True, help="override the SGLang version gate (only the version gate)")
@change_options("applying")
@hosts_command(local_ok=True)
def apply_cmd(app, hosts, forks, path, local_file, model_class, force, dry_run, show_diff, no_lock) -> int:
    """Insert the marked blocks atomically (backup kept), then verify; restore the backup if verify fails."""

    def work(remote, target):
        result = patching.apply(remote, target, force=force, dry_run=dry_run, lock=not no_lock)
        _render_apply(app.console, result, dry_run, show_diff)
        return 0, result

    return on_targets(app, hosts, forks, path, local_file, work, model_class=model_class)


def _render_apply(console, result, dry_run: bool, show_diff: bool) -> None:
    render_check(console, result.check, data=False)
    if dry_run or show_diff:
        _diff(console, result.diff if result.action != "noop" else "")
    if result.action in ("applied", "replaced"):
        console.step(f"verify {result.host}:{result.path}")
        render_verify(console, result.verify, data=False)
        console.status(
            "ok",
            f"{result.action}: sha256 {result.sha_before[:16]} -> {result.sha_after[:16]}; backup "
            f"{result.backup_path} (sha256 {str(result.backup_sha256)[:16]}); "
            f"{result.round_trips} round trips, {result.duration_s:.2f}s",
        )
    elif result.action == "noop":
        console.status("ok", f"already applied with this content (sha256 {result.sha_before[:16]}); nothing written")
    else:
        console.status("info", "dry run: nothing changed")


@patch_group.command("verify")
@target_options
@hosts_command(local_ok=True)
def verify_cmd(app, hosts, forks, path, local_file, model_class) -> int:
    """Post-check: py_compile on the host, each block right after its anchor, after every flag reset."""

    def work(remote, target):
        result = patching.verify(remote, target)
        app.console.step(f"verify {result.host}:{result.path}")
        render_verify(app.console, result)
        result.raise_if_failed()
        app.console.status("ok", f"{result.host}: patch verified", data=True)  # the verdict is data
        return 0, result

    return on_targets(app, hosts, forks, path, local_file, work, model_class=model_class)


@patch_group.command("revert")
@target_options
@click.option("--from-backup", is_flag=True, help="restore the backup copy instead of removing the blocks")
@change_options("reverting")
@hosts_command(local_ok=True)
def revert_cmd(app, hosts, forks, path, local_file, model_class, dry_run, show_diff, from_backup, no_lock) -> int:
    """Remove the blocks; the file must hash to the original (byte-identical)."""

    def work(remote, target):
        result = patching.revert(remote, target, dry_run=dry_run, from_backup=from_backup, lock=not no_lock)
        _render_revert(app.console, result, dry_run, show_diff)
        return (ExitCode.VERIFY_FAILED if result.identical is False else ExitCode.OK), result

    return on_targets(app, hosts, forks, path, local_file, work, model_class=model_class)


def _render_revert(console, result, dry_run: bool, show_diff: bool) -> None:
    console.step(f"patch revert {result.host}:{result.path}")
    if dry_run or show_diff:
        _diff(console, result.diff)
    ident = {True: "byte-identical to the original", False: "NOT identical to the original", None: ""}[result.identical]
    console.status(
        "ok" if result.identical is not False else "fail",
        f"{result.action}: sha256 {result.sha_before[:16]} -> {result.sha_after[:16]} "
        f"(original {str(result.original_sha256)[:16]}) {ident}",
    )


@patch_group.command("status")
@target_options
@hosts_command(local_ok=True)
def status_cmd(app, hosts, forks, path, local_file, model_class) -> int:
    """applied / not_applied / outdated / partial / misplaced / modified, with shas (exit 10 if misplaced/modified)."""

    def work(remote, target):
        result = patching.status(remote, target)
        bad = result.status in (anchors.MISPLACED, anchors.MODIFIED)
        return (ExitCode.VERIFY_FAILED if bad else ExitCode.OK), result

    return on_targets(app, hosts, forks, path, local_file, work, _render_status, model_class=model_class)


def _render_status(console, _spec, result) -> None:
    console.step(f"patch status {result.host}:{result.path}: {result.status}")
    console.say(
        f"sha256 {result.sha256}  pristine {result.pristine_sha256}  backup {result.backup_sha256 or '-'}  "
        f"SGLang {result.sglang_version or 'unknown'}  spec {result.spec_hash}"
    )
    rows = [
        [
            b.name,
            b.state,
            b.spec_hash,
            b.region.marker_hash if b.region else "-",
            f"{b.region.begin}-{b.region.end}" if b.region else "-",
            b.anchor.line if b.anchor else "-",
        ]
        for b in result.report.blocks
    ]
    console.table(["block", "state", "spec hash", "marker hash", "lines", "anchor"], rows)
    for f in result.report.findings:
        console.status("fail", f.message)
    verdict = "fail" if result.status in (anchors.MISPLACED, anchors.MODIFIED) else "ok"
    console.status(verdict, f"{result.host}:{result.path}: {result.status}", data=True)  # the verdict is data


@patch_group.command("drift")
@click.option(
    "--versions",
    default=None,
    metavar="V1,V2,...",
    help="SGLang releases to compare, e.g. 0.5.5,0.5.9,0.5.14,0.5.23 (default with --all-specs: "
    "every release some spec validates)",
)
@click.option("--spec", "spec_name", default=None, metavar="NAME", help="patch spec (see `patch specs`)")
@click.option("--all-specs", is_flag=True, help="one table: spec x release -> anchor lines or refusal reason")
@click.option("--base", default="0.5.9", show_default=True, help="release the text hunk is generated for")
@app_options
def drift_cmd(app, versions, spec_name, all_specs, base) -> None:
    """Per release (wheels from PyPI, cached): the anchor's line and neighbours, and three
    verdicts side by side: tree anchor, `git apply --check`, GNU `patch --dry-run`.

    \b
    Examples:
      remote-ops patch drift --spec llama --versions 0.5.5,0.5.9,0.5.14,0.5.23
      remote-ops patch drift --all-specs
    """
    from ...core import patchspec
    from ...workflows import drift

    wanted = [v.strip() for v in (versions or "").split(",") if v.strip()]
    if all_specs:
        if spec_name:
            raise UsageError("give --spec NAME or --all-specs, not both")
        models = patchspec.catalog()
        wanted = wanted or _release_order({v for m in models for v in m.versions})
        cells = drift.matrix([m.name for m in models], wanted)
        drift.render_matrix(app.console, cells, wanted)
        app.console.emit({"versions": wanted, "cells": [c.to_dict() for c in cells]})
        return
    if not spec_name or not wanted:
        raise UsageError("give --spec NAME and --versions V1,V2,... (or --all-specs)")
    report = drift.drift(wanted, patchspec.resolve(spec_name), base=base)
    drift.render(app.console, report)
    app.console.emit(report)


def _release_order(versions) -> list[str]:
    """0.5.5 < 0.5.9 < 0.5.14 (numeric parts, then the rest)."""
    import re

    return sorted(versions, key=lambda v: [int(x) if x.isdigit() else -1 for x in re.split(r"[.]", v)] + [v])


@patch_group.command("specs")
@click.option("--markdown", is_flag=True, help="a Markdown table (docs/models.md)")
@app_options
def specs_cmd(app, markdown) -> None:
    """The supported models: spec name, file, class, config.json architectures, validated releases.

    Specs are data: templates/patches/<id>/spec.json and the folders under
    $REMOTE_OPS_PATCH_PATH (os.pathsep-separated directories)."""
    from ...core import patchspec

    models = patchspec.catalog()
    rows = patchspec.table(models)
    if markdown:
        app.console.out(patchspec.markdown_table(rows))
    else:
        app.console.table(patchspec.TABLE_HEADERS, rows)
    app.console.emit(
        [
            {
                "spec": m.name,
                "patch": m.patch_id,
                "title": m.title,
                "file": m.file,
                "class": m.cls,
                "architectures": list(m.architectures),
                "validated_versions": list(m.versions),
                "source": m.source,
            }
            for m in models
        ]
    )


commands = [patch_group]
