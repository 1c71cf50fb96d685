"""What the host is: its OS, kernel, CPUs and memory (the `facts` command's first lines),
and its `python3` (the preflight of `facts`, `deploy` and `extract start`).

Each parser reads only a probe that succeeded: a failed probe's output (an
error message) parses as "unknown" (empty, None), never as a value.
`python_problem` is the python3 rule: missing, or older than 3.8, is named
with what needs it on the host.
"""

from __future__ import annotations

import re

from ..core import shell
from .base import Probe


def parse_os_release(text: str) -> str:
    m = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', text, re.M)
    return m.group(1) if m else ""


def parse_cpu(text: str) -> tuple[int | None, str]:
    lines = text.splitlines()
    count = int(lines[0]) if lines and lines[0].strip().isdigit() else None
    model = lines[1].split(":", 1)[1].strip() if len(lines) > 1 and ":" in lines[1] else ""
    return count, model


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    values = {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d{1,15}) kB", text, re.M)}
    return values.get("MemTotal"), values.get("MemAvailable")


class OsRelease(Probe[str]):
    """The distribution's pretty name (`/etc/os-release`)."""

    name = "os"

    def command(self) -> str:
        return shell.small_file_command("/etc/os-release")

    def parse(self, status: int, text: str) -> str:
        return parse_os_release(text if status == 0 else "")


class Kernel(Probe[str]):
    name = "kernel"

    def command(self) -> str:
        return "uname -srm"

    def parse(self, status: int, text: str) -> str:
        return text.strip() if status == 0 else ""


class Cpu(Probe[tuple[int | None, str]]):
    """(CPU count, model name)."""

    name = "cpu"

    def command(self) -> str:
        return "nproc; grep -m1 'model name' /proc/cpuinfo"

    def parse(self, status: int, text: str) -> tuple[int | None, str]:
        return parse_cpu(text if status == 0 else "")


class Memory(Probe[tuple[int | None, int | None]]):
    """(total, available) bytes of memory."""

    name = "mem"

    def command(self) -> str:
        return "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo"

    def parse(self, status: int, text: str) -> tuple[int | None, int | None]:
        return parse_meminfo(text if status == 0 else "")


# -- the host's python3: what runs the on-host tools ------------------------------------------------

#: The oldest python3 the on-host tools run on (`remote_ops/onhost/*`: stdlib only, Python 3.8+).
PYTHON_MIN = (3, 8)
#: What runs with the host's python3, named when it is missing or too old.
PYTHON_USERS = "the extraction client (`extract`), `dumps verify` and the SpecForge exporter (`dumps export`)"


class HostPython(Probe[tuple[tuple[int, ...] | None, str | None]]):
    """The host's `python3` on the SSH session's PATH: (version, None), or (None, why not)."""

    name = "python3"

    def command(self) -> str:
        return (
            "command -v python3 >/dev/null 2>&1 || { echo 'python3 not found on PATH'; exit 127; }; "
            "python3 -c 'import sys; print(\"%d.%d.%d\" % sys.version_info[:3])'"
        )

    def parse(self, status: int, text: str) -> tuple[tuple[int, ...] | None, str | None]:
        return parse_python(status, text)


def parse_python(status: int, text: str) -> tuple[tuple[int, ...] | None, str | None]:
    """`3.11.2` -> ((3, 11, 2), None); a failure -> (None, its last line)."""
    lines = text.strip().splitlines()
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", lines[-1].strip()) if status == 0 and lines else None
    if m:
        return tuple(int(x) for x in m.groups()), None
    return None, (lines[-1].strip() if lines else f"python3 exited {status}")


def python_problem(version: tuple[int, ...] | None, error: str | None) -> str | None:
    """Why the host's python3 cannot run the on-host tools, naming what needs it (None: it can)."""
    if version is None:
        return f"{error or 'python3 not found'}: {PYTHON_USERS} run with the host's python3"
    if version < PYTHON_MIN:
        have, want = ".".join(map(str, version)), ".".join(map(str, PYTHON_MIN))
        return f"python3 {have} is older than {want}, which {PYTHON_USERS} need on the host"
    return None
