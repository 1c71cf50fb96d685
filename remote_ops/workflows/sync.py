"""`dumps sync`: dumps move host to host, verified and resumable; the laptop only orchestrates.

Steps (docs/sync.md is the reference):

1. Check: every source's and the destination's dump dir is reconciled (the
   `dumps status` probes: the dir as the host resolves it, so a symlinked dump
   dir is used, granted and reported by its target; entries that are not
   regular files named, never followed) and the sources' tools are looked up
   (`sync_onhost.py source-check`); `core.syncplan.plan` decides what moves,
   what is already there and what conflicts.  `--dry-run` stops here.
2. Grant: under the destination's host lock, in one round trip (`keygen`) the
   destination's tools are looked up, a new ed25519 key is made there and its
   known_hosts is written from the keys this machine has pinned for the
   sources (`remote.pinned`); then each source gets
   one `restrict,from=,command="rrsync -ro DIR"` line (`grant`, which first
   drops what a killed sync to this destination left, under the source's
   authorized_keys lock).  Each grant goes in the source's audit log.
3. Act: the destination runs `sync_onhost.py transfer` per source (rsync over
   ssh from the destination to the source, each file checked against the
   source manifest's sha256 on arrival, renamed into `rank<R>/` and recorded
   in the manifest with its `host`).  Only progress lines reach this process.
   The transfer removes its staging dir when every file arrived.
4. Always (success, failure, Ctrl-C): the lines are revoked on every source
   (under the same lock, and read back: `revoked` only when the line is gone;
   audit-logged) and the destination cleaned up (`cleanup`: the key and
   known_hosts deleted, plans and staging locks removed, partial files kept).
   A revoke that cannot run (a source down) is named; the next sync removes
   it.  A revoke that ran and could not remove the line (the lock not had in
   time, the line read back) is an error naming the file.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import onhost, signals
from ..core import shell, syncplan
from ..core.dumpcheck import Reconciliation
from ..errors import CommandFailed, ConfigError, NotFound, Refused, RemoteOpsError, UsageError, VerifyFailed
from ..remote.pinned import pinned_lines
from . import dumps as dumps_mod, fleet, hostlock

if TYPE_CHECKING:
    from ..core.inventory import HostSpec
    from ..remote import Remote
    from ..remote.sshconfig import SshTarget

SCRIPT = "sync_onhost.py"
#: How long a transfer key may stay on a source if both its revoke and the next sync fail (OpenSSH expiry-time).
GRANT_HOURS = 48


@dataclass(frozen=True)
class SyncOptions:
    """How a sync runs: the address the sources see the destination at (`from=`; default its
    inventory address), compression in transit, a rate cap per source, rsync's stall timeout,
    the whole transfer's deadline, and hosts worked on at once."""

    dest_address: str | None = None
    compress: str = "none"  # none | zstd
    bwlimit_mbps: float | None = None
    stall_timeout: float = 60.0
    transfer_timeout: float = 7 * 24 * 3600.0
    forks: int = 16


@dataclass
class Checked:
    """Step 1's findings: every host's reconciliation and tools, the plan."""

    recons: dict[str, Reconciliation]
    dest_recon: Reconciliation
    tools: dict[str, dict]  # source -> source-check
    dest_tools: dict
    plan: syncplan.SyncPlan
    host_errors: dict[str, RemoteOpsError] = field(default_factory=dict)
    dirs: dict[str, str] = field(default_factory=dict)  # host -> its dump dir as the host resolved it
    configured: dict[str, str] = field(default_factory=dict)  # host -> its inventory dump.dir

    @property
    def rows(self) -> syncplan.SourceRows:
        """The sources' rows and entries that do not move: missing, not regular, unsafe, torn."""
        return syncplan.source_rows(self.recons)


