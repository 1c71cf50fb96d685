"""inspect-source, pure on text: numbered lines like `sed -n 'A,Bp'` / `grep -n`,
each annotated with its enclosing `Class.method`.

The operator already trusts `grep -n` and `sed -n`; remote-ops shows the same
lines with the same numbers, plus the scope each line belongs to, so "is this
line in `DeepseekV2ForCausalLM.__init__`?" is answered on the page.  The same
listings are the evidence `patch check` and `patch verify` print.

Everything here takes text (or an `anchors.Source`) and returns values; bad
input raises `UsageError` (exit 2) and nothing is changed anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import NotFound, UsageError
from . import anchors

RANGE_RE = re.compile(r"^\s*(\d+)\s*(?:[:,]\s*(\d+)\s*)?$")


@dataclass
class Row:
    """One numbered line; `mark` flags anchors (">") and inserted block lines ("+")."""

    n: int
    text: str
    scope: str
    mark: str = ""

    def to_dict(self) -> dict:
        return {"n": self.n, "text": self.text, "scope": self.scope or "<module>", "mark": self.mark}


@dataclass
class Listing:
    """A titled run of rows, with the shell command that would show the same lines."""

    title: str
    command: str
    rows: list[Row] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"title": self.title, "command": self.command, "rows": [r.to_dict() for r in self.rows]}

    def render(self) -> str:
        """`  2837  DeepseekV2ForCausalLM.__init__ |         self.capture_aux_hidden_states = False`."""
        width = max((len(r.scope or "<module>") for r in self.rows), default=8)
        digits = max((len(str(r.n)) for r in self.rows), default=4)
        out = [f"-- {self.title}   [{self.command}]"]
        for r in self.rows:
            out.append(f"{r.mark or ' '}{r.n:>{digits}}  {(r.scope or '<module>'):<{width}} | {r.text}")
        if not self.rows:
            out.append("   (no lines)")
        return "\n".join(out)


@dataclass
class Text:
    """A file's text parsed once: lines, scopes, parse status."""

    src: anchors.Source | None
    lines: list[str]
    scopes: list[str]
    parse_error: str = ""

    @classmethod
    def of(cls, data: bytes | str) -> "Text":
        """Decode (refusing binary) and parse; a syntax error still allows listing."""
        try:
            text = anchors.decode(data)
        except anchors.AnchorRefusal as exc:
            raise UsageError(f"cannot show source: {exc.message}") from None
        try:
            src = anchors.parse_source(text)
        except anchors.AnchorRefusal as exc:
            lines = [ln.rstrip("\r\n") for ln in anchors.split_lines(text)]
            return cls(None, lines, ["?"] * len(lines), exc.message)
        return cls.from_source(src)

    @classmethod
    def from_source(cls, src: anchors.Source) -> "Text":
        """Reuse a parse already made (patch check parses the file once)."""
        return cls(src, [ln.rstrip("\r\n") for ln in src.lines], anchors.scope_of_lines(src))

    @property
    def count(self) -> int:
        return len(self.lines)

    def rows(self, first: int, last: int, marks: dict[int, str] | None = None) -> list[Row]:
        marks = marks or {}
        return [
            Row(n, self.lines[n - 1], self.scopes[n - 1], marks.get(n, ""))
            for n in range(max(first, 1), min(last, self.count) + 1)
        ]


def parse_range(spec: str, line_count: int) -> tuple[int, int]:
    """`A:B` (or `A,B`, or `A`) -> (A, B), checked against the file's length."""
    m = RANGE_RE.match(spec or "")
    if not m:
        raise UsageError(f"bad line range {spec!r}: expected A:B with line numbers, e.g. 2830:2845")
    first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    if first < 1:
        raise UsageError(f"bad line range {spec!r}: lines are numbered from 1")
    if first > last:
        raise UsageError(f"bad line range {spec!r}: start {first} is after end {last}")
    if last > line_count:
        raise UsageError(f"line range {spec!r} goes beyond the end of the file ({line_count} lines)")
    return first, last


