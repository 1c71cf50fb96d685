"""Patch workflow over a `Remote`: check / apply / verify / revert / status.

Stable API (the deploy workflow and the commands call these; each returns a
dataclass with `to_dict()`; problems raise typed errors):

    target = PatchTarget.for_host(host_spec)          # or PatchTarget.local(path)
    check(remote, target, force=False)   -> CheckReport   (refusal in .refusal; .raise_if_refused())
    apply(remote, target, force=False, dry_run=False, lock=True) -> ApplyResult
    verify(remote, target)               -> VerifyResult  (.ok; .raise_if_failed())
    revert(remote, target, dry_run=False, from_backup=False, lock=True) -> RevertResult
    status(remote, target)               -> StatusResult
    read_target(remote, target, compile=False) -> TargetFile (one round trip)
    LocalRemote()                         a `Remote` running /bin/sh locally (--local-file;
                                          defined in the seam, remote_ops.remote.local)

`target` may also be a `HostSpec` (its `sglang.target_file`, checkout and lock_dir).

Round trips (each is one `remote.run`):
- check, status: 1 (file bytes + sha256 + stat + SGLang version + backup record,
  framed by `shell.sections`); verify: 1 (the same plus `python3 -m py_compile`).
- apply: 2: the read, then one write that takes the new bytes on stdin and, under
  the host lock (`remote_ops.workflows.hostlock`: atomic `mkdir`, holder info inside,
  deadline, stale locks of dead remote PIDs broken), checks the file is unchanged since the read, writes a temp
  file in the same directory, keeps mode and owner, fsyncs, runs
  `python3 -m py_compile` on it, makes the backup (+ sha256 sidecar) and renames
  atomically, printing the new sha256.  Verification is then done locally from
  the bytes known to be there.  A failed verification restores the backup (a
  third round trip) and raises VerifyFailed saying so.  A re-apply with the same
  content is 1 round trip (no write).  If a concurrent apply changed the file
  while we waited for the lock, apply re-reads and decides once more.
- `lock=False` is for callers that already hold the host lock (deploy).
- revert: 2 (read, write).

The decisions (anchors, evidence, diffs, version gate) are pure functions of
the bytes read, in `remote_ops.core.anchors` and `remote_ops.core.source`.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..core import anchors, jsonload, patchspec, shell, source as srcview
from ..core.anchors import AnchorRefusal, PatchSpec
from ..core.jsonable import fields_of
from ..errors import CommandFailed, NotFound, Refused, UnsafeHostFile, UsageError, VerifyFailed, tail
from ..probes.lock import parse_info
from ..remote import LocalRemote, Remote, RunResult, command_deadline  # noqa: F401 (LocalRemote: re-exported)
from ..remote.smallfile import small_file_error
from . import hostlock

BACKUP_SUFFIX = ".remote-ops-backup"
LOCK_WAIT_S = 30.0
# Exit codes of the write script (WRITE_SCRIPT), mapped to typed errors in `_write`.
RC_LOCK_HELD, RC_CHANGED, RC_COMPILE, RC_IO = 75, 76, 65, 74


# ----------------------------------------------------------------------- target
@dataclass(frozen=True)
class PatchTarget:
    """Which file to patch, with which model spec, where its checkout is, which lock guards the host."""

    path: str
    checkout: str | None = None
    lock_dir: str | None = None
    spec_name: str = ""
    model_class: str | None = None
    audit_log: str | None = None  # where a takeover of a stale lock is written (the host's audit log)

    @classmethod
    def for_host(cls, host, path: str | None = None, spec: PatchSpec | None = None) -> "PatchTarget":
        """The inventory host's target file (or `path`) under its spec, with its checkout and lock.

        `spec` defaults to the one the inventory names (`sglang.patch`); a host
        whose spec is derived on the host goes through `bind_host` first."""
        spec = spec or patchspec.for_host(host)
        checkout = host.sglang.checkout if path is None else _checkout_of(path, spec)
        return cls(
            path or patchspec.target_path(host.sglang.checkout, spec),
            checkout,
            host.lock_dir,
            spec.name,
            spec.model_class or None,
            host.audit_log,
        )

    @classmethod
    def local(cls, path: str | Path, model_class: str | None = None, strict: bool = True) -> "PatchTarget":
        """A file on this machine: its spec from its one capture class (or `model_class`); lock beside it.

        `strict=False` (inspect-source: any file can be read) leaves the spec empty
        instead of refusing when the file has no single covered capture class."""
        p = Path(path).absolute()
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise NotFound(f"{p} cannot be read: {exc.strerror}") from None
        try:
            spec = patchspec.for_file(data, model_class)
        except Refused:
            if strict:
                raise
            return cls(str(p), None, str(p) + ".remote-ops-lock")
        return cls(str(p), _checkout_of(str(p), spec), str(p) + ".remote-ops-lock", spec.name, spec.model_class or None)

    def spec(self) -> PatchSpec | None:
        return patchspec.resolve(self.spec_name, self.model_class) if self.spec_name else None


def _checkout_of(path: str, spec: PatchSpec) -> str | None:
    """The checkout root when `path` ends with the spec's python/sglang/srt/models/<file>."""
    tail_parts = PurePosixPath(spec.target).parts
    parts = PurePosixPath(path).parts
    if len(parts) > len(tail_parts) and parts[-len(tail_parts) :] == tail_parts:
        return str(PurePosixPath(*parts[: -len(tail_parts)]))
    return None


