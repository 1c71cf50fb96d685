"""Dumps over a Remote: probe, host-side verify, the pull, and the local copies it leaves.

The status and verify probes (commands and parsers) are units in
`remote_ops.probes.dumps`; the decisions (reconcile, projection, pull verdicts,
a group's merge) are pure in `remote_ops.core.dumpcheck`; `pull_items` / `merged_items` say what
`remote_ops.remote.transfer` must fetch, `pull` (one host) and `pull_merged`
(a group, round after round until every key has a verified copy or none is
left) fetch it, and the local manifests are written here.  Every local path
is `remote_ops.core.hostpaths.local_path(root, name)`: the reconciliation has
already set aside the names that fail its check, and the transfer checks each
item again before it writes.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..core import hostpaths
from ..core.dumpcheck import MANIFEST, SUFFIXES, TMP_PREFIX, FleetDumps, Reconciliation, reconcile
from ..errors import CommandFailed, ExitCode, NoSpace, NotFound
from ..paths import package_file
from ..probes import batch
from ..probes.dumps import DumpDirState, DumpStatus, DumpVerify
from ..remote import Remote, transfer
from ..remote.transfer import PullItem, PullReport
from . import fleet

if TYPE_CHECKING:
    from ..core.inventory import HostSpec
    from ..remote.sshconfig import SshTarget

# --------------------------------------------------------------------------- local disk (for the projection)


def local_free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem that would hold `path` (nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def local_bytes(root: Path) -> int:
    """Bytes of complete dump files already pulled under `root`."""
    if not root.exists():
        return 0
    return sum(p.stat().st_size for s in SUFFIXES for p in root.glob(f"rank*/*{s}"))


# --------------------------------------------------------------------------- edges


def probe(remote: Remote, dump_dir: str, timeout: float | None = None) -> DumpDirState:
    """Ask the status probes on the host (one round trip: `probes.dumps.DumpStatus`); refused
    names are in `DumpDirState.unsafe`, entries that are not regular files in `.irregular`, the
    dir as the host resolved it (it may be a symlink) in `.real_dir`."""
    status = DumpStatus(dump_dir)
    found = status.read(batch.run(remote, status.probes, check=True, timeout=timeout))
    if not found.exists:
        raise NotFound(
            f"dump dir {dump_dir} does not exist",
            host=remote.name,
            hint="check dump.dir in the inventory, or start the server with dumps on",
        )
    return found


def format_script() -> bytes:
    """The stdlib-only dump checker shipped to the host on stdin, the packed-dump codec with it
    (`onhost.with_codec`: it reads compacted `.hsz` files too)."""
    from .. import onhost

    return onhost.with_codec(package_file("dumper", "dumpfile.py").read_bytes(), "dumpfile.py")


def host_verify(
    remote: Remote, dump_dir: str, hidden_size: int | None, check_sha: bool = False, timeout: float | None = None
) -> dict:
    """Header (and optionally sha256) check on the host with its own python3, no torch
    (`probes.dumps.DumpVerify`: the checker on stdin)."""
    verify = DumpVerify(dump_dir, hidden_size, check_sha)
    result = remote.run(verify.command(), input=format_script(), check=False, timeout=timeout)
    report = verify.parse(result.exit_status, result.stdout)
    if report is None and result.exit_status == 3 and not result.stdout.strip():
        raise NotFound(f"dump dir {dump_dir} does not exist", host=remote.name)
    if report is None:
        raise CommandFailed.of("host-side dump check gave no report (is python3 on the host?)", result, remote.name)
    return report


def local_dump_dir(host_name: str) -> Path:
    from ..paths import host_dir

    return host_dir(host_name) / "dumps"


def reconcile_probe(probe: DumpDirState, dump_dir: str, hidden_size: int | None = None) -> Reconciliation:
    """`dumpcheck.reconcile` of a probe, its listing's refused names and entries that are not
    regular files included; reported at the dir the host resolved (`configured_dir`: `dump_dir`
    when that differs)."""
    return reconcile(
        probe.real_dir or dump_dir,
        probe.files,
        probe.manifest_text,
        hidden_size,
        unsafe=probe.unsafe,
        irregular=probe.irregular,
        configured_dir=dump_dir.rstrip("/") or "/",
    )


def _item(rec: dict, local_root: Path) -> PullItem:
    name = str(rec["file"])
    return PullItem(name, hostpaths.local_path(local_root, name), int(rec["bytes"]), rec.get("sha256"))


def pull_items(r: Reconciliation, local_root: Path) -> list[PullItem]:
    """One item per manifest row whose file is on the host (missing ones cannot be pulled, and
    one that is not a regular file is never opened)."""
    missing = set(r.missing_files) | r.unusable
    return [_item(rec, local_root) for rec in r.records if str(rec["file"]) not in missing]


def write_local_manifests(r: Reconciliation, local_root: Path) -> int:
    """Write `rank<R>/manifest.jsonl` locally for the files that were pulled and verified.

    The local copy is then itself a valid dump dir (`dumpfile.py verify` works on it).
    """
    by_rank: dict[str, list[str]] = {}
    for rec in r.records:
        if hostpaths.local_path(local_root, rec["file"]).exists():
            by_rank.setdefault(str(rec["file"]).split("/", 1)[0], []).append(json.dumps(rec, sort_keys=True))
    for rank, lines in by_rank.items():
        path = local_root / rank / MANIFEST
        tmp = path.with_name(TMP_PREFIX + MANIFEST)
        tmp.write_text("".join(l + "\n" for l in lines))
        tmp.replace(path)
    return sum(len(v) for v in by_rank.values())


# --------------------------------------------------------------------------- a pull


@dataclass(frozen=True)
class PullSettings:
    """How a pull runs: the ssh_config file, concurrent ssh streams per host, the stall deadline."""

    ssh_config: str | None = None
    jobs: int = 2
    stall_timeout: float = 60.0


def check_pull_space(items: list[PullItem], host: str) -> None:
    """NoSpace (exit 14) before the first byte when the files still to fetch cannot fit here."""
    transfer.check_space([i for i in items if not transfer.is_complete(i)], host)


def pull(
    target: SshTarget,
    dump_dir: str,
    items: list[PullItem],
    how: PullSettings,
    local_root: Path,
    advance: transfer.Advance | None = None,
) -> PullReport:
    """Fetch `items` from one host into `local_root`: resumable, sha256-verified, `how.jobs` streams.
    Failed and unsafe files are in the report (not raised); a lost connection is `Unreachable`."""
    return transfer.pull(
        target,
        dump_dir,
        items,
        ssh_config=how.ssh_config,
        jobs=how.jobs,
        stall_timeout=how.stall_timeout,
        advance=advance,
        strict=False,
        dest=local_root,
    )


def write_pulled_manifests(r: Reconciliation, local_root: Path, host: str) -> int:
    """`write_local_manifests` after a pull; a full disk here is NoSpace (exit 14) too."""
    try:
        return write_local_manifests(r, local_root)
    except OSError as exc:
        if exc.errno not in transfer.NO_SPACE_ERRNOS:
            raise
        where, free = transfer.free_space(local_root)
        raise NoSpace(
            f"local disk full writing the local manifests: {free:,} bytes free on {where}",
            host=host,
            hint="free space there and re-run: the pulled files are kept",
            details={"needed_bytes": None, "free_bytes": free, "path": str(where)},
        ) from None


# --------------------------------------------------------------------------- a group: one merged tree
#
# Dump files are named by their key (content), so the hosts' trees merge into
# one: `rank<R>/<key>.safetensors`.  The same key on two hosts (a sample sent
# twice, e.g. in flight on a host that died and was re-split) is a duplicate:
# reported, and pulled from one host only - the first whose copy verifies.
# The merge itself is pure: `core.dumpcheck.merge_hosts`.


def merged_items(merged: FleetDumps, local_root: Path, choice: dict[str, int]) -> dict[str, list[PullItem]]:
    """{host: items} taking, for each key, copy number `choice[key]` (0 = preferred); keys past the end: none."""
    out: dict[str, list[PullItem]] = {}
    for key, copies in merged.copies.items():
        n = choice.get(key, 0)
        if n < len(copies):
            host, rec = copies[n]
            out.setdefault(host, []).append(_item(rec, local_root))
    return out


def write_merged_manifests(merged: FleetDumps, kept: dict[str, str], local_root: Path) -> int:
    """Local `rank<R>/manifest.jsonl` for the kept copies, each record naming its `host` (one merged manifest)."""
    records = [
        {**rec, "host": host} for key, copies in merged.copies.items() for host, rec in copies if kept.get(key) == host
    ]
    return write_local_manifests(Reconciliation("merged", records=sorted(records, key=lambda r: r["file"])), local_root)


def merged_dump_dir() -> Path:
    from ..paths import state_dir

    return state_dir() / "merged" / "dumps"


@dataclass
class GroupPull:
    """What `pull_merged` did: the host each key was kept from, the keys not reached (their only
    copies were on hosts whose connection was lost), those hosts, each host's pull reports
    (one per round it took part in), the seconds it took and the rows of the merged manifest."""

    kept: dict[str, str] = field(default_factory=dict)
    unreached: list[str] = field(default_factory=list)
    lost_hosts: list[str] = field(default_factory=list)
    reports: dict[str, list[dict]] = field(default_factory=dict)
    seconds: float = 0.0
    written: int = 0


def pull_merged(
    merged: FleetDumps,
    local_root: Path,
    hosts: list[HostSpec],
    target_of: Callable[[HostSpec], SshTarget],
    how: PullSettings,
    *,
    forks: int,
    advance: transfer.Advance | None = None,
) -> GroupPull:
    """Pull every key of `merged` once into `local_root`, then write the merged manifest.

    Round after round, each host (`forks` at a time) pulls the keys whose current
    copy it holds; a key whose copy fails on arrival moves to its next copy in the
    next round, until every key is kept or has no copy left.  `advance` may be
    called from several threads at once (it is serialised here)."""
    by_name = {h.name: h for h in hosts}
    out = GroupPull()
    lost_hosts: set[str] = set()  # connection lost during their pull
    choice: dict[str, int] = {}
    lock = threading.Lock()

    def tick(n: int) -> None:
        if advance is not None:
            with lock:
                advance(n)

    round_ = _PullRound(by_name, target_of, how, local_root, tick)
    t0 = time.monotonic()
    items = merged_items(merged, local_root, {})
    while items:
        failed = round_.run(items, forks, out, lost_hosts)
        for key in failed:
            choice[key] = choice.get(key, 0) + 1
        items = merged_items(merged, local_root, {k: choice[k] for k in failed})
        items = {h: [i for i in v if _key_of(i) in failed] for h, v in items.items()}
        items = {h: v for h, v in items.items() if v}
    out.seconds = time.monotonic() - t0
    out.written = write_merged_manifests(merged, out.kept, local_root)
    out.unreached = sorted(
        k for k in set(merged.copies) - set(out.kept) if any(h in lost_hosts for h, _ in merged.copies[k])
    )
    out.lost_hosts = sorted(lost_hosts)
    return out


def key_of_name(name: str) -> str:
    """The key of a dump file name, plain (`<key>.safetensors`) or compacted (`<key>.hsz`)."""
    base = Path(name).name
    return next((base[: -len(s)] for s in SUFFIXES if base.endswith(s)), base)


def _key_of(item: PullItem) -> str:
    return key_of_name(item.remote)


@dataclass
class _PullRound:
    """One pull per host, in parallel (`fleet.fan_out`)."""

    by_name: dict[str, HostSpec]
    target_of: Callable[[HostSpec], SshTarget]
    how: PullSettings
    local_root: Path
    tick: transfer.Advance

    def run(self, items: dict[str, list[PullItem]], forks: int, out: GroupPull, lost_hosts: set[str]) -> set[str]:
        """The keys whose copy failed; every other key of `items` is kept from its host (`out.kept`);
        a host whose connection was lost joins `lost_hosts`."""

        def work(spec: HostSpec) -> tuple[int, PullReport]:
            return 0, pull(self.target_of(spec), spec.dump.dir, items[spec.name], self.how, self.local_root, self.tick)

        run = fleet.fan_out([self.by_name[h] for h in items], work, forks=forks)
        failed: set[str] = set()
        for o in run.outcomes:
            out.reports.setdefault(o.host, []).append(o.result.to_dict() if o.result else {"error": str(o.error)})
            done = o.result.failed + o.result.unsafe if o.result else []
            bad = {key_of_name(f) for f, _ in done}
            if o.error is not None:
                bad = {_key_of(i) for i in items[o.host]}
                if o.error.exit_code == ExitCode.UNREACHABLE:
                    lost_hosts.add(o.host)
            for item in items[o.host]:
                key = _key_of(item)
                if key in bad:
                    failed.add(key)
                else:
                    out.kept[key] = o.host
        return failed
