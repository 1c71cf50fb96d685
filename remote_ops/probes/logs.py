"""A host's log file, fetched from where the last pull stopped: the new bytes, byte-exact.

`FileFetch` is one round trip per chunk: it prints the file's identity
(`inode size start count`), then at most `max_bytes` new bytes, gzip + base64.
The host decides where to start from the pull's cursor (`core.logparse.FileCursor`):
same inode, size >= offset and the same first bytes (a copytruncate'd file that
regrew differs there): continue at the offset; otherwise start at 0.  So the
bytes always match the identity printed with them.  The cursors and the local
copies are `remote_ops.workflows.logs`.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass

from ..core import shell
from ..core.logparse import FileCursor
from .base import Probe

#: The first bytes of a file compared with the local copy's (sha256) to tell a regrown file.
HEAD_BYTES = 4096


@dataclass(frozen=True)
class FileChunk:
    """What one pull fetched of a file: the remote identity, where the bytes start, the bytes."""

    inode: str
    size: int
    start: int
    data: bytes


class FileFetch(Probe[FileChunk | None]):
    """The new bytes of `path` after `cursor`, at most `max_bytes`; None when the file is missing."""

    name = "fetch"

    def __init__(self, path: str, cursor: FileCursor, max_bytes: int) -> None:
        self.path, self.cursor, self.max_bytes = path, cursor, max_bytes

    def command(self) -> str:
        cursor = self.cursor
        known = shell.quote(cursor.inode or "-")
        k = min(cursor.offset, HEAD_BYTES)
        return (
            f'f={shell.quote(self.path)}; [ -f "$f" ] || {{ echo missing; exit 0; }}; '
            f"set -- $(stat -Lc '%i %s' \"$f\"); s=0; "
            f'if [ "$1" = {known} ] && [ "$2" -ge {int(cursor.offset)} ] && '
            f'[ "$(head -c {k} "$f" | sha256sum | cut -c1-64)" = {shell.quote(cursor.head or "-")} ]; '
            f"then s={int(cursor.offset)}; fi; "
            f"n=$(( $2 - s )); [ $n -le {int(self.max_bytes)} ] || n={int(self.max_bytes)}; "
            f'echo "$1 $2 $s $n"; tail -c +$((s + 1)) "$f" | head -c $n | gzip -1c | base64 -w0'
        )

    def parse(self, status: int, text: str) -> FileChunk | None:
        return parse_file_fetch(text)


def parse_file_fetch(output: str) -> FileChunk | None:
    """Parse `FileFetch` output (pure); None when the remote file does not exist.  ValueError
    when the bytes that came are not the count announced."""
    head, _, payload = output.partition("\n")
    if head.strip() == "missing":
        return None
    inode, size, start, count = head.split()
    data = zlib.decompress(base64.b64decode(payload.strip()), 31) if payload.strip() else b""
    if len(data) != int(count):
        raise ValueError(f"expected {count} bytes, got {len(data)}")
    return FileChunk(inode, int(size), int(start), data)