def _as_target(target) -> PatchTarget:
    return target if isinstance(target, PatchTarget) else PatchTarget.for_host(target)


def config_path(host) -> str:
    """The served model's config.json on the host."""
    return str(PurePosixPath(host.model.path) / "config.json")


def host_spec(remote: Remote, host) -> tuple[PatchSpec, patchspec.Derivation]:
    """The host's spec: named in the inventory (no I/O), or derived from its model's config.json
    `architectures` (one round trip); refuses when no single spec serves the architecture."""
    if host.sglang.patch:
        spec = patchspec.resolve(host.sglang.patch)
        return spec, patchspec.Derivation(spec.name, "inventory", f"inventory {host.source or ''} sglang.patch".strip())
    path = config_path(host)
    res = remote.run(shell.read_small_file(path), check=False)  # a regular file, at most 1 MiB
    unsafe = small_file_error(res.exit_status, res.stderr, path, shell.SMALL_FILE_CAP, host.name)
    if isinstance(unsafe, UnsafeHostFile):
        raise unsafe
    if res.exit_status != 0:
        raise Refused(
            f"cannot read {path} to derive the patch spec ({tail(res.stderr or res.stdout, 1)})",
            host=host.name,
            hint="name the spec in the inventory: sglang.patch (see `patch specs`)",
            details={"reason": "no_model_config"},
        )
    jsonload.loads_json(res.stdout, f"{host.name}:{path}", what="model config")  # nesting: exit 3, no traceback
    derivation = patchspec.for_architectures(patchspec.parse_config_architectures(res.stdout, path), path)
    return patchspec.resolve(derivation.spec), derivation


def bind_host(remote: Remote, host):
    """(host with `sglang.patch` filled in, Derivation): later code reads the spec from the host."""
    spec, derivation = host_spec(remote, host)
    if host.sglang.patch:
        return host, derivation
    return host.model_copy(update={"sglang": host.sglang.model_copy(update={"patch": spec.name})}), derivation


# ------------------------------------------------------------------------- read
@dataclass
class TargetFile:
    """Everything one read round trip learns about the target file."""

    host: str
    path: str
    data: bytes
    sha256: str
    mode: str
    owner: str
    size: int
    version: str | None
    version_source: str
    backup_sha256: str | None
    compile_rc: int | None = None
    compile_output: str = ""
    grep_output: str | None = None  # `srcview.grep_command`'s output, when asked

    @property
    def backup_path(self) -> str:
        return self.path + BACKUP_SUFFIX

    def to_dict(self) -> dict:
        names = "host path sha256 mode owner size sglang_version version_source backup_sha256"
        return fields_of(self, names, sglang_version=self.version)


def read_probe(target: PatchTarget, compile: bool = False, grep: str | None = None) -> str:
    """The one command that reads the file and everything around it (and, with `grep`, the
    numbers of the lines the host's `grep -E` matches: `srcview.grep_command`)."""
    path, backup = target.path, target.path + BACKUP_SUFFIX
    probes: list[tuple[str, str | shell.Argv]] = [
        ("stat", ["stat", "-L", "-c", "%a %U:%G %s", path]),
        ("data", ["base64", path]),
        ("sha", shell.sha256_of(path)),
        ("backup", shell.quiet(["cat", backup + ".sha256"])),
    ]
    if target.checkout:
        root = PurePosixPath(target.checkout) / "python" / "sglang"
        probes += [
            ("version", shell.small_file_command(str(root / "version.py"))),
            ("version_scm", shell.small_file_command(str(root / "_version.py"))),
            ("git", shell.quiet(["git", "-C", target.checkout, "describe", "--tags", "--always"])),
        ]
    if compile:
        probes.append(("compile", ["sh", "-c", COMPILE_SCRIPT, "py_compile", path]))
    if grep is not None:
        probes.append(("grep", srcview.grep_command(grep, path)))
    return shell.sections(probes)


