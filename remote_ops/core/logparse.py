"""Log text (pure): parse extraction and training logs; the pure half of pulling them.

Three kinds of log live on a host:

- `server`: the SGLang container's output (the engine's `logs`), container name
  from the inventory (`container.name`);
- `extraction`: the log of `remote_ops/onhost/extract_onhost.py` (inventory `logs.extraction`);
- `training`: the log of an EAGLE-3 trainer (inventory `logs.training`).

Parsing is pure (text in, summaries out) and linear in the text: lines are cut
to `LINE_LIMIT` before any regex sees them, and no regex here re-scans a line
from every start (a host can write anything into its logs; a 16 MB word once
made `extract status` quadratic).  Pulling is a pure *plan* (what to
fetch, from which byte, given what we pulled before: the cursors and the
server log's parsers, here; the file fetch probe, `remote_ops.probes.logs`)
plus one remote command per pull (`remote_ops.workflows.logs`, which asks the
host's engine for the server log's command line), so every file is fetched in
a single round trip and only its new bytes travel.

Training log format: SpecForge (sgl-project/SpecForge), the most used open
EAGLE-3 trainer.  Three of its outputs are understood:

- SpecForge 0.2.0 (`specforge train --config`): its `TrainerController` hands the
  step's metrics to a console logger (`specforge/training/assembly.py::_logger`)
  every `log_interval` optimizer steps, which prints the Python dict:
  `step 50: {'acc_0': 0.41, ..., 'ploss_0': 1.9, ..., 'acc': .., 'loss': .., 'lr': .., 'perf/..': ..}`.
  With a tracker (`tracking.report_to`: wandb, tensorboard, ...) the keys carry
  the tracker namespace (`train/acc_0`), lists are flattened (`eval/per_position_acc/0`).
  Evaluation (`eval_interval`) prints `step N: {'eval/avg_loss': .., 'eval/per_position_acc': [..],
  'eval/simulated_acc_len': .., 'eval/ploss_0': ..}`.  Its tqdm bar only draws on a
  terminal, so a container's log has no bar: epoch and total steps are not printed.

- the per-position summary lines the older `scripts/train_eagle3*.py` print once per
  epoch (or per step when it evaluates by step):
  `Train Epoch [1/10], position 0,  Acc: 0.45` and `... position 0, pLoss: 1.23`,
  likewise `Eval Epoch [...]` and `Train Step [N], position i, ...`;
- the tqdm bar of the unified `train_eagle3.py`, whose postfix carries the
  step's mean loss and accuracy: `Training Epoch 0:  12%|...| 120/1000 [.., loss=1.23, acc=0.45, time=0.50s]`.
  Position 0 accuracy ("step-0 accuracy") is what predicts the acceptance rate.
"""

from __future__ import annotations

import ast
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from .inventory import HostSpec

KINDS = ("server", "extraction", "training")


#: The longest line any parser here reads, in characters: the rest of a longer line is
#: dropped before parsing.  A host can write anything into its logs, and a 16 MB word must
#: cost no more than a 64 KB one; every regex below is linear in the line's length too.
LINE_LIMIT = 64 * 1024

#: An error line kept for display (`ExtractionSummary.error_lines`) is cut to this many characters.
ERROR_LINE_LIMIT = 1000

_LINE = re.compile(r"[^\r\n]+")  # one run per line: linear, no backtracking


def bounded_lines(text: str | Iterable[str], limit: int = LINE_LIMIT) -> Iterator[str]:
    """The non-empty lines of `text` (split on \\n and \\r, as tqdm repaints), each cut to `limit`.

    Slices of the text, one line at a time: a 200 MB log is never copied whole
    and a 16 MB line costs a scan, not a copy.  `text` may also be an iterable
    of lines (`stream_lines` of an open file), taken as they come."""
    if not isinstance(text, str):
        for line in text:
            yield from bounded_lines(line, limit)
        return
    for m in _LINE.finditer(text):
        start, end = m.span()
        yield text[start : min(end, start + limit)]


def stream_lines(stream: IO[str], limit: int = LINE_LIMIT) -> Iterator[str]:
    """The lines of an open text file, each cut to `limit`, read `limit` characters at a time:
    a file holding one 200 MB line never sits in memory (`parse_extraction(stream_lines(fh))`)."""
    while line := stream.readline(limit):
        if not line.endswith("\n"):  # cut: skip the rest of this line
            while (rest := stream.readline(limit)) and not rest.endswith("\n"):
                pass
        yield line.rstrip("\r\n")