@dataclass
class SyncResult:
    """What a sync did, per source; `to_dict` is the `--json` document."""

    checked: Checked
    sync_id: str = ""
    transfers: dict[str, dict] = field(default_factory=dict)  # source -> the on-host `done` event
    errors: dict[str, RemoteOpsError] = field(default_factory=dict)
    grants: dict[str, dict] = field(default_factory=dict)
    revoked: dict[str, dict] = field(default_factory=dict)
    revoke_errors: dict[str, str] = field(default_factory=dict)
    #: revokes that ran and did not remove the line (lock not had, line read back): errors
    revoke_failures: dict[str, RemoteOpsError] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def moved(self) -> int:
        return sum(int(t.get("moved", 0)) for t in self.transfers.values())

    @property
    def bytes(self) -> int:
        return sum(int(t.get("bytes", 0)) for t in self.transfers.values())

    @property
    def wire_bytes(self) -> int:
        return sum(int(t.get("wire_bytes", 0)) for t in self.transfers.values())

    @property
    def failed(self) -> dict[str, str]:
        return {f"{h}:{f}": why for h, t in self.transfers.items() for f, why in t.get("failed", {}).items()}

    def to_dict(self) -> dict:
        c = self.checked
        rows = c.rows
        return {
            "dest": c.plan.dest,
            "sync_id": self.sync_id,
            "dump_dirs": c.dirs,
            "plan": c.plan.to_dict(),
            "moved": self.moved,
            "bytes": self.bytes,
            "wire_bytes": self.wire_bytes,
            "seconds": round(self.seconds, 3),
            "mb_per_s": round(self.bytes / 1e6 / self.seconds, 1) if self.seconds else 0.0,
            "transfers": self.transfers,
            "failed": self.failed,
            "conflicts": c.plan.conflicts,
            "errors": {h: e.to_dict() for h, e in {**c.host_errors, **self.errors}.items()},
            "unsafe": rows.unsafe,
            "missing_on_source": rows.missing,
            "not_regular_on_source": rows.not_regular,
            "torn": rows.torn,
            "grants": self.grants,
            "revoked": self.revoked,
            "revoke_errors": self.revoke_errors,
        }


# --------------------------------------------------------------------------- the on-host program


def _script_argv(*args: str) -> str:
    return shell.join(["python3", "-", *args])


def on_host(remote: Remote, *args: str, timeout: float | None = None, on_line=None, check: bool = True) -> dict:
    """Run `sync_onhost.py ARGS` (script on stdin); its last JSON line."""
    r = remote.run(_script_argv(*args), input=onhost.source(SCRIPT), check=False, timeout=timeout, on_line=on_line)
    doc = _last_json(r.stdout)
    if check and (r.exit_status != 0 or doc is None):
        raise CommandFailed.of(f"sync_onhost.py {args[0]} exited {r.exit_status}", r, remote.name)
    return doc or {}


def _edit(remote: Remote, *args: str) -> dict:
    """`grant` / `revoke` on a source (under its authorized_keys lock, read back); a report that
    did not happen is a typed error naming the file: the lock not had in time (Refused, 9), the
    file read back without the grant or still with the line (VerifyFailed, 10), the file not
    writable (CommandFailed, 7)."""
    doc = on_host(remote, *args, check=False)
    what = args[0]
    problem = doc.get("error")
    if problem is None and doc.get("granted" if what == "grant" else "revoked") is True:
        return doc
    file = doc.get("file", "authorized_keys")
    details = {"reason": f"{what}_{problem}", "file": file, "report": doc}
    if problem == "locked":
        raise Refused(
            f"{what}: {file} is being edited by another run: its lock {doc.get('lock')} "
            f"was not free within {doc.get('waited')}s",
            host=remote.name,
            hint="another dumps sync from this source holds it; re-run when it is done",
            details=details,
        )
    if problem in ("still_there", "not_granted"):
        said = (
            f"{doc.get('left')} transfer-key line(s) of this destination are still there"
            if problem == "still_there"
            else "the grant line is not there"
        )
        raise VerifyFailed(
            f"{what}: {file} read back after the edit: {said}",
            host=remote.name,
            hint="something else edits that file; look at it on the host (a transfer key line ends by "
            "its expiry-time, 48 h)",
            details=details,
        )
    raise CommandFailed(
        f"{what} of {file} failed: {doc.get('reason') or 'no report'}",
        host=remote.name,
        details=details,
    )


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


# --------------------------------------------------------------------------- 1. check