COMPILE_SCRIPT = (
    "d=$(mktemp -d) || exit 70; "
    'if command -v python3 >/dev/null 2>&1; then PYTHONPYCACHEPREFIX="$d" python3 -m py_compile "$1"; '
    'rc=$?; else echo "python3 not found on host"; rc=127; fi; rm -rf "$d"; exit $rc'
)


def read_target(remote: Remote, target, compile: bool = False, grep: str | None = None) -> TargetFile:
    """Read the target file and its context in one round trip; NotFound if missing."""
    target = _as_target(target)
    out = shell.split_sections(remote.run(read_probe(target, compile, grep), check=False).stdout)
    return parse_read(out, target, remote.name)


def parse_read(sections: dict[str, tuple[int, str]], target: PatchTarget, host: str) -> TargetFile:
    """Pure: the probe's sections -> TargetFile (checks the sha256 of what arrived)."""
    rc, stat_text = sections.get("stat", (1, ""))
    if rc != 0:
        raise NotFound(f"{target.path} does not exist or cannot be read ({tail(stat_text, 1)})", host=host)
    data = base64.b64decode("".join(sections["data"][1].split()))
    sha = sections["sha"][1].strip()
    if hashlib.sha256(data).hexdigest() != sha:
        raise CommandFailed(f"read of {target.path} came back corrupted (sha256 mismatch)", host=host)
    mode, owner, size = (stat_text.split() + ["", "", "0"])[:3]
    version, source = detect_version(sections, target.spec(), data)
    backup = sections.get("backup", (1, ""))
    compile_rc, compile_out = sections.get("compile", (None, ""))
    return TargetFile(
        host,
        target.path,
        data,
        sha,
        mode,
        owner,
        int(size),
        version,
        source,
        backup[1].split()[0] if backup[0] == 0 and backup[1].strip() else None,
        compile_rc,
        compile_out,
        sections["grep"][1] if "grep" in sections else None,
    )


VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", re.M)


def detect_version(sections: dict, spec: PatchSpec | None, data: bytes) -> tuple[str | None, str]:
    """SGLang version: checkout's version.py, then _version.py, then git tag, then known sha256."""
    for name, label in (("version", "python/sglang/version.py"), ("version_scm", "python/sglang/_version.py")):
        rc, text = sections.get(name, (1, ""))
        m = VERSION_RE.search(text) if rc == 0 else None
        if m:
            return m.group(1), label
    rc, text = sections.get("git", (1, ""))
    m = re.match(r"^v?(\d+\.\d+\.\d+(?:\.post\d+|rc\d+)?)$", text.strip()) if rc == 0 else None
    if m:
        return m.group(1), "git describe"
    if spec is None:
        return None, "not found"
    known = patchspec.version_for_sha(spec, hashlib.sha256(data).hexdigest())
    if known is None and b"# >>> remote-ops:" in data:  # patched: compare the file without our blocks
        try:
            known = patchspec.version_for_sha(spec, hashlib.sha256(anchors.strip(data, spec).encode()).hexdigest())
        except AnchorRefusal:
            pass
    return (known, "sha256 of the released file") if known else (None, "not found")


# ------------------------------------------------------------------------ check
@dataclass
class CheckReport:
    """Pre-check verdict and its evidence: grep -n of the anchor name, sed -n context."""

    host: str
    path: str
    sha256: str
    sglang_version: str | None
    version_source: str
    version_validated: bool
    forced: bool
    state: str  # the patch's status in the file now
    anchors: list = field(default_factory=list)  # anchors.AnchorMatch
    evidence: list = field(default_factory=list)  # source.Listing
    refusal: dict | None = None  # {"reason", "message", "lines"}
    plan: Any = None  # anchors.Plan (not serialised)

    @property
    def ok(self) -> bool:
        return self.refusal is None

    def raise_if_refused(self) -> None:
        if self.refusal:
            raise Refused(
                self.refusal["message"],
                host=self.host,
                hint=_hint(self.refusal["reason"]),
                details={
                    "reason": self.refusal["reason"],
                    "lines": self.refusal.get("lines", []),
                    "check": self.to_dict(),
                },
            )

    def to_dict(self) -> dict:
        return fields_of(
            self,
            "host path sha256 sglang_version version_source version_validated forced state ok refusal",
            anchors=[a.to_dict() for a in self.anchors],
            evidence=[e.to_dict() for e in self.evidence],
        )


