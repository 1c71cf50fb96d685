"""Free space where the dumps go: `df` of the dump dir, or of its nearest existing parent."""

from __future__ import annotations

from ..core import shell
from .base import Probe


def existing_parent_df(path: str) -> str:
    """`df` of `path`, or of its nearest existing parent (the dump dir may not exist yet)."""
    return f'd={shell.quote(path)}; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -P -B1 "$d"'


def parse_df_free(text: str) -> int | None:
    """Available bytes from `df -P -B1` (POSIX format: 4th column of line 2)."""
    lines = text.strip().splitlines()
    if len(lines) < 2:
        return None
    cols = lines[-1].split()
    return int(cols[3]) if len(cols) >= 4 and cols[3].isdigit() else None


class DiskFree(Probe[int | None]):
    """Bytes free on the filesystem that holds (or will hold) `path`."""

    name = "disk"

    def __init__(self, path: str) -> None:
        self.path = path

    def command(self) -> str:
        return existing_parent_df(self.path)

    def parse(self, status: int, text: str) -> int | None:
        return parse_df_free(text) if status == 0 else None
