"""What the host is: its OS, kernel, CPUs and memory (the `facts` command's first lines).

Each parser reads only a probe that succeeded: a failed probe's output (an
error message) parses as "unknown" (empty, None), never as a value.
"""

from __future__ import annotations

import re

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
        return "cat /etc/os-release"

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
