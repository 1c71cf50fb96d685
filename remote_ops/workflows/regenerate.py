"""`dataset regenerate` on a host: ship the client, start it on a shard, follow it, pull its records.

The client (`remote_ops/onhost/regenerate_onhost.py`, stdlib only, with `extract_onhost.py`
beside it for its helpers) runs with the host's `python3` next to the server and asks the
server's published port (`127.0.0.1:<server.port>`).  It lives in `<logs.dir>/regenerate/`
(`core.regenplan.RegenPaths`): the extraction client's layout (manifest, run.json,
dataset.keys, client.pid, client.out) plus `regenerated.jsonl`, and the same probes ask it how it
stands (`probes.extract`), the same start / wait / stop code runs it (`workflows.extract`, given
these paths).  The laptop pulls only the records it lacks (`pull`: their keys on stdin) and
merges them (`core.regenplan.merge`); `server_figure` reads the server's own generation
throughput over the run from its decode log lines (`probes.throughput`).

A local chat dataset is checked here (`check_chats`, the chat rules of
`remote_ops.core.datasetcheck`) before any connection: a bad line is a ConfigError (exit 3)
naming `FILE:LINE`.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from .. import onhost
from ..core import datasetcheck, regenplan, sglanglog
from ..core.extractplan import ExtractStatus, Sample
from ..core.regenplan import RegenPaths, Sampling, paths_for
from ..errors import CommandFailed, ConfigError, Refused
from ..probes import batch
from ..probes.extract import DoneKeys, ExtractAlive, FileSha
from ..probes.system import HostPython
from ..probes.throughput import RunStarted, SchedulerLines
from . import extract as extract_wf

#: (the run, the command that waits, the command that follows it): the timeout's words.
WHAT = ("regeneration", "dataset regenerate --wait", "dataset regenerate")
#: Seconds a pull of records may take (a large shard's records over a slow link).
PULL_TIMEOUT_S = 1800.0


def check_chats(path: Path) -> None:
    """ConfigError (exit 3) naming `FILE:LINE` and why, for the first bad line of a chat dataset."""
    try:
        with open(path, "rb") as fh:
            problems = datasetcheck.check_chat_lines(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read the chat dataset: {exc.strerror or exc}", source=str(path)) from None
    if problems:
        first, more = problems[0], problems[1:]
        rest = f"; more bad lines: {', '.join(str(p.line) for p in more)}" if more else ""
        raise ConfigError(
            first.reason,
            source=f"{path}:{first.line}",
            hint='each line one JSON object: {"id": ..., "messages": [{"role": "user", "content": ...}, ...]}' + rest,
        )


def client_files(p: RegenPaths) -> list[tuple[bytes, str]]:
    """(bytes, path on the host) of the client and its helper."""
    return [(onhost.source(regenplan.CLIENT_NAME), p.client), (onhost.source(regenplan.HELPER), p.helper)]


def prepare(remote, host) -> tuple[bool, set[str]]:
    """Ship the client (if changed); (is a client running, every key done on this host)."""
    p = paths_for(host)
    remote.run(["mkdir", "-p", p.workdir])
    for data, path in client_files(p):
        extract_wf.upload_if_changed(remote, data, path, 0o755)
    alive, keys = ExtractAlive(p), DoneKeys(p)
    sec = batch.run(remote, [alive, keys], check=True)
    return alive.read(sec), keys.read(sec)


def look(remote, host) -> tuple[bool, set[str], bool]:
    """What `prepare` would find, changing nothing (--dry-run): (running, done keys, clients current)."""
    p = paths_for(host)
    shas = [FileSha(path, f"sha{i}") for i, (_data, path) in enumerate(client_files(p))]
    alive, keys = ExtractAlive(p), DoneKeys(p)
    sec = batch.run(remote, [alive, keys, *shas])
    current = all(probe.read(sec) == extract_wf._sha256(data) for probe, (data, _path) in zip(shas, client_files(p)))
    return alive.read(sec), keys.read(sec), current


def pull(remote, host, keys: Iterable[str]) -> dict[str, dict]:
    """The host's records of these keys ({key: record}); only those travel."""
    wanted = sorted(set(keys))
    if not wanted:
        return {}
    p = paths_for(host)
    result = remote.run(
        regenplan.records_command(p), input=("\n".join(wanted) + "\n").encode(), check=False, timeout=PULL_TIMEOUT_S
    )
    if result.exit_status != 0:
        raise CommandFailed(
            "could not read the regenerated records on the host",
            host=host.name,
            command=result.command,
            exit_status=result.exit_status,
            stderr_tail=result.stderr[-2000:],
        )
    return regenplan.parse_records(result.stdout)


def start_shard(
    remote,
    host,
    shard: list[Sample],
    sampling: Sampling,
    *,
    concurrency: int,
    retries: int,
    server_url: str | None = None,
    wait_s: float = 30.0,
) -> ExtractStatus:
    """Put this host's shard in its work dir and start its client on it (refused, exit 9, without
    a usable python3 on the host or while a client runs); wait (bounded) for its `started` line."""
    p = paths_for(host)
    alive, python = ExtractAlive(p), HostPython()
    sec = batch.run(remote, [python, alive])
    extract_wf._refuse_without_python(host, python.read(sec))
    remote.run(["mkdir", "-p", p.workdir, str(PurePosixPath(p.log).parent)])
    if alive.read(sec):
        raise Refused(
            "a regeneration client is already running on this host",
            host=host.name,
            hint=f"remote-ops dataset regenerate --host {host.name} --dataset ... --wait SECONDS follows it",
        )
    for data, path in client_files(p):
        extract_wf.upload_if_changed(remote, data, path, 0o755)
    dataset = p.file("shard.jsonl")
    extract_wf.upload_if_changed(remote, "".join(s.line + "\n" for s in shard).encode(), dataset)
    url = server_url or f"http://127.0.0.1:{host.server.port}"
    before = extract_wf._log_size(remote, p)
    remote.run(regenplan.launch_command(p, url, sampling, concurrency, retries, dataset))
    extract_wf._await_started(remote, host, p, before, wait_s, "regeneration client", "dataset regenerate")
    return status(remote, host)


def status(remote, host, wait_s: float = 0.0) -> ExtractStatus:
    return extract_wf.status(remote, host, wait_s, paths_for(host))


def wait_finished(remote, host, timeout_s: float, on_status=None) -> ExtractStatus:
    return extract_wf.wait_finished(remote, host, timeout_s, on_status, paths=paths_for(host), what=WHAT)


def stop(remote, host, wait_s: float = 60.0) -> ExtractStatus:
    return extract_wf.stop(remote, host, wait_s, paths_for(host))


def server_figure(remote, host, until: str | None = None) -> sglanglog.GenThroughput | None:
    """The server's own generation throughput over the client's last run: the mean of its decode
    lines' `gen throughput` from run.json's `started` to `until` (the client's last log time),
    or None when the run's start is unknown.  Two round trips (the start, then the lines)."""
    started = batch.ask(remote, RunStarted(paths_for(host)))
    if not started:
        return None
    lines = batch.ask(remote, SchedulerLines(host, started))
    return sglanglog.gen_throughput(sglanglog.within(lines, _utc(started), _utc(until, 1.0)))


def _utc(stamp: str | None, slack: float = 0.0) -> float | None:
    """`2026-01-29T10:00:00Z` -> UTC seconds (+ slack), None when absent or unreadable."""
    if not stamp:
        return None
    try:
        return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) + slack
    except ValueError:
        return None
