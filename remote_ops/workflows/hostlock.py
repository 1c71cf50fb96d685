"""The host lock: one lock per host, taken by every command that changes the host.

The lock is a directory on the host (`HostSpec.lock_dir`, default
`/var/lock/remote-ops.lock`) made with an atomic `mkdir`; its `info` file says
who holds it, in `key=value` lines:

    user=alice               who ran remote-ops
    client=laptop            the machine remote-ops ran on
    client_pid=4242          remote-ops's PID there
    pid=777                  (only when a single remote shell holds it: its PID on the host)
    when=2026-12-01T04:00:00Z
    what=deploy: new model   why
    tool=remote-ops 0.x
    token=5f0c...            a random value: release removes only the lock it took

Who takes it: `deploy` (inside its probe, so a no-op deploy costs no extra
round trip), `container start|stop|restart`, `patch apply|revert` (inside
the write script, waiting up to `patching.LOCK_WAIT_S`), `extract start|stop`,
`train start|stop` (while starting or stopping, not for the run), `unlock
--force` (removes it).  Read-only commands (`facts`, `health`, `status`, `--dry-run`)
only ever read `info`, never wait for it.

A holder that died leaves the directory behind.  `stale_reason` proves it
stale when the holder ran on this machine and its PID is gone, or when a
single remote shell held it and that PID is gone on the host.  A lock proved
stale is taken over by whoever wants it next, the same way everywhere:
`take_over_stale` (used by `take`, hence `held`, and by deploy's locking
probe) removes exactly that holder's lock (by its token) and writes a
`lock-takeover` line to the host's audit log; the one-shell lock of
`SHELL_TAKE_WAITING` (patching's write script) breaks a dead remote PID's
lock and writes the same line.  Anything not provably gone (a holder on
another machine, an `info` without a token) needs `remote-ops unlock
--force`, which writes the release to the host's audit log.

Reading and taking the lock are probe units (`remote_ops.probes.lock`: the
commands, the `info` parser, `Holder`), also asked inside deploy's batched
probe.  Here is the policy: who we are (`info_text`), the stale proof, the
refusal, the takeover, the release and their audit lines.  `take`, `take_over_stale`,
`read`, `release`, `release_held` and `held` at the end are the only functions that talk
to a host.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from .. import __version__
from ..core import shell
from ..errors import Refused, RemoteOpsError
from ..probes import batch
from ..probes.lock import Holder, LockRead, LockTake
from ..remote import Remote

if TYPE_CHECKING:
    from ..core.inventory import HostSpec


# -- the holder (pure) ---------------------------------------------------------------------------
def stale_reason(holder: Holder, this_client: str, pid_alive: Callable[[int], bool]) -> str | None:
    """Why `holder` is provably gone, or None (pure but for the `pid_alive(pid)` callback).

    Proof is only possible for a holder on this machine (its PID is checked
    here) or a single remote shell (its PID was checked on the host)."""
    if holder.client == this_client and holder.client_pid and not pid_alive(holder.client_pid):
        return f"stale lock: holder PID {holder.client_pid} is gone"
    if holder.pid and holder.remote_pid_alive is False:
        return f"stale lock: holder PID {holder.pid} is gone (on the host)"
    return None


def pid_alive(pid: int) -> bool:
    """Is `pid` a live process on this machine?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def this_client() -> str:
    return socket.gethostname()


