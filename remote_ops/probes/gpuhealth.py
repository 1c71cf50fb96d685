"""The GPU checks an SRE runs, from `nvidia-smi --query-gpu` fields: one probe, five verdicts.

`GpuHealthQuery` asks, in one `sh` run on the host, the fields below per GPU
(`--format=csv,noheader,nounits`), then the row remapper
(`--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure`;
row remapping replaced page retirement from Ampere on, so an RTX PRO 6000
Blackwell reports its memory repairs there).  A driver that does not know the
newer field names (`clocks_event_reasons.*` and `pcie.link.gen.gpucurrent`,
nvidia-smi: `Field "…" is not a valid field to query.`) is asked again with
their older aliases (`clocks_throttle_reasons.*`, `pcie.link.gen.current`);
the values come in the same order.  Without nvidia-smi (exit 127) there are no
checks here: `gpus/count` says why.

The rules (each check is `gpus/<name>`; field meanings from `nvidia-smi
--help-query-gpu`, NVIDIA's documentation of the query fields):

- `pcie_link`: `pcie.link.gen.gpucurrent` against `pcie.link.gen.max` and
  `pcie.link.width.current` against `pcie.link.width.max`.  NVIDIA documents
  that the current generation and width "may be reduced when the GPU is not in
  use", so a GPU is judged only while it works (`utilization.gpu` ≥
  `LINK_LOAD_PCT` %): below its maximum then is **warn** (a link trained at x8
  of x16 halves host-to-GPU and PCIe all-reduce bandwidth).  An idle GPU's
  link is reported, never judged; all GPUs idle and downshifted is **skip**.
- `memory_rows`: `remapped_rows.failure` Yes is **fail** (no spare rows: the
  GPU needs service); `remapped_rows.pending` or `retired_pages.pending` Yes
  is **warn** (the repair takes effect after a GPU reset or reboot; until then
  the bad row or page can still be allocated); neither reported is **skip**.
- `throttle` (`clocks_event_reasons.*`): `hw_thermal_slowdown` or
  `hw_power_brake_slowdown` Active is **fail** (the hardware cuts the clocks by
  half or more: too hot, or the power supply asserted its brake);
  `hw_slowdown` alone or `sw_thermal_slowdown` Active is **warn** (NVIDIA: HW
  slowdown "may be also reported during PState or clock change"; SW thermal:
  above the max operating temperature).  `gpu_idle`,
  `applications_clocks_setting`, `sync_boost` and `sw_power_cap` (running at
  the power limit under full load) are not faults.
- `persistence`: `persistence_mode` Disabled is **warn** (the driver unloads
  between clients: slower CUDA start-up, settings lost; `nvidia-smi -pm 1` or
  nvidia-persistenced).
- `driver_cuda`: the host's `driver_version` against the CUDA the image needs
  (its `NVIDIA_REQUIRE_CUDA` `cuda>=X.Y`, else `CUDA_VERSION`, from the
  engine's image inspect), with NVIDIA's published minimum drivers as data:
  `TOOLKIT_DRIVER` is Table 3 of the CUDA Toolkit release notes ("CUDA Toolkit
  and Corresponding Driver Versions", Linux x86_64, each X.Y's GA row) and
  `MINOR_COMPAT_DRIVER` their Table 2 (CUDA minor version compatibility:
  13.x >= 580, 12.x >= 525.60.13, 11.x >= 450.80.02).  Below the major's
  floor is **fail** (that CUDA cannot initialise); below X.Y's toolkit driver
  is **warn** (only through minor version compatibility: the NVIDIA container
  toolkit refuses the image's `cuda>=X.Y` unless told otherwise, and PTX newer
  than the driver cannot be JIT-compiled); else **ok**.  No image, no CUDA in
  its env, or an X.Y newer than the table: **skip**.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..core import shell
from .base import Check, Output, Probe, last_line

#: The query, newest field names; `LEGACY_FIELDS` are the same values under older drivers' names.
REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
)
FIELDS = (
    "index",
    "pci.bus_id",
    "driver_version",
    "persistence_mode",
    "pcie.link.gen.gpucurrent",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    "utilization.gpu",
    "retired_pages.pending",
    *(f"clocks_event_reasons.{r}" for r in REASONS),
)
LEGACY_FIELDS = tuple(
    f.replace("clocks_event_reasons.", "clocks_throttle_reasons.").replace("gen.gpucurrent", "gen.current")
    for f in FIELDS
)
REMAP_FIELDS = ("gpu_bus_id", "remapped_rows.pending", "remapped_rows.failure")
REMAP_MARK = "--- remapped rows"

#: A GPU at least this busy (`utilization.gpu`, %) has its link at full speed unless it is degraded.
LINK_LOAD_PCT = 20

#: NVIDIA's minimum Linux x86_64 driver per CUDA X.Y (Table 3 of the CUDA Toolkit release notes, GA rows).
TOOLKIT_DRIVER: dict[tuple[int, int], str] = {
    (13, 2): "595.45.04",
    (13, 1): "590.44.01",
    (13, 0): "580.65.06",
    (12, 9): "575.51.03",
    (12, 8): "570.26",
    (12, 6): "560.28.03",
    (12, 5): "555.42.02",
    (12, 4): "550.54.14",
    (12, 3): "545.23.06",
    (12, 2): "535.54.03",
    (12, 1): "530.30.02",
    (12, 0): "525.60.13",
    (11, 8): "520.61.05",
    (11, 7): "515.43.04",
    (11, 6): "510.39.01",
    (11, 5): "495.29.05",
    (11, 4): "470.42.01",
    (11, 3): "465.19.01",
    (11, 2): "460.27.03",
    (11, 1): "455.23",
    (11, 0): "450.51.05",
}
#: The least driver a CUDA major runs on at all, through minor version compatibility (Table 2).
MINOR_COMPAT_DRIVER: dict[int, str] = {13: "580", 12: "525.60.13", 11: "450.80.02"}


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's SRE fields (None: `[N/A]`, `[Not Supported]` or unreadable)."""

    index: int
    bus_id: str
    driver: str | None
    persistence: bool | None
    link_gen: int | None
    link_gen_max: int | None
    link_width: int | None
    link_width_max: int | None
    utilization: int | None
    retired_pending: bool | None
    reasons: dict[str, bool | None] = field(default_factory=dict)
    remap_pending: bool | None = None
    remap_failure: bool | None = None


