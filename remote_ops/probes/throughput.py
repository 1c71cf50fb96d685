"""The server's own figures and the dumper's cost, read on the host: SGLang's scheduler lines from
the container's log, every rank's `stats.json`, and when a regenerate run started.

`SchedulerLines` asks the host's engine for the server container's log from a time on
(`engine.cli_for(host).logs_since_command`) and keeps only the prefill and decode lines, at most
`limit` of them (the last ones), so a long log never travels whole; they are read by
`remote_ops.core.sglanglog`.  `DumperStats` prints each `rank*/stats.json` after a `==> PATH`
line, read by `remote_ops.core.dumpercost.parse_stats`.  `RunStarted` is `run.json`'s `started`
in a client work dir (`dataset regenerate`'s window for the server's generation figure).
"""

from __future__ import annotations

import json

from ..core import dumpercost, sglanglog, shell
from ..core.inventory import HostSpec
from ..engine import cli_for
from .base import DumpDirProbe, Probe, WorkDirProbe

#: At most this many scheduler lines come back (the last ones of the window).
MAX_LINES = 200_000
_PATTERN = f"{sglanglog.PREFILL}|{sglanglog.DECODE}"


class SchedulerLines(Probe[list[sglanglog.SchedLine]]):
    """The server container's prefill and decode lines since `since` (an engine `--since` value:
    Unix seconds or RFC 3339), each with the engine's timestamp in front."""

    name = "scheduler_lines"
    absent = (0, "")

    def __init__(self, host: HostSpec, since: str, limit: int = MAX_LINES) -> None:
        self.host, self.since, self.limit = host, since, limit

    def command(self) -> str:
        logs = cli_for(self.host).logs_since_command(self.host.container.name, self.since)
        return f"( {logs} ) | grep -aE {shell.quote(_PATTERN)} | tail -n {int(self.limit)}"

    def parse(self, status: int, text: str) -> list[sglanglog.SchedLine]:
        return sglanglog.parse_lines(text)


class DumperStats(DumpDirProbe[dict[int, dumpercost.RankStats]]):
    """Every rank's stats.json under the dump dir, each after a `==> PATH` line."""

    name = "dumper_stats"
    absent = (0, "")

    def command(self) -> str:
        d = shell.quote(self.dump_dir.rstrip("/") or "/")
        mark = dumpercost.STATS_MARK
        return f'for f in {d}/rank*/stats.json; do [ -f "$f" ] && {{ printf \'{mark}%s\\n\' "$f"; head -c {shell.SMALL_FILE_CAP} "$f"; echo; }}; done; true'

    def parse(self, status: int, text: str) -> dict[int, dumpercost.RankStats]:
        return dumpercost.parse_stats(text)


class RunStarted(WorkDirProbe[str | None]):
    """`started` of a client work dir's run.json (UTC, RFC 3339), or None."""

    name = "run_started"

    def command(self) -> str:
        return shell.read_small_file(self.paths.file("run.json"))  # a regular file, at most 1 MiB

    def parse(self, status: int, text: str) -> str | None:
        try:
            started = json.loads(text).get("started") if status == 0 else None
        except (ValueError, AttributeError):
            return None
        return started if isinstance(started, str) else None
