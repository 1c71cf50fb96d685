"""`remote-ops logs pull|follow|summary`: server, extraction and training logs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import click

from ...core import logparse
from ...workflows import logs as logs_mod
from ._fleet import run_on_hosts
from ._options import hosts_command

WHAT = click.Choice(["server", "extraction", "training", "all"])


def _kinds(what: str) -> tuple[str, ...]:
    return logparse.KINDS if what == "all" else (what,)


@click.group("logs")
def logs_group() -> None:
    """Pull, follow and summarise a host's logs (server container, extraction, training).

    \b
    Examples:
      remote-ops logs pull --host gpu-node                 # everything, only new bytes
      remote-ops logs follow --host gpu-node --what extraction
      remote-ops logs summary --host gpu-node --plot
      remote-ops logs summary --local train.log --local extraction.log --plot   # no SSH
    """


@logs_group.command("pull")
@click.option("--what", type=WHAT, default="all", show_default=True)
@click.option(
    "--since",
    default=None,
    metavar="WHEN",
    help="server log only: start at docker's --since value (e.g. 30m, 2026-01-01T00:00:00) "
    "instead of where the last pull stopped",
)
@hosts_command
def pull_cmd(app, hosts, forks, what, since) -> int:
    """Fetch new log bytes into the local run dir (<state>/hosts/<host>/logs/).

    Incremental: per-file byte offsets (and the file's inode and first bytes)
    are kept, so only new bytes travel; a rotated or truncated file is noticed
    and the old local copy kept as <name>.<n>.  Safe to interrupt: the offset is
    saved only after the bytes are on disk.
    """

    def work(spec):
        return 0, {"host": spec.name, "logs": logs_mod.pull_logs(app.remote(spec), spec, _kinds(what), since=since)}

    return run_on_hosts(app, hosts, work, _render_pull, forks=forks)


def _render_pull(console, spec, doc) -> None:
    """What each log file got: the command's data (stdout)."""
    for r in doc["logs"]:
        if r.missing:
            console.status("skip", f"{spec.name} {r.kind}: {r.remote} not found on the host", data=True)
        else:
            note = f" (remote {r.reset}; old copy kept)" if r.reset else ""
            console.status(
                "ok",
                f"{spec.name} {r.kind}: +{r.new_bytes} bytes -> {r.local} ({r.total_bytes} bytes){note}",
                data=True,
            )


@logs_group.command("follow")
@click.option("--what", type=WHAT, default="all", show_default=True)
@click.option("--since", default=None, metavar="WHEN", help="server log: docker's --since")
@click.option("--lines", type=int, default=20, show_default=True, help="lines of history first")
@click.option(
    "--duration",
    type=float,
    default=3600.0,
    show_default=True,
    help="stop following after this many seconds (every wait has a deadline)",
)
@click.option(
    "--raw",
    is_flag=True,
    help="write each log line as the host sent it, escape sequences included (default: control "
    "characters shown as ^[ etc., so a log line cannot drive the terminal)",
)
@hosts_command
def follow_cmd(app, hosts, forks, what, since, lines, duration, raw) -> int:
    """Stream logs live on stdout, each line prefixed with the host (and the log kind).

    A log line's control characters are shown in `cat -v` notation (ESC as ^[),
    so a line holding `ESC[2J` or an OSC 52 clipboard write cannot clear the
    screen or set the clipboard; --raw writes the lines as they came.
    With --json: JSON Lines, one `{"host", "kind", "stream", "line"}` object per log line,
    each line exact; an error or Ctrl-C ends the stream with one compact JSON line.
    Many hosts are followed at once (--forks), their lines interleaved as they come."""
    app.console.streaming = True

    def work(spec):
        _follow(app, spec, what, since, lines, duration, raw)
        return 0, None

    return run_on_hosts(app, hosts, work, lambda *_: None, forks=max(forks, len(hosts)), emit=lambda _doc: None)


def _follow(app, spec, what, since, lines, duration, raw: bool) -> None:
    def on_line(stream: str, line: str) -> None:
        kind, text = logparse.split_tagged(line)
        if app.console.json_mode:
            app.console.emit_line({"host": spec.name, "kind": kind, "stream": stream, "line": text})
        elif raw:
            app.console.raw_line(spec.name, f"[{kind}] {text}")
        else:
            app.console.host_line(spec.name, stream, f"[{kind}] {text}", data=True)

    if not logs_mod.follow(app.remote(spec), spec, _kinds(what), since, lines, duration, on_line):
        app.console.say(f"{spec.name}: followed for {duration:g}s; stopping", style="dim")


@logs_group.command("summary")
@click.option(
    "--pull/--no-pull", "do_pull", default=True, show_default=True, help="pull extraction and training logs first"
)
@click.option("--plot", is_flag=True, help="also write PNG plots next to the pulled logs")
@click.option(
    "--local",
    "local_file",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    callback=lambda _ctx, _param, value: value or None,
    metavar="FILE",
    help="summarise log files already on this machine instead of a host's (repeat for several; "
    "no SSH): each is read as an extraction or a SpecForge log by its content",
)
@hosts_command(local_ok=True)
def summary_cmd(app, hosts, forks, do_pull, plot, local_file) -> int:
    """Extraction progress (done/total, tokens, rate, errors, ETA) and training metrics.

    Training logs are read in SpecForge's format (per-position `Acc`/`pLoss`
    lines per epoch or step, and train_eagle3.py's progress bar).  With
    --local FILE (instead of --host) the files are read here, without SSH; plots
    go to plots/<file stem>/ next to each file.
    """
    if local_file:
        return _summary_local(app, local_file, plot)

    def work(spec):
        return 0, _summary_one(app, spec, do_pull, plot)

    return run_on_hosts(app, hosts, work, _render_summary, forks=forks)


def _summary_one(app, spec, do_pull: bool, plot: bool) -> LogSummary:
    """Pull (optionally), parse and plot one host's logs."""
    if do_pull:
        logs_mod.pull_logs(app.remote(spec), spec, ("extraction", "training"))
    local = logs_mod.local_log_dir(spec.name)
    ext_lines, train_lines = _read(local / "extraction.log"), _read(local / "training.log")
    extraction = logparse.parse_extraction(ext_lines)
    training = logparse.parse_training(train_lines)
    plots = _plots(local, spec.name, ext_lines, training) if plot else []
    return LogSummary(spec.name, extraction, training, [str(p) for p in plots])


@dataclass
class LogSummary:
    """One host's summary: the parsed extraction and training logs and the plots written."""

    host: str
    extraction: logparse.ExtractionSummary
    training: logparse.TrainingSummary
    plots: list

    def to_dict(self) -> dict:
        return {
            "host": self.host,
            "extraction": self.extraction,
            "training": self.training.to_dict(),
            "plots": self.plots,
        }


def _summary_local(app, files, plot: bool) -> int:
    """`--local`: each file summarised as the log its content says it is; one JSON document."""
    summaries = [_summary_file(Path(f), plot) for f in files]
    for s in summaries:
        app.console.say(f"{s.file}: {s.kind} log", style="dim")
        if s.kind == "extraction":
            _render_extraction(app.console, s.extraction)
        elif s.kind == "training":
            _render_training(app.console, s.training)
        for p in s.plots:
            app.console.status("ok", f"plot: {p}")
    app.console.emit({"files": [s.to_dict() for s in summaries]})
    return 0


def _summary_file(path: Path, plot: bool) -> LocalSummary:
    """One local log: parsed both ways, kept as the kind whose parser found something."""
    lines = _read(path)
    extraction, training = logparse.parse_extraction(lines), logparse.parse_training(lines)
    kind = log_kind(extraction, training)
    plots: list = []
    if plot and kind == "training":
        plots = _plot_training(path.parent / "plots" / path.stem, path.stem, training)
    elif plot and kind == "extraction":
        plots = _plot_extraction(path.parent / "plots" / path.stem, path.stem, lines)
    return LocalSummary(str(path), kind, extraction, training, [str(p) for p in plots])


def log_kind(extraction: logparse.ExtractionSummary, training: logparse.TrainingSummary) -> str:
    """'training' when SpecForge metrics were found, 'extraction' when the extraction client's
    events were, else 'unknown' (a file is one or the other: their line formats do not overlap)."""
    if training.records or training.steps:
        return "training"
    if extraction.state != "unknown" or extraction.done or extraction.errors or extraction.error_lines:
        return "extraction"
    return "unknown"


@dataclass
class LocalSummary:
    """One local log file's summary: its kind, the parse of that kind, and the plots written."""

    file: str
    kind: str  # extraction | training | unknown
    extraction: logparse.ExtractionSummary
    training: logparse.TrainingSummary
    plots: list

    def to_dict(self) -> dict:
        doc: dict = {"file": self.file, "kind": self.kind}
        if self.kind == "extraction":
            doc["extraction"] = self.extraction.to_dict()
        elif self.kind == "training":
            doc["training"] = self.training.to_dict()
        return {**doc, "plots": self.plots}


def _render_summary(console, _spec, s: LogSummary) -> None:
    _render_extraction(console, s.extraction)
    _render_training(console, s.training)
    for p in s.plots:
        console.status("ok", f"plot: {p}")


def _read(path) -> list[str]:
    """A local log's lines, each cut to logparse's line limit as it is read (a file holding one
    200 MB line never sits in memory)."""
    if not path.exists():
        return []
    with open(path, errors="replace") as fh:
        return list(logparse.stream_lines(fh))


def _plots(local, name, ext_lines, training):
    out = local / "plots"
    return _plot_training(out, name, training) + _plot_extraction(out, name, ext_lines)


def _plot_training(out: Path, name: str, training) -> list:
    from ...core import plots

    return plots.plot_training(training, out, title=name)


def _plot_extraction(out: Path, name: str, ext_lines) -> list:
    from ...core import plots

    ext = plots.plot_extraction(logparse.extraction_points(ext_lines), out, title=name)
    return [ext] if ext else []


def _fmt_eta(seconds) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 86400:.1f} d"