@dataclass(frozen=True)
class GpuHealthAnswer:
    """The GPUs, or why not: `missing` (no nvidia-smi), else `error` (nvidia-smi's complaint)."""

    gpus: tuple[GpuHealth, ...] = ()
    missing: bool = False
    error: str | None = None


class GpuHealthQuery(Probe[GpuHealthAnswer]):
    """nvidia-smi's SRE fields per GPU, then its row remapper (see the module doc)."""

    name = "gpu_health"
    absent = (127, "no NVIDIA driver")

    def command(self) -> str:
        def query(fields: Iterable[str]) -> str:
            return shell.join(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"])

        remap = shell.join(
            ["nvidia-smi", "--query-remapped-rows=" + ",".join(REMAP_FIELDS), "--format=csv,noheader,nounits"]
        )
        return (
            "command -v nvidia-smi >/dev/null || { echo 'no NVIDIA driver'; exit 127; }; "
            f"out=$({query(FIELDS)} 2>&1); rc=$?; "
            "if [ $rc -ne 0 ] && printf '%s' \"$out\" | grep -q 'is not a valid field'; then "
            f"out=$({query(LEGACY_FIELDS)} 2>&1); rc=$?; fi; "
            "printf '%s\\n' \"$out\"; [ $rc -eq 0 ] || exit $rc; "
            f"echo {shell.quote(REMAP_MARK)}; {remap} 2>&1; exit 0"
        )

    def parse(self, status: int, text: str) -> GpuHealthAnswer:
        return parse_gpu_health(status, text)


def _value(raw: str) -> str | None:
    """A field's value, None for nvidia-smi's `[N/A]`, `[Not Supported]`, `[Unknown Error]`."""
    value = raw.strip()
    bare = value.strip("[]").lower()
    return None if not value or bare in ("n/a", "not supported", "unknown error", "insufficient permissions") else value


def _int(raw: str) -> int | None:
    value = _value(raw)
    try:
        return int(float(value)) if value is not None else None
    except ValueError:
        return None


def _flag(raw: str, yes: str, no: str) -> bool | None:
    """`Active`/`Not Active`, `Enabled`/`Disabled`, `Yes`/`No` (or 1/0) -> True/False/None."""
    value = (_value(raw) or "").lower()
    if value in (yes.lower(), "1", "true"):
        return True
    if value in (no.lower(), "0", "false"):
        return False
    return None


def bus_key(bus_id: str) -> str:
    """A PCI address as `dddd:bb:dd` (lowercase, 4-digit domain, no function): nvidia-smi's
    `00000000:3B:00.0` and the kernel log's `PCI:0000:3b:00` give the same key."""
    text = bus_id.strip().lower().removeprefix("pci:")
    parts = text.split(":")
    if len(parts) < 3:
        return text
    return f"{parts[-3][-4:].rjust(4, '0')}:{parts[-2]}:{parts[-1].split('.')[0]}"


def parse_gpu_health(status: int, text: str) -> GpuHealthAnswer:
    """The probe's output -> its GPUs (pure): the query's rows, then the remapper's by bus id."""
    if status == 127:
        return GpuHealthAnswer(missing=True)
    if status != 0:
        return GpuHealthAnswer(error=last_line(text))
    head, _, tail = text.partition(REMAP_MARK)
    remap: dict[str, tuple[bool | None, bool | None]] = {}
    for line in tail.strip().splitlines():
        cols = line.split(",")
        if len(cols) == len(REMAP_FIELDS):
            remap[bus_key(cols[0])] = (_flag(cols[1], "Yes", "No"), _flag(cols[2], "Yes", "No"))
    gpus = []
    for line in head.strip().splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != len(FIELDS) or not cols[0].isdigit():
            continue
        pending, failure = remap.get(bus_key(cols[1]), (None, None))
        gpus.append(
            GpuHealth(
                index=int(cols[0]),
                bus_id=cols[1],
                driver=_value(cols[2]),
                persistence=_flag(cols[3], "Enabled", "Disabled"),
                link_gen=_int(cols[4]),
                link_gen_max=_int(cols[5]),
                link_width=_int(cols[6]),
                link_width_max=_int(cols[7]),
                utilization=_int(cols[8]),
                retired_pending=_flag(cols[9], "Yes", "No"),
                reasons={r: _flag(v, "Active", "Not Active") for r, v in zip(REASONS, cols[10:])},
                remap_pending=pending,
                remap_failure=failure,
            )
        )
    if not gpus:
        return GpuHealthAnswer(error=f"nvidia-smi listed no GPUs ({last_line(head)})")
    return GpuHealthAnswer(tuple(gpus))


# -- the verdicts ------------------------------------------------------------------------------------


def check_gpu_health(probe: Output, cuda_env: Mapping[str, str] | None) -> list[Check]:
    """Link, memory rows, throttle, persistence and driver-vs-CUDA (the module doc's rules);
    none without nvidia-smi.  `cuda_env`: the image's CUDA variables (None: no image)."""
    answer = parse_gpu_health(*probe)
    if answer.missing:
        return []
    names = ("pcie_link", "memory_rows", "throttle", "persistence", "driver_cuda")
    if answer.error:
        return [Check("gpus", n, "skip", f"nvidia-smi: {answer.error}") for n in names]
    gpus = answer.gpus
    return [
        check_pcie_link(gpus),
        check_memory_rows(gpus),
        check_throttle(gpus),
        check_persistence(gpus),
        check_driver_cuda(next((g.driver for g in gpus if g.driver), None), cuda_env),
    ]


def _link(gen: int | None, width: int | None) -> str:
    return f"Gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"


def check_pcie_link(gpus: Iterable[GpuHealth]) -> Check:
    """Below the maximum generation or width while working: warn; idle GPUs are not judged."""
    degraded, idle_low, judged = [], [], 0
    for g in gpus:
        if None in (g.link_gen, g.link_gen_max, g.link_width, g.link_width_max):
            continue
        low = (g.link_gen or 0) < (g.link_gen_max or 0) or (g.link_width or 0) < (g.link_width_max or 0)
        busy = (g.utilization or 0) >= LINK_LOAD_PCT
        shown = f"GPU{g.index} {_link(g.link_gen, g.link_width)} of {_link(g.link_gen_max, g.link_width_max)}"
        if low and busy:
            degraded.append(f"{shown} at {g.utilization}% busy")
        elif low:
            idle_low.append(shown)
        judged += not low or busy
    note = (
        f"; {len(idle_low)} idle GPU(s) downshifted, not judged (NVIDIA: the current link "
        '"may be reduced when the GPU is not in use"): ' + ", ".join(idle_low[:4])
        if idle_low
        else ""
    )
    data = {"degraded": degraded, "idle_downshifted": idle_low}
    if degraded:
        return Check(
            "gpus", "pcie_link", "warn", "PCIe link below its maximum under load: " + "; ".join(degraded), data
        )
    if not judged and idle_low:
        return Check("gpus", "pcie_link", "skip", "all GPUs idle" + note + "; run health while they work", data)
    if not judged:
        return Check("gpus", "pcie_link", "skip", "PCIe link generation/width not reported", data)
    return Check("gpus", "pcie_link", "ok", f"{judged} GPU(s) at their maximum PCIe link" + note, data)


def check_memory_rows(gpus: Iterable[GpuHealth]) -> Check:
    """Row remapping failed: fail; a remap or page retirement pending: warn."""
    gpus = list(gpus)
    failed = [f"GPU{g.index}" for g in gpus if g.remap_failure]
    pending = [f"GPU{g.index} (row remap)" for g in gpus if g.remap_pending]
    pending += [f"GPU{g.index} (page retirement)" for g in gpus if g.retired_pending]
    if failed:
        return Check(
            "gpus",
            "memory_rows",
            "fail",
            f"row remapping failed on {', '.join(failed)}: no spare rows left, the GPU needs service",
        )
    if pending:
        return Check(
            "gpus",
            "memory_rows",
            "warn",
            f"memory repair pending on {', '.join(pending)}: reset the GPU (or reboot) while it is idle to apply "
            "it; until then the bad row/page can still be allocated",
        )
    if all(g.remap_pending is None and g.retired_pending is None for g in gpus):
        return Check("gpus", "memory_rows", "skip", "neither row remapping nor page retirement reported")
    return Check("gpus", "memory_rows", "ok", "no row remap or page retirement pending, no remap failure")


def check_throttle(gpus: Iterable[GpuHealth]) -> Check:
    """HW thermal / power-brake slowdown: fail; HW slowdown alone or SW thermal: warn; else ok."""
    hard, soft, capped = [], [], []
    for g in gpus:
        on = {r for r, active in g.reasons.items() if active}
        hard += [f"GPU{g.index} {r}" for r in ("hw_thermal_slowdown", "hw_power_brake_slowdown") if r in on]
        if "hw_slowdown" in on and not on & {"hw_thermal_slowdown", "hw_power_brake_slowdown"}:
            soft.append(f"GPU{g.index} hw_slowdown")
        soft += [f"GPU{g.index} sw_thermal_slowdown"] if "sw_thermal_slowdown" in on else []
        capped += [f"GPU{g.index}"] if "sw_power_cap" in on else []
    cap_note = f"; at the power limit (sw_power_cap, normal under full load): {', '.join(capped)}" if capped else ""
    if hard:
        return Check(
            "gpus",
            "throttle",
            "fail",
            "clocks cut by the hardware (half or more): " + ", ".join(hard + soft) + cap_note,
        )
    if soft:
        return Check("gpus", "throttle", "warn", "clocks slowed: " + ", ".join(soft) + cap_note)
    return Check("gpus", "throttle", "ok", "no thermal or hardware slowdown" + cap_note)


def check_persistence(gpus: Iterable[GpuHealth]) -> Check:
    """Persistence mode off on any GPU: warn."""
    gpus = list(gpus)
    off = [f"GPU{g.index}" for g in gpus if g.persistence is False]
    if off:
        return Check(
            "gpus",
            "persistence",
            "warn",
            f"persistence mode off on {', '.join(off)}: the driver unloads between clients "
            "(`nvidia-smi -pm 1`, or run nvidia-persistenced)",
        )
    if all(g.persistence is None for g in gpus):
        return Check("gpus", "persistence", "skip", "persistence mode not reported")
    return Check("gpus", "persistence", "ok", "persistence mode on")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def cuda_required(env: Mapping[str, str]) -> tuple[int, int] | None:
    """The CUDA X.Y an image needs: `NVIDIA_REQUIRE_CUDA`'s `cuda>=X.Y`, else `CUDA_VERSION`'s X.Y."""
    m = re.search(r"cuda>=(\d+)\.(\d+)", env.get("NVIDIA_REQUIRE_CUDA", ""))
    m = m or re.match(r"\s*(\d+)\.(\d+)", env.get("CUDA_VERSION", ""))
    return (int(m[1]), int(m[2])) if m else None


def check_driver_cuda(driver: str | None, cuda_env: Mapping[str, str] | None) -> Check:
    """The host's driver against the image's CUDA (NVIDIA's tables: see the module doc)."""
    if cuda_env is None:
        return Check("gpus", "driver_cuda", "skip", "no image to compare with (not deployed)")
    need = cuda_required(cuda_env)
    if need is None:
        return Check("gpus", "driver_cuda", "skip", "the image names no CUDA (no NVIDIA_REQUIRE_CUDA or CUDA_VERSION)")
    if not driver:
        return Check("gpus", "driver_cuda", "skip", "driver version not reported")
    cuda, floor, toolkit = f"{need[0]}.{need[1]}", MINOR_COMPAT_DRIVER.get(need[0]), TOOLKIT_DRIVER.get(need)
    data = {"driver": driver, "cuda": cuda, "toolkit_driver": toolkit, "minor_compat_driver": floor}
    if floor is None or toolkit is None:
        newest = max(TOOLKIT_DRIVER)
        return Check(
            "gpus",
            "driver_cuda",
            "skip",
            f"CUDA {cuda} is not in NVIDIA's driver table remote-ops knows (11.0-{newest[0]}.{newest[1]})",
            data,
        )
    if _version(driver) < _version(floor):
        return Check(
            "gpus",
            "driver_cuda",
            "fail",
            f"driver {driver} is too old for the image's CUDA {cuda}: CUDA {need[0]}.x needs at least {floor}",
            data,
        )
    if _version(driver) < _version(toolkit):
        return Check(
            "gpus",
            "driver_cuda",
            "warn",
            f"driver {driver} is older than CUDA {cuda}'s {toolkit}: it runs only through CUDA minor version "
            "compatibility (the NVIDIA container toolkit refuses the image's requirement unless told otherwise; "
            "newer PTX cannot be JIT-compiled)",
            data,
        )
    return Check("gpus", "driver_cuda", "ok", f"driver {driver} >= {toolkit} (CUDA {cuda})", data)
