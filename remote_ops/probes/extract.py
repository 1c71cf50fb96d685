"""The extraction client on the host (`remote_ops/onhost/extract_onhost.py`): is it running,
where it stands, what it has done.

`extract status` asks `ExtractStatusProbes` in one round trip and reads them
into an `ExtractStatus`: alive, PID, the log's tail, the client's own
counts for the current dataset, the missing samples, the client's output (and,
for a group, every dump key done; with a wait, the host first waits for the
client to exit).  `ExtractAlive` is also `health`'s question (dumps only grow
while a client runs) and what `extract start` / `stop` ask before they act.
The work dir layout and the launch command are `remote_ops.core.extractplan`.

The same probes ask `dataset regenerate`'s client (`remote_ops/onhost/regenerate_onhost.py`),
whose work dir has the same layout and whose paths name its own program
(`remote_ops.core.regenplan.RegenPaths`); its content keys end in `-c`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..core import shell
from ..core.extractplan import ExtractPaths, ExtractStatus
from .base import Probe, Sections, WorkDirProbe


class ExtractAlive(WorkDirProbe[bool]):
    """The recorded PID is alive and still runs our client (not a reused PID): exit 0."""

    name = "extraction"

    def command(self) -> str:
        read_pid = shell.small_file_command(self.paths.file("client.pid"), PID_FILE_CAP)
        return (
            f'pid=$({read_pid}) && [ -n "$pid" ] && '
            f"tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -q {shell.quote(self.paths.client_name)}"
        )

    def parse(self, status: int, text: str) -> bool:
        return status == 0


#: A client.pid holds one number; `missing.jsonl` is read up to this many bytes (a line cut
#: there is dropped by the parser; 16 MiB is ~100,000 records).
PID_FILE_CAP = 64
MISSING_CAP = 16 << 20


class ClientPid(WorkDirProbe[int | None]):
    name = "pid"

    def command(self) -> str:
        return f"{shell.small_file_command(self.paths.file('client.pid'), PID_FILE_CAP)}; echo"

    def parse(self, status: int, text: str) -> int | None:
        return count(text.strip())


#: `extract status` reads at most this much of each log line (the host cuts the rest):
#: a 16 MB line in the log must not travel, nor be parsed (`logparse.LINE_LIMIT`).
LOG_LINE_BYTES = 64 * 1024


class ClientLog(Probe[str]):
    """The last `lines` lines of the client's progress log, each cut to `LOG_LINE_BYTES`."""

    name = "log"

    def __init__(self, paths: ExtractPaths, lines: int = 400) -> None:
        self.paths, self.lines = paths, lines

    def command(self) -> str:
        return f"tail -n {int(self.lines)} {shell.quote(self.paths.log)} | cut -b 1-{LOG_LINE_BYTES}; echo"

    def parse(self, status: int, text: str) -> str:
        return text


class ClientLogSince(Probe[str]):
    """The client's progress log from byte `offset` on (what a start wrote)."""

    name = "log_since"

    def __init__(self, paths: ExtractPaths, offset: int) -> None:
        self.paths, self.offset = paths, offset

    def command(self) -> str:
        return f"tail -c +{int(self.offset) + 1} {shell.quote(self.paths.log)}"

    def parse(self, status: int, text: str) -> str:
        return text


class ClientCounts(WorkDirProbe[dict[str, Any]]):
    """The client's own count for the current dataset (`count`): done, total, dataset_id."""

    name = "counts"

    def command(self) -> str:
        p = self.paths
        return f"python3 {shell.quote(p.client)} count --workdir {shell.quote(p.workdir)}"

    def parse(self, status: int, text: str) -> dict[str, Any]:
        try:
            doc = json.loads(text.strip() or "{}")
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}


class MissingSamples(WorkDirProbe[list[Any]]):
    """`missing.jsonl`: the samples whose dumps never appeared, one JSON record a line."""

    name = "missing"

    def command(self) -> str:
        return f"{shell.head_of_regular_file(self.paths.file('missing.jsonl'), MISSING_CAP)}; echo"

    def parse(self, status: int, text: str) -> list[Any]:
        missing = []
        for line in text.splitlines():
            try:
                missing.append(json.loads(line))
            except ValueError:
                pass
        return missing


class ClientOutput(WorkDirProbe[str]):
    """The last 20 lines of the client's stdout + stderr (`client.out`)."""

    name = "out"

    def command(self) -> str:
        return f"tail -n 20 {shell.quote(self.paths.file('client.out'))}"

    def parse(self, status: int, text: str) -> str:
        return text


_KEY = re.compile(r"[0-9a-f]{32}-(?:p\d+|c)")


def parse_keys(text: str) -> set[str]:
    """Content keys, one a line: dump keys (`-p<prefix>`) or regenerate's chat keys (`-c`);
    anything else, e.g. an error message, is ignored."""
    return {ln.strip() for ln in text.splitlines() if _KEY.fullmatch(ln.strip())}


