"""Dumps over a Remote: probe, host-side verify, and the local copies of a pull.

The decisions (reconcile, projection, pull verdicts, a group's merge) are pure
in `remote_ops.core.dumpcheck`; `pull_items` / `merged_items` say what
`remote_ops.remote.transfer` must fetch, and the local manifests are written here.
Every local path is `remote_ops.core.hostpaths.local_path(root, name)`: the
reconciliation has already set aside the names that fail its check, and the
transfer checks each item again before it writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..core import hostpaths
from ..core.dumpcheck import (
    MANIFEST,
    SUFFIX,
    TMP_PREFIX,
    FleetDumps,
    Probe,
    Reconciliation,
    parse_probe,
    reconcile,
    status_command,
    verify_command,
)
from ..errors import CommandFailed, NotFound
from ..paths import package_file
from ..remote.transfer import PullItem

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
    return sum(p.stat().st_size for p in root.glob(f"rank*/*{SUFFIX}"))


# --------------------------------------------------------------------------- edges


def probe(remote, dump_dir: str, timeout: float | None = None) -> Probe:
    """Run the status probe on the host (one round trip); refused names are in `Probe.unsafe`."""
    result = remote.run(status_command(dump_dir), timeout=timeout)
    found = parse_probe(result.stdout)
    if not found.exists:
        raise NotFound(
            f"dump dir {dump_dir} does not exist",
            host=remote.name,
            hint="check dump.dir in the inventory, or start the server with dumps on",
        )
    return found


def format_script() -> bytes:
    """The stdlib-only dump checker shipped to the host on stdin."""
    return package_file("dumper", "dumpfile.py").read_bytes()


def host_verify(
    remote, dump_dir: str, hidden_size: int | None, check_sha: bool = False, timeout: float | None = None
) -> dict:
    """Header (and optionally sha256) check on the host with its own python3, no torch."""
    result = remote.run(
        verify_command(dump_dir, hidden_size, check_sha), input=format_script(), check=False, timeout=timeout
    )
    try:
        return json.loads(result.stdout)
    except ValueError:
        raise CommandFailed(
            "host-side dump check gave no report (is python3 on the host?)",
            host=remote.name,
            command=result.command,
            exit_status=result.exit_status,
            stderr_tail=result.stderr[-2000:],
        ) from None


def local_dump_dir(host_name: str) -> Path:
    from ..paths import host_dir

    return host_dir(host_name) / "dumps"


def reconcile_probe(probe: Probe, dump_dir: str, hidden_size: int | None = None) -> Reconciliation:
    """`dumpcheck.reconcile` of a probe, its listing's refused names included."""
    return reconcile(dump_dir, probe.files, probe.manifest_text, hidden_size, unsafe=probe.unsafe)


def _item(rec: dict, local_root: Path) -> PullItem:
    name = str(rec["file"])
    return PullItem(name, hostpaths.local_path(local_root, name), int(rec["bytes"]), rec.get("sha256"))


def pull_items(r: Reconciliation, local_root: Path) -> list[PullItem]:
    """One item per manifest row whose file is on the host (missing ones cannot be pulled)."""
    missing = set(r.missing_files)
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
