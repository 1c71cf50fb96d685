"""The dump dir on the host: what `dumps status` lists, what `dumps verify` checks, and what
`health` watches (growth and free space).

`dumps status` asks four probes in one round trip (`DumpStatus`) and reads
them into one `DumpDirState`: whether the dir exists, its files
(name + size), every rank's manifest, the free space.  The listing is
NUL-separated (`find -printf '%P\\0%s\\0'`, base64 on the wire so the section
framing holds), so a name holding a newline stays one name, and every name
passes `remote_ops.core.hostpaths.problem` or is set aside as *unsafe*.  The
comparison of manifest and files is pure and lives in `remote_ops.core.dumpcheck`.

`dumps verify` is `DumpVerify`: the stdlib-only `remote_ops/dumper/dumpfile.py`
sent on stdin to the host's `python3` (`python3 - verify DIR --json`), one
round trip, nothing installed.

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
from .base import Check, Output, Probe, Sections
from .disk import existing_parent_df, parse_df_free


def _dir(dump_dir: str) -> str:
    return shell.quote(dump_dir.rstrip("/") or "/")


class DumpDirExists(Probe[bool]):
    name = "exists"

    def __init__(self, dump_dir: str) -> None:
        self.dump_dir = dump_dir

    def command(self) -> str:
        return f"test -d {_dir(self.dump_dir)}"

    def parse(self, status: int, text: str) -> bool:
        return status == 0


#: ({relative name: size}, refused "<name>: <reason>")
Listing = tuple[dict[str, int], list[str]]


class DumpFiles(Probe[Listing]):
    """Every file under `rank*/`, name NUL size NUL ... (any byte but NUL and / may be in a name,
    a newline too), base64 so the section framing holds."""

    name = "files"
    absent = (0, "")

    def __init__(self, dump_dir: str) -> None:
        self.dump_dir = dump_dir

    def command(self) -> str:
        d = _dir(self.dump_dir)
        return f"find {d} -mindepth 2 -maxdepth 2 -path {d}'/rank*/*' -type f -printf '%P\\0%s\\0' | base64 -w0"

    def parse(self, status: int, text: str) -> Listing:
        return parse_listing(text)


def parse_listing(text: str) -> Listing:
    """The base64 of `name NUL size NUL ...` -> ({name: size}, refused "<name>: <reason>") (pure).

    Every name is checked (`hostpaths`): a name with a newline, `..`, a leading
    `/` or bytes that are not UTF-8 is refused, never split into entries.
    """
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return {}, []  # no readable listing: every manifest row shows as missing
    fields = raw.split(b"\0")
    files, unsafe = {}, []
    for name_bytes, size in zip(fields[0::2], fields[1::2]):
        name, reason = hostpaths.decode_name(name_bytes)
        if reason is not None:
            unsafe.append(hostpaths.Unsafe(name, reason).entry)
        elif size.isdigit():
            files[name] = int(size)
    return files, unsafe


class DumpManifests(Probe[str]):
    """Every rank's manifest, each after a `SOURCE_MARK` line naming it (and a newline after it,
    so a torn last line never joins the next marker): torn lines can then be named by file and
    line.  The marker's control characters (a rank dir named `rankZ<newline>..`) show as `?`."""

    name = "manifest"
    absent = (0, "")

    def __init__(self, dump_dir: str) -> None:
        self.dump_dir = dump_dir

    def command(self) -> str:
        d = _dir(self.dump_dir)
        return (
            f'for f in {d}/rank*/{MANIFEST}; do [ -f "$f" ] && '
            f"{{ printf '%s' \"{SOURCE_MARK}$f\" | tr '[:cntrl:]' '?'; echo; cat \"$f\"; echo; }}; done; true"
        )

    def parse(self, status: int, text: str) -> str:
        return text


class DumpDirFree(Probe[int | None]):
    """Bytes free on the dump dir's filesystem (`df -PB1`, its last line)."""

    name = "df"

    def __init__(self, dump_dir: str) -> None:
        self.dump_dir = dump_dir

    def command(self) -> str:
        return f"df -PB1 {_dir(self.dump_dir)} | tail -n 1"

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


class DumpStatus:
    """`dumps status`'s probes (one round trip, in order), read back into one `DumpDirState`."""

    def __init__(self, dump_dir: str) -> None:
        self.exists = DumpDirExists(dump_dir)
        self.files = DumpFiles(dump_dir)
        self.manifests = DumpManifests(dump_dir)
        self.free = DumpDirFree(dump_dir)

    @property
    def probes(self) -> list[Probe[Any]]:
        return [self.exists, self.files, self.manifests, self.free]

    def read(self, sections: Sections) -> DumpDirState:
        """The round trip's answers -> DumpDirState (pure)."""
        files, unsafe = self.files.read(sections)
        return DumpDirState(
            self.exists.read(sections), files, self.manifests.read(sections), self.free.read(sections), unsafe
        )


# -- dumps verify -----------------------------------------------------------------------------------


class DumpVerify(Probe[dict[str, Any] | None]):
    """`dumpfile.py verify` on the host, the script on stdin: headers (and with `check_sha` the
    sha256 of every file) against the manifest, without torch.  Its JSON report, or None."""

    name = "verify"

    def __init__(self, dump_dir: str, hidden_size: int | None, check_sha: bool) -> None:
        self.dump_dir, self.hidden_size, self.check_sha = dump_dir, hidden_size, check_sha

    def command(self) -> str:
        argv = ["python3", "-", "verify", self.dump_dir, "--json"]
        if self.hidden_size:
            argv += ["--hidden-size", str(self.hidden_size)]
        if not self.check_sha:
            argv.append("--no-sha")
        return shell.join(argv)

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


class DumpUsage(Probe[DumpUse]):
    """File count and bytes of finished dump files (temp files excluded), then free space."""

    name = "dumps"

    def __init__(self, dump_dir: str) -> None:
        self.dump_dir = dump_dir

    def command(self) -> str:
        d = shell.quote(self.dump_dir)
        return (
            f"if [ -d {d} ]; then find {d} -name '*.safetensors' ! -name '.tmp-*' -printf '%s\\n' "
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