def _hint(reason: str) -> str | None:
    return {
        "version_not_validated": "--force overrides the version gate (and only it)",
        "version_unknown": "--force overrides the version gate (and only it)",
        "modified_by_hand": "see `remote-ops patch status`; `patch revert` removes the blocks",
        "capture_before_reset": "remove the hand-made capture code, then apply",
        "unmarked_block": "remove the hand-made copy of the block, then apply",
    }.get(reason)


def check_file(tf: TargetFile, spec: PatchSpec, force: bool = False) -> CheckReport:
    """Pure pre-check of bytes read from a host: anchors, version gate, evidence (one parse)."""
    validated = tf.version in spec.validated_versions
    report = CheckReport(tf.host, tf.path, tf.sha256, tf.version, tf.version_source, validated, force, anchors.MODIFIED)
    text = None
    try:
        src = anchors.parse_source(tf.data)
        report.state = anchors.verify_placement(src, spec).status
        report.plan = anchors.plan(src, spec)
        report.anchors = report.plan.anchors
        text = srcview.Text.from_source(src)
    except AnchorRefusal as exc:
        report.refusal = exc.to_dict()
        text = _text_or_none(tf.data)
    if text is not None:
        report.evidence = pre_evidence(text, spec, report, tf.path)
    if report.refusal is None and not validated and not force:
        report.refusal = _version_refusal(tf, spec)
    return report


def _version_refusal(tf: TargetFile, spec: PatchSpec) -> dict:
    if tf.version is None:
        return {
            "reason": "version_unknown",
            "lines": [],
            "message": "cannot tell the SGLang version of this checkout (no version.py, _version.py, git tag, "
            "or known release sha256); validated: " + ", ".join(spec.validated_versions),
        }
    return {
        "reason": "version_not_validated",
        "lines": [],
        "message": f"SGLang {tf.version} ({tf.version_source}) is not a validated release for patch {spec.id} "
        f"(validated: {', '.join(spec.validated_versions)})",
    }


def _text_or_none(data: bytes) -> srcview.Text | None:
    try:
        return srcview.Text.of(data)
    except UsageError:
        return None


def pre_evidence(text: srcview.Text, spec: PatchSpec, report: CheckReport, path: str) -> list:
    """grep -n of the anchor name, sed -n around each anchor (or around the refusal's lines)."""
    out = [srcview.fixed_view(text, spec.grep, path)] if spec.grep else []
    for a in report.anchors:
        marks = {a.line: ">", a.prev_line: "<", a.next_line: "v"} if a.prev_line or a.next_line else {a.line: ">"}
        marks.pop(0, None)
        first = a.prev_line or a.line
        listing = srcview.context_view(
            text,
            a.line,
            before=max(a.line - first, 2) + 2,
            after=max((a.next_line or a.end) - a.line, 1) + 2,
            path=path,
            marks=marks,
            title=f"anchor {a.block}: line {a.line} in {a.scope}; statement before: line {a.prev_line}, "
            f"after: line {a.next_line or 'end of method'}",
        )
        out.append(listing)
    for n in (report.refusal or {}).get("lines", [])[:4]:
        out.append(srcview.context_view(text, n, 3, 3, path, f"refusal evidence: line {n}"))
    return out


def check(remote: Remote, target, force: bool = False) -> CheckReport:
    """Read once, then decide locally: can the patch land here?  (1 round trip)"""
    target = _as_target(target)
    return check_file(read_target(remote, target), target.spec(), force)


# ------------------------------------------------------------------------ verify
@dataclass
class VerifyResult:
    """Post-check: py_compile, tree placement of each block, evidence as the file is now."""

    host: str
    path: str
    sha256: str
    status: str
    compile_ok: bool | None
    compile_output: str
    report: Any  # anchors.Report
    evidence: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == anchors.APPLIED and self.compile_ok is not False

    def raise_if_failed(self, restored: str = "") -> None:
        if not self.ok:
            why = "; ".join(f["message"] for f in self.report.to_dict()["findings"]) or self.status
            if self.compile_ok is False:
                why = f"py_compile failed: {tail(self.compile_output, 3)}"
            raise VerifyFailed(
                f"patch {self.status}: {why}{restored}",
                host=self.host,
                details={"status": self.status, "verify": self.to_dict()},
            )

    def to_dict(self) -> dict:
        return fields_of(
            self,
            "host path sha256 status ok compile_ok compile_output report evidence",
            compile_output=self.compile_output or None,
            report=self.report.to_dict(),
            evidence=[e.to_dict() for e in self.evidence],
        )


