"""Host facts: what the host is, gathered in one SSH round trip.

pyinfra-style: `probes(host)` builds the commands (pure), `parse(sections)`
turns their captured output into a `Facts` record (pure), `gather(remote,
host)` is the only function that touches the network.  `health` and `deploy`
reuse the probes and parsers.

Deadlines: the round trip runs under the run's command deadline
(`--command-timeout`), and each probe inside it under `probe_deadline` of
that (`bounded`: coreutils `timeout` on the host), so one hung probe (a
frozen dockerd) is that probe's own failure ("no answer within Ns") and every
other fact is still reported.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from ..core import shell
from ..core.inventory import HostSpec
from ..engine import probe as engine_probe
from ..remote import Remote, command_deadline

#: The engine's sections in the facts probe (commands and parsing live in `remote_ops.engine.probe`).
ENGINE_SECTIONS = engine_probe.SectionNames(version="docker", objects=None, runtimes="runtimes")

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
    sglang_version: str | None = None
    target_file: str = ""
    target_sha256: str | None = None
    target_lines: int | None = None
    target_error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_query_cmd() -> str:
    return shell.join(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"])


def existing_parent_df(path: str) -> str:
    """`df` of `path`, or of its nearest existing parent (the dump dir may not exist yet)."""
    return f'd={shell.quote(path)}; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -P -B1 "$d"'


def probes(host: HostSpec, api: bool = False) -> list[tuple[str, str]]:
    """The commands `facts` runs (one round trip via `shell.sections`).  With `api` (the deploy
    probe) the engine's version is asked over its socket when it can be (`engine.probe`):
    the server's version only, ~30 ms less host CPU than the docker CLI."""
    target = host.sglang.target_file if host.sglang.patch else None  # unbound: no spec, no target
    pkg = host.sglang.checkout.rstrip("/") + "/python/sglang/"
    return [
        p
        for p in [
            ("os", "cat /etc/os-release"),
            ("kernel", "uname -srm"),
            ("cpu", "nproc; grep -m1 'model name' /proc/cpuinfo"),
            ("mem", "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo"),
            (
                "gpus",
                f"command -v nvidia-smi >/dev/null || {{ echo 'no NVIDIA driver'; exit 127; }}; {gpu_query_cmd()}",
            ),
            *engine_probe.probe_sections(None, runtimes=True, names=ENGINE_SECTIONS, api=api),
            ("nvidia_ctk", "command -v nvidia-container-runtime nvidia-container-runtime-hook nvidia-ctk"),
            ("disk", existing_parent_df(host.dump.dir)),
            (
                "sglang_version",
                shell.seq(shell.quiet(["cat", pkg + "version.py"]), shell.quiet(["cat", pkg + "_version.py"])),
            ),
            ("target", shell.and_then(shell.sha256_of(target), shell.read_stdin(["wc", "-l"], target)))
            if target
            else None,
        ]
        if p
    ]


def probe_deadline(command_s: float) -> float:
    """Seconds one probe may take inside a round trip bounded by `command_s`: 80 %, at least
    1 s less, so the framed output of the other probes still comes back in time."""
    return round(max(1.0, min(command_s - 1.0, command_s * 0.8)), 1)


PROBE_TIMED_OUT = "no answer within {s:g}s (probe timed out)"


def bounded(named: list[tuple[str, str]], seconds: float) -> list[tuple[str, str]]:
    """Each probe ends within `seconds` on the host: `timeout -k 1 (seconds - 1)` (a probe that
    ignores SIGTERM, like a docker CLI waiting for a frozen daemon, is killed 1 s later); exit
    124 and a line saying so when it ran out.  Hosts without coreutils `timeout` run it
    unbounded (pure)."""
    limit = round(max(0.5, seconds - 1.0), 1)
    note = shell.quote(PROBE_TIMED_OUT.format(s=limit))
    out = []
    for name, command in named:
        inner = shell.join(["sh", "-c", shell.cmd(command)])
        out.append(
            (
                name,
                f"if command -v timeout >/dev/null 2>&1; then timeout -k 1 {limit:g} {inner}; "
                f"rc=$?; [ $rc -eq 124 ] && echo {note}; exit $rc; else {inner}; fi",
            )
        )
    return out


