"""The dump dir on the host: what `dumps status` lists, what `dumps verify` checks, and what
`health` watches (growth and free space).

`dumps status` asks five probes in one round trip (`DumpStatus`) and reads
them into one `DumpDirState`: whether the dir exists and where it really is,
its entries (name + size + type), every rank's manifest, the free space.  The
listing is NUL-separated (`find -printf '%P\\0%s\\0%y\\0'`, base64 on the wire
so the section framing holds), so a name holding a newline stays one name, and
every name passes `remote_ops.core.hostpaths.problem` or is set aside as
*unsafe*.  The comparison of manifest and files is pure and lives in
`remote_ops.core.dumpcheck`.

The dump dir rule, the same in every command: the configured dir may itself be
a symlink (operators link it to a big disk); each probe resolves it on the host
(`cd -P`, `real_dir_command`) and works inside the resolved dir, which is what
is reported (`DumpDirResolved`).  Entries inside it are never followed: the
listing does not descend into a symlinked rank dir, a symlink, FIFO or device
where a dump file or rank dir should be is listed with its type and named "not
a regular file" (`dumpcheck.reconcile`), never counted as missing and never
opened; a manifest that is not a regular file is not read.

`dumps verify` is `DumpVerify`: the stdlib-only `remote_ops/dumper/dumpfile.py`
sent on stdin to the host's `python3` (`python3 - verify DIR --json`, DIR the
resolved dir), one round trip, nothing installed.

`health`'s `DumpUsage` counts the finished dump files and their bytes, then the
free space; `check_dumps` says whether they grow (against a local baseline)
and whether the disk has room.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

from ..core import hostpaths, shell
from ..core.dumpcheck import MANIFEST, SOURCE_MARK
from ..core.inventory import HostSpec
from .base import Check, DumpDirProbe, Output, Probe, Sections
from .disk import existing_parent_df, parse_df_free


def _dir(dump_dir: str) -> str:
    return shell.quote(dump_dir.rstrip("/") or "/")


def real_dir_command(dump_dir: str) -> str:
    """Shell that enters the dump dir as the host resolves it (the dir itself may be a symlink:
    `cd -P`, builtins only) or exits 3 when there is none; then `.` is the real dir (pure)."""
    return f"cd -P -- {_dir(dump_dir)} 2>/dev/null || exit 3"


class DumpDirResolved(DumpDirProbe[str | None]):
    """The dump dir's real path on the host (`pwd -P` inside it), or None when there is none."""

    name = "real"

    def command(self) -> str:
        return f"{real_dir_command(self.dump_dir)}; pwd -P"

    def parse(self, status: int, text: str) -> str | None:
        lines = text.strip().splitlines()
        return lines[-1] if status == 0 and lines and lines[-1].startswith("/") else None


class DumpDirExists(DumpDirProbe[bool]):
    name = "exists"

    def command(self) -> str:
        return f"test -d {_dir(self.dump_dir)}"

    def parse(self, status: int, text: str) -> bool:
        return status == 0


#: ({relative name: size} of regular files, refused "<name>: <reason>", {name: find's %y type
#: letter} of the entries that are not regular files: `l` symlink, `p` FIFO, `c`/`b` device, `s` socket)
Listing = tuple[dict[str, int], list[str], dict[str, str]]


class DumpFiles(DumpDirProbe[Listing]):
    """Every entry of the resolved dump dir that is a rank dir or in one and is not a directory,
    never followed: name NUL size NUL type NUL ... (any byte but NUL and / may be in a name, a
    newline too), base64 so the section framing holds."""

    name = "files"
    absent = (0, "")

    def command(self) -> str:
        return (
            f"{real_dir_command(self.dump_dir)}; "
            "find . -mindepth 1 -maxdepth 2 -path './rank*' ! -type d -printf '%P\\0%s\\0%y\\0' | base64 -w0"
        )

    def parse(self, status: int, text: str) -> Listing:
        return parse_listing(text)