def verify_bytes(
    host: str, path: str, data: bytes, spec: PatchSpec, compile_rc: int | None, compile_output: str = ""
) -> VerifyResult:
    """Pure: prove the placement from bytes known to be on the host."""
    report = anchors.verify_placement(data, spec)
    compile_ok = None if compile_rc in (None, 127) else compile_rc == 0
    result = VerifyResult(host, path, report.sha256, report.status, compile_ok, compile_output, report)
    text = _text_or_none(data)
    if text is not None:
        result.evidence = post_evidence(text, spec, report, path)
    return result


def post_evidence(text: srcview.Text, spec: PatchSpec, report, path: str) -> list:
    """grep -n as the file is now, and sed -n around each block (anchor ">", block "+")."""
    out = [srcview.fixed_view(text, spec.grep, path)] if spec.grep else []
    for b in report.blocks:
        r, a = b.region, b.anchor
        if r is None:
            continue
        marks = {n: "+" for n in range(r.begin, r.end + 1)}
        if a is not None:
            marks[a.line] = ">"
        first = min(r.begin, a.line if a else r.begin) - 2
        last = max(r.end, a.line if a else r.end) + 2
        out.append(
            srcview.Listing(
                f"block {b.name}: {b.state}, lines {r.begin}-{r.end}",
                f"sed -n '{first},{last}p' {path}",
                text.rows(first, last, marks),
            )
        )
    for f in report.findings:
        for n in f.lines[:1]:
            out.append(srcview.context_view(text, n, 2, 2, path, f"finding ({f.kind}): line {n}"))
    return out


def verify(remote: Remote, target) -> VerifyResult:
    """Read the file (with `python3 -m py_compile` on the host) and prove placement.  1 round trip."""
    target = _as_target(target)
    tf = read_target(remote, target, compile=True)
    return verify_bytes(tf.host, tf.path, tf.data, target.spec(), tf.compile_rc, tf.compile_output)


# ------------------------------------------------------------------------- write
WRITE_SCRIPT = r"""
f=$1 expect=$2 backup=$3 lock=$4 wait=$5 info=$6 what=$7 source=$8 newsha=$9 lock_audit=${10:-}
d=$(dirname "$f"); b=$(basename "$f"); bak="$f.remote-ops-backup"; tmp="$d/.$b.remote-ops-tmp.$$"
cleanup() { rm -rf "$tmp" "$bak.tmp.$$" "$bak.sha256.tmp.$$" ${pc:+"$pc"}; }
fail() { echo "error: $2"; cleanup; exit "$1"; }
trap 'cleanup; exit 130' INT TERM HUP
@HOSTLOCK@
cur=$(sha256sum < "$f" | cut -d' ' -f1) || fail 74 "cannot read $f"
[ "$cur" = "$expect" ] || { echo "changed-since-read: $cur"; exit 76; }
rm -f "$d/.$b.remote-ops-tmp."* "$bak.tmp."* "$bak.sha256.tmp."*
if [ "$source" = backup ]; then e=$(cp "$bak" "$tmp" 2>&1); else e=$(cat 2>&1 > "$tmp"); fi || fail 74 "cannot write $tmp: $e"
[ "$(sha256sum < "$tmp" | cut -d' ' -f1)" = "$newsha" ] || fail 74 "new content arrived corrupted"
e=$(chmod --reference="$f" "$tmp" 2>&1) || fail 74 "cannot keep the mode of $f: $e"
e=$(chown --reference="$f" "$tmp" 2>&1) || fail 74 "cannot keep the owner of $f: $e"
e=$(sync "$tmp" 2>&1) || fail 74 "fsync of $tmp failed: $e"
if command -v python3 >/dev/null 2>&1; then
  pc=$(mktemp -d 2>&1) || { e=$pc; pc=; fail 74 "cannot make a temp dir for py_compile: $e"; }
  e=$(PYTHONPYCACHEPREFIX="$pc" python3 -m py_compile "$tmp" 2>&1); rc=$?; rm -rf "$pc"; pc=
  echo "py_compile=$rc"; [ -n "$e" ] && echo "$e"; [ "$rc" = 0 ] || fail 65 "py_compile failed"
else echo "py_compile=skipped"; fi
if [ "$backup" = make ]; then
  e=$({ cp -p "$f" "$bak.tmp.$$" && sync "$bak.tmp.$$" && mv -f "$bak.tmp.$$" "$bak"; } 2>&1) || fail 74 "cannot make the backup $bak: $e"
  e=$({ printf '%s  %s\n' "$cur" "$bak" > "$bak.sha256.tmp.$$" && mv -f "$bak.sha256.tmp.$$" "$bak.sha256"; } 2>&1) || fail 74 "cannot record the backup's sha256: $e"
  echo "backup=$bak"
fi
e=$(mv -f "$tmp" "$f" 2>&1) || fail 74 "rename of $tmp to $f failed: $e"
sync "$d" 2>/dev/null
[ "$backup" = drop ] && rm -f "$bak" "$bak.sha256"
echo "sha256=$(sha256sum < "$f" | cut -d' ' -f1)"
"""


