"""STAND-IN GPUs for lab hosts: healthy and faulty cases for the fake `nvidia-smi`.

There is no GPU on the lab machine, so `health`'s GPU checks would only ever
see "no NVIDIA driver".  `install(bin_dir, case)` puts the stand-in script
(`nvidia_smi_standin.py`) into a lab host's own bin directory (first on that
host's SSH session PATH, `HostPaths.bin`) as `nvidia-smi`, `dmesg` and
`journalctl`, with the case beside it (`nvidia-smi.json`); `remove(bin_dir)`
takes them away again (the host has no NVIDIA driver then, as before).

A case is plain data: `case(name)` gives one of `CASES`, each a healthy
8-GPU RTX PRO 6000 Blackwell host (driver 580.95.05, PCIe Gen5 x16,
persistence on, busy at 85 %) with one fault applied.  The values are what the
real tool prints (`[N/A]` for retired pages on a row-remapping GPU,
`Active`/`Not Active`, `Enabled`/`Disabled`, `Yes`/`No`).

From a shell (e.g. for the sandbox, whose lab lives in the sandbox dir)::

    python -m remote_ops.hostlab.gpu_standin --host sandbox --case degraded-link
    python -m remote_ops.hostlab.gpu_standin --host sandbox --off
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..probes import gpuhealth

SCRIPT = Path(__file__).with_name("nvidia_smi_standin.py")
NAMES = ("nvidia-smi", "dmesg", "journalctl")
STATE = "nvidia-smi.json"
GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
DRIVER = "580.95.05"
#: The reasons `health` queries, and two it does not (the real tool prints them all).
REASONS = (*gpuhealth.REASONS, "sync_boost", "display_clock_setting")


def bus_id(index: int) -> str:
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


def healthy_gpu(index: int) -> dict:
    """One busy, healthy GPU's field values as nvidia-smi prints them (nounits)."""
    gpu = {
        "index": index,
        "name": GPU_NAME,
        "pci.bus_id": bus_id(index),
        "uuid": f"GPU-5a4d0c1e-0000-4000-8000-{index:012d}",
        "serial": f"17925250{index:05d}",
        "persistence_mode": "Enabled",
        "pstate": "P0",
        "compute_cap": "12.0",
        "temperature.gpu": 61,
        "utilization.gpu": 85,
        "utilization.memory": 40,
        "memory.total": 97887,
        "memory.used": 81234,
        "memory.free": 16653,
        "power.draw": "455.31",
        "power.limit": "600.00",
        "fan.speed": "[N/A]",
        "pcie.link.gen.gpucurrent": 5,
        "pcie.link.gen.max": 5,
        "pcie.link.gen.gpumax": 5,
        "pcie.link.gen.hostmax": 5,
        "pcie.link.width.current": 16,
        "pcie.link.width.max": 16,
        "ecc.mode.current": "Enabled",
        "ecc.errors.uncorrected.volatile.total": 0,
        "ecc.errors.corrected.volatile.total": 0,
        "ecc.errors.uncorrected.aggregate.total": 0,
        "retired_pages.pending": "[N/A]",  # Blackwell repairs memory by row remapping
        "retired_pages.single_bit_ecc.count": "[N/A]",
        "retired_pages.double_bit.count": "[N/A]",
        "remapped_rows.correctable": 0,
        "remapped_rows.uncorrectable": 0,
        "remapped_rows.pending": "No",
        "remapped_rows.failure": "No",
        "clocks.sm": 2430,
        "clocks.mem": 14001,
        "clocks.gr": 2430,
        "clocks_event_reasons.supported": "0x00000000000001FF",
        "clocks_event_reasons.active": "0x0000000000000000",
    }
    gpu.update({f"clocks_event_reasons.{r}": "Not Active" for r in REASONS})
    return gpu


def healthy(gpus: int = 8) -> dict:
    """A healthy host: `gpus` busy GPUs, nothing in the kernel log but the driver's load line."""
    return {
        "standin": "remote_ops.hostlab STAND-IN nvidia-smi: there is no GPU here",
        "driver": DRIVER,
        "legacy": False,
        "gpus": [healthy_gpu(i) for i in range(gpus)],
        "processes": [],
        "kernel_log": [
            {"at": time.time() - 3600, "text": f"NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER}"}
        ],
    }


def _set(index: int, **values: object) -> Callable[[dict], None]:
    def apply(case: dict) -> None:
        case["gpus"][index].update({k.replace("__", "."): v for k, v in values.items()})

    return apply


