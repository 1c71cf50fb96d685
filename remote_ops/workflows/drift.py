"""`patch drift`: does the patch still land in other SGLang releases?  Three verdicts.

For each release (the real wheel from PyPI, cached by `remote_ops.wheels`):

- tree anchor: `anchors.plan` on the release's copy of the spec's target file
  (line, neighbours, or the named refusal);
- `git apply --check` of a text hunk generated for the base release (0.5.9);
- GNU `patch --dry-run` of the same hunk, with the offset and fuzz it reports,
  and then the decisive question text tools never ask: where did the hunk
  actually land?  The patched copy is verified in the syntax tree (a hunk that
  "succeeded with fuzz 2" may sit in the wrong place).

`matrix` is the wide view: every spec x release -> anchor lines or refusal reason
(tree only), for `patch drift --all-specs` and the tests.

Runs locally only; nothing touches a host.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import wheels
from ..core import anchors, patchspec
from ..core.anchors import AnchorRefusal, PatchSpec
from ..errors import RemoteOpsError

HUNK_RE = re.compile(
    r"Hunk #(\d+) (succeeded|FAILED|ignored) at (\d+)(?: with fuzz (\d+))?(?: \(offset (-?\d+) lines?\))?"
)
TOOL_TIMEOUT_S = 60


@dataclass
class Verdict:
    """One tool's answer for one release: ok, a one-line summary, details, raw output."""

    ok: bool | None
    summary: str
    output: str = ""
    hunks: list = field(default_factory=list)
    landed: str | None = None  # tree status of the text-patched file

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class DriftRow:
    version: str
    sha256: str = ""
    lines: int = 0
    anchors: list = field(default_factory=list)  # AnchorMatch
    tree: Verdict | None = None
    git_apply: Verdict | None = None
    gnu_patch: Verdict | None = None

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "sha256": self.sha256,
            "lines": self.lines,
            "anchors": [a.to_dict() for a in self.anchors],
            **{k: getattr(self, k).to_dict() if getattr(self, k) else None for k in ("tree", "git_apply", "gnu_patch")},
        }


@dataclass
class DriftReport:
    base: str
    hunk: str
    rows: list

    def to_dict(self) -> dict:
        return {"base": self.base, "hunk": self.hunk, "rows": [r.to_dict() for r in self.rows]}


def base_hunk(spec: PatchSpec, base: str) -> str:
    """The text patch a GNU-patch user would ship: `diff -u` of base vs patched base."""
    import difflib

    text = wheels.sglang_source(base, spec.target).decode()
    new = anchors.plan(text, spec).new_text
    rel = spec.target
    return "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}"))


def tree_verdict(data: bytes, spec: PatchSpec, row: DriftRow) -> Verdict:
    """Anchors in the syntax tree: where each block goes, or the named refusal."""
    try:
        plan = anchors.plan(data, spec)
    except AnchorRefusal as exc:
        return Verdict(False, f"refused ({exc.reason}): {exc.message}")
    row.anchors = plan.anchors
    return Verdict(True, "; ".join(f"{a.block} after line {a.line}" for a in plan.anchors))


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL
    )


def _tree(data: bytes, spec: PatchSpec, rel: str, work: Path) -> Path:
    """A scratch checkout holding the release's file at its repository path."""
    target = work / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


def git_apply_verdict(data: bytes, spec: PatchSpec, hunk: Path) -> Verdict:
    """`git apply --check` (exact context, no fuzz); when it passes, apply and verify in the tree."""
    if not shutil.which("git"):
        return Verdict(None, "git not installed")
    with tempfile.TemporaryDirectory(prefix="remote-ops-drift-") as tmp:
        target = _tree(data, spec, spec.target, Path(tmp))
        proc = _run(["git", "apply", "--check", "-v", str(hunk)], Path(tmp))
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            errors = [ln for ln in out.splitlines() if ln.startswith("error: patch failed")] or out.splitlines()[-1:]
            return Verdict(False, "rejected: " + "; ".join(e.removeprefix("error: ") for e in errors), out)
        _run(["git", "apply", str(hunk)], Path(tmp))
        landed = anchors.verify_placement(target.read_bytes(), spec).status
    return Verdict(True, f"applies cleanly; tree says {landed}", out, landed=landed)


def gnu_patch_verdict(data: bytes, spec: PatchSpec, hunk: Path) -> Verdict:
    """GNU `patch --dry-run` (offsets, fuzz), then a real apply to a copy, verified in the tree."""
    if not shutil.which("patch"):
        return Verdict(None, "GNU patch not installed (apt-get install -y patch)")
    with tempfile.TemporaryDirectory(prefix="remote-ops-drift-") as tmp:
        target = _tree(data, spec, spec.target, Path(tmp))
        argv = ["patch", "-p1", "--batch", "--forward", "--verbose", "--no-backup-if-mismatch", "-i", str(hunk)]
        dry = _run(argv + ["--dry-run"], Path(tmp))
        hunks = [_hunk(m) for m in HUNK_RE.finditer(dry.stdout)]
        if dry.returncode != 0:
            last = (dry.stdout.strip().splitlines() or ["no output"])[-1]
            return Verdict(False, f"fails: {_hunk_summary(hunks) or last}", dry.stdout + dry.stderr, hunks)
        _run(argv, Path(tmp))
        landed = anchors.verify_placement(target.read_bytes(), spec).status
    exact = hunks and all(h["offset"] == 0 and h["fuzz"] == 0 for h in hunks)
    summary = "all hunks exact" if exact else _hunk_summary(hunks)
    return Verdict(True, f"{summary}; tree says {landed}", dry.stdout + dry.stderr, hunks, landed)