def _cut(line: str, limit: int = ERROR_LINE_LIMIT) -> str:
    return line if len(line) <= limit else line[:limit] + " ... (cut)"


@dataclass
class ExtractionSummary:
    """Where an extraction run stands, read from its log."""

    done: int = 0
    total: int | None = None
    tokens: int = 0
    errors: int = 0
    failed: int = 0
    missing_dumps: int | None = None
    rate_samples_s: float | None = None
    rate_tokens_s: float | None = None
    eta_s: float | None = None
    state: str = "unknown"  # running | finished | stopped | unknown
    last_time: str | None = None
    error_lines: list[str] = field(default_factory=list)
    no_space: dict | None = None  # the client's last `nospace` line, until it logs `space` again

    def to_dict(self) -> dict:
        return asdict(self)


def _fields(line: str) -> dict[str, str]:
    """The `key=value` words of one `extract_onhost.py` log line (`<iso time> <event> k=v ...`;
    a value with spaces or quotes is a JSON string: `error="HTTP 503 ..."`).

    A scan, not a regex: one pass over at most `LINE_LIMIT` characters.  Keys
    are word characters; a word without `=` is skipped."""
    line, i = line[:LINE_LIMIT], 0
    out: dict[str, str] = {}
    while i < len(line):
        end = line.find(" ", i)
        end = len(line) if end < 0 else end
        eq = line.find("=", i, end)
        key = line[i:eq] if eq > i else ""
        if not (key.replace("_", "a").isalnum() and key.isascii()):
            i = end + 1
        elif line.startswith('"', eq + 1):
            try:
                value, i = _JSON.raw_decode(line, eq + 1)
            except ValueError:
                return out  # an unterminated quote: nothing after it can be read reliably
            out[key] = str(value)
        else:
            if end > eq + 1:
                out[key] = line[eq + 1 : end]
            i = end + 1
    return out


_JSON = json.JSONDecoder()


def _num(value: str | None, cast: Callable[[str], Any] = float) -> Any:
    try:
        return cast(value) if value not in (None, "", "-") else None
    except ValueError:
        return None


def parse_extraction(text: str | Iterable[str]) -> ExtractionSummary:
    """Summarise an extraction log: the last progress line wins; errors are counted.

    `text` is the log, or its lines (`stream_lines`); lines are cut to `LINE_LIMIT`."""
    s, session = ExtractionSummary(), {}
    for line in bounded_lines(text):
        parts = line.split(" ", 2)
        event = parts[1] if len(parts) > 1 else ""
        if event in ("progress", "finished", "stopped", "started"):
            session = _apply_progress(s, line, event)
        elif event in ("error", "failed"):
            s.error_lines = (s.error_lines + [_cut(line)])[-20:]
        elif event in ("nospace", "space"):
            s.no_space = _no_space(line, parts[0]) if event == "nospace" else None
    _derive_rates(s, session)
    if s.no_space:
        s.eta_s = None  # nothing moves until space returns
    return s


def _no_space(line: str, when: str) -> dict | None:
    """The client's `nospace dir=.. free_bytes=.. needed_bytes=.. pending=..` line, with its sentence."""
    kv = _fields(line)
    free, needed = _num(kv.get("free_bytes"), int), _num(kv.get("needed_bytes"), int)
    if "dir" not in kv or free is None or needed is None:
        return None
    return {
        "dir": kv["dir"],
        "free_bytes": free,
        "needed_bytes": needed,
        "pending": _num(kv.get("pending"), int),
        "since": when,
        "message": no_space_message(kv["dir"], free, needed),
    }


def no_space_message(directory: str, free: int, needed: int) -> str:
    """`no space left on /data/dumps: 1.2 GB free, 40.0 GB needed` (the client logs the same words)."""
    return f"no space left on {directory}: {human_bytes(free)} free, {human_bytes(needed)} needed"


