"""Host-provided relative paths (pure): what a host names never becomes a local path unchecked.

A host's listing, a dump manifest's `file` field, a rank directory: each is a
name the host chose, and a hostile or broken host can choose `../x`,
`/etc/x`, or a name with a newline that a line-based listing would read as
two entries.  Before any such name is joined to a local root (`dumps pull
--dest`) or, later, to another host's root (a host-to-host sync), it must pass
`problem`, the one check, the rules rsync and tar apply when they receive:

- not empty, a string;
- not absolute (`/x`);
- no `..` component, no `.` component, no empty component (`a//b`, `a/`);
- no control character (C0 incl. newline and tab, DEL, C1: U+0080-U+009F,
  some terminals obey U+009B as CSI); names from a listing must also be UTF-8.

A name that passes is lexically inside any root it is joined to.  The edge
that writes (`remote_ops.remote.transfer`) also checks the *resolved* local
path, since a local symlink could still point out of the root.

An offending name is reported as an `Unsafe` entry: named (exactly; the console
shows its control characters), skipped, and the pull exits non-zero.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

#: C0 (newline and tab included), DEL, C1.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class UnsafeName(ValueError):
    """A host-provided name that must not become a local path (`problem` says why)."""

    def __init__(self, name: object, reason: str) -> None:
        self.name, self.reason = name, reason
        super().__init__(f"{name!r}: {reason}")


@dataclass(frozen=True)
class Unsafe:
    """One refused name and why; `entry` is how reports list it (`<name>: <reason>`)."""

    name: str
    reason: str

    @property
    def entry(self) -> str:
        return f"{self.name}: {self.reason}"


def problem(name: object) -> str | None:
    """Why `name` may not be used as a relative path under a root, or None when it may."""
    if not isinstance(name, str):
        return "not a string"
    if not name:
        return "empty name"
    if _CONTROL.search(name):
        return "control character"
    if name.startswith("/"):
        return "absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "'..' component"
    if "" in parts:
        return "empty component"
    if "." in parts:
        return "'.' component"
    return None


def local_path(root: Path, name: object) -> Path:
    """`root / name` for a name that passes `problem`; else `UnsafeName`.  Lexical (no I/O)."""
    reason = problem(name)
    if reason is not None:
        raise UnsafeName(name, reason)
    assert isinstance(name, str)
    return root.joinpath(*PurePosixPath(name).parts)


def decode_name(raw: bytes) -> tuple[str, str | None]:
    """A listed name's bytes as text and its problem; bytes that are not UTF-8 are shown as
    `\\xNN` and refused ("not UTF-8": the local name could not be the host's)."""
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), "not UTF-8"
    return name, problem(name)
