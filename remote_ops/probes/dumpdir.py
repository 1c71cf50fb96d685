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
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import shell
from .base import Check, DumpDirProbe

#: What `DumpDir.problem` names, as `details.reason` of a refusal and `data.cause` of a check.
MISSING, NOT_A_DIR, NOT_WRITABLE = "dump_dir_missing", "dump_dir_not_a_directory", "dump_dir_not_writable"


@dataclass(frozen=True)
class DumpDir:
    """The configured dump dir, what the host resolved it to (None: it does not exist), and
    whether that is a directory the SSH user can write into."""

    configured: str
    resolved: str | None = None
    is_dir: bool = False
    writable: bool = False

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
    """`dir=0|1`, `writable=0|1`, then `resolved=<realpath>` (empty when it does not resolve)."""

    name = "dump_dir"

    def command(self) -> str:
        d = shell.quote(self.dump_dir)
        return (
            f'r=$(realpath -e -- {d} 2>/dev/null) || r=""; '
            'if [ -n "$r" ] && [ -d "$r" ]; then echo dir=1; else echo dir=0; fi; '
            'if [ -n "$r" ] && [ -w "$r" ]; then echo writable=1; else echo writable=0; fi; '
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
    resolved = rest[:-1] if rest.endswith("\n") else rest
    return DumpDir(configured, resolved or None, "dir=1" in flags, "writable=1" in flags)


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