def lines_view(text: Text, spec: str, path: str = "FILE") -> Listing:
    """`sed -n 'A,Bp'`, numbered and annotated."""
    first, last = parse_range(spec, text.count)
    return Listing(f"lines {first}-{last}", f"sed -n '{first},{last}p' {path}", text.rows(first, last))


def grep_view(text: Text, pattern: str, path: str = "FILE") -> Listing:
    """`grep -n PATTERN` (Python regular expression), annotated."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"bad pattern {pattern!r}: {exc}") from None
    rows = [Row(n, ln, text.scopes[n - 1]) for n, ln in enumerate(text.lines, 1) if rx.search(ln)]
    return Listing(f"grep {pattern}", f"grep -n {_sh(pattern)} {path}", rows)


def symbol_view(text: Text, symbol: str, path: str = "FILE") -> list[Listing]:
    """Every definition named `Class.method` (or `Class`, or `function`), decorators included."""
    if text.src is None:
        raise UsageError(f"cannot find symbols: {text.parse_error}")
    wanted = tuple(p for p in symbol.split(".") if p)
    if not wanted:
        raise UsageError(f"bad symbol {symbol!r}: expected Class.method, Class or function")
    found = []
    for s in text.src.stmts:
        node = s.node
        if hasattr(node, "decorator_list") and (s.scope + (node.name,))[-len(wanted) :] == wanted:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            name = ".".join(s.scope + (node.name,))
            found.append(Listing(name, f"sed -n '{first},{s.end}p' {path}", text.rows(first, s.end)))
    if not found:
        raise NotFound(f"no definition named {symbol} in {path}")
    return found


def context_view(
    text: Text,
    line: int,
    before: int = 4,
    after: int = 4,
    path: str = "FILE",
    title: str = "",
    marks: dict[int, str] | None = None,
) -> Listing:
    """`sed -n` around one line (the anchor), marked."""
    first, last = max(1, line - before), min(text.count, line + after)
    return Listing(
        title or f"around line {line}", f"sed -n '{first},{last}p' {path}", text.rows(first, last, marks or {line: ">"})
    )


def _sh(value: str) -> str:
    from .shell import quote

    return quote(value)


@dataclass
class SourceView:
    """What inspect-source shows: a header (sha256, lines, version) and listings."""

    path: str
    host: str
    sha256: str
    line_count: int
    sglang_version: str | None
    version_source: str
    listings: list[Listing]
    parse_error: str = ""

    def header(self) -> str:
        version = f"{self.sglang_version} ({self.version_source})" if self.sglang_version else "unknown"
        lines = [f"{self.host}:{self.path}", f"sha256 {self.sha256}  lines {self.line_count}  SGLang {version}"]
        if self.parse_error:
            lines.append(f"warning: file does not parse ({self.parse_error}); scopes shown as ?")
        return "\n".join(lines)

    def render(self) -> str:
        return "\n".join([self.header()] + [listing.render() for listing in self.listings])

    def to_dict(self) -> dict:
        return {
            "host": self.host,
            "path": self.path,
            "sha256": self.sha256,
            "lines": self.line_count,
            "sglang_version": self.sglang_version,
            "version_source": self.version_source,
            "parse_error": self.parse_error or None,
            "listings": [x.to_dict() for x in self.listings],
        }


def inspect(
    data: bytes,
    *,
    path: str,
    host: str,
    sha256: str,
    version: str | None,
    version_source: str,
    lines: str | None = None,
    grep: str | None = None,
    symbol: str | None = None,
) -> SourceView:
    """Build the view for exactly one of lines/grep/symbol (pure)."""
    if sum(x is not None for x in (lines, grep, symbol)) != 1:
        raise UsageError("give exactly one of --lines A:B, --grep PATTERN, --symbol Class.method")
    text = Text.of(data)
    if lines is not None:
        listings = [lines_view(text, lines, path)]
    elif grep is not None:
        listings = [grep_view(text, grep, path)]
    else:
        listings = symbol_view(text, symbol or "", path)
    return SourceView(path, host, sha256, text.count, version, version_source, listings, text.parse_error)
