"""The dumper's real cost (pure): its `capture()` time from each rank's `stats.json` next to the
forward time of the same prefill steps from SGLang's own log lines (`remote-ops dumps stats`).

- **Capture time**: the dumper counts, per writer rank, the prefill steps it took
  (`capture_steps`: copied, or held to be copied with the next ones) and the wall time its
  `capture()` spent on them on the forward thread (`capture_steps_us`), plus every call
  (`capture_calls` / `capture_us`: decode and other skipped steps too); `started` is when it
  attached (remote_ops/dumper/FORMAT.md, "stats.json").  The slowest rank is the one that
  counts: tensor-parallel ranks wait for each other.
- **Forward time**: the server's prefill lines logged between the dumper's `started` and its
  last `updated` (`core.sglanglog`).  A step's wall time is the previous line's `#new-token`
  over this line's `input throughput`; `capture()` runs inside the model's forward, so that
  time includes it.  Steps whose previous line had requests waiting are *busy*: they began as
  the last one ended, so their time is the step's own.  With at least `MIN_BUSY` busy steps the
  share is taken over them; otherwise over every timed step, which may include waits for
  requests, so the share is then a lower bound (said in `basis` and the notes).
- **Share** = mean capture time per captured step / mean forward time per step.

The sandbox's stand-in writes the same fields (`standin: true`) and lines (prefix ` STAND-IN`):
its capture is a synchronous file write and its forward a CPU network, so its share says
nothing about the real dumper on a GPU; every figure from it is labelled STAND-IN.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .sglanglog import PrefillSteps, SchedLine, prefill_steps, within

#: Fewer busy steps than this: the share is taken over every timed step (a lower bound).
MIN_BUSY = 8
#: The log's prefill batches and the dumper's captured steps may differ by this share before
#: the report says so.
COUNT_TOLERANCE = 0.05
STATS_MARK = "==> "


@dataclass
class RankStats:
    """One writer rank's stats.json, the fields the cost needs."""

    rank: int
    state: str | None = None
    steps: int | None = None  # capture_steps
    steps_us: int | None = None  # capture_steps_us
    calls: int | None = None
    calls_us: int | None = None
    started: float | None = None
    updated: float | None = None
    tokens: int = 0
    files: int = 0
    skipped: dict = field(default_factory=dict)
    standin: bool = False

    @property
    def timed(self) -> bool:
        return self.steps is not None and self.steps_us is not None

    def to_dict(self) -> dict:
        return asdict(self)


def parse_stats(text: str) -> dict[int, RankStats]:
    """`==> <dir>/rank<R>/stats.json` then its JSON, per rank (the probe's output) -> {rank: stats}.
    Unreadable files are left out (a stats.json is replaced atomically: a torn one is not a state)."""
    out: dict[int, RankStats] = {}
    for block in text.split(STATS_MARK)[1:]:
        name, _, body = block.partition("\n")
        try:
            doc = json.loads(body)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        rank = _int(doc.get("rank"))
        if rank is None:  # a stats.json without its rank (a refused dumper's): the folder's name
            parts = name.strip().split("/")
            folder = parts[-2] if len(parts) >= 2 else ""
            rank = int(folder[4:]) if folder.startswith("rank") and folder[4:].isdigit() else None
        if rank is None:
            continue
        skipped = doc.get("skipped")
        out[rank] = RankStats(
            rank,
            doc.get("state") if isinstance(doc.get("state"), str) else None,
            _int(doc.get("capture_steps")),
            _int(doc.get("capture_steps_us")),
            _int(doc.get("capture_calls")),
            _int(doc.get("capture_us")),
            _float(doc.get("started")),
            _float(doc.get("updated")),
            _int(doc.get("tokens")) or 0,
            _int(doc.get("files")) or 0,
            skipped if isinstance(skipped, dict) else {},
            doc.get("standin") is True,
        )
    return out


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class DumperCost:
    """`dumps stats` for one host: per rank, the log's steps, and the share."""

    ranks: list[RankStats]
    prefill: PrefillSteps
    slowest_rank: int | None = None
    capture_steps: int | None = None
    mean_capture_us: float | None = None
    mean_forward_us: float | None = None
    basis: str | None = None  # "busy" | "all timed" | None (no share)
    share: float | None = None
    standin: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefill"] = self.prefill.to_dict()
        return d


def window(ranks: dict[int, RankStats]) -> tuple[float | None, float | None]:
    """(since, until) in UTC seconds: the earliest `started` and the latest `updated` (+ 2 s, the
    stats' write interval and a clock tick), over the ranks that have them."""
    starts = [r.started for r in ranks.values() if r.started is not None]
    ends = [r.updated for r in ranks.values() if r.updated is not None]
    return (min(starts) if starts else None, max(ends) + 2.0 if ends else None)


def dumper_cost(ranks: dict[int, RankStats], lines: list[SchedLine]) -> DumperCost:
    """The cost from each rank's stats and the server's lines (already limited to the window's
    start by the probe; limited to its end here)."""
    since, until = window(ranks)
    steps = prefill_steps(within(lines, since, until))
    cost = DumperCost(sorted(ranks.values(), key=lambda r: r.rank), steps)
    cost.standin = steps.standin or any(r.standin for r in ranks.values())
    timed = [r for r in ranks.values() if r.timed]
    if not ranks:
        cost.notes.append("no stats.json under the dump dir: the dumper never attached (or writes elsewhere)")
        return cost
    if not timed:
        cost.notes.append("stats.json has no capture timing (capture_steps_us): a dumper older than the field")
        return cost
    slowest = max(timed, key=lambda r: r.steps_us or 0)
    cost.slowest_rank, cost.capture_steps = slowest.rank, slowest.steps
    if slowest.steps:
        cost.mean_capture_us = round((slowest.steps_us or 0) / slowest.steps, 1)
    _count_note(cost, slowest)
    if steps.busy >= MIN_BUSY:
        cost.basis, cost.mean_forward_us = "busy", steps.busy_s / steps.busy * 1e6
    elif steps.timed:
        cost.basis, cost.mean_forward_us = "all timed", steps.timed_s / steps.timed * 1e6
        cost.notes.append(
            f"only {steps.busy} step(s) with requests waiting: the forward time includes waits for "
            "requests, so the share is a lower bound (more requests in flight give busy steps)"
        )
    else:
        cost.notes.append(
            "no prefill line with an input throughput in the window: SGLang releases before 0.5.9 "
            "print none (outside PD prefill mode), or the server log was not reached"
        )
    if cost.mean_forward_us is not None:
        cost.mean_forward_us = round(cost.mean_forward_us, 1)
        if cost.mean_capture_us is not None and cost.mean_forward_us > 0:
            cost.share = round(cost.mean_capture_us / cost.mean_forward_us, 6)
    return cost


def _count_note(cost: DumperCost, slowest: RankStats) -> None:
    """Say when the log's prefill batches and the captured steps are not the same steps."""
    logged, captured = cost.prefill.lines, slowest.steps or 0
    if logged and abs(logged - captured) > COUNT_TOLERANCE * max(logged, captured):
        skipped = sum(v for v in slowest.skipped.values() if isinstance(v, int) and v > 0)
        cost.notes.append(
            f"the log shows {logged} prefill batch(es), rank {slowest.rank} captured {captured} step(s)"
            + (f" and skipped {skipped} (decode/mixed/...: stats.json `skipped`)" if skipped else "")
            + ": the means compare steps of different sets"
        )
