"""The SGLang tree on the host: its release, and the file the patch targets (sha256, lines)."""

from __future__ import annotations

import re

from ..core import shell
from .base import Probe


def parse_sglang_version(text: str) -> str | None:
    """A top-level `__version__ = "X"` (version.py of old releases, or _version.py of 0.5.x).

    Only column-0 assignments count: 0.5.x's version.py has an indented
    fallback `__version__ = "0.0.0.dev0"` that is not the release.
    """
    m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", text, re.M)
    return m.group(1) if m else None


class SglangVersion(Probe[str | None]):
    """The release of the checkout's `python/sglang/` (`version.py`, then `_version.py`)."""

    name = "sglang_version"

    def __init__(self, checkout: str) -> None:
        self.package = checkout.rstrip("/") + "/python/sglang/"

    def command(self) -> str:
        return shell.seq(
            shell.small_file_command(self.package + "version.py"),
            shell.small_file_command(self.package + "_version.py"),
        )

    def parse(self, status: int, text: str) -> str | None:
        return parse_sglang_version(text)


#: (sha256, line count, error): the error set when the file could not be read.
TargetRead = tuple[str | None, int | None, str | None]


class PatchTarget(Probe[TargetRead]):
    """sha256 and line count of the file the patch targets (`sha256 of FILE && wc -l < FILE`)."""

    name = "target"

    def __init__(self, path: str) -> None:
        self.path = path

    def command(self) -> str:
        return shell.and_then(shell.sha256_of(self.path), shell.read_stdin(["wc", "-l"], self.path))

    def parse(self, status: int, text: str) -> TargetRead:
        return parse_target(status, text)


def parse_target(status: int, text: str) -> TargetRead:
    """`sha256 of FILE && wc -l < FILE` -> (sha, lines, error)."""
    if status != 0:
        return None, None, (text.strip().splitlines() or ["cannot read target file"])[-1]
    lines = text.strip().splitlines()
    sha = lines[0].split()[0] if lines else None
    count = int(lines[1].split()[0]) if len(lines) > 1 and lines[1].split()[0].isdigit() else None
    return sha, count, None