WRITE_SCRIPT = WRITE_SCRIPT.replace("@HOSTLOCK@\n", hostlock.SHELL_TAKE_WAITING.lstrip("\n"))


@dataclass
class WriteOutcome:
    sha256: str
    compile_rc: int | None
    compile_output: str
    log: str


def write_command(
    target: PatchTarget, expect_sha: str, new_sha: str, backup: str, lock: bool, what: str, source: str = "stdin"
) -> str:
    """The write round trip: `sh -c WRITE_SCRIPT` with every value as a quoted argument."""
    info = hostlock.info_text(what)
    return shell.join(
        [
            "sh",
            "-c",
            WRITE_SCRIPT,
            "remote-ops-write",
            target.path,
            expect_sha,
            backup,
            target.lock_dir if (lock and target.lock_dir) else "",
            str(int(LOCK_WAIT_S)),
            info,
            what,
            source,
            new_sha,
            target.audit_log or "",
        ]
    )


def _write(
    remote: Remote,
    target: PatchTarget,
    expect_sha: str,
    data: bytes | None,
    *,
    backup: str,
    lock: bool,
    what: str,
    new_sha: str,
) -> WriteOutcome:
    """Run the write script; map its exit codes to Refused / VerifyFailed / CommandFailed."""
    cmd = write_command(target, expect_sha, new_sha, backup, lock, what, "stdin" if data is not None else "backup")
    result = remote.run(
        cmd, check=False, input=data if data is not None else None, timeout=LOCK_WAIT_S + command_deadline(remote)
    )
    return _write_outcome(result, remote.name, target)


def _write_outcome(result: RunResult, host: str, target: PatchTarget) -> WriteOutcome:
    out = result.stdout
    if result.exit_status == RC_LOCK_HELD:
        holder = parse_info(_field(out, "lock-held: ").replace("\t", "\n"))
        raise Refused(
            f"host lock {target.lock_dir} is held by {holder.describe()}; waited {LOCK_WAIT_S:g}s",
            host=host,
            details={"reason": "lock_held", "lock": holder.to_dict()},
            hint="wait for that run, or `remote-ops unlock --host HOST` (shows the holder; --force if it is gone)",
        )
    if result.exit_status == RC_CHANGED:
        raise Refused(
            f"{target.path} changed while remote-ops was working (now {_field(out, 'changed-since-read: ')})"
            "; nothing written, run again",
            host=host,
            details={"reason": "changed_since_read"},
        )
    if result.exit_status == RC_COMPILE:
        raise VerifyFailed(
            f"python3 -m py_compile rejected the new file; {target.path} unchanged: {tail(out, 4)}", host=host
        )
    if result.exit_status != 0 or "sha256=" not in out:
        cause = _field(out, "error: ")  # the script's own words (with the OS error) come first
        what = (
            f"{cause}; {target.path} unchanged, temp files removed" if cause else tail(result.stderr, 3) or tail(out, 3)
        )
        raise CommandFailed(
            f"writing {target.path} failed: {what}",
            host=host,
            command="sh -c WRITE_SCRIPT",
            exit_status=result.exit_status,
            stderr_tail=tail(result.stderr),
            stdout_tail=tail(out),
        )
    rc = _field(out, "py_compile=")
    return WriteOutcome(_field(out, "sha256="), int(rc) if rc.isdigit() else None, out.split("py_compile=", 1)[-1], out)


def _field(out: str, prefix: str) -> str:
    return next((ln[len(prefix) :].strip() for ln in out.splitlines() if ln.startswith(prefix)), "")