def gather(remote: Remote, host: HostSpec) -> Facts:
    """Run all probes concurrently in one round trip (each one bounded) and parse them."""
    probe_s = probe_deadline(command_deadline(remote))
    out = remote.run(shell.parallel_sections(bounded(probes(host), probe_s)), check=False).stdout
    return parse(host, shell.split_sections(out))


def parse(host: HostSpec, sec: dict[str, tuple[int, str]]) -> Facts:
    """Turn probe output into `Facts` (pure; tested from captured text)."""
    f = Facts(host=host.name, dump_dir=host.dump.dir, target_file=host.sglang.target_file if host.sglang.patch else "")
    f.os = parse_os_release(_text(sec, "os"))
    f.kernel = _text(sec, "kernel").strip()
    f.cpus, f.cpu_model = parse_cpu(_text(sec, "cpu"))
    f.mem_total_bytes, f.mem_available_bytes = parse_meminfo(_text(sec, "mem"))
    f.gpus, f.gpu_error = parse_gpus(*sec.get("gpus", (127, "no NVIDIA driver")))
    snap = engine_probe.parse_probe(sec, names=ENGINE_SECTIONS)
    f.docker = engine_summary(snap)
    f.docker_runtimes = list(snap.runtimes)
    f.nvidia_runtime = "nvidia" in f.docker_runtimes or bool(_text(sec, "nvidia_ctk").strip())
    f.dump_dir_free_bytes = parse_df_free(_text(sec, "disk"))
    f.sglang_version = parse_sglang_version(sec.get("sglang_version", (1, ""))[1])
    f.target_sha256, f.target_lines, f.target_error = parse_target(*sec.get("target", (1, "")))
    return f


def _text(sec: dict[str, tuple[int, str]], name: str) -> str:
    status, text = sec.get(name, (1, ""))
    return text if status == 0 else ""


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


def _num(value: str) -> int | None:
    value = value.strip()
    try:
        return int(float(value))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_gpus(status: int, text: str) -> tuple[list[Gpu], str | None]:
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


def engine_summary(snap: engine_probe.Snapshot) -> dict:
    """The engine part of facts: {"client", "server", "api"} (+ "error" when the daemon did not answer)."""
    out = {
        "client": snap.client_version,
        "server": snap.version.server if snap.version else None,
        "api": snap.version.api if snap.version else None,
    }
    if snap.version is None:
        out["error"] = snap.error or "docker not available"
    return out


def parse_df_free(text: str) -> int | None:
    """Available bytes from `df -P -B1` (POSIX format: 4th column of line 2)."""
    lines = text.strip().splitlines()
    if len(lines) < 2:
        return None
    cols = lines[-1].split()
    return int(cols[3]) if len(cols) >= 4 and cols[3].isdigit() else None


def parse_sglang_version(text: str) -> str | None:
    """A top-level `__version__ = "X"` (version.py of old releases, or _version.py of 0.5.x).

    Only column-0 assignments count: 0.5.x's version.py has an indented
    fallback `__version__ = "0.0.0.dev0"` that is not the release.
    """
    m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", text, re.M)
    return m.group(1) if m else None


def parse_target(status: int, text: str) -> tuple[str | None, int | None, str | None]:
    """`sha256 of FILE && wc -l < FILE` -> (sha, lines, error)."""
    if status != 0:
        return None, None, (text.strip().splitlines() or ["cannot read target file"])[-1]
    lines = text.strip().splitlines()
    sha = lines[0].split()[0] if lines else None
    count = int(lines[1].split()[0]) if len(lines) > 1 and lines[1].split()[0].isdigit() else None
    return sha, count, None
