"""NVIDIA Xid events in the host's kernel log since the server container started.

`KernelXids` reads the kernel log where the SSH user may (`dmesg`, else
`journalctl -k -b -o short-monotonic`) and keeps only the driver's Xid lines
(`NVRM: Xid (PCI:0000:3b:00): 79, pid=…, GPU has fallen off the bus.`), with
the boot time (`btime` of /proc/stat) that turns their `[seconds since boot]`
stamps into wall-clock time.  An unreadable kernel log (`dmesg: read kernel
buffer failed: Operation not permitted` under `kernel.dmesg_restrict`, no
journal access) is not a fault: the check is skipped and says why.

The rule (`check_xid`, check `gpus/xid`): the Xids logged since the container
started (since boot when there is no container; a line without a time stamp
counts):

- none: **ok**;
- any whose code is in `FATAL_XIDS`: **fail**.  These are the Xids NVIDIA's
  Xid catalog resolves with a GPU reset, a reboot or service rather than an
  application restart (docs.nvidia.com/deploy/xid-errors, "Resolution Bucket
  (Immediate Action)"; NVIDIA Health Validation's Xid checks drain on 46 and
  48): 46 GPU stopped processing, 48 double-bit ECC, 62 internal
  micro-controller halt, 64 row remapping / page retirement failure, 74
  NVLink error, 79 GPU fallen off the bus, 92 high single-bit ECC rate, 95
  uncontained ECC error, 119/120 GSP timeout/error, 140 unrecovered ECC, 154
  GPU recovery action changed;
- any other (13, 31, 43, 45, 63, 94, …: mostly an application's fault, or a
  repair already recorded): **warn**.

Without an NVIDIA driver there is no check (`gpus/count` says why).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .base import Check, Output, Probe, last_line
from .gpuhealth import bus_key

#: Xids whose NVIDIA resolution is a GPU reset, a reboot or service (see the module doc).
FATAL_XIDS = frozenset({46, 48, 62, 64, 74, 79, 92, 95, 119, 120, 140, 154})
_XID = re.compile(r"(?:\[\s*(\d+(?:\.\d+)?)\])?.*?NVRM: Xid \((PCI:[0-9A-Fa-f:.]+)\): (\d+),\s*(.*)")
MAX_LINES = 200  # the host sends at most the last this many Xid lines


@dataclass(frozen=True)
class Xid:
    code: int
    pci: str  # PCI:dddd:bb:dd as the driver writes it
    text: str  # the rest of the line (pid, name, description)
    at: float | None  # unix seconds (boot time + the stamp), None when the line has no stamp


@dataclass(frozen=True)
class XidLog:
    """The kernel log's Xid lines, or why it could not be read (`unreadable`)."""

    xids: tuple[Xid, ...] = ()
    source: str = ""
    unreadable: str | None = None
    boot: float | None = None
    lines: int = 0  # Xid lines the host found (the last MAX_LINES are sent)


class KernelXids(Probe[XidLog]):
    """The kernel log's `NVRM: Xid` lines (dmesg, else journalctl -k), with the boot time; not read
    on a host without nvidia-smi (exit 127: no NVIDIA driver, no Xids)."""

    name = "xid"
    absent = (3, "unreadable: not asked")

    def command(self) -> str:
        return (
            "command -v nvidia-smi >/dev/null || { echo 'no NVIDIA driver'; exit 127; }; "
            "echo \"boot $(awk '/^btime /{print $2}' /proc/stat 2>/dev/null)\"; "
            'if log=$(dmesg 2>&1); then echo "source dmesg"; '
            'elif j=$(journalctl -k -b -o short-monotonic --no-pager -q 2>&1) && [ -n "$j" ]; then '
            'log=$j; echo "source journalctl -k"; '
            'else echo "unreadable: $(printf \'%s\\n\' "$log" | tail -n 1)"; exit 3; fi; '
            "x=$(printf '%s\\n' \"$log\" | grep -F 'NVRM: Xid'); "
            'echo "lines $(printf \'%s\' "$x" | grep -c .)"; '
            f"printf '%s\\n' \"$x\" | tail -n {MAX_LINES}; exit 0"
        )

    def parse(self, status: int, text: str) -> XidLog:
        return parse_xids(status, text)


def parse_xids(status: int, text: str) -> XidLog:
    """The probe's output -> its Xids (pure)."""
    boot, source, count, xids = None, "", 0, []
    for line in text.splitlines():
        if line.startswith("boot "):
            value = line[5:].strip()
            boot = float(value) if value.isdigit() else None
        elif line.startswith("source "):
            source = line[7:].strip()
        elif line.startswith("lines ") and line[6:].strip().isdigit():
            count = int(line[6:].strip())
        elif line.startswith("unreadable: "):
            return XidLog(source=source, unreadable=line[12:].strip() or "no output", boot=boot)
        elif m := _XID.search(line):
            at = boot + float(m[1]) if m[1] is not None and boot is not None else None
            xids.append(Xid(int(m[3]), m[2], m[4].strip(), at))
    if status != 0:
        return XidLog(source=source, unreadable=last_line(text), boot=boot)
    return XidLog(tuple(xids), source, None, boot, max(count, len(xids)))


@dataclass(frozen=True)
class XidWindow:
    """Since when Xids count: the container's start (unix seconds), or since boot (None)."""

    since: float | None = None
    what: str = "since boot"
    gpu_by_pci: dict[str, int] = field(default_factory=dict)  # bus key -> GPU index, for the message


def window(started_at: float | None, gpu_by_pci: dict[str, int] | None = None) -> XidWindow:
    """The window for a container that started at `started_at` (unix seconds; None or 0: none)."""
    if not started_at or started_at <= 0:
        return XidWindow(gpu_by_pci=gpu_by_pci or {})
    when = datetime.fromtimestamp(started_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    return XidWindow(started_at, f"since the container started ({when})", gpu_by_pci or {})


def check_xid(probe: Output, win: XidWindow, driver: bool = True) -> list[Check]:
    """Xids in the window: fatal codes fail, others warn, none ok; unreadable log: skip."""
    if not driver:
        return []
    log = parse_xids(*probe)
    if log.unreadable is not None:
        return [
            Check(
                "gpus",
                "xid",
                "skip",
                f"kernel log not readable ({log.unreadable}): dmesg needs root or kernel.dmesg_restrict=0, "
                "journalctl -k the systemd-journal or adm group",
            )
        ]
    seen = [x for x in log.xids if win.since is None or x.at is None or x.at >= win.since]
    data = {"source": log.source, "xids": [x.code for x in seen], "window": win.what}
    if not seen:
        return [Check("gpus", "xid", "ok", f"no Xid in the kernel log ({log.source}) {win.what}", data)]
    fatal = [x for x in seen if x.code in FATAL_XIDS]
    shown = ", ".join(_describe(x, win) for x in (fatal or seen)[:4])
    more = f" (+{len(seen) - 4} more)" if len(seen) > 4 else ""
    if fatal:
        return [Check("gpus", "xid", "fail", f"{len(seen)} Xid(s) {win.what}: {shown}{more}", data)]
    return [Check("gpus", "xid", "warn", f"{len(seen)} Xid(s) {win.what}: {shown}{more}", data)]


def _describe(x: Xid, win: XidWindow) -> str:
    gpu = win.gpu_by_pci.get(bus_key(x.pci))
    where = f"GPU{gpu}" if gpu is not None else x.pci
    text = x.text if len(x.text) <= 80 else x.text[:77] + "..."
    return f"Xid {x.code} on {where} ({text})"