# ------------------------------------------------------------------------ apply
@dataclass
class ApplyResult:
    host: str
    path: str
    action: str  # applied | replaced | noop | dry_run | restored
    sha_before: str
    sha_after: str
    pristine_sha256: str
    backup_path: str | None
    backup_sha256: str | None
    diff: str
    check: CheckReport
    verify: VerifyResult | None
    round_trips: int
    duration_s: float

    def to_dict(self) -> dict:
        return fields_of(
            self,
            "host path action sha_before sha_after pristine_sha256 backup_path backup_sha256 diff round_trips",
            duration_s=round(self.duration_s, 3),
            check=self.check.to_dict(),
            verify=self.verify.to_dict() if self.verify else None,
        )


def unified_diff(old: str, new: str, path: str) -> str:
    """`diff -u` of the file, as `a/PATH` `b/PATH`."""
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a{_abs(path)}", f"b{_abs(path)}", n=3)
    )


def _abs(path: str) -> str:
    return path if path.startswith("/") else "/" + path


def apply(remote: Remote, target, force: bool = False, dry_run: bool = False, lock: bool = True) -> ApplyResult:
    """Check, insert the marked blocks atomically, verify; restore the backup if verify fails.

    If another apply changed the file between our read and our write (we waited
    for its lock), decide again once from a fresh read: usually a no-op."""
    start, trips = time.monotonic(), _trips(remote)
    try:
        result = _apply_once(remote, _as_target(target), force, dry_run, lock)
    except Refused as exc:
        if exc.details.get("reason") != "changed_since_read":
            raise
        result = _apply_once(remote, _as_target(target), force, dry_run, lock)
    return _finish(result, remote, trips, start)


def _apply_once(remote: Remote, target: PatchTarget, force: bool, dry_run: bool, lock: bool) -> ApplyResult:
    start, trips = time.monotonic(), _trips(remote)
    spec = target.spec()
    assert spec is not None, "apply is only called with a patch spec"
    tf = read_target(remote, target)
    report = check_file(tf, spec, force)
    report.raise_if_refused()
    plan = report.plan
    new = plan.new_text.encode("utf-8")
    result = ApplyResult(
        tf.host,
        tf.path,
        "noop",
        tf.sha256,
        tf.sha256,
        _sha(plan.pristine.encode("utf-8")),
        None,
        tf.backup_sha256,
        unified_diff(tf.data.decode("utf-8"), plan.new_text, tf.path),
        report,
        None,
        0,
        0.0,
    )
    if not plan.changes or dry_run:
        result.action = "dry_run" if dry_run and plan.changes else "noop"
        result.verify = verify_bytes(tf.host, tf.path, tf.data if not dry_run else new, spec, None)
        return _finish(result, remote, trips, start)
    make_backup = plan.state == anchors.NOT_APPLIED or tf.backup_sha256 is None
    outcome = _write(
        remote,
        target,
        tf.sha256,
        new,
        backup="make" if make_backup else "keep",
        lock=lock,
        what=f"patch apply {spec.id}",
        new_sha=_sha(new),
    )
    result.action = "applied" if plan.state == anchors.NOT_APPLIED else "replaced"
    result.sha_after = outcome.sha256
    if make_backup:
        result.backup_sha256 = tf.sha256
    result.backup_path = tf.backup_path
    result.verify = verify_bytes(tf.host, tf.path, new, spec, outcome.compile_rc, outcome.compile_output)
    if outcome.sha256 != _sha(new) or not result.verify.ok:
        _restore_after_failed_verify(remote, target, result, outcome.sha256, lock)
    return _finish(result, remote, trips, start)


def _restore_after_failed_verify(
    remote: Remote, target: PatchTarget, result: ApplyResult, sha_now: str, lock: bool
) -> None:
    """Put the backup back (the file as it was before the first apply) and raise saying so.

    `lock` is the caller's: a deploy already holds the host lock, so the
    restore must not wait for it."""
    _write(
        remote,
        target,
        sha_now,
        None,
        backup="keep",
        lock=lock,
        what="patch apply: restore backup",
        new_sha=result.backup_sha256 or result.sha_before,
    )
    result.action = "restored"
    assert result.verify is not None, "set by the apply that failed"
    result.verify.raise_if_failed(
        restored=f"; the backup {result.backup_path} was restored (sha256 {result.backup_sha256})"
    )
    raise VerifyFailed(
        f"{target.path} did not have the expected sha256 after the write; backup restored", host=remote.name
    )