def parse_listing(text: str) -> Listing:
    """The base64 of `name NUL size NUL type NUL ...` -> ({name: size} of regular files, refused
    "<name>: <reason>", {name: type} of the rest) (pure).

    Every name is checked (`hostpaths`): a name with a newline, `..`, a leading
    `/` or bytes that are not UTF-8 is refused, never split into entries.
    """
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return {}, [], {}  # no readable listing: every manifest row shows as missing
    fields = raw.split(b"\0")
    files, unsafe, irregular = {}, [], {}
    for name_bytes, size, kind in zip(fields[0::3], fields[1::3], fields[2::3]):
        name, reason = hostpaths.decode_name(name_bytes)
        if reason is not None:
            unsafe.append(hostpaths.Unsafe(name, reason).entry)
        elif kind != b"f":
            irregular[name] = kind.decode("ascii", "replace")[:1] or "?"
        elif size.isdigit():
            files[name] = int(size)
    return files, unsafe, irregular


class DumpManifests(DumpDirProbe[str]):
    """Every rank's manifest, each after a `SOURCE_MARK` line naming it (and a newline after it,
    so a torn last line never joins the next marker): torn lines can then be named by file and
    line.  The marker's control characters (a rank dir named `rankZ<newline>..`) show as `?`."""

    name = "manifest"
    absent = (0, "")

    def command(self) -> str:
        return (  # inside the resolved dir; a manifest (or its rank dir) that is a symlink is not read
            f"{real_dir_command(self.dump_dir)}; "
            f'for f in rank*/{MANIFEST}; do [ -f "$f" ] && [ ! -L "$f" ] && [ ! -L "${{f%/*}}" ] && '
            f"{{ printf '%s' \"{SOURCE_MARK}$f\" | tr '[:cntrl:]' '?'; echo; cat \"$f\"; echo; }}; "
            "done; true"
        )

    def parse(self, status: int, text: str) -> str:
        return text


class DumpDirFree(DumpDirProbe[int | None]):
    """Bytes free on the dump dir's filesystem (`df -PB1`, its last line)."""

    name = "df"

    def command(self) -> str:
        return f"{real_dir_command(self.dump_dir)}; df -PB1 . | tail -n 1"

    def parse(self, status: int, text: str) -> int | None:
        df = text.split()
        return int(df[3]) if len(df) >= 4 and df[3].isdigit() else None


@dataclass
class DumpDirState:
    """What `dumps status` found in a dump dir (before reconciling it with its manifest)."""

    exists: bool
    files: dict[str, int]  # relative path -> size (names that pass `hostpaths.problem`)
    manifest_text: str
    free_bytes: int | None
    unsafe: list[str] = field(default_factory=list)  # listed names refused: "<name>: <reason>"
    irregular: dict[str, str] = field(default_factory=dict)  # entries that are not regular files: name -> type
    real_dir: str | None = None  # the dump dir as the host resolved it (None: not there)


class DumpStatus:
    """`dumps status`'s probes (one round trip, in order), read back into one `DumpDirState`."""

    def __init__(self, dump_dir: str) -> None:
        self.exists = DumpDirExists(dump_dir)
        self.real = DumpDirResolved(dump_dir)
        self.files = DumpFiles(dump_dir)
        self.manifests = DumpManifests(dump_dir)
        self.free = DumpDirFree(dump_dir)

    @property
    def probes(self) -> list[Probe[Any]]:
        return [self.exists, self.real, self.files, self.manifests, self.free]

    def read(self, sections: Sections) -> DumpDirState:
        """The round trip's answers -> DumpDirState (pure)."""
        files, unsafe, irregular = self.files.read(sections)
        return DumpDirState(
            self.exists.read(sections),
            files,
            self.manifests.read(sections),
            self.free.read(sections),
            unsafe,
            irregular,
            self.real.read(sections),
        )


# -- dumps verify -----------------------------------------------------------------------------------


class DumpVerify(Probe[dict[str, Any] | None]):
    """`dumpfile.py verify` on the host, the script on stdin: headers (and with `check_sha` the
    sha256 of every file) against the manifest, without torch.  Its JSON report, or None."""

    name = "verify"

    def __init__(self, dump_dir: str, hidden_size: int | None, check_sha: bool) -> None:
        self.dump_dir, self.hidden_size, self.check_sha = dump_dir, hidden_size, check_sha

    def command(self) -> str:
        """In the resolved dump dir (the configured one may be a symlink), its real path given."""
        argv = ["python3", "-", "verify"]
        rest = ["--json", *(["--hidden-size", str(self.hidden_size)] if self.hidden_size else [])]
        rest += [] if self.check_sha else ["--no-sha"]
        return f'{real_dir_command(self.dump_dir)}; {shell.join(argv)} "$(pwd -P)" {shell.join(rest)}'

    def parse(self, status: int, text: str) -> dict[str, Any] | None:
        """The report whatever the exit status (problems exit non-zero); None when there is none."""
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None


