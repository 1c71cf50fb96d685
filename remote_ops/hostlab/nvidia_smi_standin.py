#!/usr/bin/env python3
"""STAND-IN nvidia-smi (and dmesg, journalctl) for the remote-ops host lab: there is no GPU here.

Installed by `remote_ops.hostlab.gpu_standin` into a lab host's own bin
directory, which is first on that host's SSH session PATH; the same file runs
as `nvidia-smi`, `dmesg` and `journalctl` (by the name it was called as).  It
answers from `nvidia-smi.json` beside it, which the tests (or `python -m
remote_ops.hostlab.gpu_standin`) write: the GPUs' field values, the row
remapper, compute processes and the kernel log.  Standard library only.

What it imitates of the real tools (NVIDIA's documentation of the query
fields, `nvidia-smi --help-query-gpu`):

- `nvidia-smi --query-gpu=F1,F2,... --format=csv[,noheader][,nounits]`: one line
  per GPU, the values in the order asked, separated by ", "; `[N/A]` for a field
  the GPU does not report, `[Not Supported]` where the case says so; units
  (`MiB`, `%`, `W`, `MHz`) unless `nounits`; a header line unless `noheader`.
  Field aliases as the real tool takes them (`name`/`gpu_name`,
  `clocks_throttle_reasons.*` = `clocks_event_reasons.*`,
  `pcie.link.gen.current` = `pcie.link.gen.gpucurrent`).  An unknown field
  prints `Field "F" is not a valid field to query.` and exits 2; with
  `"legacy": true` (an older driver) the newer names are unknown too.
- `--query-compute-apps=...` and `--query-remapped-rows=...` likewise.
- A case with `"fail"` prints that message and exits with its code (e.g. the
  driver not loaded: exit 9).
- `dmesg` prints the case's kernel log as `[seconds since boot] text`, the
  stamp computed from each entry's wall-clock time and this machine's boot
  time (/proc/stat btime); `"kernel_log_denied": true` makes `dmesg` fail as
  under `kernel.dmesg_restrict` and `journalctl` print nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time

STATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvidia-smi.json")

UNITS = {
    "memory.total": "MiB",
    "memory.used": "MiB",
    "memory.free": "MiB",
    "memory.reserved": "MiB",
    "utilization.gpu": "%",
    "utilization.memory": "%",
    "fan.speed": "%",
    "power.draw": "W",
    "power.limit": "W",
    "clocks.sm": "MHz",
    "clocks.mem": "MHz",
    "clocks.gr": "MHz",
    "used_memory": "MiB",
    "used_gpu_memory": "MiB",
}
ALIASES = {
    "gpu_name": "name",
    "gpu_bus_id": "pci.bus_id",
    "gpu_uuid": "uuid",
    "gpu_serial": "serial",
    "pcie.link.gen.current": "pcie.link.gen.gpucurrent",
    "clocks.current.sm": "clocks.sm",
    "clocks.current.memory": "clocks.mem",
    "clocks.current.graphics": "clocks.gr",
    "retired_pages.sbe": "retired_pages.single_bit_ecc.count",
    "retired_pages.dbe": "retired_pages.double_bit.count",
}
#: Names an older driver (`"legacy": true`) does not know.
NEW_NAMES = ("clocks_event_reasons.", "pcie.link.gen.gpucurrent", "pcie.link.gen.gpumax", "pcie.link.gen.hostmax")
GPU_FIELDS = {
    "index", "name", "pci.bus_id", "uuid", "serial", "driver_version", "count", "timestamp",
    "persistence_mode", "pstate", "compute_cap", "temperature.gpu", "utilization.gpu", "utilization.memory",
    "memory.total", "memory.used", "memory.free", "memory.reserved", "power.draw", "power.limit", "fan.speed",
    "pcie.link.gen.gpucurrent", "pcie.link.gen.max", "pcie.link.gen.gpumax", "pcie.link.gen.hostmax",
    "pcie.link.width.current", "pcie.link.width.max", "ecc.mode.current",
    "ecc.errors.uncorrected.volatile.total", "ecc.errors.corrected.volatile.total",
    "ecc.errors.uncorrected.aggregate.total", "retired_pages.pending",
    "retired_pages.single_bit_ecc.count", "retired_pages.double_bit.count",
    "clocks.sm", "clocks.mem", "clocks.gr",
}  # fmt: skip
REASONS = (
    "supported", "active", "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown",
    "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown", "sync_boost",
    "display_clock_setting",
)  # fmt: skip
GPU_FIELDS |= {f"clocks_event_reasons.{r}" for r in REASONS}
APP_FIELDS = {"pid", "process_name", "used_memory", "used_gpu_memory", "gpu_uuid", "gpu_bus_id", "gpu_name"}
REMAP_FIELDS = {
    "gpu_bus_id", "gpu_uuid", "gpu_name", "gpu_serial", "timestamp", "remapped_rows.correctable",
    "remapped_rows.uncorrectable", "remapped_rows.pending", "remapped_rows.failure",
}  # fmt: skip


def canonical(name: str) -> str:
    name = ALIASES.get(name, name)
    return name.replace("clocks_throttle_reasons.", "clocks_event_reasons.")


def load() -> dict:
    with open(STATE) as fh:
        return json.load(fh)


def options(argv: list[str]) -> dict[str, str]:
    out = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        out[key] = value
    return out


def invalid(field: str) -> int:
    print(f'Field "{field}" is not a valid field to query.')
    print()
    return 2


def render(rows: list[dict], fields: list[str], fmt: set[str]) -> None:
    if "noheader" not in fmt:
        print(", ".join(f + (f" [{UNITS[canonical(f)]}]" if canonical(f) in UNITS else "") for f in fields))
    for row in rows:
        values = []
        for f in fields:
            value = row.get(canonical(f))
            value = "[N/A]" if value is None else str(value)
            unit = UNITS.get(canonical(f))
            if unit and "nounits" not in fmt and not value.startswith("["):
                value = f"{value} {unit}"
            values.append(value)
        print(", ".join(values))


def _fields(query: str, known) -> tuple[list[str], str | None]:
    """A `--query-*=a,b` list's fields, and the first one not `known` (None: all known)."""
    fields = query.split(",")
    return fields, next((f for f in fields if f not in known), None)


