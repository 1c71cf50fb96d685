"""Dumps (pure): what a dump dir holds against its manifest, and the verdicts built on that.

The dump dir layout and manifest are the contract in docs/CONTRIBUTING.md and
`remote_ops/dumper/FORMAT.md`: `<dir>/rank<R>/<key>.safetensors`,
`<dir>/rank<R>/manifest.jsonl` (last line of a key wins), `.tmp-*` never listed.

- `reconcile` compares the manifest with the files that `dumps status` listed
  (the probes that list them and read the manifests are `remote_ops.probes.dumps`):
  counts, tokens, bytes, bytes per token (`float_bytes_per_token`: 4 * H * 2 =
  57,344 for H = 7168 in bf16, 4 * H + 16 = 28,688 in FP8 storage), files missing from the manifest, manifest rows with no file, size
  mismatches, temp leftovers.  Every name the host gives (a listed file, a
  manifest row's `file`) passes `remote_ops.core.hostpaths.problem` or is set
  aside as *unsafe*: named in `unsafe`, never counted, never pulled.  An entry
  that is not a regular file (a FIFO, a device, a symlink: entries of the dump
  dir are never followed, `not_regular_reason`) is named in `not_regular` (and
  in `unsafe`: never opened, never pulled), never counted as missing.
- `errors_of`: the error-level problems of the host-side check (`dumps verify`).
- `project`: space for the remaining samples against free space on the host and
  locally.
- `pull_problems`, `merge_hosts`: the verdicts of a pull and a group's merged tree.

The round trips and the local copies are `remote_ops.workflows.dumps`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from . import hostpaths

SUFFIX = ".safetensors"
PACKED_SUFFIX = ".hsz"  # a compacted dump file (`dumps compact`; dumper/FORMAT.md "Packed files")
SUFFIXES = (SUFFIX, PACKED_SUFFIX)


TMP_PREFIX = ".tmp-"


MANIFEST = "manifest.jsonl"


SOURCE_MARK = "#== "  # in the manifests' probe output: the manifest file the following lines come from


DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


TYPICAL_TOKENS_PER_SAMPLE = 1730  # the user's run: 17.3 M tokens / 10,000 samples


#: FP8 storage (dumper/FORMAT.md "FP8 storage (version 2)"), as the inventory's `dump.storage` says it
#: and as a file's `storage` metadata / manifest line says it.
FP8_STORAGES = ("fp8_e4m3", "fp8_e4m3_rowscale")
FP8_DTYPE = "F8_E4M3"  # a manifest line's `dtype` in FP8 storage
ID_BYTES_PER_TOKEN = 8  # input_ids + positions, int32 each (vLLM: token_ids, int64)


def is_fp8(dtype: str | None = None, storage: str | None = None) -> bool:
    """FP8 storage: the inventory's `dump.storage`, a manifest line's `storage` or its `dtype` says so."""
    return storage in FP8_STORAGES or dtype == FP8_DTYPE


def float_bytes_per_token(hidden_size: int, dtype: str | None = "BF16", storage: str | None = "bf16") -> int:
    """Float bytes of one token in a dump: 4 states (3 aux + final) of H values.  4 * H * (dtype size):
    57,344 for H = 7168 in bf16.  FP8 storage (`dump.storage: fp8_e4m3`, a file's `storage=
    fp8_e4m3_rowscale` or dtype F8_E4M3): one byte a value and 4 float32 scales, 4 * H + 16 = 28,688.
    The one size estimate: the extraction client's first guess, `dumps status` and its projection."""
    if is_fp8(dtype, storage):
        return 4 * hidden_size + 4 * 4
    return 4 * hidden_size * DTYPE_BYTES.get(str(dtype), 2)


def bytes_per_token(hidden_size: int, dtype: str | None = "BF16", storage: str | None = "bf16") -> int:
    """A dump file's bytes per token beside its header: `float_bytes_per_token` and the token ids."""
    return float_bytes_per_token(hidden_size, dtype, storage) + ID_BYTES_PER_TOKEN


@dataclass
class Reconciliation:
    """Manifest vs files present on the host."""

    dump_dir: str
    manifest_rows: int = 0  # distinct keys (last line of a key wins)
    files_present: int = 0  # complete *.safetensors files
    tokens: int = 0
    bytes: int = 0  # of manifest rows whose file is present
    partial_rows: int = 0
    hidden_size: int | None = None
    float_bytes_per_token: int | None = None  # 4*H*dtype: 57,344 for H=7168 bf16; FP8 storage 4*H+16
    storage: str = "bf16"  # what the manifest's lines say: bf16 (as computed) or fp8_e4m3_rowscale
    file_bytes_per_token: float | None = None  # observed, headers and ids included
    unlisted_files: list[str] = field(default_factory=list)  # present, not in the manifest
    missing_files: list[str] = field(default_factory=list)  # in the manifest, no file
    size_mismatches: list[dict] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    torn_lines: int = 0
    torn: list[str] = field(default_factory=list)  # "rank0/manifest.jsonl:7: <start of line>"
    # names the host gave that may not become local paths (listed files, manifest rows'
    # `file`), "<name>: <reason>"; never counted above, never pulled (they fail a pull)
    unsafe: list[str] = field(default_factory=list)
    # entries that are not regular files (FIFO, device, symlink; a row inside a symlinked rank
    # dir), "<name>: not a regular file (<what>)": never counted, never opened, never pulled
    not_regular: list[str] = field(default_factory=list)
    configured_dir: str | None = None  # the inventory's dump dir when `dump_dir` is where it resolved to
    records: list[dict] = field(default_factory=list, repr=False)
    unusable: set[str] = field(default_factory=set, repr=False)  # manifest rows' files that are not regular

    @property
    def ok(self) -> bool:
        """Manifest and files agree (`unsafe` names are judged by the pull, which refuses them)."""
        return not (self.missing_files or self.size_mismatches or self.not_regular)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("records")
        d.pop("unusable")
        d["ok"] = self.ok
        return d


#: find's %y type letters of entries that are not regular files, in words
NOT_REGULAR = {
    "l": "a symlink: entries of the dump dir are never followed",
    "p": "a FIFO",
    "c": "a character device",
    "b": "a block device",
    "s": "a socket",
    "D": "a door",
}


def not_regular_reason(kind: str) -> str:
    """`not a regular file (a FIFO)` for find's %y letter `kind` (pure): the one wording of this
    fault in `dumps status`, `verify`, `audit` and `sync`."""
    return f"not a regular file ({NOT_REGULAR.get(kind, f'type {kind!r}')})"


def _not_regular(irregular: dict[str, str], rows: Iterable[str]) -> tuple[list[str], set[str]]:
    """(entries "<name>: not a regular file (...)" sorted by name, the manifest rows among them):
    every listed entry that is not a regular file, and every row inside a rank dir that is one."""
    named = {name: not_regular_reason(kind) for name, kind in irregular.items()}
    hit: set[str] = set()
    for row in rows:
        parent = row.split("/", 1)[0]
        if row in irregular:
            hit.add(row)
        elif "/" in row and parent in irregular:
            what = "a symlink, never followed" if irregular[parent] == "l" else NOT_REGULAR.get(irregular[parent], "?")
            named[row] = f"not a regular file (its rank dir {parent} is {what})"
            hit.add(row)
    return [f"{n}: {named[n]}" for n in sorted(named)], hit


def latest_records(manifest_text: str) -> tuple[dict[str, dict], int]:
    """The last manifest line of each key, and how many lines were unreadable (torn)."""
    latest, torn = {}, 0
    for line in manifest_text.splitlines():
        if not line.strip() or line.startswith(SOURCE_MARK):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(rec, dict) and "key" in rec and "file" in rec:
            latest[str(rec["key"])] = rec
        else:
            torn += 1
    return latest, torn


def torn_entries(manifest_text: str, dump_dir: str = "") -> list[str]:
    """Each unreadable manifest line as `<manifest>:<line>: <start of it>` (pure; names what was torn)."""
    out, source, number = [], "manifest", 0
    for line in manifest_text.splitlines():
        if line.startswith(SOURCE_MARK):
            source, number = _relative(line[len(SOURCE_MARK) :], dump_dir), 0
            continue
        number += 1
        if line.strip() and not _is_record(line):
            out.append(f"{source}:{number}: {line[:60]}")
    return out


def _relative(path: str, dump_dir: str) -> str:
    root = dump_dir.rstrip("/") + "/"
    return path[len(root) :] if dump_dir and path.startswith(root) else path


def _is_record(line: str) -> bool:
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return isinstance(rec, dict) and "key" in rec and "file" in rec


def reconcile(
    dump_dir: str,
    files: dict[str, int],
    manifest_text: str,
    hidden_size: int | None = None,
    unsafe: Iterable[str] = (),
    irregular: dict[str, str] | None = None,
    configured_dir: str | None = None,
) -> Reconciliation:
    """Compare the manifest with the files present (pure).

    `unsafe`: the listing's refused names (`DumpDirState.unsafe`); manifest rows whose
    `file` is refused (or whose `bytes` is not a whole number) join them and are
    left out of everything else.  `irregular`: the listing's entries that are not
    regular files ({name: find's %y letter}): each is named in `not_regular` (and
    `unsafe`), and a row naming one (or a file inside one) is neither present nor
    missing.  `dump_dir` is the dir as the host resolved it; `configured_dir` the
    inventory's, when it differs (a symlink to a big disk).
    """
    latest, torn = latest_records(manifest_text)
    latest, refused = _safe_records(latest)
    not_regular, unusable = _not_regular(irregular or {}, (str(rec["file"]) for rec in latest.values()))
    r = Reconciliation(
        dump_dir,
        manifest_rows=len(latest),
        torn_lines=torn,
        torn=torn_entries(manifest_text, dump_dir),
        unsafe=list(dict.fromkeys([*unsafe, *refused, *not_regular])),
        not_regular=not_regular,
        configured_dir=configured_dir if configured_dir not in (None, dump_dir) else None,
        unusable=unusable,
    )
    complete = {n: s for n, s in files.items() if n.endswith(SUFFIXES) and not _is_temp(n)}
    r.temp_files = sorted(n for n in files if _is_temp(n))
    r.files_present = len(complete)
    listed: set[str] = set()
    for rec in latest.values():
        if str(rec["file"]) in unusable:
            listed.add(str(rec["file"]))
            continue
        _account_record(r, rec, complete, listed)
    r.unlisted_files = sorted(set(complete) - listed)
    _bytes_per_token(r, latest, hidden_size)
    r.records = [latest[k] for k in sorted(latest)]
    return r


def _safe_records(latest: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """Split manifest records into usable ones and refused "<file>: <reason>" entries."""
    safe, refused = {}, []
    for key, rec in latest.items():
        reason = hostpaths.problem(rec["file"])
        if reason is None and (not isinstance(rec.get("bytes"), int) or rec["bytes"] < 0):
            reason = "manifest 'bytes' is not a whole number"
        if reason is None:
            safe[key] = rec
        else:
            refused.append(hostpaths.Unsafe(str(rec["file"]), reason).entry)
    return safe, refused


def _is_temp(name: str) -> bool:
    return name.rsplit("/", 1)[-1].startswith(TMP_PREFIX)


def _account_record(r: Reconciliation, rec: dict, complete: dict[str, int], listed: set) -> None:
    name = str(rec["file"])
    listed.add(name)
    if name not in complete:
        r.missing_files.append(name)
        return
    if complete[name] != rec.get("bytes"):
        r.size_mismatches.append({"file": name, "size": complete[name], "manifest": rec.get("bytes")})
    r.tokens += int(rec.get("tokens", 0))
    r.bytes += complete[name]
    r.partial_rows += 1 if rec.get("partial") else 0


def _bytes_per_token(r: Reconciliation, latest: dict, hidden_size: int | None) -> None:
    found = next((int(x["hidden_size"]) for x in latest.values() if x.get("hidden_size")), None)
    first: dict = next((x for x in latest.values() if x.get("dtype")), {})
    dtype, storage = str(first.get("dtype", "BF16")), first.get("storage")
    r.storage = "fp8_e4m3_rowscale" if is_fp8(dtype, storage) else "bf16"
    r.hidden_size = found or hidden_size
    if r.hidden_size:
        r.float_bytes_per_token = float_bytes_per_token(r.hidden_size, dtype, storage)
    if r.tokens:
        r.file_bytes_per_token = round(r.bytes / r.tokens, 1)


@dataclass
class Projection:
    """Space the rest of the run needs, against free space on the host and locally."""

    samples_done: int
    samples_total: int | None
    bytes_per_sample: float
    remaining_bytes: int  # still to be written on the host
    host_free: int | None
    host_ok: bool | None
    local_needed: int  # to pull everything (done + remaining) not yet local
    local_free: int | None
    local_ok: bool | None
    basis: str  # how bytes_per_sample was estimated

    def to_dict(self) -> dict:
        return asdict(self)


def project(
    r: Reconciliation,
    samples_total: int | None,
    host_free: int | None,
    local_free: int | None,
    local_bytes: int = 0,
    margin: float = 0.05,
    hidden_size: int = 7168,
    storage: str = "bf16",
) -> Projection:
    """Project disk use from the average file so far (or the typical sample when none yet, at the
    size `storage`, the inventory's `dump.storage`, gives a token)."""
    done = r.manifest_rows - len(r.missing_files)
    if done and r.bytes:
        per_sample, basis = r.bytes / done, f"average of {done} files"
    else:
        per_sample = TYPICAL_TOKENS_PER_SAMPLE * bytes_per_token(hidden_size, storage=storage)
        basis = f"typical sample ({TYPICAL_TOKENS_PER_SAMPLE} tokens{', FP8 storage' if is_fp8(None, storage) else ''})"
    remaining = int(max((samples_total or done) - done, 0) * per_sample * (1 + margin))
    local_needed = max(r.bytes + remaining - local_bytes, 0)
    return Projection(
        done,
        samples_total,
        round(per_sample, 1),
        remaining,
        host_free,
        None if host_free is None else host_free >= remaining,
        local_needed,
        local_free,
        None if local_free is None else local_free >= local_needed,
        basis,
    )


def errors_of(report: dict) -> list[dict]:
    """The error-level problems of a dumpfile.py report."""
    return [p for p in report.get("problems", []) if p.get("level") == "error"]


@dataclass
class PullProblems:
    """What a pull could not bring home intact, each entry named (pure verdict of `pull_problems`)."""

    missing: list[str] = field(default_factory=list)  # manifest rows with no file on the host
    torn: list[str] = field(default_factory=list)  # unreadable manifest lines (their file is unknown)
    corrupt: list[str] = field(default_factory=list)  # fetched but size/sha256 differ
    unsafe: list[str] = field(default_factory=list)  # host names refused as local paths: never fetched

    def blocking(self, allow_missing: bool) -> bool:
        """Exit 10?  Corrupt and unsafe entries always; missing and torn ones unless --allow-missing."""
        return bool(self.corrupt or self.unsafe or (not allow_missing and (self.missing or self.torn)))

    def to_dict(self) -> dict:
        return asdict(self)


def pull_problems(
    r: Reconciliation, failed: list[tuple[str, str]], refused: Iterable[tuple[str, str]] = ()
) -> PullProblems:
    """Sort what went wrong: missing on the host (before or during the pull), torn, corrupt, and
    unsafe names (the reconciliation's, and `refused`: those the transfer itself would not write)."""
    p = PullProblems(missing=list(r.missing_files), torn=list(r.torn))
    p.unsafe = list(dict.fromkeys([*r.unsafe, *(hostpaths.Unsafe(n, why).entry for n, why in refused)]))
    for name, reason in failed:
        (p.missing if reason == "missing on the host" else p.corrupt).append(
            name if reason == "missing on the host" else f"{name}: {reason}"
        )
    return p


# --------------------------------------------------------------------------- a group: one merged tree
# Dump files are named by their key, so the hosts' trees merge into one; the same key
# on two hosts is a duplicate, pulled from one host only (remote_ops.workflows.dumps).


@dataclass
class FleetDumps:
    """The hosts' reconciliations merged by dump key."""

    hosts: list[str]
    copies: dict[str, list[tuple[str, dict]]] = field(default_factory=dict)  # key -> [(host, record)]
    conflicts: list[str] = field(default_factory=list)  # one key, copies of different size/sha256

    @property
    def duplicates(self) -> dict[str, list[str]]:
        return {k: [h for h, _ in v] for k, v in self.copies.items() if len(v) > 1}

    def to_dict(self) -> dict:
        per_host = {h: sum(1 for v in self.copies.values() if any(x == h for x, _ in v)) for h in self.hosts}
        return {
            "keys": len(self.copies),
            "per_host": per_host,
            "duplicates": self.duplicates,
            "conflicts": self.conflicts,
            "bytes": sum(int(v[0][1].get("bytes") or 0) for v in self.copies.values()),
        }


def content_id(rec: dict) -> tuple[object, object]:
    """What a dump's content is, whatever its form: (bytes, sha256) of the original file, which a
    compacted copy (`<key>.hsz`) records as `packed.source_bytes` / `packed.source_sha256`; so a
    plain and a compacted copy of the same file are one content, never a conflict (pure)."""
    info = rec.get("packed")
    if isinstance(info, dict) and str(rec.get("file", "")).endswith(PACKED_SUFFIX):
        return info.get("source_bytes"), info.get("source_sha256")
    return rec.get("bytes"), rec.get("sha256")


def merge_hosts(recons: dict[str, Reconciliation], bad: dict[str, set[str]] | None = None) -> FleetDumps:
    """Every key with a file on some host; its copies ordered: not known bad first, then host order (pure)."""
    merged = FleetDumps(list(recons))
    for host, r in recons.items():
        missing = set(r.missing_files) | {m["file"] for m in r.size_mismatches} | r.unusable
        for rec in r.records:
            if str(rec["file"]) not in missing:
                merged.copies.setdefault(str(rec["key"]), []).append((host, rec))
    bad = bad or {}
    for key, copies in merged.copies.items():
        copies.sort(key=lambda c: (str(c[1]["file"]) in bad.get(c[0], set()), merged.hosts.index(c[0])))
        if len({content_id(c[1]) for c in copies}) > 1:
            merged.conflicts.append(key)
    return merged
