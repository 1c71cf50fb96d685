"""deploy's decision: one batched probe (one SSH round trip) and the plan it implies (pure).

`probe_commands` builds the probe: host facts, the host lock (taken in the
same round trip, atomic `mkdir`), the target file's sha256, and the engine's
answer for container + image (`engine.probe`: one `inspect` of both).
`parse_probe` reads it into a `Probe`; `preflight_problems` and `make_plan`
decide from that alone what is out of date.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ...core import shell
from ...core.inventory import HostSpec
from ...engine import labels, probe as engine_probe
from ...engine.types import ContainerInfo, ImageInfo
from ...remote import Remote, command_deadline
from .. import container, facts, hostlock
from .context import context_hash


@dataclass
class Plan:
    """What is out of date, and why (from the probe)."""

    patch: bool
    build: bool
    start: bool
    wait: bool
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def up_to_date(self) -> bool:
        return not (self.patch or self.build or self.start)


@dataclass
class Probe:
    """What the one batched probe found."""

    facts: facts.Facts
    builder: str
    image: ImageInfo | None
    container: ContainerInfo | None
    lock: dict | None
    raw: dict[str, tuple[int, str]] = field(default_factory=dict)
    took_lock: bool = False
    holder: hostlock.Holder | None = None


#: facts probes a deploy does not need to decide anything (reported by `facts` and `health`): each
#: is a process or three on the host, and a fleet's no-op deploy pays them on every host.
SKIPPED_FACTS = {"runtimes", "nvidia_ctk", "os", "kernel", "cpu", "mem", "sglang_version"}
#: The engine's section for container + image in the deploy probe (`engine.probe`).
ENGINE_SECTIONS = engine_probe.SectionNames(version=None, objects="objects", runtimes=None)


def probe_commands(
    host: HostSpec, ref: str, lock_why: str | None = None, token: str | None = None, probe_s: float | None = None
) -> list[tuple[str, str]]:
    """Preflight facts, the lock, then the state under the lock: target sha, container + image (pure).

    One engine inspect of NAME and REF answers for both objects (each docker CLI
    call costs ~0.1-0.25 s on the host; `engine.probe.objects_command`).  With `lock_why`, a section takes the host
    lock (`hostlock.take_cmd`, atomic mkdir) before the state is read, so a
    no-op deploy needs no separate lock round trip; otherwise (dry run) it
    only reads the lock (`hostlock.read_cmd`).  With `probe_s`, each docker
    probe is bounded on the host (a frozen dockerd is that probe's failure).
    """
    lock = (
        hostlock.take_cmd(host.lock_dir, hostlock.info_text(f"deploy: {lock_why}", token))
        if lock_why
        else hostlock.read_cmd(host.lock_dir)
    )
    found = [(n, c) for n, c in facts.probes(host, api=True) if n not in SKIPPED_FACTS]
    preflight = [(n, c) for n, c in found if n != "target"]
    objects = engine_probe.probe_sections(host.container.name, ref, names=ENGINE_SECTIONS, api=True)[0][1]
    if probe_s:
        preflight = facts.bounded(preflight, probe_s)
        objects = facts.bounded([("objects", objects)], probe_s)[0][1]
    return [*preflight, ("lock", lock), *[(n, c) for n, c in found if n == "target"], ("objects", objects)]


def parse_probe(host: HostSpec, sec: dict[str, tuple[int, str]], locking: bool = False) -> Probe:
    """Turn the probe's sections into a `Probe` (pure).

    When `locking`, `lock` is None if this probe took the lock, else the holder;
    otherwise (dry run) it is the holder, if any."""
    f = facts.parse(host, sec)
    snap = engine_probe.parse_probe(sec, names=ENGINE_SECTIONS)
    image, ctr = snap.image, snap.container
    lock_status, lock_text = sec.get("lock", (1, ""))
    if locking:
        took = lock_status == 0
        holder = None if took else (hostlock.parse_info(lock_text) if lock_text.strip() else None)
    else:
        took, holder = False, hostlock.parse_read(lock_status, lock_text)
    lock = holder.to_dict() if holder else (None if took or not locking else {"info": "none"})
    return Probe(f, "", image, ctr, lock, sec, took_lock=took, holder=holder)


def probe(remote: Remote, host: HostSpec, ref: str, lock_why: str | None = None, token: str | None = None) -> Probe:
    """One round trip under the run's command deadline: facts, container + image, and the
    lock: taken with `token` when `lock_why` is given (sections in order: the state is read
    under the lock), else only read (sections concurrently on the host)."""
    if lock_why is None:  # read-only: the sections run at once on the host
        commands = probe_commands(host, ref, None, None, facts.probe_deadline(command_deadline(remote)))
        out = remote.run(shell.parallel_sections(commands), check=False).stdout
        return parse_probe(host, shell.split_sections(out), locking=False)
    probe_s = facts.probe_deadline(command_deadline(remote)) / 2  # its two docker probes run one after the other
    out = remote.run(shell.sections(probe_commands(host, ref, lock_why, token, probe_s)), check=False).stdout
    return parse_probe(host, shell.split_sections(out), locking=lock_why is not None)


def preflight_problems(host: HostSpec, p: Probe) -> list[str]:
    """Reasons not to deploy: no engine, wrong GPU count, no disk, no target file."""
    f, problems = p.facts, []
    if f.docker.get("error") or not f.docker.get("server"):
        problems.append(f"docker engine not usable: {f.docker.get('error', 'no server version')}")
    if host.gpus.count and len(f.gpus) != host.gpus.count:
        problems.append(
            f"inventory expects {host.gpus.count} GPUs, nvidia-smi shows {len(f.gpus)}"
            + (f" ({f.gpu_error})" if f.gpu_error else "")
        )
    free_gb = (f.dump_dir_free_bytes or 0) / 1e9
    if f.dump_dir_free_bytes is not None and free_gb < host.dump.min_free_gb:
        problems.append(f"{free_gb:.1f} GB free under {host.dump.dir}, inventory wants {host.dump.min_free_gb:g} GB")
    if f.target_error or not f.target_sha256:
        problems.append(f"cannot read {host.sglang.target_file}: {f.target_error or 'no sha'}")
    return problems


def make_plan(host: HostSpec, patch, p: Probe, ref: str) -> Plan:
    """Decide what to do from the probe alone (pure)."""
    img, ctr, reasons = p.image, p.container, {}
    patched = bool(
        img
        and img.labels.get(labels.SHA_AFTER) == p.facts.target_sha256
        and img.labels.get(labels.PATCH_HASH) == patch.hash
    )
    if not patched:
        reasons["patch"] = f"{PurePosixPath(patch.target).name} is not the patched file of the current image"
    want_ctx = (
        context_hash(host, patch, (img.labels.get(labels.SHA_BEFORE, "") if img else ""), p.facts.target_sha256 or "")
        if patched
        else None
    )
    build = not patched or img is None or img.labels.get(labels.CONTEXT_HASH) != want_ctx
    if build:
        reasons["build"] = "image missing" if img is None else "build inputs changed"
    start = (
        build
        or img is None
        or ctr is None
        or not ctr.running
        or ctr.image_id != img.id
        or ctr.labels.get(labels.RUN_CONFIG) != container.expected_run_config(host, ref)
    )
    if start:
        reasons["start"] = _start_reason(host, ctr, img, ref, build)
    wait = start or (ctr is not None and ctr.health not in ("healthy", None))
    return Plan(patch=not patched, build=build, start=start, wait=wait, reasons=reasons)


def _start_reason(host: HostSpec, ctr, img, ref: str, build: bool) -> str:
    if build:
        return "new image"
    if ctr is None:
        return "no container"
    if not ctr.running:
        return f"container is {ctr.status}"
    if img is None or ctr.image_id != img.id:
        return "container runs another image"
    return "run settings changed"


def lock_info(why: str) -> str:
    """The lock's `info` for a deploy (`hostlock.info_text`): no `pid=`, the lock is held by
    this client across many commands, so its `client`+`client_pid` prove it stale."""
    return hostlock.info_text(f"deploy: {why}")


def parse_lock(status: int, text: str) -> dict | None:
    """`cat LOCK/info` -> {key: value}, or None when the lock is free (pure)."""
    if status != 0:
        return None
    pairs = [l.split("=", 1) for l in text.splitlines() if "=" in l]
    return {k: v for k, v in pairs} or {"raw": text.strip()}