# -- health: are dumps growing, is there room --------------------------------------------------------


@dataclass(frozen=True)
class DumpUse:
    """Finished dump files and their bytes (None: no dump dir yet), and the free bytes there."""

    files: int | None
    bytes: int | None
    free_bytes: int | None


class DumpUsage(DumpDirProbe[DumpUse]):
    """File count and bytes of finished dump files (temp files excluded), then free space."""

    name = "dumps"

    def command(self) -> str:
        # the dump dir resolved once (a symlinked dump dir: its target, `probes.dumpdir`); find never follows inside
        d = shell.quote(self.dump_dir)
        return (
            f"d=$(realpath -e -- {d} 2>/dev/null) || d={d}; "
            "if [ -d \"$d\" ]; then find \"$d\" \\( -name '*.safetensors' -o -name '*.hsz' \\) ! -name '.tmp-*' -printf '%s\\n' "
            "| awk '{n++; s+=$1} END {print n+0, s+0}'; else echo 'absent'; fi; " + existing_parent_df(self.dump_dir)
        )

    def parse(self, status: int, text: str) -> DumpUse:
        return parse_usage(status, text)


def parse_usage(status: int, text: str) -> DumpUse:
    """`FILES BYTES` (or `absent`) on the first line, then `df` (read whatever the exit status)."""
    lines = text.strip().splitlines()
    parts = lines[0].split() if lines else []
    counted = len(parts) == 2 and all(p.isdigit() for p in parts)
    free = parse_df_free("\n".join(lines[1:]))
    return DumpUse(int(parts[0]) if counted else None, int(parts[1]) if counted else None, free)


def check_dumps(
    host: HostSpec, probe: Output, last: dict[str, Any] | None, now: float, extracting: bool | None = None
) -> list[Check]:
    """Dumps growing (against `last`, the previous run's baseline) and room left on the dump disk."""
    use = parse_usage(*probe)
    need = host.dump.min_free_gb * 1e9
    disk = Check("dumps", "free_disk", "skip", "cannot read free space")
    if use.free_bytes is not None:
        free = use.free_bytes
        level = "fail" if free < need else "warn" if free < 2 * need else "ok"
        disk = Check(
            "dumps",
            "free_disk",
            level,
            f"{free / 1e9:,.1f} GB free on {host.dump.dir} (minimum {host.dump.min_free_gb:g} GB)",
            {"free_bytes": free},
        )
    return [_growth(host, use, last, now, extracting), disk]


def _growth(host: HostSpec, use: DumpUse, last: dict[str, Any] | None, now: float, extracting: bool | None) -> Check:
    """Dumps must grow while an extraction runs; with none running (`extracting` False) a
    standing dump dir is expected.  Unknown (`None`): warn, as before the probe said."""
    if use.files is None or use.bytes is None:
        return Check("dumps", "growth", "skip", f"dump dir {host.dump.dir} does not exist yet")
    files, size = use.files, use.bytes
    data = {"files": files, "bytes": size, "time": now}
    if not last:
        return Check("dumps", "growth", "ok", f"{files} files, {size / 1e9:,.2f} GB (baseline recorded)", data)
    grew, dt = size - last["bytes"], now - last["time"]
    if grew > 0:
        return Check(
            "dumps",
            "growth",
            "ok",
            f"+{files - last['files']} files, +{grew / 1e6:,.1f} MB "
            f"in {dt:,.0f}s ({grew / max(dt, 1e-9) / 1e6:,.1f} MB/s)",
            data,
        )
    if extracting is False:
        return Check("dumps", "growth", "ok", f"{files} files, {size / 1e9:,.2f} GB; no extraction running", data)
    return Check(
        "dumps",
        "growth",
        "warn" if files else "ok",
        f"not growing: {files} files, {size / 1e9:,.2f} GB, unchanged for {dt:,.0f}s",
        data,
    )
