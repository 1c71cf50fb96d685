"""SGLang's scheduler log lines (pure): per-batch prefill and decode lines, read for the server's
own figures (`dataset regenerate`'s generation throughput, `dumps stats`' forward time).

The format is SGLang 0.5.x's (`sglang/srt/managers/scheduler_metrics_mixin.py`, logged by the
scheduler of attention-TP rank 0 through `configure_logger`'s `[%(asctime)s{ms}{prefix}] %(message)s`,
asctime `%Y-%m-%d %H:%M:%S`, `.mmm` with SGLANG_LOG_MS, a prefix such as ` TP0`):

    [2026-01-29 10:00:00 TP0] Prefill batch, #new-seq: 4, #new-token: 8192, #cached-token: 0,
        token usage: 0.05, #running-req: 0, #queue-req: 12, input throughput (token/s): 41234.56,
        cuda graph: False
    [2026-01-29 10:00:01 TP0] Decode batch, #running-req: 64, #token: 90000, token usage: 0.40,
        cuda graph: True, gen throughput (token/s): 2345.67, #queue-req: 0

(one line each; `Prefill batch [N],` with SGLANG_LOG_FORWARD_ITERS; hybrid models print other
usage fields, which are read like any other).  Through the engine's `logs --timestamps` each line
starts with the engine's RFC 3339 time, which is kept (`engine_time`, UTC seconds).

What the figures mean, from that source:

- A prefill line is written when the batch's result is processed (0.5.9:
  `process_batch_result_prefill` -> `log_prefill_stats`).  Its `input throughput` is the
  PREVIOUS line's `#new-token` divided by the time since the previous line (perf_counter), so
  `previous #new-token / input throughput` is exactly that interval: the wall time of this
  step, from the end of the last batch to the end of this one.  When the previous line still had
  requests waiting (`#queue-req` > 0) the step started at once and the interval is its own time
  (forward, with anything run inside it, plus scheduling); otherwise it may include a wait for
  requests.  SGLang releases before 0.5.9 print `input throughput` only in PD-prefill mode.
- A decode line is written every `--decode-log-interval` (40) decode steps; its `gen throughput`
  is the tokens generated since the last decode line over the time since then.

The sandbox's stand-in server writes lines of this format with the prefix ` STAND-IN`
(`standin`); its figures are a CPU network's, not a GPU's.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from .logparse import bounded_lines

PREFILL = "Prefill batch"
DECODE = "Decode batch"
STANDIN_PREFIX = "STAND-IN"
INPUT_THROUGHPUT = "input throughput (token/s)"
GEN_THROUGHPUT = "gen throughput (token/s)"


@dataclass(frozen=True)
class SchedLine:
    """One prefill or decode line: its kind, SGLang's own time and prefix, the engine's time (UTC
    seconds, None without `--timestamps`) and its numeric `name: value` fields."""

    kind: str  # "prefill" | "decode"
    when: str
    prefix: str
    engine_time: float | None
    fields: dict[str, float]

    @property
    def standin(self) -> bool:
        return STANDIN_PREFIX in self.prefix

    def num(self, name: str) -> float:
        return self.fields.get(name, 0.0)


def engine_seconds(stamp: str) -> float | None:
    """`2026-01-29T10:00:00.123456789Z` (RFC 3339, as `docker logs --timestamps` prints) -> UTC
    seconds; None for anything else."""
    if len(stamp) < 19 or stamp[4] != "-" or stamp[10] != "T":
        return None
    try:
        whole = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
    frac = stamp[19:].split("Z")[0].split("+")[0]
    digits = frac[1:10] if frac.startswith(".") else ""
    return whole + (int(digits) / 10 ** len(digits) if digits.isdigit() else 0.0)


def parse_line(line: str) -> SchedLine | None:
    """One scheduler line (with or without the engine's time in front), or None."""
    engine_time = None
    if line[:1].isdigit():
        stamp, _, rest = line.partition(" ")
        engine_time = engine_seconds(stamp)
        line = rest
    if not line.startswith("["):
        return None
    close = line.find("] ")
    if close < 20:
        return None
    head, message = line[1:close], line[close + 2 :]
    kind = "prefill" if message.startswith(PREFILL) else "decode" if message.startswith(DECODE) else None
    if kind is None:
        return None
    _title, _, body = message.partition(", ")
    return SchedLine(kind, head[:19], head[19:].strip(), engine_time, _fields(body))


def _fields(body: str) -> dict[str, float]:
    """`#new-token: 8192, token usage: 0.05, cuda graph: False` -> the numeric ones."""
    out: dict[str, float] = {}
    for part in body.split(", "):
        name, sep, value = part.partition(": ")
        if not sep:
            continue
        try:
            out[name.strip()] = float(value.strip().rstrip(","))
        except ValueError:
            continue
    return out


def parse_lines(text: str | Iterable[str]) -> list[SchedLine]:
    """Every prefill and decode line of a server log, in order (lines cut to logparse's limit)."""
    out = []
    for line in bounded_lines(text):
        parsed = parse_line(line)
        if parsed is not None:
            out.append(parsed)
    return out


def within(lines: list[SchedLine], since: float | None = None, until: float | None = None) -> list[SchedLine]:
    """The lines whose engine time is in [since, until] (lines without one are kept)."""
    return [
        ln
        for ln in lines
        if ln.engine_time is None
        or ((since is None or ln.engine_time >= since) and (until is None or ln.engine_time <= until))
    ]


@dataclass
class PrefillSteps:
    """The prefill batches of a window and their wall time, from the lines' own figures.

    `timed` steps have an interval (`previous #new-token / input throughput`, from the second line
    of the window on); `busy` ones are those whose previous line had requests waiting."""

    lines: int = 0
    tokens: int = 0
    timed: int = 0
    timed_s: float = 0.0
    busy: int = 0
    busy_s: float = 0.0
    standin: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def prefill_steps(lines: list[SchedLine]) -> PrefillSteps:
    out = PrefillSteps()
    prev: SchedLine | None = None
    for ln in lines:
        if ln.kind != "prefill":
            continue
        out.lines += 1
        out.tokens += int(ln.num("#new-token"))
        out.standin = out.standin or ln.standin
        rate = ln.num(INPUT_THROUGHPUT)
        if prev is not None and rate > 0 and prev.num("#new-token") > 0:
            gap = prev.num("#new-token") / rate
            out.timed, out.timed_s = out.timed + 1, out.timed_s + gap
            if prev.num("#queue-req") > 0:
                out.busy, out.busy_s = out.busy + 1, out.busy_s + gap
        prev = ln
    return out


@dataclass
class GenThroughput:
    """The server's own generation figure over a window: its decode lines' `gen throughput`."""

    lines: int = 0
    mean_tokens_s: float | None = None
    max_tokens_s: float | None = None
    standin: bool = False
    samples: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("samples")
        return d


def gen_throughput(lines: list[SchedLine]) -> GenThroughput:
    """Mean and max of the decode lines' `gen throughput (token/s)` (lines without it skipped)."""
    rates = [ln.num(GEN_THROUGHPUT) for ln in lines if ln.kind == "decode" and GEN_THROUGHPUT in ln.fields]
    standin = any(ln.standin for ln in lines if ln.kind == "decode")
    if not rates:
        return GenThroughput(standin=standin)
    return GenThroughput(len(rates), round(sum(rates) / len(rates), 2), round(max(rates), 2), standin, rates)
