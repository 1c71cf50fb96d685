"""Which side of the SSH link a path option names (pure): here, unless marked as on the host.

The one rule every path-taking option follows, as scp reads its arguments:

- `host:PATH` is PATH on the selected host (the literal prefix `host:`, since the
  host itself is already named by `--host`);
- anything else is a path on this machine: `./host:x` (a `/` before the
  colon) is a local file called `host:x`, as scp treats `./a:b`;
- options documented as host-side (`train start --data`, `spec deploy --draft`,
  `dataset prepare -o` with `--on-host`) take host paths without the prefix, and
  accept it too.

An option says whether it takes a host path at all (`host_ok`) and what a local
path must be (an existing file, an existing directory, or anything: an output).
`problem` decides from what the caller observed of the local path (`Seen`), so
the check is done before any connection and the decision stays testable
without a filesystem.  A missing local file is a usage error (exit 2), as
click's own `exists=True` paths are; what a file *contains* stays a config
error (exit 3), checked by the command that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The prefix that marks a path on the host.
HOST_PREFIX = "host:"

Want = Literal["file", "dir", "any"]


@dataclass(frozen=True)
class PathRef:
    """A path option's value: `path` (the prefix removed) and the side it is on."""

    path: str
    on_host: bool = False

    def __str__(self) -> str:
        return f"{HOST_PREFIX}{self.path}" if self.on_host else self.path


@dataclass(frozen=True)
class Seen:
    """What the caller found at a local path (one `stat`): nothing, a file, or a directory."""

    exists: bool
    is_dir: bool = False


def parse(value: str) -> PathRef:
    """`host:PATH` -> PathRef(PATH, on_host=True); any other value is local."""
    if value.startswith(HOST_PREFIX):
        return PathRef(value[len(HOST_PREFIX) :], on_host=True)
    return PathRef(value)


def problem(ref: PathRef, *, host_ok: bool, want: Want, seen: Seen | None = None) -> str | None:
    """Why `ref` is not acceptable for an option, or None.  `seen` is what the caller found at
    the local path (needed only for a local `ref` with `want` "file" or "dir")."""
    if ref.on_host:
        if not host_ok:
            return f"takes a path on this machine; {HOST_PREFIX}PATH (a path on the host) is not accepted here"
        return None if ref.path else f"{HOST_PREFIX} needs a path after it"
    if not ref.path:
        return "empty path"
    if want == "any":
        return None
    if seen is None or not seen.exists:
        where = f" (a path on the host is written {HOST_PREFIX}{ref.path})" if host_ok else ""
        return f"{want} {ref.path!r} does not exist here{where}"
    if want == "file" and seen.is_dir:
        return f"{ref.path!r} is a directory, not a file"
    if want == "dir" and not seen.is_dir:
        return f"{ref.path!r} is not a directory"
    return None
