"""All output goes through here: data on stdout, progress and notes on stderr.

Commands return result objects; the CLI hands them to `Console`.  Nothing else
prints.  The streams rule:

- data (tables, diffs, listings, check results and verdicts, followed log
  lines) -> stdout, so `remote-ops hosts 2>/dev/null`, `patch apply --dry-run
  > x.diff` and `logs follow | grep` work; a table to a stdout that is not a
  terminal is tab-separated lines with whole values (`tab_separated`), so
  `patch specs | grep -c CLASS` counts rows;
- progress, notes, warnings and errors -> stderr;
- with `--json`, stdout carries exactly one JSON document (`emit`), or one
  compact object per line for streams (`emit_line`: `health --watch`, `logs
  follow`), and the human data goes to stderr instead.  Once a command says
  it streams (`streaming`, or its first `emit_line`), every later document is
  one compact line too: the error or interruption that ends a stream (rendered
  by the CLI boundary on this same console) keeps stdout JSON Lines.

Host text is data, not terminal control: every human-output path shows the
control characters of what it prints in `cat -v` notation
(`remote_ops.core.terminal.visible`: ESC as `^[`), one-line paths their
newlines too.  JSON keeps the exact strings; `raw_line` (`logs follow --raw`)
is the one way to write host bytes as they came.

Colour only on a terminal and never with NO_COLOR set (rich's own rules).

A line for a stream that rich would leave unstyled (not a terminal, and
neither FORCE_COLOR nor TTY_COMPATIBLE set: `plain_stream`) is written as it
is, without rich: a command whose output goes to a pipe or a file and prints
no table never imports it.  Otherwise rich is imported on first output, or
earlier in the background (`warm`): a command that opens connections first
(health) imports it while the handshake waits on the network instead of
before the first packet.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..core.jsonable import to_jsonable
from ..core.terminal import visible

if TYPE_CHECKING:
    from rich.console import Console as RichConsole

STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim", "info": "cyan"}


class Console:
    """Human output on stderr; machine output on stdout when `json_mode`."""

    def __init__(
        self, json_mode: bool = False, quiet: bool = False, stderr=None, stdout=None, streaming: bool = False
    ) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        #: stdout carries JSON Lines (a stream): every document is one compact line
        self.streaming = streaming
        #: the run ended (`for_errors`): stream lines from threads still running are dropped
        self.ended = False
        self.verbose = 0
        self._stderr = stderr or sys.stderr
        self._stdout = stdout or sys.stdout
        self._err: RichConsole | None = None
        self._data: RichConsole | None = None

    def for_errors(self) -> Console:
        """A console for the CLI boundary's error or interruption: this one's streams, JSON mode
        and `streaming` (the last line of a stream is one compact line too), but never quiet
        (errors and their stderr tail always print).  This console's stream is over: a line a
        host's thread still delivers is dropped, so the error stays the stream's last line."""
        self.ended = True
        return Console(self.json_mode, stderr=self._stderr, stdout=self._stdout, streaming=self.streaming)

    def warm(self) -> None:
        """Import rich in a daemon thread now, so the first line does not pay for it.  Worth
        calling just before the run waits on the network (`App.preconnect`); the import lock
        makes a first print during the import wait for it.  Not when both streams are plain
        (`plain_stream`): lines need no rich there, and a table imports it when it prints."""
        if plain_stream(self._stdout) and plain_stream(self._stderr):
            return
        threading.Thread(target=_import_rich, name="import rich", daemon=True).start()

    @property
    def err(self) -> RichConsole:
        """The rich console on stderr (progress, notes, errors)."""
        if self._err is None:
            self._err = _rich(self._stderr)
        return self._err

    @property
    def data(self) -> RichConsole:
        """Where human-readable data goes: stdout, or stderr when stdout carries JSON."""
        if self.json_mode:
            return self.err
        if self._data is None:
            self._data = _rich(self._stdout)
        return self._data

    # -- human ---------------------------------------------------------------
    def say(self, text: str = "", style: str | None = None) -> None:
        """One line for humans (stderr).  Text is escaped: remote output is not markup, and its
        control characters and newlines are shown (`visible`)."""
        if not self.quiet:
            text = visible(text, one_line=True)
            self._line(False, text, lambda: escape(text), style)

    def step(self, text: str) -> None:
        self.say(f"==> {text}", style="bold")

    def status(self, status: str, text: str, data: bool = False) -> None:
        """`[ ok ] text` style line, coloured by status; `data`: a result line (stdout), not progress."""
        label = f"[{status:^4}]"
        text = visible(text, one_line=True)
        if data or not self.quiet:
            markup = lambda: f"[{STATUS_STYLE.get(status, '')}]{escape(label)}[/] {escape(text)}"  # noqa: E731
            self._line(data, f"{label} {text}", markup)

    def warn(self, text: str) -> None:
        self.say(f"warning: {text}", style="yellow")

    def error(self, text: str, hint: str | None = None) -> None:
        """`error: text` and `hint: hint` on stderr, even with --quiet.  Messages may span lines
        (an inventory's errors); their control characters are shown (`visible`)."""
        text = visible(text)
        self._line(False, f"error: {text}", lambda: f"[red bold]error:[/] {escape(text)}")
        if hint:
            hint = visible(hint)
            self._line(False, f"hint: {hint}", lambda: f"[dim]hint: {escape(hint)}[/]")

    def host_line(self, host: str, stream: str, line: str, data: bool = False) -> None:
        """A live line of remote output, prefixed by its host: progress (a build's output) on
        stderr, or with `data` the command's data (followed log lines) on stdout.  Its control
        characters are shown (`visible`, one line): a log line cannot drive the terminal."""
        if (data or not self.quiet) and not self.ended:
            host, line = visible(host, one_line=True), visible(line, one_line=True)
            style = "dim" if stream == "stderr" else None
            self._line(data, f"{host} | {line}", lambda: f"[cyan]{escape(host)}[/] | {escape(line)}", style)

    def raw_line(self, host: str, line: str) -> None:
        """A followed log line exactly as the host sent it, prefixed by its host, on stdout, never
        through rich (which would drop some control characters): `logs follow --raw`, asked for
        by name.  The host name (from the inventory) is still shown as `visible`."""
        if self.ended:
            return
        self._stdout.write(f"{visible(host, one_line=True)} | {line}\n")
        self._stdout.flush()

    def _line(self, data: bool, plain: str, markup: Callable[[], str], style: str | None = None) -> None:
        """One line of data (`data`: stdout, stderr with --json) or progress (stderr).  Where rich
        would not style it the plain text is written as is, rich not even imported: rich would
        only drop the markup (no wrapping: soft_wrap) and expand tabs, at ~0.7 ms a line on the
        lab VM (health prints 16 lines a host)."""
        file = self._stdout if data and not self.json_mode else self._stderr
        target = None if plain_stream(file) else (self.data if data else self.err)
        if target is None or (target.color_system is None and not target.is_terminal):
            file.write(plain + "\n")
            file.flush()
        else:
            target.print(markup(), style=style)

    def table(self, columns: list[str], rows: list[list[Any]], title: str | None = None) -> None:
        """A table of data (stdout; stderr with --json).  To a stdout that is not a terminal
        (`plain_stream`) it is `tab_separated`: values whole, no box characters, the title
        (if any) a `# title` line before the header, so a run that prints several tables
        (`facts` of many hosts) still says which is which, and `grep -v '^#'` drops it.
        Otherwise a rich table, as on a terminal."""
        if not self.json_mode and plain_stream(self._stdout):
            heading = f"# {visible(title, one_line=True)}\n" if title else ""
            self._stdout.write(heading + tab_separated(columns, rows))
            self._stdout.flush()
            return
        from rich.table import Table

        t = Table(title=title, show_edge=False, header_style="bold")
        for c in columns:
            t.add_column(c)
        for r in rows:
            t.add_row(*[escape(visible("" if v is None else str(v))) for v in r])
        self.data.print(t)

    def text_block(self, text: str, data: bool = True) -> None:
        """Multi-line text as given (diffs, numbered source), lines and tabs kept, other control
        characters shown (`visible`): data on stdout (stderr with --json); with `data=False`
        supporting evidence for progress (stderr, silenced by -q)."""
        if self.json_mode or not data:
            if not self.quiet:
                self.err.out(visible(text), highlight=False)
        else:
            self.out(text)

    def trace(self, text: str) -> None:
        """A `-v` line (each remote command and its time) on stderr, even with --quiet."""
        text = visible(text, one_line=True)
        self._line(False, text, lambda: escape(text), "dim")

    def live(self) -> bool:
        """Whether progress is drawn: not --quiet, and stderr is a terminal (rich's own test,
        `plain_stream`).  Piped or redirected, a run prints no bars, counters or ETAs at all:
        only its lines."""
        return not self.quiet and not plain_stream(self._stderr)

    @contextmanager
    def progress(self, description: str, total: float | None = None) -> Iterator[Any]:
        """A rich progress bar on stderr; yields a callable `advance(n, description=None)`.
        Nothing is drawn unless `live` (then `advance` does nothing)."""
        if not self.live():
            yield lambda n=0, description=None: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        description = visible(description, one_line=True)
        columns = [TextColumn("{task.description}"), BarColumn()]
        if total:
            columns += [DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
        with Progress(*columns, console=self.err, transient=False) as prog:
            task = prog.add_task(description, total=total)

            def advance(n: float = 0, description: str | None = None) -> None:
                shown = visible(description, one_line=True) if description else None  # None: keep it
                prog.update(task, advance=n, description=shown)

            yield advance

    @contextmanager
    def transfer(self, description: str) -> Iterator[Callable[[int, "int | None"], None]]:
        """A download's bar on stderr (bytes, rate, time left); yields `update(done, total)`, total
        None while unknown.  Nothing is drawn unless `live`."""
        if not self.live():

            def nothing(done: int, total: int | None = None) -> None:
                return None

            yield nothing
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
        with Progress(*columns, console=self.err, transient=False) as prog:
            task = prog.add_task(visible(description, one_line=True), total=None)

            def update(done: int, total: int | None = None) -> None:
                prog.update(task, completed=done, total=total)

            yield update

    @contextmanager
    def counter(self, description: str, unit: str) -> Iterator[Callable[..., None]]:
        """Work counted in `unit`s (samples, build steps) on stderr: done/total, then the rate and
        the time left as the caller measured them, and a note.  Yields `update(done, total,
        rate=None, eta_s=None, note="")`; the bar appears at the first update.  Nothing is drawn
        unless `live`."""
        if not self.live():
            yield lambda done, total, rate=None, eta_s=None, note="": None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tail]}"),
        ]
        prog = Progress(*columns, console=self.err, transient=False)
        task = prog.add_task(f"{visible(description, one_line=True)} ({unit})", total=None, tail="", start=False)

        def update(done, total, rate=None, eta_s=None, note: str = "") -> None:
            if not prog.live.is_started:
                prog.start()
                prog.start_task(task)
            tail = visible(progress_tail(unit, rate, eta_s, note), one_line=True)
            prog.update(task, completed=done, total=total, tail=tail)

        try:
            yield update
        finally:
            if prog.live.is_started:
                prog.stop()

    # -- machine -------------------------------------------------------------
    def emit(self, obj: Any) -> None:
        """Write the command's result as one JSON document on stdout (only in json mode); in a
        stream (`streaming`) one compact line, so stdout stays JSON Lines to its end."""
        if self.json_mode and self.streaming:
            self.emit_line(obj)
        elif self.json_mode:
            json.dump(to_jsonable(obj), self._stdout, indent=2, sort_keys=False)
            self._stdout.write("\n")
            self._stdout.flush()

    def emit_line(self, obj: Any) -> None:
        """One compact JSON object on one line (JSON Lines, for streams), only in json mode.
        Marks the console as `streaming`: whatever document follows is a line of the stream."""
        self.streaming = True
        if self.json_mode and not self.ended:
            self._stdout.write(json.dumps(to_jsonable(obj), separators=(",", ":")) + "\n")
            self._stdout.flush()

    def out(self, text: str) -> None:
        """Primary data a user may pipe (a rendered Dockerfile, a source listing) -> stdout; lines
        and tabs kept, other control characters shown (`visible`)."""
        text = visible(text)
        self._stdout.write(text if text.endswith("\n") else text + "\n")
        self._stdout.flush()


