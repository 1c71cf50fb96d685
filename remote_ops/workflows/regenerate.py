"""`dataset regenerate` on a host: ship the client, start it on a shard, follow it, pull its records.

The client (`remote_ops/onhost/regenerate_onhost.py`, stdlib only, built on the on-host skeleton
`client.py`, shipped beside it) runs with the host's `python3` next to the server and asks the
server's published port (`127.0.0.1:<server.port>`).  It lives in `<logs.dir>/regenerate/`
(`core.regenplan.RegenPaths`): every client's layout (manifest, run.json, dataset.keys,
client.pid, client.out) plus `regenerated.jsonl`; the same probes ask it how it stands
(`probes.extract`), and every client's edges ship, start, follow and stop it
(`workflows.hostclient`: `Regeneration` names this one).  The laptop pulls only the records it
lacks (`pull`: their keys on stdin) and merges them (`core.regenplan.merge`); `server_figure`
reads the server's own generation throughput over the run from its decode log lines
(`probes.throughput`).

A local chat dataset is checked here (`check_chats`, the chat rules of
`remote_ops.core.datasetcheck`) before any connection: a bad line is a ConfigError (exit 3)
naming `FILE:LINE`.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from ..core import datasetcheck, regenplan, sglanglog
from ..core.extractplan import ExtractStatus, Sample
from ..core.regenplan import Sampling, paths_for
from ..errors import CommandFailed
from ..probes import batch
from ..probes.throughput import RunStarted, SchedulerLines
from .hostclient import Client, check_file, upload_if_changed, url_for

#: Seconds a pull of records may take (a large shard's records over a slow link).
PULL_TIMEOUT_S = 1800.0


class Regeneration(Client):
    """The regeneration client, `regenerate_onhost.py` in `<logs.dir>/regenerate/`."""

    paths = staticmethod(paths_for)
    name, a_name = "regeneration client", "a regeneration client"
    busy = "remote-ops dataset regenerate --host {host} --dataset ... --wait SECONDS follows it"
    what, start_command = ("regeneration", "dataset regenerate --wait", "dataset regenerate"), "dataset regenerate"


CLIENT = Regeneration()
status, wait_finished, stop = CLIENT.status, CLIENT.wait_finished, CLIENT.stop
prepare, look = CLIENT.probe_done, CLIENT.look


def check_chats(path: Path) -> None:
    """ConfigError (exit 3) naming `FILE:LINE` and why, for the first bad line of a chat dataset."""
    hint = 'each line one JSON object: {"id": ..., "messages": [{"role": "user", "content": ...}, ...]}'
    check_file(path, datasetcheck.check_chat_lines, "chat dataset", hint)


def pull(remote, host, keys: Iterable[str]) -> dict[str, dict]:
    """The host's records of these keys ({key: record}); only those travel."""
    wanted = sorted(set(keys))
    if not wanted:
        return {}
    command, keys_in = regenplan.records_command(paths_for(host)), ("\n".join(wanted) + "\n").encode()
    try:
        result = remote.run(command, input=keys_in, timeout=PULL_TIMEOUT_S)
    except CommandFailed as exc:
        exc.message = "could not read the regenerated records on the host"
        raise
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
    _sec, running = CLIENT.preflight(remote, host, p)
    url = url_for(host, server_url)

    def place() -> str:
        upload_if_changed(remote, "".join(s.line + "\n" for s in shard).encode(), p.file("shard.jsonl"))
        return p.file("shard.jsonl")

    command = partial(regenplan.launch_command, p, url, sampling, concurrency, retries)
    return CLIENT.launch(remote, host, p, running, place, command, wait_s)


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