# -- command builders (pure) ----------------------------------------------------------------------
def info_text(
    what: str,
    token: str | None = None,
    *,
    user: str | None = None,
    client: str | None = None,
    client_pid: int | None = None,
    now: float | None = None,
) -> str:
    """The `info` file for a lock taken by this process (one newline-free value per line)."""
    values = {
        "user": user or getpass.getuser(),
        "client": client or this_client(),
        "client_pid": client_pid or os.getpid(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "what": what,
        "tool": f"remote-ops {__version__}",
        "token": token or new_token(),
    }
    return "".join(f"{k}={' '.join(str(v).splitlines())}\n" for k, v in values.items())


def new_token() -> str:
    return secrets.token_hex(8)


def audit_append_cmd(audit_log: str, record: dict) -> str:
    """Append one JSON line to the host's audit log (its directory made if needed)."""
    line = json.dumps(record, sort_keys=True)
    return shell.and_then(
        ["mkdir", "-p", str(PurePosixPath(audit_log).parent)],
        shell.redirect(["printf", "%s\n", line], stdout=audit_log, append=True),
    )


def release_cmd(lock_dir: str, token: str | None, audit_log: str | None = None, audit: dict | None = None) -> str:
    """Append the audit line, then remove the lock: ours only (`token`), or any (`token=None`)."""
    d = shell.quote(lock_dir)
    if token is None:
        remove = f"rm -rf {d}"
    else:
        remove = f"if [ -f {d}/info ] && grep -qxF {shell.quote('token=' + token)} {d}/info; then rm -rf {d}; fi"
    if audit_log and audit is not None:
        return shell.seq(audit_append_cmd(audit_log, audit), remove)
    return remove


def takeover_cmd(lock_dir: str, token: str, audit_log: str, record: dict) -> str:
    """Remove the lock only while it is still the stale holder's (`token`), and only then append
    `record` to the host's audit log; prints `taken-over` when it did (pure)."""
    d = shell.quote(lock_dir)
    moved = shell.quote(f"{lock_dir}.takeover.{token}")
    return (
        f"if [ -f {d}/info ] && grep -qxF {shell.quote('token=' + token)} {d}/info && mv {d} {moved} 2>/dev/null; then "
        f"rm -rf {moved}; {audit_append_cmd(audit_log, record)} && echo taken-over; fi"
    )


#: The lock as taken by one remote shell (patching's write script): `$lock` is the lock dir,
#: `$wait` the seconds to wait, `$info` the info text; `pid=$$` is added so a dead holder can
#: be proved stale on the host and broken: the same takeover as `take_over_stale`, with its
#: `lock-takeover` line appended to `$lock_audit` (the host's audit log) when the script sets it.
#: The lock is removed when that shell exits (an EXIT trap calling `release_lock`; a script that
#: sets its own EXIT trap must call it too).
SHELL_TAKE_WAITING = r"""
if [ -n "$lock" ]; then
  end=$(( $(date +%s) + wait ))
  mkdir -p "$(dirname "$lock")"
  while ! mkdir "$lock" 2>/dev/null; do
    pid=; [ -f "$lock/info" ] && pid=$(head -c 65536 "$lock/info" | sed -n 's/^pid=//p')
    if [ -n "$pid" ] && [ ! -d "/proc/$pid" ]; then
      if mv "$lock" "$lock.stale.$$" 2>/dev/null; then
        rm -rf "$lock.stale.$$"
        echo "broke stale lock of dead pid $pid"
        if [ -n "${lock_audit:-}" ]; then
          mkdir -p "$(dirname "$lock_audit")"
          printf '{"action": "lock-takeover", "by": "%s", "host_pid": %s, "stale": "stale lock: holder PID %s is gone (on the host)", "time": %s, "tool": "remote-ops"}\n' \
            "$(printf %s "$what" | tr -d '"\\')" "$$" "$pid" "$(date +%s)" >> "$lock_audit"
        fi
      fi
      continue
    fi
    [ "$(date +%s)" -ge "$end" ] && { echo "lock-held: $([ -f "$lock/info" ] && head -c 65536 "$lock/info" | tr '\n' '\t')"; exit 75; }
    sleep 0.2
  done
  release_lock() { rm -rf "$lock"; }
  trap release_lock EXIT
  printf '%spid=%s\n' "$info" "$$" > "$lock/info"
fi
"""


def audit_record(action: str, host: str, holder: Holder | None, *, forced: bool, reason: str | None) -> dict:
    """The audit-log line for a release done by `remote-ops unlock`."""
    return {
        "time": time.time(),
        "tool": f"remote-ops {__version__}",
        "action": action,
        "host": host,
        "user": getpass.getuser(),
        "client": this_client(),
        "forced": forced,
        "stale": reason,
        "holder": holder.to_dict() if holder else None,
    }


# -- the edge -------------------------------------------------------------------------------------
def held_refusal(host: HostSpec, holder: Holder | None, what: str) -> Refused:
    """Refused (exit 9) naming the holder, whether it is stale, and how to recover."""
    stale = stale_reason(holder, this_client(), pid_alive) if holder else None
    desc = holder.describe() if holder else "no info file"
    return Refused(
        f"lock: {host.lock_dir} is held by {desc}" + (f" ({stale})" if stale else "") + f"; {what} not started",
        host=host.name,
        hint=(
            f"`remote-ops unlock --host {host.name}` releases it"
            if stale
            else f"wait for that run, or `remote-ops unlock --host {host.name} --force` if it is gone"
        ),
        details={"reason": "lock_held", "lock": holder.to_dict() if holder else None, "stale": stale},
    )


def take_over_stale(remote: Remote, host: HostSpec, holder: Holder | None, what: str) -> str | None:
    """THE takeover of a stale lock, for every lock taker: when `holder` is provably gone
    (`stale_reason`) and its `info` has a token, remove that holder's lock (only it: a run
    that took the lock meanwhile keeps its own) and write a `lock-takeover` line, naming the
    holder, why it is stale and `what` takes over, to the host's audit log.  Returns the
    reason when this call removed it; None when it is not provably stale (no round trip)
    or was no longer that holder's (another run took it over first).  The caller then takes
    the lock as usual."""
    reason = stale_reason(holder, this_client(), pid_alive) if holder else None
    if holder is None or reason is None or not holder.token:
        return None
    record = {**audit_record("lock-takeover", host.name, holder, forced=False, reason=reason), "by": what}
    r = remote.run(takeover_cmd(host.lock_dir, holder.token, host.audit_log, record), check=False)
    return reason if "taken-over" in r.stdout else None


def take(remote: Remote, host: HostSpec, what: str) -> str:
    """Take the host lock (no waiting) and return its token; a lock whose holder is provably
    gone is taken over first (`take_over_stale`, audit-logged); otherwise raise `held_refusal`."""
    token = new_token()
    probe = LockTake(host.lock_dir, info_text(what, token))
    r = remote.run(probe.command(), check=False)
    taken = probe.parse(r.exit_status, r.stdout)
    if taken.held and take_over_stale(remote, host, taken.holder, what):
        r = remote.run(probe.command(), check=False)
        taken = probe.parse(r.exit_status, r.stdout)
    if taken.held:
        raise held_refusal(host, taken.holder, what)
    if not taken.took:
        from ..errors import CommandFailed

        raise CommandFailed.of(f"lock: cannot create {host.lock_dir}", r, host.name)
    return token


def read(remote: Remote, host: HostSpec) -> Holder | None:
    """The current holder, or None (one read-only round trip)."""
    return batch.ask(remote, LockRead(host.lock_dir))


def release(remote: Remote, host: HostSpec, token: str, audit: dict | None = None) -> None:
    """Release the lock we took (and append `audit` to the host's audit log)."""
    remote.run(release_cmd(host.lock_dir, token, host.audit_log if audit else None, audit))


def release_held(remote: Remote, host: HostSpec, holder: Holder, *, forced: bool, reason: str | None) -> None:
    """`remote-ops unlock`'s release: remove the lock `holder` holds (only that one, by its
    token, so a run that took the lock meanwhile keeps it) and append the release to the
    host's audit log (`forced`: released although not proved stale; `reason`: why it is stale)."""
    audit = audit_record("unlock", host.name, holder, forced=forced, reason=reason)
    remote.run(release_cmd(host.lock_dir, holder.token or None, host.audit_log, audit))


def recovery_hint(host: HostSpec) -> str:
    """What to do when a run could not release its lock (connection lost, host frozen)."""
    return (
        f"the host lock {host.lock_dir} may still be held by this run; once {host.name} answers, "
        f"`remote-ops unlock --host {host.name}` shows the holder and releases it (stale: this PID "
        f"{os.getpid()} is gone)"
    )


@contextmanager
def held(remote: Remote, host: HostSpec, what: str) -> Iterator[str]:
    """Hold the host lock around a block; released on success, error and signals.

    If the release itself fails (connection lost), the original error wins and
    the recovery hint is added to it."""
    from .. import signals

    token = take(remote, host, what)
    failed = False
    try:
        yield token
    except BaseException as exc:
        failed = True
        with signals.deferred():
            _release_quietly(remote, host, token, exc)
        raise
    finally:
        if not failed:
            with signals.deferred():
                release(remote, host, token)


def _release_quietly(remote: Remote, host: HostSpec, token: str, exc: BaseException) -> None:
    try:
        release(remote, host, token)
    except RemoteOpsError:
        if isinstance(exc, RemoteOpsError):
            exc.hint = "; ".join(x for x in (exc.hint, recovery_hint(host)) if x)
