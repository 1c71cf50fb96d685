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
single remote shell held it and that PID is gone on the host; anything else
needs `remote-ops unlock --force`, which writes the release to the host's
audit log.

Pure builders and parsers first; `take`, `read`, `release`, `release_held` and
`held` at the end are the only functions that talk to a host.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath

from .. import __version__
from ..core import shell
from ..errors import Refused, RemoteOpsError
from ..remote import Remote

#: Exit status of `take_cmd` when someone else holds the lock.
RC_HELD = 75


# -- the holder (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its `info` file says (fields may be empty for old or torn files)."""

    user: str = ""
    client: str = ""
    client_pid: int | None = None
    pid: int | None = None  # remote shell PID, when one command holds the lock
    when: str = ""
    what: str = ""
    tool: str = ""
    token: str = ""
    remote_pid_alive: bool | None = None  # from `read_cmd`, when `pid` is set

    def describe(self) -> str:
        """`alice on laptop (PID 4242) since 2026-...: deploy: why` for messages."""
        who = self.user or "unknown user"
        where = f" on {self.client}" if self.client else ""
        pid = f" (PID {self.client_pid})" if self.client_pid else (f" (host PID {self.pid})" if self.pid else "")
        since = f" since {self.when}" if self.when else ""
        return f"{who}{where}{pid}{since}: {self.what or 'no reason given'}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("token")
        return d


def _int(value: str | None) -> int | None:
    return int(value) if value and value.strip().isdigit() else None


def parse_info(text: str) -> Holder:
    """`info` file text (+ `remote_pid_alive=` from `read_cmd`) -> Holder (pure, lenient)."""
    kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    user, client = kv.get("user", ""), kv.get("client", "")
    if not user and "@" in kv.get("who", ""):  # older info files: who=user@client
        user, client = kv["who"].split("@", 1)
    alive = kv.get("remote_pid_alive")
    return Holder(
        user=user,
        client=client,
        client_pid=_int(kv.get("client_pid")),
        pid=_int(kv.get("pid")),
        when=kv.get("when", ""),
        what=kv.get("what", ""),
        tool=kv.get("tool", ""),
        token=kv.get("token", ""),
        remote_pid_alive=None if alive is None else alive == "1",
    )


def parse_read(status: int, text: str) -> Holder | None:
    """Output of `read_cmd` -> the holder, or None when the lock is free (pure)."""
    if status != 0 or "free" == text.strip():
        return None
    return parse_info(text)


def stale_reason(holder: Holder, this_client: str, pid_alive) -> str | None:
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


def take_cmd(lock_dir: str, info: str) -> str:
    """Atomic `mkdir` of the lock, then its `info`; exit RC_HELD (and print the holder) if held."""
    d = shell.quote(lock_dir)
    parent = shell.quote(str(PurePosixPath(lock_dir).parent))
    write = shell.redirect(["printf", "%s", info], stdout=f"{lock_dir}/info")
    return (
        f"mkdir -p {parent} && if mkdir {d} 2>/dev/null; then {write}; "
        f"else cat {d}/info 2>/dev/null; exit {RC_HELD}; fi"
    )


def read_cmd(lock_dir: str) -> str:
    """Print `info` (and whether a remote holder PID is alive), or `free` (read-only, never waits)."""
    d = shell.quote(lock_dir)
    return (
        f"if [ -d {d} ]; then cat {d}/info 2>/dev/null; echo; "
        f"p=$(sed -n 's/^pid=//p' {d}/info 2>/dev/null); "
        f'if [ -n "$p" ]; then [ -d /proc/$p ] && echo remote_pid_alive=1 || echo remote_pid_alive=0; fi; '
        f"else echo free; fi"
    )


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
        remove = f"if grep -qxF {shell.quote('token=' + token)} {d}/info 2>/dev/null; then rm -rf {d}; fi"
    if audit_log and audit is not None:
        return shell.seq(audit_append_cmd(audit_log, audit), remove)
    return remove


#: The lock as taken by one remote shell (patching's write script): `$lock` is the lock dir,
#: `$wait` the seconds to wait, `$info` the info text; `pid=$$` is added so a dead holder can
#: be proved stale on the host and broken.  The lock is removed when that shell exits (an EXIT
#: trap calling `release_lock`; a script that sets its own EXIT trap must call it too).
SHELL_TAKE_WAITING = r"""
if [ -n "$lock" ]; then
  end=$(( $(date +%s) + wait ))
  mkdir -p "$(dirname "$lock")"
  while ! mkdir "$lock" 2>/dev/null; do
    pid=$(sed -n 's/^pid=//p' "$lock/info" 2>/dev/null)
    if [ -n "$pid" ] && [ ! -d "/proc/$pid" ]; then
      mv "$lock" "$lock.stale.$$" 2>/dev/null && rm -rf "$lock.stale.$$" && echo "broke stale lock of dead pid $pid"
      continue
    fi
    [ "$(date +%s)" -ge "$end" ] && { echo "lock-held: $(tr '\n' '\t' < "$lock/info" 2>/dev/null)"; exit 75; }
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
def held_refusal(host, holder: Holder | None, what: str) -> Refused:
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


def take(remote: Remote, host, what: str) -> str:
    """Take the host lock (no waiting) and return its token, or raise `held_refusal`."""
    token = new_token()
    r = remote.run(take_cmd(host.lock_dir, info_text(what, token)), check=False)
    if r.exit_status == RC_HELD:
        raise held_refusal(host, parse_info(r.stdout) if r.stdout.strip() else None, what)
    if r.exit_status != 0:
        from ..errors import CommandFailed

        raise CommandFailed(
            f"lock: cannot create {host.lock_dir}",
            host=host.name,
            command=r.command,
            exit_status=r.exit_status,
            stderr_tail=r.stderr,
        )
    return token


def read(remote: Remote, host) -> Holder | None:
    """The current holder, or None (one read-only round trip)."""
    r = remote.run(read_cmd(host.lock_dir), check=False)
    return parse_read(r.exit_status, r.stdout)


def release(remote: Remote, host, token: str, audit: dict | None = None) -> None:
    """Release the lock we took (and append `audit` to the host's audit log)."""
    remote.run(release_cmd(host.lock_dir, token, host.audit_log if audit else None, audit))


def release_held(remote: Remote, host, holder: Holder, *, forced: bool, reason: str | None) -> None:
    """`remote-ops unlock`'s release: remove the lock `holder` holds (only that one, by its
    token, so a run that took the lock meanwhile keeps it) and append the release to the
    host's audit log (`forced`: released although not proved stale; `reason`: why it is stale)."""
    audit = audit_record("unlock", host.name, holder, forced=forced, reason=reason)
    remote.run(release_cmd(host.lock_dir, holder.token or None, host.audit_log, audit))


def recovery_hint(host) -> str:
    """What to do when a run could not release its lock (connection lost, host frozen)."""
    return (
        f"the host lock {host.lock_dir} may still be held by this run; once {host.name} answers, "
        f"`remote-ops unlock --host {host.name}` shows the holder and releases it (stale: this PID "
        f"{os.getpid()} is gone)"
    )


@contextmanager
def held(remote: Remote, host, what: str) -> Iterator[str]:
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


def _release_quietly(remote: Remote, host, token: str, exc: BaseException) -> None:
    try:
        release(remote, host, token)
    except RemoteOpsError:
        if isinstance(exc, RemoteOpsError):
            exc.hint = "; ".join(x for x in (exc.hint, recovery_hint(host)) if x)
