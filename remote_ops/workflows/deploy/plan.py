"""deploy's decision: one batched probe (one SSH round trip) and the plan it implies (pure).

`probes_for` picks the probe units (`remote_ops.probes`): the host facts a
deploy decides on (GPUs, the engine's version, free space, the dump dir's
`device:inode`), the host lock (taken in the same round trip, atomic `mkdir`),
the target file's sha256, and the engine's answer for container + image (one
`inspect` of both).
`parse_probe` reads their answers into a `Probe`; `preflight_problems` and
`make_plan` decide from that alone what is out of date.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from ...core.inventory import HostSpec
from ...engine import labels
from ...engine.types import ContainerInfo, ImageInfo
from ...probes import base, batch
from ...probes.disk import DiskFree
from ...probes.dumpdir import DumpDir, DumpDirState, stale_mount
from ...probes.engine import EngineObjects, EngineVersion
from ...probes.gpu import GpuQuery
from ...probes.lock import Holder, LockRead, LockTake
from ...probes.sglang import PatchTarget
from ...probes.system import HostPython
from ...remote import Remote
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
    holder: Holder | None = None
    dump_dir: DumpDir | None = None  # None: the probe did not answer (the mount is then not judged)


def probes_for(
    host: HostSpec, ref: str, lock_why: str | None = None, token: str | None = None
) -> list[base.Probe[Any]]:
    """Preflight facts, the lock, then the state under the lock: target sha, container + image.

    Only the facts a deploy decides on (each other fact is a process or three on
    the host, and a fleet's no-op deploy pays them on every host), the engine's
    over its socket when it can be.  One engine inspect of NAME and REF answers
    for both objects (each engine CLI call costs ~0.1-0.25 s on the host).  With
    `lock_why`, a probe takes the host lock (`LockTake`, atomic mkdir) before
    the state is read, so a no-op deploy needs no separate lock round trip;
    otherwise (dry run) it only reads the lock (`LockRead`).
    """
    lock: base.Probe[Any] = (
        LockTake(host.lock_dir, hostlock.info_text(f"deploy: {lock_why}", token))
        if lock_why
        else LockRead(host.lock_dir)
    )
    target = facts.target_of(host)
    return [
        GpuQuery(),
        EngineVersion(host, api=True),
        DiskFree(host.dump.dir),
        HostPython(),
        lock,
        *([PatchTarget(target)] if target else []),
        EngineObjects(host, ref, api=True),
        DumpDirState(host.dump.dir),
    ]


def parse_probe(host: HostSpec, sec: base.Sections, locking: bool = False) -> Probe:
    """Turn the probes' answers into a `Probe` (pure).

    When `locking`, `lock` is None if this probe took the lock, else the holder;
    otherwise (dry run) it is the holder, if any."""
    f = facts.parse(host, sec)
    found = EngineObjects(host).read(sec)
    if locking:
        taken = LockTake(host.lock_dir, "").read(sec)
        took, holder = taken.took, taken.holder
    else:
        took, holder = False, LockRead(host.lock_dir).read(sec)
    lock = holder.to_dict() if holder else (None if took or not locking else {"info": "none"})
    dump_dir = DumpDirState(host.dump.dir)
    state = dump_dir.read(sec) if dump_dir.output(sec)[0] == 0 else None
    return Probe(f, "", found.image, found.container, lock, dict(sec), took_lock=took, holder=holder, dump_dir=state)


def probe(remote: Remote, host: HostSpec, ref: str, lock_why: str | None = None, token: str | None = None) -> Probe:
    """One round trip under the run's command deadline: facts, container + image, and the
    lock: taken with `token` when `lock_why` is given (probes in order: the state is read
    under the lock), else only read (probes concurrently on the host).  Each probe but the
    lock and the target's sha is bounded on the host (a frozen daemon is that probe's failure)."""
    asked = probes_for(host, ref, lock_why, token)
    if lock_why is None:  # read-only: the probes run at once on the host
        sec = batch.run(remote, asked, parallel=True, probe_s=batch.deadline_of(remote), unbounded=[PatchTarget])
        return parse_probe(host, sec, locking=False)
    probe_s = batch.deadline_of(remote) / 2  # its two engine probes run one after the other
    sec = batch.run(remote, asked, probe_s=probe_s, unbounded=[PatchTarget])
    return parse_probe(host, sec, locking=True)


def preflight_problems(host: HostSpec, p: Probe) -> list[str]:
    """Reasons not to deploy: no engine, wrong GPU count, no disk, no target file, no python3 for
    the on-host tools (`probes.system.python_problem` names them)."""
    f, problems = p.facts, []
    if f.docker.get("error") or not f.docker.get("server"):
        problems.append(f"{host.engine} engine not usable: {f.docker.get('error', 'no server version')}")
    if host.gpus.count and len(f.gpus) != host.gpus.count:
        problems.append(
            f"inventory expects {host.gpus.count} GPUs, nvidia-smi shows {len(f.gpus)}"
            + (f" ({f.gpu_error})" if f.gpu_error else "")
        )
    free_gb = (f.dump_dir_free_bytes or 0) / 1e9
    if f.dump_dir_free_bytes is not None and free_gb < host.dump.min_free_gb:
        problems.append(f"{free_gb:.1f} GB free under {host.dump.dir}, inventory wants {host.dump.min_free_gb:g} GB")
    if host.serving.engine == "sglang" and (f.target_error or not f.target_sha256):
        problems.append(f"cannot read {host.sglang.target_file}: {f.target_error or 'no sha'}")
    if f.python3_problem:
        problems.append(f.python3_problem)
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
    start = needs_start(host, ref, img, ctr, build, p.dump_dir)
    if start:
        reasons["start"] = start_reason(host, ref, ctr, img, build, p.dump_dir)
    wait = start or (ctr is not None and ctr.health not in ("healthy", None))
    return Plan(patch=not patched, build=build, start=start, wait=wait, reasons=reasons)


def needs_start(host, ref: str, img, ctr, build: bool, dump_dir: DumpDir | None = None) -> bool:
    """The container must be (re)created: a new build, no image or container, not running, another
    image, other run settings than the inventory's, or a stale mount of the dump dir (it was
    removed, or removed and made again, since the container started: `probes.dumpdir.mount_of`)
    (any serving engine)."""
    return build or img is None or not is_current(host, ref, ctr, img.id, dump_dir)


def is_current(host, ref: str, ctr, image_id: str, dump_dir: DumpDir | None = None) -> bool:
    """The container may stay: it runs `image_id` with the inventory's run settings and mounts the
    dump dir as it is now (not judged when the probe did not read the dir) (pure)."""
    return bool(
        ctr is not None
        and ctr.running
        and ctr.image_id == image_id
        and ctr.labels.get(labels.RUN_CONFIG) == container.expected_run_config(host, ref)
        and (dump_dir is None or stale_mount(dump_dir, ctr) is None)
    )


def start_reason(host: HostSpec, ref: str, ctr, img, build: bool, dump_dir: DumpDir | None = None) -> str:
    """Why `needs_start` said so, in words (what `--dry-run` and the check step show)."""
    if build:
        return "new image"
    if ctr is None:
        return "no container"
    if not ctr.running:
        return f"container is {ctr.status}"
    if img is None or ctr.image_id != img.id:
        return "container runs another image"
    stale = stale_mount(dump_dir, ctr) if dump_dir is not None else None
    if not stale:
        return "run settings changed"
    settings = ctr.labels.get(labels.RUN_CONFIG) != container.expected_run_config(host, ref)
    return ("run settings changed; " if settings else "") + f"stale mount: {stale}"


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
