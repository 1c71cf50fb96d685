"""Tiered, read-only health checks, cheap first, in one SSH round trip.

Orchestration only: the probes (each one's command, parser and evaluator side
by side) are units in `remote_ops.probes`; here `probes` picks them for a host,
`probe_checks` asks them in one round trip, concurrently on the host
(`probes.batch`), and `evaluate` turns their answers into `Check(tier, name,
status, reason)` with status ok / warn / fail / skip, plus the rules that span
probes (`starting_but_answering`, dump growth only while an extraction runs).
So a health run costs one connection and one command (the SSH tier is the
connection itself), and its wall time is the slowest probe's, not the sum.
The only thing written on the host is that command's private temp dir,
removed when it exits.

Why tiers: SGLang 0.5.x's `/health` runs a one-token generation (20 s timeout)
and piled-up probes have crashed servers, so the HTTP tier polls only cheap
endpoints (`probes.endpoints`), and a generation probe runs at most once, only
with `--deep`.  Nothing here writes to the host: the dump-growth baseline is
kept locally.

The engine's questions (version, container + image, the container's id and
PID, `exec` where the container's root cannot be read) come from the engine
seam (`engine.cli_for(host)`: over the engine's socket with curl when it can,
its CLI otherwise), read back into its typed records; no engine command line
is written here.

"Healthy" means what deploy's wait means: a running container whose engine
health check is still `starting` is ok once every cheap endpoint answers
(`starting_but_answering`), so `health` right after a deploy that reported
healthy exits 0.  `dumps/growth` warns about standing dumps only while the
extraction client runs (`probes.extract.ExtractAlive`: its PID file).  `dumps/dir`
fails when the server is up with capture on and its dump dir is missing, not a
directory or not writable (`probes.dumpdir`, resolved once on the host; a symlinked
dump dir is named with the path it resolves to).  `dumps/mount` fails when the running
server container still mounts a dump dir that was removed and made again since it started
(`probes.dumpdir.mount_of`: the dir's `device:inode` against the one the container recorded
at create time, and its start against the dir's birth); `remote-ops deploy` recreates it.

Deadlines: the round trip runs under the run's command deadline
(`--command-timeout`); each probe in it is bounded by `batch.probe_deadline`
of that on the host, and the HTTP probe's own calls share that budget.  So a
hung probe (a frozen engine daemon) fails only its own checks, and the others
are still reported.

Exit codes: a host that cannot be connected to is listed as the failing
`ssh/connect` check, and the run exits with that error's own code (4
unreachable, 5 auth, 6 host key) rather than 12, as every other command does.

The GPU checks an SRE runs beyond count, ECC, stray processes and temperature
(PCIe link under load, Xids since the container started, pending row remaps,
throttle reasons, persistence mode, the driver against the image's CUDA) are
`probes.gpuhealth` and `probes.kernlog`; each rule is in its module's docstring
and in docs/deploy.md.

A new check is a probe unit (command, parser, evaluator) in `remote_ops/probes/`
plus one line in `probes` (ask it) and one in `evaluate` (judge its answer);
docs/CONTRIBUTING.md has the recipe.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.extractplan import paths_for
from ..core.inventory import HostSpec
from ..engine.types import unix_time
from ..errors import ExitCode
from ..probes import batch
from ..probes.base import Answers, Check, Probe, Sections, last_line
from ..probes.dumpdir import DumpDir, DumpDirState, check_dump_dir, check_dump_mount
from ..probes.dumps import DumpUsage, check_dumps
from ..probes.endpoints import HttpEndpoints, check_http
from ..probes.engine import EngineObjects, EngineVersion, check_container, check_engine
from ..probes.extract import ExtractAlive
from ..probes.gpu import GpuProcesses, GpuQuery, check_fusion, check_gpus
from ..probes.gpuhealth import GpuHealthQuery, bus_key, check_gpu_health
from ..probes.kernlog import KernelXids, check_xid, window
from ..probes.patch import PatchInContainer, check_patch
from ..serving import KINDS, serving_for

ORDER = {"ok": 0, "skip": 0, "warn": 1, "fail": 2}
#: the tiers of the serving engine's endpoint checks (`remote_ops.serving.KINDS`)
SERVING_TIERS = tuple(KINDS)


@dataclass
class HostHealth:
    host: str
    checks: list[Check]
    duration_s: float = 0.0
    round_trips: int = 0
    error_exit: int | None = None  # the exit code of a connection/SSH error, if one ended the run

    @property
    def worst(self) -> str:
        return max((c.status for c in self.checks), key=lambda s: ORDER[s], default="ok")

    @property
    def verdict(self) -> str:
        """This host's own result for a fleet summary: `ok`, or its worst status and the first
        check that has it (`fail: ssh/connect: connection to … refused`)."""
        first = next((c for c in self.checks if c.status == self.worst), None)
        if ORDER[self.worst] == 0 or first is None:
            return "ok"
        return f"{self.worst}: {first.tier}/{first.name}: {first.reason}"

    def to_dict(self) -> dict:
        """`exit_code` is this host's own (an integer: `exit_code([self])`), never the run's worst."""
        return {
            "host": self.host,
            "worst": self.worst,
            "duration_s": round(self.duration_s, 3),
            "round_trips": self.round_trips,
            "exit_code": exit_code([self]),
            "checks": [asdict(c) for c in self.checks],
        }


def exit_code(results: list[HostHealth]) -> int:
    """0 when all ok, 11 when the worst is warn, 12 when anything failed; but a host that
    could not be reached or trusted gives that error's own code (6 host key > 5 auth >
    4 unreachable > 8 timeout), the same as every other command."""
    errors = [r.error_exit for r in results if r.error_exit]
    if errors:
        rank = {ExitCode.HOST_KEY: 4, ExitCode.AUTH: 3, ExitCode.UNREACHABLE: 2, ExitCode.TIMEOUT: 1}
        return max(errors, key=lambda c: rank.get(c, 0))
    worst = max((ORDER[r.worst] for r in results), default=0)
    return {0: ExitCode.OK, 1: ExitCode.HEALTH_WARN, 2: ExitCode.HEALTH_FAIL}[worst]


# -- which probes, and their verdicts ------------------------------------------------------


def probes(
    host: HostSpec, deep: bool = False, expected_image: str | None = None, probe_s: float = 96.0
) -> list[Probe[Any]]:
    """Every probe of a health run for `host` (the engine's over its socket when it can be);
    building them costs nothing: each command is built when the round trip is."""
    return [
        EngineVersion(host, api=True),
        GpuQuery(),
        GpuProcesses(host),
        GpuHealthQuery(),
        KernelXids(),
        EngineObjects(host, expected_image, api=True),
        *([PatchInContainer(host)] if serving_for(host).NEEDS_PATCH else []),
        HttpEndpoints(host, deep, probe_s),
        DumpUsage(host.dump.dir),
        DumpDirState(host.dump.dir),
        ExtractAlive(paths_for(host)),
    ]


def evaluate(
    host: HostSpec,
    sec: Sections,
    *,
    expected_image: str | None = None,
    last_dumps: dict | None = None,
    now: float | None = None,
) -> list[Check]:
    """All checks after the SSH tier, from the probes' captured answers (pure)."""
    a = Answers(probes(host, expected_image=expected_image), sec)
    found = a.read(EngineObjects)
    container, image = found.container, found.image
    checks = [check_engine(a.read(EngineVersion))]
    checks += check_gpus(host, a.output(GpuQuery), a.output(GpuProcesses))
    cuda_from = image if image and image.cuda_env else container or image  # the deploy's image, else what runs
    checks += check_gpu_health(a.output(GpuHealthQuery), cuda_from.cuda_env if cuda_from else None)
    gpu_health = a.read(GpuHealthQuery)
    started = unix_time(container.started_at) if container else None
    checks += check_xid(
        a.output(KernelXids),
        window(started, {bus_key(g.bus_id): g.index for g in gpu_health.gpus}),
        driver=not gpu_health.missing,
    )
    if serving_for(host).NEEDS_PATCH:  # the all-reduce fusion window is the SGLang dumper's concern
        checks.append(check_fusion(host, a.read(GpuQuery)[0]))
    status, text = a.output(EngineObjects)
    if status == 124:  # the probe ran out of time: not "absent"
        checks.append(Check("container", "state", "fail", f"{host.engine} inspect: {last_line(text)}"))
    else:
        checks += check_container(host, container, image, expected_image)
    if serving_for(host).NEEDS_PATCH:
        checks.append(check_patch(a.output(PatchInContainer), container, image))
    else:
        checks.append(Check("patch", "source", "skip", serving_for(host).NO_PATCH))
    checks += check_http(host, a.output(HttpEndpoints), container)
    checks = starting_but_answering(checks)
    extracting = a.read(ExtractAlive) if a.came(ExtractAlive) else None  # None: the probe did not say
    checks += check_dumps(host, a.output(DumpUsage), last_dumps, now or time.time(), extracting=extracting)
    if not a.came(DumpDirState) or a.output(DumpDirState)[0] != 0:  # not asked, or no answer in time
        return checks
    state = a.read(DumpDirState)
    mount = check_dump_mount(state, container)
    return capture_dir(checks, state, bool(container and container.running)) + ([mount] if mount else [])


def capture_dir(checks: list[Check], state: DumpDir, server_up: bool) -> list[Check]:
    """`dumps/dir` (`probes.dumpdir.check_dump_dir`): the server is up with capture on (its patch
    verified in the container, or an engine without a patch: vLLM's connector) and its dump
    dir is missing or not writable: a fail naming the path, in place of growth's skip (pure)."""
    patch = next((c for c in checks if c.tier == "patch"), None)
    capturing = patch is not None and (patch.status == "ok" or patch.name == "source")  # source: no patch
    dump_dir = check_dump_dir(state, server_up, capturing)
    if dump_dir is None:
        return checks
    if dump_dir.status == "fail":
        checks = [c for c in checks if not (c.tier == "dumps" and c.name == "growth" and c.status == "skip")]
    return [*checks, dump_dir]


def starting_but_answering(checks: list[Check]) -> list[Check]:
    """A running container whose engine health check has not run yet ("starting") is ok when
    every cheap endpoint answers: that is what deploy's wait calls healthy, and the engine's
    first check only runs one interval (15 s) after the start (pure)."""
    endpoints = [c for c in checks if c.tier in SERVING_TIERS]
    answering = bool(endpoints) and all(c.status == "ok" for c in endpoints)
    return [
        Check(
            c.tier,
            c.name,
            "ok",
            c.reason.replace("health check still starting", "endpoints answer (docker's first health check pending)"),
            c.data,
        )
        if answering and c.tier == "container" and c.name == "state" and c.status == "warn" and "starting" in c.reason
        else c
        for c in checks
    ]


# -- the edge ----------------------------------------------------------------


def baseline_file(state_dir: Path) -> Path:
    return state_dir / "health-dumps.json"


def load_baseline(state_dir: Path) -> dict | None:
    try:
        return json.loads(baseline_file(state_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def save_baseline(state_dir: Path, checks: list[Check]) -> None:
    growth = next((c for c in checks if c.name == "growth" and c.data), None)
    if growth:
        state_dir.mkdir(parents=True, exist_ok=True)
        baseline_file(state_dir).write_text(json.dumps(growth.data))


def probe_checks(
    remote, host: HostSpec, *, deep: bool = False, expected_image: str | None = None, last_dumps: dict | None = None
) -> list[Check]:
    """One round trip of every probe under the run's command deadline -> checks after the SSH tier.

    Raises the SSH seam's typed error when the host does not answer at all
    (timeout, connection lost); a single hung probe is only its own failure."""
    probe_s = batch.deadline_of(remote)
    sec = batch.run(remote, probes(host, deep, expected_image, probe_s), parallel=True, probe_s=probe_s)
    return evaluate(host, sec, expected_image=expected_image, last_dumps=last_dumps)


def check_host(
    connect, host: HostSpec, *, deep: bool = False, expected_image: str | None = None, state_dir: Path | None = None
) -> HostHealth:
    """Run every tier for one host.  `connect(host)` returns a Remote or raises.

    Connection failures become the failing SSH check instead of an exception,
    so `--all` reports every host; the error's exit code is kept (`exit_code`).
    """
    from ..errors import RemoteOpsError

    start = time.monotonic()
    try:
        remote = connect(host)
    except RemoteOpsError as exc:
        return HostHealth(
            host.name,
            [Check("ssh", "connect", "fail", exc.message, {"error": exc.kind, "exit_code": exc.exit_code})],
            time.monotonic() - start,
            error_exit=exc.exit_code,
        )
    ssh = Check("ssh", "connect", "ok", f"{remote.target.display}, host key {remote.host_key_fingerprint}")
    before = remote.round_trips
    last = load_baseline(state_dir) if state_dir else None
    try:
        checks = [ssh, *probe_checks(remote, host, deep=deep, expected_image=expected_image, last_dumps=last)]
    except RemoteOpsError as exc:
        return HostHealth(
            host.name,
            [ssh, Check("ssh", "command", "fail", str(exc), {"error": exc.kind, "exit_code": exc.exit_code})],
            time.monotonic() - start,
            error_exit=exc.exit_code,
        )
    if state_dir:
        save_baseline(state_dir, checks)
    return HostHealth(host.name, checks, time.monotonic() - start, remote.round_trips - before)
