"""The host lock as probes: read who holds it, or take it (atomic `mkdir`), and parse its `info`.

The lock is a directory on the host (`HostSpec.lock_dir`) whose `info` file
says who holds it in `key=value` lines (`workflows.hostlock.info_text` writes
it).  `LockRead` prints that file (and whether a remote holder's PID is alive),
or `free`; `LockTake` makes the directory and writes `info`, or prints the
holder's `info` and exits `RC_HELD`.  Neither is ever bounded by a probe
deadline: a take killed half-way would leave a lock with no `info`.  The
lock's policy (stale proof, refusals, release, `held()`) is
`remote_ops.workflows.hostlock`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import PurePosixPath
from typing import Any

from ..core import shell
from .base import Probe

#: Exit status of `LockTake` when someone else holds the lock.
RC_HELD = 75
#: A lock's `info` is a few `key=value` lines; read only when it is a regular file this big.
LOCK_INFO_CAP = 64 << 10


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
    remote_pid_alive: bool | None = None  # from `LockRead`, when `pid` is set

    def describe(self) -> str:
        """`alice on laptop (PID 4242) since 2026-...: deploy: why` for messages."""
        who = self.user or "unknown user"
        where = f" on {self.client}" if self.client else ""
        pid = f" (PID {self.client_pid})" if self.client_pid else (f" (host PID {self.pid})" if self.pid else "")
        since = f" since {self.when}" if self.when else ""
        return f"{who}{where}{pid}{since}: {self.what or 'no reason given'}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token")
        return d


def _int(value: str | None) -> int | None:
    return int(value) if value and value.strip().isdigit() else None


def parse_info(text: str) -> Holder:
    """`info` file text (+ `remote_pid_alive=` from `LockRead`) -> Holder (pure, lenient)."""
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


class LockRead(Probe[Holder | None]):
    """Print `info` (and whether a remote holder PID is alive), or `free` (read-only, never waits)."""

    name = "lock"
    bounded = False

    def __init__(self, lock_dir: str) -> None:
        self.lock_dir = lock_dir

    def command(self) -> str:
        d = shell.quote(self.lock_dir)
        info = shell.small_file_command(self.lock_dir + "/info", LOCK_INFO_CAP)
        return (
            f"if [ -d {d} ]; then {info}; echo; "
            f"p=$({info} | sed -n 's/^pid=//p'); "
            f'if [ -n "$p" ]; then [ -d /proc/$p ] && echo remote_pid_alive=1 || echo remote_pid_alive=0; fi; '
            f"else echo free; fi"
        )

    def parse(self, status: int, text: str) -> Holder | None:
        return parse_read(status, text)


def parse_read(status: int, text: str) -> Holder | None:
    """`LockRead`'s output -> the holder, or None when the lock is free (or could not be read)."""
    if status != 0 or "free" == text.strip():
        return None
    return parse_info(text)


@dataclass(frozen=True)
class Taken:
    """What `LockTake` did: took the lock, or found it `held` by `holder` (None: no readable
    `info`); neither means the lock could not be made (its parent, a full disk)."""

    took: bool
    held: bool
    holder: Holder | None


class LockTake(Probe[Taken]):
    """Atomic `mkdir` of the lock, then its `info`; exit `RC_HELD` (and print the holder) if held."""

    name = "lock"
    bounded = False

    def __init__(self, lock_dir: str, info: str) -> None:
        self.lock_dir, self.info = lock_dir, info

    def command(self) -> str:
        d = shell.quote(self.lock_dir)
        parent = shell.quote(str(PurePosixPath(self.lock_dir).parent))
        write = shell.redirect(["printf", "%s", self.info], stdout=f"{self.lock_dir}/info")
        return (
            f"mkdir -p {parent} && if mkdir {d} 2>/dev/null; then {write}; "
            f"else {shell.small_file_command(self.lock_dir + '/info', LOCK_INFO_CAP)}; exit {RC_HELD}; fi"
        )

    def parse(self, status: int, text: str) -> Taken:
        took = status == 0
        holder = None if took or not text.strip() else parse_info(text)
        return Taken(took, status == RC_HELD, holder)
