"""`dumps stats` on a host: the dumper's capture time beside the forward time of the same steps.

Two round trips: every rank's `stats.json` under the dump dir (`probes.throughput.DumperStats`),
then the server container's prefill lines since the earliest rank's `started`
(`probes.throughput.SchedulerLines`); the join and the share are pure
(`remote_ops.core.dumpercost`).  Nothing is changed on the host.
"""

from __future__ import annotations

from ..core import dumpercost
from ..probes import batch
from ..probes.throughput import DumperStats, SchedulerLines


def cost(remote, host) -> dumpercost.DumperCost:
    """The host's dumper cost report (read only)."""
    ranks = batch.ask(remote, DumperStats(host.dump.dir))
    if not ranks:
        return dumpercost.dumper_cost(ranks, [])
    since, _until = dumpercost.window(ranks)
    lines = batch.ask(remote, SchedulerLines(host, str(int(since)) if since else "0"))
    return dumpercost.dumper_cost(ranks, lines)
