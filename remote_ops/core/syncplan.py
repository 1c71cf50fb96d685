"""`dumps sync` decided (pure): what moves from which source, what is already there, what conflicts,
and the narrow grant each source gives the destination.

The inputs are the reconciliations `dumps status` makes (`core.dumpcheck.reconcile`):
every source's and the destination's manifest against its files.  A row whose
file is missing or of the wrong size on its host is not a copy; names a host
gave that fail `core.hostpaths.problem` were already set aside as unsafe.

- A key whose copies (on the sources and the destination) all have one size
  and sha256 moves once, from the first source that has it, unless the
  destination has it already.
- A key with two different contents is a *conflict*: named with every copy's
  host and sha256, never moved, never a silent pick.
- A row whose file is not a regular file on its host (a FIFO, a symlink, a
  device: the listing's type, `Reconciliation.unusable`) is never moved;
  `source_rows` names it apart from a row with no file at all.

The grant (`grant_line`) is one authorized_keys line on a source:
`restrict,from="<destination>",command="<rrsync> -ro <dump dir>" <key> <mark><sync id>`.
`restrict` turns off every forwarding, the pty and ~/.ssh/rc; `command=` makes
the key able to run one thing, a read-only rsync of the dump dir; `from=`
accepts it only from the destination's address.  The comment's mark
(`remote-ops-sync:<destination>:`) lets the next sync to that destination
remove what a killed run left.  The workflow is `remote_ops.workflows.sync`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from . import hostpaths, shell
from .dumpcheck import Reconciliation, content_id

MARK = "remote-ops-sync:"
#: Under the destination's dump dir: the sync's key, known_hosts, plans and staging (same filesystem).
WORK_DIR = ".remote-ops-sync"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


@dataclass
class SyncPlan:
    """Per source, the manifest records to move; the keys the destination has already; the conflicts."""

    dest: str
    moves: dict[str, list[dict]] = field(default_factory=dict)  # source -> records
    present: list[str] = field(default_factory=list)  # keys already on the destination, same content
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # key -> sources with the same content
    conflicts: list[dict] = field(default_factory=list)  # {"key", "copies": [{"host", "sha256", "bytes"}]}

    @property
    def files(self) -> int:
        return sum(len(v) for v in self.moves.values())

    @property
    def bytes(self) -> int:
        return sum(int(r.get("bytes") or 0) for v in self.moves.values() for r in v)

    def source_bytes(self, source: str) -> int:
        return sum(int(r.get("bytes") or 0) for r in self.moves.get(source, []))

    def to_dict(self) -> dict:
        return {
            "dest": self.dest,
            "files": self.files,
            "bytes": self.bytes,
            "per_source": {h: {"files": len(v), "bytes": self.source_bytes(h)} for h, v in self.moves.items()},
            "already_on_dest": len(self.present),
            "duplicates": self.duplicates,
            "conflicts": self.conflicts,
        }


def _copies(r: Reconciliation) -> list[dict]:
    """The records of `r` whose file is on the host at the manifest's size, and regular."""
    bad = set(r.missing_files) | {str(m["file"]) for m in r.size_mismatches} | r.unusable
    return [rec for rec in r.records if str(rec["file"]) not in bad]


@dataclass(frozen=True)
class SourceRows:
    """What the sources cannot give, each "<host>:<entry>": manifest rows with no file
    (`missing`), entries that are not regular files (`not_regular`, "...: not a regular file
    (a FIFO)", `dumpcheck.not_regular_reason`), the other refused names (`unsafe`), torn lines."""

    missing: list[str] = field(default_factory=list)
    not_regular: list[str] = field(default_factory=list)
    unsafe: list[str] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)


def source_rows(recons: dict[str, Reconciliation]) -> SourceRows:
    """Every source's rows and entries that do not move (see `SourceRows`; pure)."""
    out = SourceRows()
    for host, r in recons.items():
        odd = set(r.not_regular)
        out.missing.extend(f"{host}:{m}" for m in r.missing_files)
        out.not_regular.extend(f"{host}:{e}" for e in r.not_regular)
        out.unsafe.extend(f"{host}:{u}" for u in r.unsafe if u not in odd)
        out.torn.extend(f"{host}:{t}" for t in r.torn)
    return out