def nvidia_smi(argv: list[str]) -> int:
    state = load()
    if state.get("fail"):
        print(state["fail"]["text"])
        return int(state["fail"]["rc"])
    opts = options(argv)
    fmt = set(opts.get("--format", "").split(","))
    if "csv" not in fmt and any(k.startswith("--query") for k in opts):
        print('"--format" must be specified with "--query-*" options (STAND-IN: csv only).')
        return 2
    gpus = state["gpus"]
    common = {
        "driver_version": state["driver"],
        "count": len(gpus),
        "timestamp": time.strftime("%Y/%m/%d %H:%M:%S.000"),
    }
    if "--query-gpu" in opts:
        fields = opts["--query-gpu"].split(",")
        for f in fields:
            legacy_unknown = state.get("legacy") and f.startswith(NEW_NAMES)
            if canonical(f) not in GPU_FIELDS or legacy_unknown:
                return invalid(f)
        render([{**common, **g} for g in gpus], fields, fmt)
        return 0
    if "--query-compute-apps" in opts:
        fields, bad = _fields(opts["--query-compute-apps"], APP_FIELDS)
        if bad:
            return invalid(bad)
        by_index = {g["index"]: g for g in gpus}
        rows = []
        for p in state.get("processes", []):
            g = by_index.get(p.get("gpu", 0), {})
            used = p.get("used_memory")
            rows.append(
                {
                    "pid": p["pid"],
                    "process_name": p.get("name", "python3"),
                    "used_memory": used,
                    "used_gpu_memory": used,
                    "uuid": g.get("uuid"),
                    "pci.bus_id": g.get("pci.bus_id"),
                    "name": g.get("name"),
                }
            )
        render(rows, fields, fmt)
        return 0
    if "--query-remapped-rows" in opts:
        fields, bad = _fields(opts["--query-remapped-rows"], REMAP_FIELDS)
        if bad:
            return invalid(bad)
        render([{**common, **g} for g in gpus], fields, fmt)
        return 0
    print(f"STAND-IN nvidia-smi (remote_ops.hostlab): {len(gpus)} GPUs, driver {state['driver']}; no GPU here")
    return 0


def boot_time() -> float:
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("btime "):
                return float(line.split()[1])
    return time.time() - float(open("/proc/uptime").read().split()[0])


def dmesg(journal: bool) -> int:
    state = load()
    if state.get("kernel_log_denied"):
        if journal:
            return 0  # journalctl -q without access to the kernel's entries: nothing
        print("dmesg: read kernel buffer failed: Operation not permitted")
        return 1
    boot = boot_time()
    for entry in state.get("kernel_log", []):
        stamp = max(0.0, float(entry["at"]) - boot)
        print(f"[{stamp:12.6f}] {'kernel: ' if journal else ''}{entry['text']}")
    return 0


def main() -> int:
    called = os.path.basename(sys.argv[0])
    if called == "dmesg":
        return dmesg(journal=False)
    if called == "journalctl":
        return dmesg(journal=True)
    return nvidia_smi(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
