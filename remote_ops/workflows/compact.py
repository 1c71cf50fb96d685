"""`dumps compact`: pack a host's finished dump files in place (`<key>.hsz`), over a `Remote`.

The pass runs ON the host with its own python3 (`remote_ops/onhost/compact_onhost.py`, the
packed-dump codec `remote_ops/dumper/packed.py` shipped with it on stdin: `onhost.bundled`),
under `nice` (its CPU is lent by the GPUs' host, never the serving process's), in the dump dir
as the host resolves it (a symlink to a big disk: its target), and under the command's
deadline (`Remote.run(timeout=...)`, which bounds the host's process too).  Its answer is read
from JSON lines (progress events, then one report with capped lists), so what the host sends
is bounded.  Which files it takes and the per-file steps are the on-host program's docstring.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import onhost
from ..core import shell
from ..errors import CommandFailed, NotFound
from ..probes.dumps import real_dir_command
from ..remote import Remote

SCRIPT = "compact_onhost.py"
#: Default deadline of one pass, in seconds (a week: a big host's whole dump dir).
COMPACT_TIMEOUT_S = 7 * 24 * 3600.0
#: Niceness the pass runs at on the host.
NICE = 10


def script() -> bytes:
    return onhost.bundled(SCRIPT)


@dataclass(frozen=True)
class CompactOptions:
    """How a pass runs: worker processes, at most how many files, dry run, fsync, niceness."""

    jobs: int = 2
    limit: int | None = None
    dry_run: bool = False
    fsync: bool = True
    nice: int = NICE
    crash_at: str | None = None  # tests only: the on-host program kills itself (SIGKILL) at this step


def compact_command(dump_dir: str, opts: CompactOptions) -> str:
    """`cd -P DUMP_DIR && nice -n N python3 -u - compact "$(pwd -P)" ...` (the program on stdin; pure)."""
    argv = ["nice", "-n", str(opts.nice), "python3", "-u", "-", "compact"]
    rest = ["--jobs", str(opts.jobs)]
    rest += ["--limit", str(opts.limit)] if opts.limit is not None else []
    rest += ["--dry-run"] if opts.dry_run else []
    rest += [] if opts.fsync else ["--no-fsync"]
    rest += ["--crash-at", opts.crash_at] if opts.crash_at else []
    return f'{real_dir_command(dump_dir)}; {shell.join(argv)} "$(pwd -P)" {shell.join(rest)}'


@dataclass
class CompactRun:
    """The pass's progress events and its final report (None until the report line came)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] | None = None
    error: str | None = None

    def take(self, line: str) -> dict[str, Any] | None:
        """One stdout line: a progress event, the report, or an error document; None otherwise."""
        try:
            doc = json.loads(line)
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        if doc.get("event") == "progress":
            self.events.append(doc)
        elif "error" in doc:
            self.error = str(doc["error"])
        elif "counts" in doc:
            self.report = doc
        return doc


def parse_output(stdout: str) -> CompactRun:
    run = CompactRun()
    for line in stdout.splitlines()[-10000:]:
        run.take(line)
    return run


def compact(
    remote: Remote,
    dump_dir: str,
    opts: CompactOptions,
    *,
    timeout: float = COMPACT_TIMEOUT_S,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run one pass; its report.  NotFound when the dump dir is absent, CommandFailed when the
    program gave no report (no python3, killed)."""
    run = CompactRun()

    def line(stream: str, text: str) -> None:
        if stream == "stdout" and text.strip():
            doc = run.take(text)
            if doc is not None and doc.get("event") == "progress" and on_event is not None:
                on_event(doc)

    result = remote.run(compact_command(dump_dir, opts), input=script(), check=False, timeout=timeout, on_line=line)
    if run.report is None and run.error is None:
        run = parse_output(result.stdout)  # a Remote that does not stream lines
    if result.exit_status == 3 and run.report is None:
        raise NotFound(f"dump dir {dump_dir} does not exist", host=remote.name)
    if run.report is None:
        raise CommandFailed.of(f"dumps compact gave no report: {run.error or 'no output'}", result, remote.name)
    return run.report