def _finish(result, remote: Remote, trips: int, start: float):
    result.round_trips = _trips(remote) - trips
    result.duration_s = time.monotonic() - start
    return result


def _trips(remote: Remote) -> int:
    return getattr(remote, "round_trips", 0)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------- revert
@dataclass
class RevertResult:
    host: str
    path: str
    action: str  # reverted | restored_backup | noop | dry_run
    sha_before: str
    sha_after: str
    original_sha256: str | None
    identical: bool | None
    diff: str
    round_trips: int = 0
    duration_s: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def revert(remote: Remote, target, dry_run: bool = False, from_backup: bool = False, lock: bool = True) -> RevertResult:
    """Remove the marked blocks; the result must hash to the original (backup record)."""
    target, start, trips = _as_target(target), time.monotonic(), _trips(remote)
    spec = target.spec()
    tf = read_target(remote, target)
    if from_backup:
        return _finish(_revert_from_backup(remote, target, tf, dry_run, lock), remote, trips, start)
    try:
        stripped = anchors.strip(tf.data, spec).encode("utf-8")
    except AnchorRefusal as exc:
        raise Refused(
            f"cannot find the blocks to remove: {exc.message}",
            host=tf.host,
            hint="`patch revert --from-backup` restores the backup copy",
            details={"reason": exc.reason},
        ) from None
    result = RevertResult(
        tf.host,
        tf.path,
        "noop",
        tf.sha256,
        tf.sha256,
        tf.backup_sha256 or _sha(stripped),
        None,
        unified_diff(tf.data.decode("utf-8"), stripped.decode("utf-8"), tf.path),
    )
    if tf.backup_sha256 and _sha(stripped) != tf.backup_sha256:
        raise Refused(
            f"removing the blocks would give sha256 {_sha(stripped)}, not the original "
            f"{tf.backup_sha256}: the file was changed outside the blocks since apply",
            host=tf.host,
            hint="`patch revert --from-backup` restores the backup copy (losing those changes)",
            details={"reason": "not_identical"},
        )
    if stripped == tf.data or dry_run:
        result.action = "dry_run" if dry_run and stripped != tf.data else "noop"
        result.identical = _sha(stripped) == result.original_sha256
        return _finish(result, remote, trips, start)
    outcome = _write(
        remote,
        target,
        tf.sha256,
        stripped,
        backup="drop",
        lock=lock,
        what=f"patch revert {spec.id}",
        new_sha=_sha(stripped),
    )
    result.action, result.sha_after = "reverted", outcome.sha256
    result.identical = outcome.sha256 == result.original_sha256
    return _finish(result, remote, trips, start)


def _revert_from_backup(remote: Remote, target: PatchTarget, tf: TargetFile, dry_run: bool, lock: bool) -> RevertResult:
    if not tf.backup_sha256:
        raise NotFound(f"no backup record {tf.backup_path}.sha256 on the host", host=tf.host)
    result = RevertResult(tf.host, tf.path, "dry_run", tf.sha256, tf.sha256, tf.backup_sha256, None, "")
    if dry_run:
        return result
    outcome = _write(
        remote,
        target,
        tf.sha256,
        None,
        backup="drop",
        lock=lock,
        what="patch revert --from-backup",
        new_sha=tf.backup_sha256,
    )
    result.action, result.sha_after = "restored_backup", outcome.sha256
    result.identical = outcome.sha256 == tf.backup_sha256
    return result


# ----------------------------------------------------------------------- status
@dataclass
class StatusResult:
    host: str
    path: str
    status: str  # applied | not_applied | outdated | partial | misplaced | modified
    sha256: str
    pristine_sha256: str
    sglang_version: str | None
    backup_sha256: str | None
    spec_hash: str
    report: Any

    def to_dict(self) -> dict:
        names = "host path status sha256 pristine_sha256 sglang_version backup_sha256 spec_hash"
        return fields_of(self, names, report=self.report.to_dict())


def status(remote: Remote, target) -> StatusResult:
    """applied / not applied / outdated / partial / misplaced / modified by hand, with shas.  1 round trip."""
    target = _as_target(target)
    spec = target.spec()
    tf = read_target(remote, target)
    report = anchors.verify_placement(tf.data, spec)
    return StatusResult(
        tf.host,
        tf.path,
        report.status,
        tf.sha256,
        report.pristine_sha256 or tf.sha256,
        tf.version,
        tf.backup_sha256,
        spec.hash,
        report,
    )