def _render_extraction(console, s) -> None:
    total = s.total if s.total is not None else "?"
    rows = [
        ["state", s.state],
        ["samples", f"{s.done} / {total}"],
        ["tokens", f"{s.tokens:,}"],
        ["rate", f"{s.rate_samples_s or 0:.2f} samples/s, {s.rate_tokens_s or 0:,.0f} tokens/s"],
        ["errors (retried) / failed", f"{s.errors} / {s.failed}"],
        ["missing dumps", "-" if s.missing_dumps is None else s.missing_dumps],
        ["ETA", _fmt_eta(s.eta_s)],
        ["last update", s.last_time or "-"],
    ]
    if s.no_space:
        rows.append(["disk", s.no_space["message"]])
    console.table(["extraction", ""], rows, title="Extraction")


def _render_training(console, t) -> None:
    if not t.records and not t.steps:
        console.say("training: no SpecForge metrics found in the log", style="dim")
        return
    positions = sorted({p for r in t.records for p in r.acc})
    cols = ["phase", "unit", "#", "loss", "step-0 acc", "tau"] + [f"acc@{p}" for p in positions]
    rows = [
        [
            r.phase,
            r.unit,
            r.index if r.total is None else f"{r.index}/{r.total}",
            "-" if r.loss is None else f"{r.loss:.3f}",
            "-" if r.step0_acc is None else f"{r.step0_acc:.2f}",
            "-" if r.acceptance_length is None else f"{r.acceptance_length:.2f}",
        ]
        + [f"{r.acc[p]:.2f}" if p in r.acc else "" for p in positions]
        for r in t.records
    ]
    if rows:
        console.table(cols, rows, title="Training (SpecForge)")
        console.say(
            "tau = 1 + sum_k prod_{i<=k} acc_i: the expected accepted tokens per verify step "
            "a chain draft would give (an estimate from training accuracy, not a measurement on the served model)",
            style="dim",
        )
    if t.steps:
        last = t.steps[-1]
        console.text_block(
            f"last step: epoch {last.epoch}, {last.step}/{last.total}, loss {last.loss:.3f}, acc {last.acc:.3f}"
        )


commands = [logs_group]