def check(sources: list[HostSpec], dest: HostSpec, remote_of: Callable[[HostSpec], Remote], forks: int) -> Checked:
    """Reconcile every host (`forks` at a time; each dump dir where its host resolves it) and look
    up their tools; the plan.  A source that cannot be reached or read is left out (its error in
    `host_errors`); the destination must answer (a destination without a dump dir yet counts as
    empty)."""
    dest_remote = remote_of(dest)
    try:
        dest_recon = dumps_mod.reconcile_probe(dumps_mod.probe(dest_remote, dest.dump.dir), dest.dump.dir)
    except NotFound:
        dest_recon = Reconciliation(dest.dump.dir)  # no dump dir yet: the transfer makes it

    def work(spec: HostSpec) -> tuple[int, tuple[Reconciliation, dict]]:
        remote = remote_of(spec)
        recon = dumps_mod.reconcile_probe(dumps_mod.probe(remote, spec.dump.dir), spec.dump.dir)
        return 0, (recon, on_host(remote, "source-check", "--dir", spec.dump.dir))

    run = fleet.fan_out(sources, work, forks=forks)
    done = {o.host: o.result for o in run.outcomes if o.error is None}
    host_errors = {o.host: o.error for o in run.outcomes if o.error is not None}
    recons = {h: v[0] for h, v in done.items()}
    plan = syncplan.plan(recons, dest.name, dest_recon)
    dirs = {dest.name: dest_recon.dump_dir, **{h: r.dump_dir for h, r in recons.items()}}  # as resolved
    configured = {spec.name: spec.dump.dir for spec in [dest, *sources]}
    tools = {h: v[1] for h, v in done.items()}
    return Checked(recons, dest_recon, tools, {}, plan, host_errors, dirs, configured)


def check_addresses(
    sources: list[HostSpec], dest: HostSpec, target_of: Callable[[HostSpec], SshTarget], opts: SyncOptions
) -> None:
    """Every address a sync writes into a grant or a transfer plan, checked before anything
    connects: `--dest-address` a UsageError (exit 2), an inventory or ssh_config address a
    ConfigError (exit 3), each naming the value (`core.syncplan.check_address`)."""
    if opts.dest_address is not None:
        try:
            syncplan.check_address(opts.dest_address)
        except ValueError as exc:
            raise UsageError(f"--dest-address: {exc}") from None
    for spec in [*sources, dest]:
        address = target_of(spec).hostname
        try:
            syncplan.check_address(address)
        except ValueError as exc:
            raise ConfigError(
                f"cannot go into a sync grant or transfer plan: {exc}", field=f"{spec.name}.address"
            ) from None


def _source_problem(name: str, tools: dict) -> str | None:
    if not tools.get("rrsync"):
        return f"{name} has no rrsync (rsync >= 3.2.4 ships it; Debian/Ubuntu: package rsync)"
    if not tools.get("rsync"):
        return f"{name} has no rsync"
    return None


# --------------------------------------------------------------------------- the destination's lock


# --------------------------------------------------------------------------- 2-4. grant, act, revoke


Progress = Callable[[str, int], None]  # (source, bytes moved since the last call)