def human_bytes(n: int) -> str:
    """Decimal units, one decimal: 1.0 KB, 5.0 GB (as `extract_onhost.py` writes them)."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _apply_progress(s: ExtractionSummary, line: str, event: str) -> dict:
    """Fold one progress line into `s`; return its per-session counters (for the rates)."""
    kv = _fields(line)
    s.last_time = line.split(" ", 1)[0]
    for name in ("done", "total", "tokens", "errors", "failed", "missing_dumps"):
        if name in kv and _num(kv[name], int) is not None:
            setattr(s, name, _num(kv[name], int))
    s.state = {"finished": "finished", "stopped": "stopped"}.get(event, "running")
    if event != "progress":
        s.no_space = None  # a new session, or the end of one
    return {
        "elapsed": _num(kv.get("elapsed")),
        "done": _num(kv.get("session_done"), int),
        "tokens": _num(kv.get("session_tokens"), int),
    }


def _derive_rates(s: ExtractionSummary, session: dict) -> None:
    """Rates over the current session (a resumed run starts a new one), ETA from them."""
    elapsed = session.get("elapsed")
    if not elapsed or elapsed <= 0:
        return
    done = session.get("done") if session.get("done") is not None else s.done
    toks = session.get("tokens") if session.get("tokens") is not None else s.tokens
    s.rate_samples_s = round(done / elapsed, 3)
    s.rate_tokens_s = round(toks / elapsed, 1)
    if s.state == "finished":
        s.eta_s = 0.0
    elif s.total and s.rate_samples_s:
        s.eta_s = round(max(s.total - s.done, 0) / s.rate_samples_s, 1)


# Linear on any line: every attempt starts at a literal word (`Train`, `Training Epoch`, `loss=`)
# or at the first digit of a run (`(?<!\d)`), and numbers read as ints are at most 18 digits
# (a longer one is no match, rather than a 16 MB int).
_POSITION = re.compile(
    r"(?P<phase>Train|Eval)\s+(?P<unit>Epoch|Step)\s+\[(?P<index>\d{1,18})(?:/(?P<total>\d{1,18}))?\],\s*"
    r"position\s+(?P<pos>\d{1,9}),\s*(?P<metric>Acc|pLoss):\s*(?P<value>[-+0-9.eEnaif]+)"
)


_STEP_DICT = re.compile(r"^step (?P<step>\d{1,18}): (?P<dict>\{.*\})\s*$")


_NONFINITE = re.compile(r"(?<![\w'.])-?(?:nan|inf)(?![\w'])")


_POSITION_KEY = re.compile(r"^(?:(?P<ns>train|eval)/)?(?P<metric>acc|ploss|per_position_acc)[_/](?P<pos>\d{1,9})$")


# The tqdm bar in three steps (one regex with `.*?` between them re-scanned the line from
# every `Training Epoch`): the head, then each `N/M [..]` after it, then loss/acc inside.
_TQDM_HEAD = re.compile(r"Training Epoch (?P<epoch>\d{1,9}):")
_TQDM_COUNT = re.compile(r"(?<!\d)(?P<n>\d{1,18})/(?P<total>\d{1,18})\s*\[(?P<postfix>[^\]]*)")
_TQDM_POSTFIX = re.compile(r"loss=(?P<loss>[-0-9.eE]+),\s*acc=(?P<acc>[-0-9.eE]+)")


@dataclass
class TrainRecord:
    """Per-position accuracy and loss of one epoch (or step), for train or eval."""

    phase: str  # train | eval
    unit: str  # epoch | step
    index: int
    total: int | None = None
    acc: dict[int, float] = field(default_factory=dict)
    ploss: dict[int, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # 0.2.0: the line's other scalars (lr, perf/..)

    @property
    def step0_acc(self) -> float | None:
        return self.acc.get(0)

    @property
    def acceptance_length(self) -> float | None:
        """Expected tokens per verify step, tau = 1 + sum_k prod_{i<=k} acc_i (positions 0, 1, ... in a row).

        Each position's accuracy is read as the chance that draft token k is
        accepted once the tokens before it were.  SpecForge measures position k
        on the drafter's own earlier predictions (training-time test), so this is
        the estimate practitioners quote for a chain draft (topk 1), not a
        measurement on the served model."""
        if 0 not in self.acc:
            return None
        tau, chain, k = 1.0, 1.0, 0
        while k in self.acc:
            chain *= self.acc[k]
            tau += chain
            k += 1
        return round(tau, 3)

    @property
    def loss(self) -> float | None:
        """SpecForge's training objective: position losses weighted 0.8**i."""
        if not self.ploss:
            return None
        return round(sum(0.8**i * v for i, v in self.ploss.items()), 4)


@dataclass
class StepPoint:
    """One tqdm update of `train_eagle3.py`: mean loss/accuracy over positions at a step."""

    epoch: int
    step: int
    total: int
    loss: float
    acc: float


@dataclass
class TrainingSummary:
    records: list[TrainRecord] = field(default_factory=list)
    steps: list[StepPoint] = field(default_factory=list)

    def latest(self, phase: str = "train") -> TrainRecord | None:
        rows = [r for r in self.records if r.phase == phase]
        return rows[-1] if rows else None

    def to_dict(self) -> dict:
        return {
            "format": "specforge",
            "records": [
                {**asdict(r), "step0_acc": r.step0_acc, "loss": r.loss, "acceptance_length": r.acceptance_length}
                for r in self.records
            ],
            "steps": [asdict(p) for p in self.steps],
        }


