"""`read_small_file`: the one way a small host file (a config.json, a run record) reaches the laptop.

A host decides what its files are: a config.json may be a FIFO (a reader blocks in `open()`
forever), a symlink to /dev/zero (a `cat` streams without end: 2.38 GB on the laptop before its
deadline), or simply huge.  This reads a file only when it is a regular file of at most `cap`
bytes, checked on the host before it is opened (`core.shell.read_small_file`), under the
command's deadline, which ends the host's process too (`core.shell.deadline`, applied by the
seam to every command).  What it refuses is typed: `UnsafeHostFile` (exit 9, `not_regular` or
`too_large`, naming the file and the cap), `NotFound` (exit 13) when it is missing.

A probe that reads a small file inside a batched round trip uses the same command
(`core.shell.read_small_file`) and the same verdict (`small_file_error`).
"""

from __future__ import annotations

from ..core import shell
from ..errors import CommandFailed, NotFound, RemoteOpsError, UnsafeHostFile, tail
from .base import Remote


def small_file_error(status: int, stderr: str, path: str, cap: int, host: str | None) -> RemoteOpsError | None:
    """The typed error for `read_small_file`'s exit status (None: read fine); pure."""
    problem = shell.small_file_problem(status)
    where = f"{host}:{path}" if host else path
    if problem == "missing":
        return NotFound(f"{path} does not exist", host=host, details={"path": path})
    if problem == "not_regular":
        return UnsafeHostFile(
            f"{path} is not a regular file (a FIFO, a device, a directory or a symlink to one); not read",
            host=host,
            hint=f"replace {where} with a regular file",
            details={"reason": "not_regular", "path": path, "cap": cap},
        )
    if problem == "too_large":
        size = stderr.strip().split(" ", 1)[0]
        return UnsafeHostFile(
            f"{path} is larger than its cap of {cap} bytes ({size} bytes); not read",
            host=host,
            hint=f"{where} should be a small file; check what wrote it",
            details={"reason": "too_large", "path": path, "cap": cap, "size": int(size) if size.isdigit() else None},
        )
    if status != 0:
        return CommandFailed(
            f"cannot read {path} (exit {status}): {tail(stderr, 1)}",
            host=host,
            command=f"read {path}",
            exit_status=status,
            stderr_tail=tail(stderr),
        )
    return None


def read_small_file(
    remote: Remote,
    path: str,
    cap: int = shell.SMALL_FILE_CAP,
    *,
    timeout: float | None = None,
    missing_ok: bool = False,
) -> str | None:
    """The text of the regular host file `path` (UTF-8, invalid bytes replaced), at most `cap`
    bytes of it; None when it is missing and `missing_ok`.  Raises UnsafeHostFile (not regular / over the cap), NotFound, CommandFailed,
    CommandTimedOut (the host's process ends with the deadline too)."""
    result = remote.run(shell.read_small_file(path, cap), timeout=timeout, check=False)
    error = small_file_error(result.exit_status, result.stderr, path, cap, remote.name)
    if isinstance(error, NotFound) and missing_ok:
        return None
    if error is not None:
        raise error
    return result.stdout
