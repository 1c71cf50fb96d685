"""The dump dir as the server writes into it: resolved once on the host, present, writable.

The inventory's `dump.dir` may be a symlink.  The rule, for every command
that uses it: the host resolves it ONCE (`realpath -e`), and that resolved
path is the one used and reported from then on (`extract start` gives it to
the client, `health` names it); entries inside are never followed.

`DumpDirState` asks the host in one probe; `DumpDir.problem` says why the
server cannot write its dumps there (missing, not a directory, not writable
by the SSH user, who is also the extraction client's user), and
`check_dump_dir` is `health`'s rule: a fail only while the server is up with
capture on, since only then is a missing dump dir losing data.

The same probe reads the dir's identity (`device:inode`) and birth time.
The server container is bind-mounted onto the dump dir as it was when the
container started: a dir removed and made again at the same path since is
another inode, and the container keeps writing into the deleted one, where
nothing reaches the host.  Deploy records the identity at create time as the
container label `labels.DUMP_DIR_ID`; `stale_mount` compares it with the dir
as it is now (deploy's plan recreates such a container, `check_dump_mount` is
`health`'s `dumps/mount`, and `extract start` refuses to start a client against
it: `replaced_mount` is the sentence both say).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import shell
from ..engine.labels import DUMP_DIR_ID
from ..engine.types import ContainerInfo, unix_time
from .base import Check, DumpDirProbe

#: What `DumpDir.problem` names, as `details.reason` of a refusal and `data.cause` of a check.
MISSING, NOT_A_DIR, NOT_WRITABLE = "dump_dir_missing", "dump_dir_not_a_directory", "dump_dir_not_writable"
#: What `stale_mount` names when the dir was removed and made again (the extraction client's word too).
REPLACED = "dump_dir_replaced"
#: `mount_of`'s word for a container that mounts the dump dir as it is now.
FRESH = "fresh"


@dataclass(frozen=True)
class DumpDir:
    """The configured dump dir, what the host resolved it to (None: it does not exist), and
    whether that is a directory the SSH user can write into."""

    configured: str
    resolved: str | None = None
    is_dir: bool = False
    writable: bool = False
    identity: str | None = None  # `device:inode` of the resolved dir (None: unknown)
    born: int | None = None  # its birth time, unix seconds (None: the filesystem does not say)

    @property
    def path(self) -> str:
        """The path to use and report: the resolved one when the host could resolve it."""
        return self.resolved or self.configured

    def named(self) -> str:
        """`/data/dumps`, or `/data/dumps (-> /mnt/a/dumps)` for a symlink."""
        if self.resolved and self.resolved != self.configured.rstrip("/"):
            return f"{self.configured} (-> {self.resolved})"
        return self.configured

    def problem(self) -> tuple[str, str] | None:
        """(cause, sentence) when the server cannot write its dumps here, else None (pure)."""
        if self.resolved is None:
            return MISSING, f"dump dir {self.configured} does not exist"
        if not self.is_dir:
            return NOT_A_DIR, f"dump dir {self.named()} is not a directory"
        if not self.writable:
            return NOT_WRITABLE, f"dump dir {self.named()} is not writable (by the SSH user)"
        return None


class DumpDirState(DumpDirProbe[DumpDir]):
    """`dir=0|1`, `writable=0|1`, `id=<device>:<inode> born=<birth, 0: unknown>` (when it resolves),
    then `resolved=<realpath>` (empty when it does not resolve)."""

    name = "dump_dir"

    def command(self) -> str:
        d, identity = shell.quote(self.dump_dir), shell.quote("id=%d:%i born=%W")
        return (
            f'r=$(realpath -e -- {d} 2>/dev/null) || r=""; '
            'if [ -n "$r" ] && [ -d "$r" ]; then echo dir=1; else echo dir=0; fi; '
            'if [ -n "$r" ] && [ -w "$r" ]; then echo writable=1; else echo writable=0; fi; '
            f'if [ -n "$r" ]; then stat -c {identity} -- "$r" 2>/dev/null; fi; '
            "printf 'resolved=%s\\n' \"$r\""
        )

    def parse(self, status: int, text: str) -> DumpDir:
        return parse_state(self.dump_dir, text)


def parse_state(configured: str, text: str) -> DumpDir:
    """`DumpDirState`'s output -> DumpDir (pure; the resolved path is everything after
    `resolved=`, so a name holding a newline stays whole)."""
    head, sep, rest = text.partition("resolved=")
    if not sep:
        return DumpDir(configured)
    flags = set(head.split())
    fields = dict(f.split("=", 1) for f in flags if "=" in f)
    resolved = rest[:-1] if rest.endswith("\n") else rest
    identity = fields.get("id", "")
    born = fields.get("born", "")
    return DumpDir(
        configured,
        resolved or None,
        "dir=1" in flags,
        "writable=1" in flags,
        identity if _is_identity(identity) else None,
        int(born) if born.isdigit() and int(born) > 0 else None,
    )


def _is_identity(text: str) -> bool:
    device, sep, inode = text.partition(":")
    return bool(sep) and device.isdigit() and inode.isdigit()


def check_dump_dir(state: DumpDir, server_up: bool, capturing: bool) -> Check | None:
    """`health`'s `dumps/dir`: a fail when the server is up with capture on and cannot write its
    dumps (missing, not a directory, not writable), naming the path; an ok naming the resolved
    path when the dump dir is a symlink; otherwise nothing (the growth check speaks)."""
    problem = state.problem()
    if problem and server_up and capturing:
        cause, sentence = problem
        return Check(
            "dumps",
            "dir",
            "fail",
            f"{sentence}: the running server cannot write its dumps (re-create it, then restart the "
            "server: a running one keeps writing into the deleted directory)",
            {"cause": cause, "dump_dir": state.configured, "resolved": state.resolved},
        )
    if not problem and state.resolved and state.path != state.configured.rstrip("/"):
        return Check("dumps", "dir", "ok", f"{state.named()}: the resolved path is used", {"resolved": state.resolved})
    return None


def mount_of(state: DumpDir, c: ContainerInfo | None) -> str | None:
    """How the running container `c`'s mount of the dump dir compares with the dir as it is now
    (pure): `FRESH`, `MISSING` (gone), `REPLACED` (removed and made again), or None (no running
    container, or it cannot be told).

    Fresh: the dir's identity is the one `c` recorded at create time (`labels.DUMP_DIR_ID`), or
    `c` (re)started a second or more after the dir was born (each start mounts the dir as it is
    then, so `container restart` after `mkdir -p` is a fix too).  Replaced: another identity than
    the one recorded, or no label and started before the dir was born.  Gone: only with a label
    (the SSH user could read the dir when the container was created).  No label and no birth
    time (the filesystem does not give one) cannot be told.  A label but no birth time reads a
    container restarted after the dir was made again as replaced: deploy then recreates it once
    more than needed, and never leaves a stale one."""
    if c is None or not c.running:
        return None
    recorded, after = c.labels.get(DUMP_DIR_ID), _started_after_birth(state, c)
    if state.resolved is None:
        return MISSING if recorded else None
    if state.identity is None:
        return None
    if recorded == state.identity or after is True:
        return FRESH
    return REPLACED if recorded or after is False else None


def _started_after_birth(state: DumpDir, c: ContainerInfo) -> bool | None:
    """True: `c` started a second or more after the dir was born; False: before it; None: the
    same second (birth times are whole seconds), or no birth or start time."""
    started = unix_time(c.started_at)
    if not started or state.born is None:
        return None
    if started >= state.born + 1:
        return True
    return False if started < state.born else None


def stale_mount(state: DumpDir, c: ContainerInfo | None) -> str | None:
    """Why the running container `c` does not mount the host's dump dir as it is now (deploy's
    reason to recreate it), or None (`mount_of`; pure)."""
    found = mount_of(state, c)
    if c is None or found not in (MISSING, REPLACED):
        return None
    if found == MISSING:
        return f"dump dir {state.configured} is gone since container {c.name} was created"
    return f"dump dir {state.named()} was removed and made again after container {c.name} started"


def replaced_mount(state: DumpDir, c: ContainerInfo | None) -> str | None:
    """The sentence for a running container `c` that still mounts a dump dir removed and made
    again since it started (`mount_of` says `REPLACED`), naming the dir, the container and both
    identities (the recorded one, the one now); None otherwise (pure).  `health`'s `dumps/mount`
    and `extract start`'s refusal say it."""
    if c is None or mount_of(state, c) != REPLACED:
        return None
    recorded = c.labels.get(DUMP_DIR_ID)
    return (
        f"{stale_mount(state, c)}: it still mounts the deleted one (device:inode {recorded or 'not recorded'}, "
        f"now {state.identity})"
    )


def check_dump_mount(state: DumpDir, c: ContainerInfo | None) -> Check | None:
    """`health`'s `dumps/mount`: a fail when the running server container still mounts a dump dir
    that was removed and made again (its dumps go into the deleted directory and never reach
    the host), an ok when its mount is the dir as it is now, nothing when the dir is gone
    (`dumps/dir` speaks), no container runs, or it cannot be told (`mount_of`; pure)."""
    found = mount_of(state, c)
    if c is None or found not in (FRESH, REPLACED):
        return None
    recorded = c.labels.get(DUMP_DIR_ID)
    data = {"dump_dir": state.path, "recorded": recorded, "now": state.identity}
    if found == FRESH:
        return Check("dumps", "mount", "ok", f"container {c.name} mounts {state.named()} as it is now", data)
    return Check(
        "dumps",
        "mount",
        "fail",
        f"{replaced_mount(state, c)}, so its dumps never reach the host; `remote-ops deploy` recreates the container",
        {"cause": REPLACED, **data},
    )
