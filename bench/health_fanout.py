"""Health on 8 hosts vs 1: does `health --all` scale out?  (goal: <= 1.3x)

Brings up a HostLab with 8 real sshd hosts (one shared dockerd, no containers
needed: the checks still run every probe and evaluate "container absent"),
then times, in one run:

  1. `health` on one host                  (connect + one batched round trip)
  2. `health --all` on 8 hosts in parallel (same code path as the CLI)
  3. the same 8 hosts checked one after another (what a naive loop costs)

and reports the wall-time ratios, this process's CPU time and the whole
machine's CPU time (/proc/stat).  All hosts live on this one 2-core machine,
so the 8 remote shells (each sourcing root's .bashrc, each running several
docker CLI calls against one shared dockerd) compete with the client for the
same two cores; on real hosts only the client side is shared.
`cpu_bound_floor_s` (machine CPU of the fan-out / cores) shows how much of the
8-host wall time is just that shared CPU, and `ratio_if_hosts_were_separate`
is max(one-host wall, client CPU for all hosts) / one-host wall.

    .venv/bin/python bench/health_fanout.py [--hosts 8] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from remote_ops.hostlab import HostLab
from remote_ops.remote import FabricRemote
from remote_ops.workflows import health


def check(lab: HostLab, name: str) -> health.HostHealth:
    """One full health check over a fresh connection (as one CLI run does)."""
    remotes = []

    def connect(spec):
        remotes.append(FabricRemote(lab.target(spec.name)).connect())
        return remotes[-1]

    try:
        return health.check_host(connect, lab.spec(name))
    finally:
        for r in remotes:
            r.close()


def machine_cpu_s() -> float:
    """CPU seconds used by the whole machine so far (user+nice+system+irq+softirq, /proc/stat)."""
    fields = open("/proc/stat").readline().split()[1:]
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6))
    return busy / os.sysconf("SC_CLK_TCK")


def timed(fn) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds, whole machine's CPU seconds) of fn()."""
    w, c, m = time.perf_counter(), time.process_time(), machine_cpu_s()
    fn()
    return time.perf_counter() - w, time.process_time() - c, machine_cpu_s() - m


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with HostLab(hosts=args.hosts) as lab:
        names = [h.name for h in lab.hosts]
        check(lab, names[0])  # warm caches (python, docker CLI, page cache)
        one = [timed(lambda: check(lab, names[0])) for _ in range(args.repeat)]
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            fan = [timed(lambda: list(pool.map(lambda n: check(lab, n), names))) for _ in range(args.repeat)]
        seq = [timed(lambda: [check(lab, n) for n in names]) for _ in range(args.repeat)]

    def med(xs, i):
        return statistics.median(x[i] for x in xs)

    result = {
        "hosts": args.hosts,
        "cpus": __import__("os").cpu_count(),
        "one_host_s": med(one, 0),
        "all_parallel_s": med(fan, 0),
        "all_sequential_s": med(seq, 0),
        "ratio_parallel_vs_one": med(fan, 0) / med(one, 0),
        "ratio_sequential_vs_one": med(seq, 0) / med(one, 0),
        "client_cpu_one_host_s": med(one, 1),
        "client_cpu_all_s": med(fan, 1),
        "machine_cpu_one_host_s": med(one, 2),
        "machine_cpu_all_s": med(fan, 2),
    }
    # With 8 real hosts the remote work runs on 8 machines; only the client is shared.
    # Lower bound for the wall time here: all CPU work of the fan-out spread over this machine's cores.
    result["cpu_bound_floor_s"] = result["machine_cpu_all_s"] / result["cpus"]
    result["ratio_if_hosts_were_separate"] = (
        max(result["one_host_s"], result["client_cpu_all_s"]) / result["one_host_s"]
    )
    print(json.dumps(result, indent=2))
    if args.json:
        open(args.json, "w").write(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
