"""Run one host workflow on many hosts: bounded concurrency, isolated failures, one exit code.

A thread pool (`--forks`) is enough: each host's work is network-bound and
holds its own SSH connection, so no scheduler is needed.  A host's failure is
caught as that host's outcome (its typed error and exit code) and never stops
the others.  `--serial N` rolls through batches of N hosts, stopping after a
batch with a failure unless told to go on (Ansible's `serial` and
`max_fail_percentage: 0`).

The exit code of a fleet run is the worst host's (`worst_exit`): 0 if every
host is ok, 11 if the worst is a health warning, else the highest failing code.
Each host keeps its own exit code and verdict (`HostOutcome.exit_code`,
`.verdict`): the summary table and the JSON document report every host's own,
never the run's worst.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import ExitCode, RemoteOpsError

DEFAULT_FORKS = 16

#: exit code -> the words a summary shows for a host that ended with it and no error of its own
_CODE_WORDS = {getattr(ExitCode, name): name.lower().replace("_", " ") for name in vars(ExitCode) if name.isupper()}


@dataclass
class HostOutcome:
    """What one host's run gave: its exit code, its result or its error, and how long it took."""

    host: str
    exit_code: int
    result: Any = None
    error: RemoteOpsError | None = None
    duration_s: float = 0.0
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == ExitCode.OK

    @property
    def failed(self) -> bool:
        """Anything worse than a health warning (a skipped host is not a failure)."""
        return not self.skipped and self.exit_code not in (ExitCode.OK, ExitCode.HEALTH_WARN)

    @property
    def verdict(self) -> str:
        """This host's own result in words: its error's message, the result's own `verdict` when
        it has one (health: the worst check), else what its exit code means ("ok" only for 0)."""
        if self.skipped:
            return "skipped after a failed batch"
        if self.error is not None:
            return self.error.message
        own = getattr(self.result, "verdict", None)
        if isinstance(own, str):
            return own
        words = _CODE_WORDS.get(self.exit_code, "failed")
        return words if self.exit_code == ExitCode.OK else f"{words} (exit {self.exit_code})"

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "host": self.host,
            "exit_code": self.exit_code,
            "duration_s": round(self.duration_s, 3),
            "skipped": self.skipped,
        }
        if self.error is not None:
            doc["error"] = self.error.to_dict()
        if self.result is not None:
            doc["result"] = self.result.to_dict() if hasattr(self.result, "to_dict") else self.result
        return doc


@dataclass
class FleetRun:
    """All hosts' outcomes, in the order the hosts were given."""

    outcomes: list[HostOutcome] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return worst_exit(o.exit_code for o in self.outcomes if not o.skipped)

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "hosts": [o.to_dict() for o in self.outcomes],
            "failed": [o.host for o in self.outcomes if o.failed],
            "skipped": [o.host for o in self.outcomes if o.skipped],
        }


def worst_exit(codes: Iterable[int]) -> int:
    """0 when all are 0; 11 when the worst is a warning; else the highest failing code."""
    codes = list(codes)
    failing = [c for c in codes if c not in (ExitCode.OK, ExitCode.HEALTH_WARN)]
    if failing:
        return max(failing)
    return ExitCode.HEALTH_WARN if ExitCode.HEALTH_WARN in codes else ExitCode.OK


def run_one(host: Any, work: Callable[[Any], tuple[int, Any]]) -> HostOutcome:
    """`work(host) -> (exit_code, result)`, with a typed error turned into that host's outcome."""
    t0 = time.monotonic()
    try:
        code, result = work(host)
        return HostOutcome(host.name, code, result, duration_s=time.monotonic() - t0)
    except RemoteOpsError as exc:
        if exc.host is None:
            exc.host = host.name
        return HostOutcome(host.name, exc.exit_code, error=exc, duration_s=time.monotonic() - t0)


def fan_out(
    hosts: list,
    work: Callable[[Any], tuple[int, Any]],
    *,
    forks: int = DEFAULT_FORKS,
    on_done: Callable[[HostOutcome], None] | None = None,
) -> FleetRun:
    """Run `work` on every host, at most `forks` at a time; outcomes keep the hosts' order.

    An interruption (Ctrl-C: `errors.Interrupted` in this, the main thread) does not wait for
    the hosts still working: hosts not started are cancelled and the signal goes on at once;
    the running ones end when the caller closes their connections (`App.close`), instead of
    after their own deadline (a `logs follow` of many hosts ran on for its --duration)."""
    if len(hosts) == 1:
        outcome = run_one(hosts[0], work)
        on_done and on_done(outcome)
        return FleetRun([outcome])
    by_name: dict[str, HostOutcome] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(forks, len(hosts))))
    try:
        futures = [pool.submit(run_one, h, work) for h in hosts]
        for future in as_completed(futures):
            outcome = future.result()
            by_name[outcome.host] = outcome
            on_done and on_done(outcome)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return FleetRun([by_name[h.name] for h in hosts])


def rolling(
    hosts: list,
    work: Callable[[Any], tuple[int, Any]],
    *,
    serial: int,
    forks: int = DEFAULT_FORKS,
    keep_going: bool = False,
    on_done: Callable[[HostOutcome], None] | None = None,
) -> FleetRun:
    """Batches of `serial` hosts one after another; after a failed batch the rest are skipped."""
    run = FleetRun()
    for i in range(0, len(hosts), max(1, serial)):
        batch = hosts[i : i + max(1, serial)]
        if not keep_going and any(o.failed for o in run.outcomes):
            run.outcomes += [HostOutcome(h.name, ExitCode.REFUSED, skipped=True) for h in batch]
            continue
        run.outcomes += fan_out(batch, work, forks=forks, on_done=on_done).outcomes
    return run