def parse_training(text: str | Iterable[str]) -> TrainingSummary:
    """Parse a SpecForge training log (the three formats above; tqdm's \\r updates included).

    `text` is the log, or its lines (`stream_lines`); lines are cut to `LINE_LIMIT`."""
    out = TrainingSummary()
    index: dict[tuple, TrainRecord] = {}
    for piece in bounded_lines(text):
        d = _STEP_DICT.match(piece)
        if d:
            _add_step_dict(out, index, int(d["step"]), d["dict"])
            continue
        m = _POSITION.search(piece)
        if m:
            _add_position(out, index, m)
            continue
        point = _tqdm_point(piece)
        if point:
            _add_step(out, point)
    return out


def _tqdm_point(piece: str) -> StepPoint | None:
    """`Training Epoch 0:  12%|..| 120/1000 [.., loss=1.23, acc=0.45, ..]` -> its StepPoint."""
    head = _TQDM_HEAD.search(piece)
    if not head:
        return None
    for count in _TQDM_COUNT.finditer(piece, head.end()):
        post = _TQDM_POSTFIX.search(count["postfix"])
        loss, acc = (_num(post["loss"]), _num(post["acc"])) if post else (None, None)
        if loss is not None and acc is not None:
            return StepPoint(int(head["epoch"]), int(count["n"]), int(count["total"]), loss, acc)
    return None


def _add_position(out: TrainingSummary, index: dict, m: re.Match) -> None:
    key = (m["phase"].lower(), m["unit"].lower(), int(m["index"]))
    rec = index.get(key)
    if rec is None:
        rec = index[key] = TrainRecord(*key, total=_num(m["total"], int))
        out.records.append(rec)
    value = _num(m["value"])
    if value is not None:
        (rec.acc if m["metric"] == "Acc" else rec.ploss)[int(m["pos"])] = value


def step_metrics(text: str) -> dict[str, float | list]:
    """The dict SpecForge 0.2.0 prints after `step N: ` -> {key: float or list} (pure; {} if unreadable).

    Python prints non-finite floats as bare `nan`/`inf`, which are not literals: read as None.
    A text longer than `LINE_LIMIT` is not read."""
    if len(text) > LINE_LIMIT:
        return {}
    try:
        doc = ast.literal_eval(_NONFINITE.sub("None", text))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _add_step_dict(out: TrainingSummary, index: dict, step: int, text: str) -> None:
    """One 0.2.0 metrics line -> the train or eval record of that optimizer step (the controller
    logs training and evaluation metrics in separate calls, so a line with `eval/` keys is an eval line)."""
    metrics = step_metrics(text)
    if not metrics:
        return
    phase = "eval" if any(str(k).startswith("eval/") for k in metrics) else "train"
    rec = index.get((phase, "step", step))
    if rec is None:
        rec = index[(phase, "step", step)] = TrainRecord(phase, "step", step)
        out.records.append(rec)
    for key, value in metrics.items():
        _put_metric(rec, str(key), value)