class DoneKeys(WorkDirProbe[set[str]]):
    """Every dump key with an `ok` line in the host's manifest (none without a manifest)."""

    name = "keys"

    def command(self) -> str:
        p = self.paths
        return f"python3 {shell.quote(p.client)} done-keys --workdir {shell.quote(p.workdir)}"

    def parse(self, status: int, text: str) -> set[str]:
        return parse_keys(text)


class WaitExit(Probe[None]):
    """Return when the running client exits, or after `wait_s` seconds.  Exit 0 either way.

    Each 0.1 s step reads the PID's state: it must exist and not be a zombie (an exited
    client whose parent has not reaped it yet is gone for us; `kill -0` would still see it)."""

    name = "waited"

    def __init__(self, paths: ExtractPaths, wait_s: float) -> None:
        self.paths, self.wait_s = paths, wait_s

    def command(self) -> str:
        steps = max(1, int(self.wait_s * 10))
        running = "grep -q '^State:[[:space:]]*[^Z[:space:]]' /proc/$pid/status 2>/dev/null"
        return (
            f"if {ExtractAlive(self.paths).command()}; then n=0; "
            f"while {running} && [ $n -lt {steps} ]; do sleep 0.1; n=$((n+1)); done; fi; true"
        )

    def parse(self, status: int, text: str) -> None:
        return None


class FileSha(Probe[str | None]):
    """sha256 of a file on the host (None when it cannot be read); `name` tells two apart."""

    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = path, name

    def command(self) -> str:
        return shell.sha256_of(self.path)

    def parse(self, status: int, text: str) -> str | None:
        return text.strip() if status == 0 else None


class ExtractStatusProbes:
    """`extract status` in one round trip: alive, pid, log tail, counts, missing, client output
    (+ with `with_keys` every done key), read back into an `ExtractStatus`.  With `wait_s`, the
    host first waits up to that long for a running client to exit (`WaitExit`), so a `--wait`
    loop sees the end within 0.1 s, not at its next poll."""

    def __init__(self, paths: ExtractPaths, log_lines: int = 400, with_keys: bool = False, wait_s: float = 0.0) -> None:
        self.waited = WaitExit(paths, wait_s) if wait_s > 0 else None
        self.keys = DoneKeys(paths) if with_keys else None
        self.alive = ExtractAlive(paths)
        self.pid = ClientPid(paths)
        self.log = ClientLog(paths, log_lines)
        self.counts = ClientCounts(paths)
        self.missing = MissingSamples(paths)
        self.out = ClientOutput(paths)

    @property
    def probes(self) -> list[Probe[Any]]:
        # `alive` before `keys`: keys read after a client was seen gone are its final ones (read
        # first, a client exiting in between left the last key out of a "finished" status)
        first = [p for p in (self.waited, self.alive, self.keys) if p is not None]
        return [*first, self.pid, self.log, self.counts, self.missing, self.out]

    def read(self, host: str, sections: Sections) -> ExtractStatus:
        """The round trip's answers -> ExtractStatus (pure)."""
        from ..core.logparse import parse_extraction  # its regexes compile on import; health needs none

        counts = self.counts.read(sections)
        log = self.log.read(sections)
        dataset_id = counts.get("dataset_id")
        return ExtractStatus(
            host,
            self.alive.read(sections),
            self.pid.read(sections),
            parse_extraction(log),
            count(counts.get("done")) or 0,
            self.missing.read(sections),
            self.out.read(sections),
            count(counts.get("total")) or 0,
            dataset_id if isinstance(dataset_id, str) else None,
            _reused_ids(log),
            fatal_of(log),
        )


def count(value: object) -> int | None:
    """A count the host printed (text or a JSON number): None unless 0..10**18."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return int(text) if text.isdigit() and text.isascii() and len(text) <= 18 else None


def _reused_ids(log_text: str) -> int:
    """`reused_ids=N` of the last `started` line (the current run), 0 if none."""
    from ..core.logparse import bounded_lines

    started = ""
    for line in bounded_lines(log_text):
        started = line if " started " in line else started
    field = next((w for w in started.split() if w.startswith("reused_ids=")), "")
    return count(field.partition("=")[2]) or 0


def fatal_of(log_text: str) -> dict[str, str] | None:
    """The current run's `fatal cause=.. dir=.. says=".."` line (after its last `started`): the
    cause the client stopped on, e.g. the dump dir gone; None when it did not (pure)."""
    from ..core.logparse import _fields, bounded_lines

    fatal: dict[str, str] | None = None
    for line in bounded_lines(log_text):
        event = line.split(" ", 2)[1] if line.count(" ") >= 1 else ""
        if event == "started":
            fatal = None
        elif event == "fatal":
            kv = _fields(line)
            fatal = {k: kv[k] for k in ("cause", "dir", "says") if k in kv}
            fatal["since"] = line.split(" ", 1)[0]
    return fatal