@dataclass
class _Sync:
    checked: Checked
    sources: dict[str, HostSpec]
    dest: HostSpec
    remote_of: Callable[[HostSpec], Remote]
    target_of: Callable[[HostSpec], SshTarget]
    opts: SyncOptions
    progress: Progress
    result: SyncResult

    @property
    def dest_remote(self) -> Remote:
        return self.remote_of(self.dest)

    @property
    def dest_dir(self) -> str:
        """The destination's dump dir as it resolved it (step 1)."""
        return self.checked.dirs.get(self.dest.name, self.dest.dump.dir)

    @property
    def work(self) -> str:
        return syncplan.work_dir(self.dest_dir)

    # -- grant --------------------------------------------------------------
    def prepare_dest(self, moving: list[str]) -> dict:
        """The destination's tools, and (when they are there) the key and known_hosts of the sync:
        one round trip (`keygen`); its answer has the public line in `public`."""
        comment = f"{syncplan.mark(self.dest.name)}{self.result.sync_id}"
        known = [line for name in moving for line in pinned_lines(self.target_of(self.sources[name]))]
        args = ["keygen", "--work", self.work, "--comment", comment, "--bind", self.from_address()]
        return on_host(self.dest_remote, *args, *(x for line in known for x in ("--known-host", line)))

    def from_address(self) -> str:
        return self.opts.dest_address or self.target_of(self.dest).hostname

    def grant(self, name: str, public: str) -> dict:
        spec, tools = self.sources[name], self.checked.tools[name]
        line = syncplan.grant_line(
            public,
            str(tools["rrsync"]),
            self.checked.dirs.get(name, spec.dump.dir),  # rrsync confined to the resolved dir
            self.from_address(),
            self.dest.name,
            self.result.sync_id,
            expiry=time.strftime("%Y%m%d%H%M", time.gmtime(time.time() + GRANT_HOURS * 3600)) + "Z",
        )
        remote = self.remote_of(spec)
        ak = str(tools["authorized_keys"])
        out = _edit(remote, "grant", "--file", ak, "--mark", syncplan.mark(self.dest.name), "--line", line)
        self._audit(remote, spec, "sync-grant", {"authorized_keys": ak, "line": line})
        return {"file": ak, "line": line, "stale_removed": out.get("removed", 0)}

    def revoke(self, name: str) -> dict:
        """Remove this destination's lines; `revoked` is true only when the file, read back under
        the lock, holds none (else `_edit` raises, naming the file)."""
        spec, tools = self.sources[name], self.checked.tools[name]
        remote = self.remote_of(spec)
        ak = str(tools["authorized_keys"])
        out = _edit(remote, "revoke", "--file", ak, "--mark", syncplan.mark(self.dest.name))
        if out.get("removed"):
            self._audit(remote, spec, "sync-revoke", {"authorized_keys": ak, "removed": out["removed"]})
        return {"file": ak, "removed": out.get("removed", 0), "revoked": out.get("revoked") is True}

    def _audit(self, remote: Remote, spec: HostSpec, action: str, extra: dict) -> None:
        record = {
            "action": action,
            "sync_id": self.result.sync_id,
            "dest": self.dest.name,
            "source": spec.name,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "client": hostlock.this_client(),
            **extra,
        }
        remote.run(hostlock.audit_append_cmd(spec.audit_log, record))

    # -- act ----------------------------------------------------------------
    def transfer(self, name: str, bind: str | None) -> dict:
        target = self.target_of(self.sources[name])
        doc = syncplan.transfer_plan(
            source=name,
            address=target.hostname,
            port=target.port,
            user=target.user,
            dest_dump_dir=self.dest_dir,
            bind=bind,
            records=self.checked.plan.moves[name],
            compress=self.opts.compress,
            bwlimit_kbps=int(self.opts.bwlimit_mbps * 1000 / 1.024) if self.opts.bwlimit_mbps else None,
            stall_timeout=self.opts.stall_timeout,
        )
        plan_file = f"{self.work}/plan-{name}.json"
        self.dest_remote.run(shell.redirect(["cat"], stdout=plan_file), input=json.dumps(doc).encode())
        events = _Events(name, self.progress)
        on_host(
            self.dest_remote,
            "transfer",
            plan_file,
            timeout=self.opts.transfer_timeout,
            on_line=events.line,
            check=False,
        )
        if events.done is None:
            raise CommandFailed(
                f"the transfer from {name} on {self.dest.name} ended without its report (killed?)",
                host=self.dest.name,
                stderr_tail=events.rsync_error,
                hint="re-run `dumps sync`: verified files are kept, partial ones resume",
            )
        if events.done.get("connection_lost"):
            from ..errors import Unreachable

            raise Unreachable(
                f"{self.dest.name} lost its connection to {name} (rsync exit {events.done.get('rsync_rc')}: "
                f"{_last_line(events.rsync_error)}): "
                f"{events.done.get('moved', 0)} file(s) moved before",
                host=name,
                hint="re-run `dumps sync` when the source answers: verified files are kept, partial ones resume",
                details={"reason": "connection_lost", "transfer": events.done, "stderr_tail": events.rsync_error},
            )
        if events.done.get("rsync_rc"):
            raise CommandFailed(
                f"rsync from {name} exited {events.done['rsync_rc']} on {self.dest.name}: {_last_line(events.rsync_error)}",
                host=self.dest.name,
                exit_status=int(events.done["rsync_rc"]),
                stderr_tail=events.rsync_error,
                hint="re-run `dumps sync`: verified files are kept, partial ones resume",
            )
        return events.done


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no message"


@dataclass
class _Events:
    """The JSON Lines of one `transfer`: progress to `progress`, the `done` report kept."""

    source: str
    progress: Progress
    done: dict | None = None
    rsync_error: str = ""
    _last: int = 0
    _files: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def line(self, stream: str, text: str) -> None:
        if stream != "stdout":
            return
        try:
            ev = json.loads(text)
        except ValueError:
            return
        kind = ev.get("event") if isinstance(ev, dict) else None
        if kind == "progress":
            n = int(ev.get("bytes", 0))
            self._advance(max(0, n - self._last))
            self._last = max(self._last, n)
        elif kind == "rsync":
            self._last = 0  # a new pass counts from 0 again
        elif kind == "rsync_failed":
            self.rsync_error = str(ev.get("stderr", ""))
        elif kind == "done":
            self.done = ev

    def _advance(self, n: int) -> None:
        if n:
            self.progress(self.source, n)