def _reason(index: int, *reasons: str) -> Callable[[dict], None]:
    def apply(case: dict) -> None:
        case["gpus"][index].update({f"clocks_event_reasons.{r}": "Active" for r in reasons})

    return apply


def _xid(code: int, text: str, ago_s: float = 60.0, index: int = 3) -> Callable[[dict], None]:
    def apply(case: dict) -> None:
        pci = case["gpus"][index]["pci.bus_id"]
        short = f"PCI:0000:{pci.split(':')[1].lower()}:00"
        case["kernel_log"].append({"at": time.time() - ago_s, "text": f"NVRM: Xid ({short}): {code}, {text}"})

    return apply


def _all(**values: object) -> Callable[[dict], None]:
    def apply(case: dict) -> None:
        for g in case["gpus"]:
            g.update({k.replace("__", "."): v for k, v in values.items()})

    return apply


def _top(**values: object) -> Callable[[dict], None]:
    return lambda case: case.update(values)


#: Name -> what it does to a healthy host (the fault each check must name).
CASES: dict[str, Callable[[dict], None]] = {
    "healthy": lambda case: None,
    "idle-downshift": _all(utilization__gpu=0, pstate="P8", **{"pcie.link.gen.gpucurrent": 1}),
    "degraded-link": _set(2, **{"pcie.link.width.current": 8}),
    "remap-pending": _set(5, **{"remapped_rows.pending": "Yes", "remapped_rows.uncorrectable": 1}),
    "remap-failure": _set(5, **{"remapped_rows.failure": "Yes", "remapped_rows.uncorrectable": 512}),
    "hw-slowdown": _reason(1, "hw_slowdown", "hw_thermal_slowdown"),
    "sw-thermal": _reason(1, "sw_thermal_slowdown"),
    "power-capped": _reason(0, "sw_power_cap"),
    "persistence-off": _set(0, persistence_mode="Disabled"),
    "old-driver": _top(driver="535.104.05"),
    "legacy-driver": _top(driver="525.60.13", legacy=True),
    "xid": _xid(13, "pid=4242, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)"),
    "xid-fatal": _xid(79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
    "xid-old": _xid(79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", ago_s=86400 * 3),
    "kernel-log-denied": _top(kernel_log_denied=True),
    "not-supported": _all(**{"pcie.link.width.current": "[Not Supported]", "persistence_mode": "[N/A]"}),
    "driver-not-loaded": _top(
        fail={
            "rc": 9,
            "text": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.",
        }
    ),
}


def case(*names: str, gpus: int = 8) -> dict:
    """A healthy host with the named faults applied, in order."""
    out = copy.deepcopy(healthy(gpus))
    for name in names:
        if name not in CASES:
            raise KeyError(f"no GPU stand-in case {name!r} (have {', '.join(CASES)})")
        CASES[name](out)
    return out


def install(bin_dir: Path, state: dict) -> None:
    """Put the stand-in (`nvidia-smi`, `dmesg`, `journalctl`) and its case into `bin_dir`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
    text = SCRIPT.read_text().replace("#!/usr/bin/env python3", f"#!{python}", 1)
    for name in NAMES:
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    tmp = bin_dir / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(bin_dir / STATE)


def remove(bin_dir: Path) -> None:
    """Take the stand-in away: the host has no NVIDIA driver again."""
    for name in (*NAMES, STATE):
        (bin_dir / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    from .hostpaths import HostPaths

    parser = argparse.ArgumentParser(prog="python -m remote_ops.hostlab.gpu_standin", description=__doc__)
    parser.add_argument("--lab", help="the lab dir (default: the sandbox's)")
    parser.add_argument("--host", required=True, help="lab host name")
    parser.add_argument("--case", action="append", default=[], help=f"one of: {', '.join(CASES)} (repeatable)")
    parser.add_argument("--off", action="store_true", help="remove the stand-in")
    args = parser.parse_args(argv)
    if args.lab:
        lab_dir = Path(args.lab)
    else:
        from ..paths import sandbox_lab_dir

        lab_dir = sandbox_lab_dir()
    paths = HostPaths(lab_dir / "hosts" / args.host)
    if not paths.root.is_dir():
        parser.error(f"no lab host {args.host!r} under {lab_dir}")
    if args.off:
        remove(paths.bin)
        print(f"{args.host}: STAND-IN nvidia-smi removed")
        return 0
    install(paths.bin, case(*(args.case or ["healthy"])))
    print(f"{args.host}: STAND-IN nvidia-smi installed in {paths.bin} ({', '.join(args.case or ['healthy'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