def tab_separated(columns: list[str], rows: list[list[Any]]) -> str:
    """A table as text for a pipe: a header line, then one line per row, cells separated by
    tabs.  Cells are whole (never cut), their control characters shown (`visible`, one line)
    and a tab inside a cell as `^I`, so each row is one line of exactly len(columns) fields."""

    def cell(v: Any) -> str:
        return visible("" if v is None else str(v), one_line=True).replace("\t", "^I")

    return "".join("\t".join(cell(v) for v in line) + "\n" for line in [columns, *rows])


def progress_tail(unit: str, rate: float | None, eta_s: float | None, note: str = "") -> str:
    """`12.5 samples/s, ETA 3m20s, running`: what a counter shows after done/total (the parts
    known)."""
    parts = [f"{rate:,.1f} {unit}/s"] if rate else []
    parts += [f"ETA {duration(eta_s)}"] if eta_s is not None else []
    return ", ".join(parts + ([note] if note else []))


def duration(seconds: float) -> str:
    """`42s`, `3m20s`, `2h05m`."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def plain_stream(file: Any) -> bool:
    """True when rich would write to `file` without any styling, by rich's own test of a
    terminal: not a tty, and neither TTY_COMPATIBLE nor FORCE_COLOR says otherwise."""
    if "TTY_COMPATIBLE" in os.environ or "FORCE_COLOR" in os.environ:
        return False
    try:
        return not file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file: rich says "not a terminal"
        return True


def escape(text: str) -> str:
    """`text` with rich markup escaped: remote output and names are never markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _import_rich() -> None:
    import importlib

    for name in ("rich.console", "rich.markup", "rich.table"):
        importlib.import_module(name)


def _rich(file) -> RichConsole:
    """A rich console on `file`: colour only on a terminal and without NO_COLOR (rich honours
    both, and NO_COLOR drops bold/dim too); 160 columns when not a terminal, so piped tables are
    not cut at 80; no `:emoji:` codes (a remote line reading `:fire:` stays text)."""
    from rich.console import Console as RichConsole

    wide = None if getattr(file, "isatty", lambda: False)() else 160
    plain = os.environ.get("NO_COLOR", "") != ""  # https://no-color.org: no styling at all
    return RichConsole(
        file=file,
        highlight=False,
        emoji=False,
        soft_wrap=True,
        width=wide,
        color_system=None if plain else "auto",
        no_color=True if plain else None,
    )