def sync(
    sources: list[HostSpec],
    dest: HostSpec,
    checked: Checked,
    remote_of: Callable[[HostSpec], Remote],
    target_of: Callable[[HostSpec], SshTarget],
    opts: SyncOptions,
    progress: Progress,
) -> SyncResult:
    """Steps 2-4 (see the module doc) for the sources that answered step 1."""
    check_addresses(sources, dest, target_of, opts)
    result = SyncResult(checked, sync_id=hostlock.new_token())
    by_name = {s.name: s for s in sources if s.name in checked.recons}
    for name, tools in checked.tools.items():
        why = _source_problem(name, tools) if checked.plan.moves.get(name) else None
        if why:
            raise Refused(
                why, host=name, hint="install rsync on the source (it ships rrsync), or leave it out of --from"
            )
    for t in (target_of(s) for s in [*by_name.values(), dest]):
        if t.jump:
            raise UsageError(f"{t.name} is reached through a ProxyJump: dumps sync needs the hosts to reach each other")
    s = _Sync(checked, by_name, dest, remote_of, target_of, opts, progress, result)
    dest_remote = remote_of(dest)
    t0 = time.monotonic()
    token = hostlock.take(dest_remote, dest, "dumps sync")  # a provably stale lock is taken over
    try:
        _grant_and_move(s)
    finally:
        with signals.deferred():
            _revoke_all(s)
            try:
                hostlock.release(dest_remote, dest, token)
            except RemoteOpsError:
                pass
    result.seconds = time.monotonic() - t0
    return result


def _grant_and_move(s: _Sync) -> None:
    moving = [h for h, recs in s.checked.plan.moves.items() if recs]
    if not moving:
        return
    s.checked.dest_tools = s.prepare_dest(moving)
    if not s.checked.dest_tools.get("public"):
        raise Refused(
            f"{s.dest.name} lacks rsync, ssh or ssh-keygen",
            host=s.dest.name,
            hint="install rsync and openssh-client there",
        )
    bind = s.from_address() if s.checked.dest_tools.get("bind_ok") else None
    public = str(s.checked.dest_tools["public"])
    specs = [s.sources[h] for h in moving]
    grants = fleet.fan_out(specs, lambda spec: (0, s.grant(spec.name, public)), forks=s.opts.forks)
    for o in grants.outcomes:
        if o.error is not None:
            s.result.errors[o.host] = o.error
        else:
            s.result.grants[o.host] = o.result
    granted = [s.sources[h] for h in moving if h in s.result.grants]
    run = fleet.fan_out(granted, lambda spec: (0, s.transfer(spec.name, bind)), forks=s.opts.forks)
    for o in run.outcomes:
        if o.error is not None:
            s.result.errors[o.host] = o.error
        else:
            s.result.transfers[o.host] = o.result


def _revoke_all(s: _Sync) -> None:
    """Revoke on every source (also those with nothing to move: a killed run's lines go too), then
    clean up the destination (`cleanup`: the key deleted, plans and staging locks removed)."""
    specs = list(s.sources.values())
    run = fleet.fan_out(specs, lambda spec: (0, s.revoke(spec.name)), forks=s.opts.forks)
    for o in run.outcomes:
        if o.error is not None:
            s.result.revoke_errors[o.host] = o.error.message
            if (o.error.details or {}).get("reason", "").startswith("revoke_"):  # it ran: an error
                s.result.revoke_failures[o.host] = o.error
        else:
            s.result.revoked[o.host] = o.result
    try:
        done = on_host(s.dest_remote, "cleanup", "--work", s.work, check=False)
        if done.get("failed") or "removed" not in done:
            s.result.revoke_errors[s.dest.name] = f"key not deleted in {s.work}: {done.get('failed') or 'no report'}"
    except RemoteOpsError as exc:
        s.result.revoke_errors[s.dest.name] = f"key not deleted: {exc.message}"


def describe(plan: syncplan.SyncPlan) -> dict[str, Any]:
    """`--dry-run`'s document: what would move, from where."""
    return plan.to_dict()