def plan(sources: dict[str, Reconciliation], dest_name: str, dest: Reconciliation) -> SyncPlan:
    """What a sync moves (see the module doc); sources in the order given."""
    out = SyncPlan(dest_name, moves={h: [] for h in sources})
    copies: dict[str, list[tuple[str, dict]]] = {}
    for rec in _copies(dest):
        copies.setdefault(str(rec["key"]), []).append((dest_name, rec))
    for host, r in sources.items():
        for rec in _copies(r):
            copies.setdefault(str(rec["key"]), []).append((host, rec))
    for key in sorted(copies):
        found = copies[key]
        if len({content_id(rec) for _, rec in found}) > 1:
            out.conflicts.append(
                {
                    "key": key,
                    "copies": [{"host": h, "sha256": rec.get("sha256"), "bytes": rec.get("bytes")} for h, rec in found],
                }
            )
            continue
        on_sources = [h for h, _ in found if h != dest_name]
        if len(on_sources) > 1:
            out.duplicates[key] = on_sources
        if found[0][0] == dest_name:
            out.present.append(key)
        else:
            out.moves[found[0][0]].append(found[0][1])
    return out


# --------------------------------------------------------------------------- the grant


def check_name(name: str) -> str:
    """An inventory name as it may appear in a path component and a key comment, else ValueError."""
    if not _NAME.fullmatch(name) or hostpaths.problem(name):
        raise ValueError(f"host name {name!r} cannot name a sync staging dir or key (letters, digits, . _ -)")
    return name


def check_address(address: str) -> str:
    """An address for `from=`, `BindAddress` and rsync's host: an IPv4 or IPv6 literal, or a host
    name of letters, digits, `.` and `-` (no leading `-`), else ValueError (pure).  An IPv6
    scope (`fe80::1%eth0`) is refused: `from=` cannot match one."""
    try:
        ip = ipaddress.ip_address(address)
        if "%" not in address:
            return str(ip)
    except ValueError:
        if len(address) <= 253 and _HOSTNAME.fullmatch(address):
            return address
    raise ValueError(f"{address!r} is not an IP address or host name (letters, digits, . and -)")


def mark(dest: str) -> str:
    """The comment prefix of every transfer key granted to destination `dest`."""
    return f"{MARK}{check_name(dest)}:"


def grant_line(
    public_key: str, rrsync: str, dump_dir: str, from_address: str, dest: str, sync_id: str, expiry: str | None = None
) -> str:
    """The authorized_keys line a source gets (see the module doc); `expiry` (`YYYYMMDDHHMMZ`, UTC)
    adds OpenSSH's `expiry-time`: a line that both its revoke and the next sync missed still ends."""
    parts = public_key.split()
    if len(parts) < 2 or not parts[0].startswith("ssh-") or not re.fullmatch(r"[A-Za-z0-9+/=]+", parts[1]):
        raise ValueError(f"not an OpenSSH public key: {public_key[:40]!r}")
    command = shell.join([rrsync, "-ro", dump_dir.rstrip("/") or "/"])
    options = [
        "restrict",
        f"from={shell.authorized_keys_value(check_address(from_address))}",
        f"command={shell.authorized_keys_value(command)}",
    ]
    if expiry is not None:
        if not re.fullmatch(r"\d{12}Z", expiry):
            raise ValueError(f"expiry {expiry!r} is not YYYYMMDDHHMMZ")
        options.append(f'expiry-time="{expiry}"')
    return f"{','.join(options)} {parts[0]} {parts[1]} {mark(dest)}{sync_id}"


def known_hosts_name(address: str, port: int) -> str:
    """How known_hosts names `address:port` (`[a]:p` unless port 22)."""
    return address if port == 22 else f"[{address}]:{port}"


# --------------------------------------------------------------------------- on the destination


def work_dir(dest_dump_dir: str) -> str:
    return str(PurePosixPath(dest_dump_dir) / WORK_DIR)


def stage_dir(dest_dump_dir: str, source: str) -> str:
    return str(PurePosixPath(work_dir(dest_dump_dir)) / "stage" / check_name(source))


def transfer_plan(
    *,
    source: str,
    address: str,
    port: int,
    user: str,
    dest_dump_dir: str,
    bind: str | None,
    records: list[dict],
    compress: str,
    bwlimit_kbps: int | None,
    stall_timeout: float,
) -> dict:
    """The JSON document `sync_onhost.py transfer` reads on the destination for one source."""
    work = work_dir(dest_dump_dir)
    return {
        "source": check_name(source),
        "address": check_address(address),
        "port": int(port),
        "user": user,
        "bind": bind,
        "dest_dir": dest_dump_dir,
        "stage": stage_dir(dest_dump_dir, source),
        "key": f"{work}/key",
        "known_hosts": f"{work}/known_hosts",
        "compress": compress,
        "bwlimit_kbps": bwlimit_kbps,
        "stall_timeout": stall_timeout,
        "files": [
            {"file": str(r["file"]), "bytes": int(r["bytes"]), "sha256": str(r["sha256"]), "record": r} for r in records
        ],
    }