def _hunk(m: re.Match) -> dict:
    return {
        "hunk": int(m.group(1)),
        "status": m.group(2),
        "line": int(m.group(3)),
        "fuzz": int(m.group(4) or 0),
        "offset": int(m.group(5) or 0),
    }


def _hunk_summary(hunks: list[dict]) -> str:
    parts = []
    for h in hunks:
        extra = ", ".join(
            x
            for x in (f"offset {h['offset']:+d}" if h["offset"] else "", f"fuzz {h['fuzz']}" if h["fuzz"] else "")
            if x
        )
        parts.append(f"#{h['hunk']} {h['status']} at {h['line']}" + (f" ({extra})" if extra else ""))
    return "; ".join(parts)


def drift_row(version: str, spec: PatchSpec, hunk: Path) -> DriftRow:
    """All three verdicts for one release."""
    row = DriftRow(version)
    try:
        data = wheels.sglang_source(version, spec.target)
    except RemoteOpsError as exc:
        row.tree = Verdict(None, f"cannot get the release: {exc.message}")
        return row
    row.sha256, row.lines = hashlib.sha256(data).hexdigest(), data.count(b"\n")
    row.tree = tree_verdict(data, spec, row)
    row.git_apply = git_apply_verdict(data, spec, hunk)
    row.gnu_patch = gnu_patch_verdict(data, spec, hunk)
    return row


def drift(versions: list[str], spec: PatchSpec, base: str = "0.5.9") -> DriftReport:
    """Compare the three ways of landing the patch across `versions`."""
    hunk_text = base_hunk(spec, base)
    with tempfile.TemporaryDirectory(prefix="remote-ops-hunk-") as tmp:
        hunk = Path(tmp) / f"{spec.name or spec.id}-{base}.patch"
        hunk.write_text(hunk_text)
        rows = [drift_row(v, spec, hunk) for v in versions]
    return DriftReport(base, hunk_text, rows)


def render(console, report: DriftReport) -> None:
    """Anchor neighbours per release, then the verdicts side by side."""
    console.step(f"patch drift: tree anchors vs a text hunk made for {report.base}")
    for row in report.rows:
        for a in row.anchors:
            console.say(f"{row.version:>10}  {a.block:<8} {a.prev_line:>5}  {a.prev_text[:60]}")
            console.say(f"{'':>10}  {'':<8}>{a.line:>5}  {a.text[:60]}")
            console.say(f"{'':>10}  {'':<8} {a.next_line or '-':>5}  {a.next_text[:60] or '(end of method)'}")
    rows = [[r.version, _v(r.tree), _v(r.git_apply), _v(r.gnu_patch)] for r in report.rows]
    console.table(["release", "tree anchor", "git apply --check", "GNU patch --dry-run"], rows)


def _v(v: Verdict | None) -> str:
    if v is None:
        return "-"
    mark = {True: "ok", False: "NO", None: "?"}[v.ok]
    if v.landed and v.landed != anchors.APPLIED:
        mark = "WRONG"
    return f"{mark}: {v.summary}"


# ----------------------------------------------------------------- spec x release
@dataclass
class Cell:
    """One spec on one release: anchor lines, or why not (absent file, refusal)."""

    spec: str
    version: str
    ok: bool | None
    summary: str
    lines: list = field(default_factory=list)
    reason: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cell(spec: PatchSpec, version: str) -> Cell:
    """Tree verdict of `spec` on the release's copy of its target file."""
    try:
        data = wheels.sglang_source(version, spec.target)
    except RemoteOpsError:
        return Cell(spec.name, version, None, "no such file", reason="absent")
    try:
        plan = anchors.plan(data, spec)
    except AnchorRefusal as exc:
        return Cell(spec.name, version, False, f"refused ({exc.reason})", exc.lines, exc.reason)
    lines = [a.line for a in plan.anchors]
    return Cell(spec.name, version, True, "/".join(str(n) for n in lines), lines)


def matrix(names: list[str], versions: list[str]) -> list[Cell]:
    """Every named spec on every release (tree only, no text tools)."""
    return [cell(patchspec.resolve(n), v) for n in names for v in versions]


def render_matrix(console, cells: list[Cell], versions: list[str]) -> None:
    """One row per spec, one column per release: `init/forward` anchor lines or the refusal."""
    names = list(dict.fromkeys(c.spec for c in cells))
    by = {(c.spec, c.version): c for c in cells}
    console.step("patch drift --all-specs: anchor lines (init/forward) per spec and release")
    console.table(["spec"] + versions, [[n] + [by[(n, v)].summary for v in versions] for n in names])