def _put_metric(rec: TrainRecord, key: str, value: object) -> None:
    if isinstance(value, list) and key.endswith("per_position_acc"):
        rec.acc.update({i: float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    m = _POSITION_KEY.match(key)
    if m:
        (rec.ploss if m["metric"] == "ploss" else rec.acc)[int(m["pos"])] = float(value)
    else:
        rec.metrics[key.removeprefix("train/")] = float(value)


def _add_step(out: TrainingSummary, point: StepPoint) -> None:
    if out.steps and (out.steps[-1].epoch, out.steps[-1].step) == (point.epoch, point.step):
        out.steps[-1] = point  # tqdm repaints the same step
    else:
        out.steps.append(point)


@dataclass
class FileCursor:
    """What we already pulled of one remote file: its identity and how many bytes."""

    inode: str = ""
    offset: int = 0
    generation: int = 0  # bumped each time the remote file was rotated/truncated
    head: str = ""  # sha256 of the file's first min(offset, probes.logs.HEAD_BYTES) bytes


@dataclass
class ServerCursor:
    """What we already pulled of a container's log: the container id and last timestamp."""

    container_id: str = ""
    last_ts: str = ""
    lines_at_last_ts: int = 0
    generation: int = 0


def reset_needed(cursor: FileCursor, inode: str, size: int) -> str | None:
    """Why the remote file must be re-read from byte 0, or None to continue (pure)."""
    if cursor.inode and inode != cursor.inode:
        return "rotated"
    if size < cursor.offset:
        return "truncated"
    return None


def split_server_fetch(output: str) -> tuple[str, list[str]]:
    head, _, rest = output.partition("\n")
    return head.strip(), [l for l in rest.splitlines() if l]


def new_server_lines(
    cursor: ServerCursor, container_id: str, lines: list[str], since: str | None
) -> tuple[list[str], ServerCursor]:
    """Drop lines already pulled (same timestamp as the cursor's last, counted), advance (pure).

    docker's `--since` is inclusive at the second's resolution it is given, so the
    lines at exactly the last timestamp we hold come back again; we skip as many
    as we already have (podman's is exclusive: none come back, none are skipped).
    A new container id starts over.
    """
    if container_id != cursor.container_id:
        cursor = ServerCursor(container_id, "", 0, cursor.generation + (1 if cursor.container_id else 0))
    skip = cursor.lines_at_last_ts if not since else 0
    fresh, last_ts, at_last = [], cursor.last_ts, cursor.lines_at_last_ts
    for line in lines:
        ts = line.split(" ", 1)[0]
        if cursor.last_ts and ts < cursor.last_ts and not since:
            continue
        if ts == cursor.last_ts and skip > 0:
            skip -= 1
            continue
        fresh.append(line)
        at_last = at_last + 1 if ts == last_ts else 1
        last_ts = ts
    return fresh, ServerCursor(container_id, last_ts, at_last, cursor.generation)


def log_sources(host: HostSpec, kinds: tuple[str, ...]) -> dict[str, str]:
    """kind -> remote source (file path, or container name for `server`) from the inventory."""
    table = {"server": host.container.name, "extraction": host.logs.extraction, "training": host.logs.training}
    unknown = [k for k in kinds if k not in table]
    if unknown:
        raise UsageError(f"unknown log kind(s) {unknown}; use {', '.join(KINDS)} or all")
    return {k: table[k] for k in kinds}


def split_tagged(line: str) -> tuple[str, str]:
    """`kind|text` -> (kind, text); untagged lines come from the shell itself."""
    kind, sep, text = line.partition("|")
    return (kind, text) if sep and kind in KINDS else ("remote", line)


def extraction_points(text: str | Iterable[str]) -> list[tuple[float, int, int]]:
    """(seconds since the first line, samples done, tokens) per progress line, for plotting."""
    import calendar

    points, first = [], None
    for line in bounded_lines(text):
        parts = line.split(" ", 2)
        if len(parts) < 3 or parts[1] not in ("progress", "finished", "stopped", "started"):
            continue
        try:
            t = calendar.timegm(time.strptime(parts[0], "%Y-%m-%dT%H:%M:%SZ"))
        except ValueError:
            continue
        first = t if first is None else first
        kv = _fields(line)
        points.append((float(t - first), _num(kv.get("done"), int) or 0, _num(kv.get("tokens"), int) or 0))
    return points


# --------------------------------------------------------------------------- vLLM's server log
#: `(APIServer pid=1) INFO 12-02 11:15:03 [loggers.py:257] Engine 000: Avg prompt throughput: 1234.5 tokens/s,
#: Avg generation throughput: 1.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.1%, ...`
#: (vllm/v1/metrics/loggers.py of 0.32.0: optional Deferred / KV fetch / Preemptions parts before the KV cache)
_VLLM_STATS = re.compile(
    r"(?P<level>[A-Z]+) (?P<time>\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)? \[[^\]]*\] (?:Engine \d+: )?"
    r"Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s, "
    r"Running: (?P<running>\d+) reqs?, Waiting: (?P<waiting>\d+) reqs?"
)
_VLLM_KV = re.compile(r"KV cache usage: (?P<kv>[\d.]+)%")


def parse_vllm_stats(text: str) -> list[dict[str, Any]]:
    """vLLM's periodic throughput lines, one record each (pure; other lines are skipped)."""
    out = []
    for line in text.splitlines():
        m = _VLLM_STATS.search(line)
        if m:
            kv = _VLLM_KV.search(line, m.end())
            out.append(
                {
                    "time": m["time"],
                    "prompt_tokens_per_s": float(m["prompt"]),
                    "generation_tokens_per_s": float(m["gen"]),
                    "running": int(m["running"]),
                    "waiting": int(m["waiting"]),
                    "kv_cache_usage_pct": float(kv["kv"]) if kv else None,
                }
            )
    return out
