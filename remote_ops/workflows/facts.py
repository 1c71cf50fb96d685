"""Host facts: what the host is, gathered in one SSH round trip.

pyinfra-style: each fact is a probe unit in `remote_ops.probes` (its command
beside its parser); `probes(host)` picks them, `gather(remote, host)` asks
them all in one round trip (`probes.batch`, concurrently on the host) and
`parse(host, sections)` reads their answers into a `Facts` record (pure;
tested from captured text).  `deploy`'s probe asks a subset of the same units.

Deadlines: the round trip runs under the run's command deadline
(`--command-timeout`), and each probe inside it under `batch.probe_deadline`
of that (coreutils `timeout` on the host), so one hung probe (a frozen
engine daemon) is that probe's own failure ("no answer within Ns") and every
other fact is still reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.inventory import HostSpec
from ..probes import batch
from ..probes.base import Answers, Probe, Sections
from ..probes.disk import DiskFree
from ..probes.engine import EngineRuntimes, EngineVersion, NvidiaToolkit, engine_summary
from ..probes.gpu import Gpu, GpuQuery
from ..probes.sglang import PatchTarget, SglangVersion
from ..probes.system import Cpu, HostPython, Kernel, Memory, OsRelease, python_problem
from ..remote import Remote


@dataclass
class Facts:
    host: str
    os: str = ""
    kernel: str = ""
    cpu_model: str = ""
    cpus: int | None = None
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    gpus: list[Gpu] = field(default_factory=list)
    gpu_error: str | None = None  # "no NVIDIA driver" or nvidia-smi's complaint
    docker: dict = field(default_factory=dict)  # server/client versions, or {"error": ...}
    docker_runtimes: list[str] = field(default_factory=list)
    nvidia_runtime: bool = False
    dump_dir: str = ""
    dump_dir_free_bytes: int | None = None
    serving: str = "sglang"  # the inventory's serving engine (`serving.engine`)
    vllm_version: str | None = None  # vLLM hosts: the release the inventory pins (its image is built from it)
    sglang_version: str | None = None
    target_file: str = ""
    target_sha256: str | None = None
    target_lines: int | None = None
    target_error: str | None = None
    python3: str | None = None  # the host's python3 version (None: missing)
    python3_problem: str | None = None  # why the on-host tools cannot run, naming them (None: they can)

    def to_dict(self) -> dict:
        return asdict(self)


def target_of(host: HostSpec) -> str | None:
    """The patch's target file on the host (None: the host's patch is unbound, no spec, or its
    serving engine needs no patch)."""
    return host.sglang.target_file if host.sglang.patch and host.serving.engine == "sglang" else None


def probes(host: HostSpec) -> list[Probe[Any]]:
    """The probes `facts` asks (one round trip)."""
    target = target_of(host)
    return [
        OsRelease(),
        Kernel(),
        Cpu(),
        Memory(),
        GpuQuery(),
        EngineVersion(host),
        EngineRuntimes(host),
        NvidiaToolkit(),
        DiskFree(host.dump.dir),
        HostPython(),
        *([SglangVersion(host.sglang.checkout)] if host.serving.engine == "sglang" else []),
        *([PatchTarget(target)] if target else []),
    ]


def gather(remote: Remote, host: HostSpec) -> Facts:
    """Ask every probe concurrently in one round trip (each one bounded) and read their answers."""
    return parse(host, batch.run(remote, probes(host), parallel=True, probe_s=batch.deadline_of(remote)))


def parse(host: HostSpec, sec: Sections) -> Facts:
    """The probes' answers -> `Facts` (pure; tested from captured text).  Probes that did not
    run read as unknown (`deploy` asks only some)."""
    asked = probes(host)
    extra = [x for x in (PatchTarget(""), SglangVersion("")) if not any(type(p) is type(x) for p in asked)]
    a = Answers([*extra, *asked], sec)  # not asked: reads as unreadable / unknown
    f = Facts(host=host.name, dump_dir=host.dump.dir, target_file=target_of(host) or "", serving=host.serving.engine)
    f.vllm_version = host.vllm.version if host.serving.engine == "vllm" else None
    f.os = a.read(OsRelease)
    f.kernel = a.read(Kernel)
    f.cpus, f.cpu_model = a.read(Cpu)
    f.mem_total_bytes, f.mem_available_bytes = a.read(Memory)
    f.gpus, f.gpu_error = a.read(GpuQuery)
    f.docker = engine_summary(a.read(EngineVersion))
    f.docker_runtimes = list(a.read(EngineRuntimes).runtimes)
    f.nvidia_runtime = "nvidia" in f.docker_runtimes or a.read(NvidiaToolkit)
    f.dump_dir_free_bytes = a.read(DiskFree)
    f.sglang_version = a.read(SglangVersion)
    f.target_sha256, f.target_lines, f.target_error = a.read(PatchTarget)
    if a.came(HostPython):  # not asked: unknown, not missing
        version, error = a.read(HostPython)
        f.python3 = ".".join(map(str, version)) if version else None
        f.python3_problem = python_problem(version, error)
    return f
