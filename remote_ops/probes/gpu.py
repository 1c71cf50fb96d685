"""GPUs: what nvidia-smi sees, which processes hold GPU memory, and the verdicts on both.

`GpuQuery` is facts' GPU list and health's count / ECC / temperature checks;
`GpuProcesses` marks each compute process `ours` when its cgroup names the
server container (its id from the engine seam, `engine.cli_for`), so a stray
process holding memory is named.  `check_fusion` reads the GPUs' compute
capability against SGLang's all-reduce-fusion window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core import shell
from ..core.inventory import HostSpec
from ..engine import cli_for
from .base import Check, Output, Probe

GPU_QUERY = (
    "index,name,memory.total,memory.used,temperature.gpu,"
    "ecc.errors.uncorrected.volatile.total,compute_cap,driver_version"
)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    temperature_c: int | None
    ecc_uncorrected: int | None
    compute_cap: str | None
    driver: str | None


#: The GPUs, or why there are none ("no NVIDIA driver", or nvidia-smi's complaint).
GpuList = tuple[list[Gpu], str | None]


class GpuQuery(Probe[GpuList]):
    """`nvidia-smi --query-gpu=... --format=csv,noheader,nounits`; exit 127 without a driver."""

    name = "gpus"
    absent = (127, "no NVIDIA driver")

    def command(self) -> str:
        query = shell.join(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"])
        return f"command -v nvidia-smi >/dev/null || {{ echo 'no NVIDIA driver'; exit 127; }}; {query}"

    def parse(self, status: int, text: str) -> GpuList:
        return parse_gpus(status, text)


def _num(value: str) -> int | None:
    value = value.strip()
    try:
        return int(float(value))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_gpus(status: int, text: str) -> GpuList:
    """Parse `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` output."""
    if status != 0:
        first = text.strip().splitlines()[0] if text.strip() else f"nvidia-smi exited {status}"
        return [], "no NVIDIA driver" if status == 127 else first
    gpus = []
    for line in text.strip().splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 8 or not cols[0].isdigit():
            continue
        gpus.append(
            Gpu(
                int(cols[0]),
                cols[1],
                _num(cols[2]),
                _num(cols[3]),
                _num(cols[4]),
                _num(cols[5]),
                cols[6] if _num(cols[6]) is not None or "." in cols[6] else None,
                cols[7] or None,
            )
        )
    return gpus, None


def check_gpus(host: HostSpec, probe: Output, procs: Output) -> list[Check]:
    """Count against the inventory, uncorrected ECC errors, temperature, stray processes."""
    gpus, err = parse_gpus(*probe)
    want = host.gpus.count
    if err:
        status = "fail" if want else "skip"
        return [Check("gpus", "count", status, f"{err} (inventory expects {want} GPUs)")]
    checks = [
        Check(
            "gpus",
            "count",
            "ok" if len(gpus) == want or not want else "fail",
            f"{len(gpus)} GPUs visible, inventory expects {want}",
        )
    ]
    bad_ecc = [g.index for g in gpus if g.ecc_uncorrected]
    checks.append(
        Check(
            "gpus",
            "ecc",
            "fail" if bad_ecc else "ok",
            f"uncorrected ECC errors on GPU {bad_ecc}" if bad_ecc else "no uncorrected ECC errors",
        )
    )
    hot = [
        f"GPU{g.index} {g.temperature_c}C"
        for g in gpus
        if g.temperature_c is not None and g.temperature_c > host.gpus.max_temperature_c
    ]
    checks.append(
        Check(
            "gpus",
            "temperature",
            "warn" if hot else "ok",
            f"above {host.gpus.max_temperature_c}C: {', '.join(hot)}"
            if hot
            else f"max {max((g.temperature_c or 0) for g in gpus)}C",
        )
    )
    checks.append(check_gpu_processes(procs))
    return checks


# -- processes holding GPU memory -------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    pid: str
    memory_mib: str
    owner: str  # "ours" (in the server container's cgroup) or "stray"


class GpuProcesses(Probe[list[GpuProcess] | None]):
    """GPU compute processes, each marked `ours` when its cgroup names our container."""

    name = "gpu_procs"
    absent = (127, "")

    def __init__(self, host: HostSpec) -> None:
        self.host = host

    def command(self) -> str:
        container_id = cli_for(self.host).container_id_command(self.host.container.name, api=True)
        return (
            "command -v nvidia-smi >/dev/null || exit 127; "
            f"cid=$({container_id}); "
            "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | "
            "while IFS=', ' read -r pid mem; do [ -n \"$pid\" ] || continue; "
            'if [ -n "$cid" ] && grep -q "$cid" /proc/$pid/cgroup 2>/dev/null; '
            'then echo "$pid $mem ours"; else echo "$pid $mem stray"; fi; done'
        )

    def parse(self, status: int, text: str) -> list[GpuProcess] | None:
        return parse_gpu_processes(status, text)


def parse_gpu_processes(status: int, text: str) -> list[GpuProcess] | None:
    """`PID MIB ours|stray` lines -> the processes, or None when they could not be listed."""
    if status != 0:
        return None
    rows = (line.split() for line in text.splitlines())
    return [GpuProcess(r[0], r[1] if len(r) == 3 else "?", r[-1]) for r in rows if len(r) in (2, 3)]


def check_gpu_processes(probe: Output) -> Check:
    procs = parse_gpu_processes(*probe)
    if procs is None:
        return Check("gpus", "processes", "skip", "cannot list GPU processes")
    stray = [p for p in procs if p.owner == "stray"]
    if stray:
        desc = ", ".join(f"pid {p.pid} ({p.memory_mib} MiB)" for p in stray)
        return Check("gpus", "processes", "warn", f"processes outside the container hold GPU memory: {desc}")
    return Check("gpus", "processes", "ok", "no stray processes hold GPU memory")


# -- SGLang's all-reduce fusion on these GPUs ----------------------------------------------------------

FUSION_WINDOW = ((0, 5, 7), (0, 5, 14))  # releases whose capture reads pre-all-reduce partial sums
FUSION_ARCHS = ("9", "10")  # sm90 / sm100: where SGLang auto-enables the fusion


def check_fusion(host: HostSpec, gpus: list[Gpu]) -> Check:
    """Is this host in SGLang's all-reduce-fusion window (0.5.7-0.5.13, TP>1, sm90/sm100)?

    There the 0.5.x capture would read per-rank partial sums (silently wrong aux
    states).  The dumper handles it at run time (SGLANG_HS_DUMP_FUSION) and logs
    what it did; this check tells the operator beforehand, from the host's real
    GPUs, the inventory's TP size and the patched version.
    """
    nums = tuple(int(n) for n in re.findall(r"\d+", host.sglang.version)[:3])
    if not FUSION_WINDOW[0] <= nums < FUSION_WINDOW[1] or host.server.tp <= 1:
        return Check(
            "capture", "allreduce_fusion", "ok", f"not affected (SGLang {host.sglang.version}, tp {host.server.tp})"
        )
    caps = sorted({g.compute_cap for g in gpus if g.compute_cap})
    if not caps:
        return Check("capture", "allreduce_fusion", "skip", "GPU compute capability unknown")
    if any(c.split(".")[0] in FUSION_ARCHS for c in caps):
        return Check(
            "capture",
            "allreduce_fusion",
            "warn",
            f"SGLang {host.sglang.version} auto-enables all-reduce fusion on sm{caps} with tp "
            f"{host.server.tp}: the dumper must disable it (SGLANG_HS_DUMP_FUSION); check its log line",
        )
    return Check(
        "capture",
        "allreduce_fusion",
        "ok",
        f"compute capability {', '.join(caps)}: SGLang does not auto-enable all-reduce fusion here",
    )
