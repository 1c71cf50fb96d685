"""inspect-source, pure on text: numbered lines like `sed -n 'A,Bp'` / `grep -n`,
each annotated with its enclosing `Class.method`.

The operator already trusts `grep -n` and `sed -n`; remote-ops shows the same
lines with the same numbers, plus the scope each line belongs to, so "is this
line in `DeepseekV2ForCausalLM.__init__`?" is answered on the page.  The same
listings are the evidence `patch check` and `patch verify` print.

Everything here takes text (or an `anchors.Source`) and returns values; bad
input raises `UsageError` (exit 2) and nothing is changed anywhere.

`--grep` patterns are POSIX extended regular expressions, as `grep -E` reads
them (GNU's `\\w \\s \\b \\< \\>` included), and the matching is done by
the host's own `grep -E` in the same round trip that reads the file
(`grep_command`, `parse_grep`): its engine does not backtrack, so no pattern
can hang the tool, as `(\\w+\\s?)+;` hung Python's `re`.  `check_pattern`
refuses, before any connection, what grep -E would refuse and the Python-only
syntax it would silently read otherwise (`\\d`, `(?i)`, backreferences).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from ..errors import CommandFailed, NotFound, UsageError
from . import anchors
from .jsonable import fields_of

RANGE_RE = re.compile(r"^\s*(\d+)\s*(?:[:,]\s*(\d+)\s*)?$")  # anchored, one start: linear

#: A line number longer than this many digits is past the end of any file (int() of a
#: 5000-digit string raises; this never converts one).
_MAX_DIGITS = 18
#: the statements a symbol names (they carry decorators and a name)
_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


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


def parse_range(spec: str, line_count: int | None) -> tuple[int, int]:
    """`A:B` (or `A,B`, or `A`) -> (A, B), checked against the file's length (`None`: not yet
    known, the form and order only, as before connecting)."""
    m = RANGE_RE.match(spec or "")
    if not m:
        raise UsageError(f"bad line range {_show(spec)}: expected A:B with line numbers, e.g. 2830:2845")
    first, last = _line_number(m.group(1)), _line_number(m.group(2) or m.group(1))
    if first < 1:
        raise UsageError(f"bad line range {_show(spec)}: lines are numbered from 1")
    if first > last:
        raise UsageError(f"bad line range {_show(spec)}: start {m.group(1)} is after end {m.group(2)}")
    if line_count is not None and last > line_count:
        raise UsageError(f"line range {_show(spec)} goes beyond the end of the file ({line_count} lines)")
    return first, last


def _line_number(digits: str) -> int:
    """The number, or 10**18 (past any file's end) when it has more than `_MAX_DIGITS` digits."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= _MAX_DIGITS else 10**_MAX_DIGITS


def _show(text: str, limit: int = 80) -> str:
    """An operator's input in a message: quoted, and cut when long."""
    return repr(text) if len(text or "") <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def lines_view(text: Text, spec: str, path: str = "FILE") -> Listing:
    """`sed -n 'A,Bp'`, numbered and annotated."""
    first, last = parse_range(spec, text.count)
    return Listing(f"lines {first}-{last}", f"sed -n '{first},{last}p' {path}", text.rows(first, last))


def grep_view(text: Text, pattern: str, path: str = "FILE", hits: list[int] | None = None) -> Listing:
    """`grep -nE PATTERN`, annotated: the lines grep -E matched (`hits`, from `parse_grep`).

    Without `hits` the pattern must be a plain word (no ERE special character),
    found as a substring: the patch evidence's anchor names."""
    check_pattern(pattern)
    if hits is None:
        if any(c in _ERE_SPECIAL for c in pattern):
            raise ValueError(f"grep_view needs grep's line numbers for the pattern {pattern!r}")
        hits = [n for n, ln in enumerate(text.lines, 1) if pattern in ln]
    rows = [Row(n, text.lines[n - 1], text.scopes[n - 1]) for n in sorted(set(hits)) if 1 <= n <= text.count]
    return Listing(f"grep {pattern}", f"grep -nE {_sh(pattern)} {path}", rows)


def fixed_view(text: Text, word: str, path: str = "FILE") -> Listing:
    """`grep -nF WORD`, annotated: the lines holding `word` (the patch evidence's anchor name)."""
    rows = [Row(n, ln, text.scopes[n - 1]) for n, ln in enumerate(text.lines, 1) if word in ln]
    return Listing(f"grep {word}", f"grep -nF {_sh(word)} {path}", rows)


# --------------------------------------------------------------------------- --grep: ERE, run by grep -E

#: Longest pattern accepted (a shell argument has to carry it: Linux takes 128 KiB per argument).
PATTERN_LIMIT = 4096
_ERE_SPECIAL = set(".[]()*+?{}|^$\\")
#: `\\X` that GNU grep -E reads as an operator; `\\` + any other punctuation is that character.
_GNU_ESCAPES = set("wWsSbB<>`'")
_PYTHON_ESCAPES = {
    "d": "[0-9] or [[:digit:]]",
    "D": "[^0-9]",
    "t": "a tab typed into the pattern, or [[:blank:]]",
    "n": "nothing: lines are matched one at a time",
    "A": "^",
    "Z": "$",
    "z": "$",
}
_CLASSES = {"alpha", "digit", "alnum", "upper", "lower", "space", "blank", "punct", "print", "graph", "cntrl", "xdigit"}
#: Largest count in `{m,n}`: larger ones make grep's automaton huge (POSIX guarantees 255).
_MAX_REPEAT = 255
_INTERVAL = re.compile(r"\{(\d{0,9})(,?)(\d{0,9})\}")  # at one position (`match`): linear
GREP_RC = "@@remote-ops-grep-status"  # no colon: `cut -d: -f1` passes it whole


def check_pattern(pattern: str) -> None:
    """UsageError (exit 2) unless `pattern` is an ERE that grep -E reads as written.

    Judged without the file, so it runs before connecting: unbalanced `(` `)`
    and `[`, bad intervals and classes, a trailing backslash, and the Python
    syntax grep -E would read differently (`\\d` is the letter d to grep,
    `(?i)` a literal `?`, backreferences make grep backtrack).  One pass."""
    if len(pattern) > PATTERN_LIMIT:
        raise UsageError(f"pattern too long ({len(pattern)} characters; at most {PATTERN_LIMIT})")
    if "\n" in pattern or "\r" in pattern or "\0" in pattern:
        raise UsageError("bad pattern: it must be one line (grep -E reads a newline as a second pattern)")
    depth, i = 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            _check_escape(pattern, i)
            i += 2
            continue
        if c == "[":
            i = _bracket_end(pattern, i)
        elif c == "(":
            if pattern.startswith("?", i + 1):
                raise _bad(
                    pattern, "(?...) is Python syntax, not ERE (grep -E has no flags, lookarounds or named groups)"
                )
            depth += 1
        elif c == ")":
            if depth == 0:
                raise _bad(pattern, r"unmatched ) (write \) for a literal parenthesis)")
            depth -= 1
        elif c == "{":
            _check_interval(pattern, i)
        i += 1
    if depth:
        raise _bad(pattern, r"unmatched ( (write \( for a literal parenthesis)")


def _bad(pattern: str, why: str) -> UsageError:
    return UsageError(
        f"bad pattern {_show(pattern)}: {why}", hint="--grep takes an extended regular expression, as grep -E"
    )


def _check_escape(pattern: str, i: int) -> None:
    if i + 1 >= len(pattern):
        raise _bad(pattern, "trailing \\")
    e = pattern[i + 1]
    if e.isdigit():
        raise _bad(pattern, f"\\{e} is a backreference: not supported (it makes grep backtrack)")
    if e in _PYTHON_ESCAPES:
        raise _bad(pattern, f"\\{e} is Python syntax, not ERE (grep -E reads the letter {e}); use {_PYTHON_ESCAPES[e]}")
    if e.isalnum() and e not in _GNU_ESCAPES:
        raise _bad(pattern, f"\\{e} is not an ERE escape (grep -E reads the letter {e})")


def _bracket_end(pattern: str, start: int) -> int:
    """Index of the `]` closing the bracket expression opened at `start` (POSIX rules: a
    leading `]` is literal, `[:class:]` `[=c=]` `[.c.]` inside, a backslash is literal,
    a range's end may not sort before its start)."""
    i = start + 1 + pattern.startswith("^", start + 1)
    first, low, dash = i, None, False
    while i < len(pattern):
        c = pattern[i]
        if c == "]" and i > first:
            return i
        if c == "[" and pattern[i + 1 : i + 2] in (":", "=", "."):
            i, low, dash = _bracket_item_end(pattern, i), None, False
            continue
        if c == "\\" and pattern[i + 1 : i + 2].isalpha():
            raise _bad(
                pattern,
                f"inside [...] \\{pattern[i + 1]} is a backslash and a letter in ERE; "
                "use [[:digit:]], [[:space:]] or [[:alnum:]_]",
            )
        if dash:
            if low is not None and ord(low) > ord(c):
                raise _bad(pattern, f"invalid range {low}-{c} in [...]")
            low, dash = None, False
        elif c == "-" and low is not None:
            dash = True
        else:
            low = c
        i += 1
    raise _bad(pattern, "unmatched [ (write \\[ for a literal bracket)")


def _bracket_item_end(pattern: str, i: int) -> int:
    """Past the `[:class:]`, `[=c=]` or `[.c.]` starting at `i`."""
    kind = pattern[i + 1]
    close = pattern.find(kind + "]", i + 2)
    if close < 0:
        raise _bad(pattern, "unmatched [ (write \\[ for a literal bracket)")
    if kind == ":" and pattern[i + 2 : close] not in _CLASSES:
        raise _bad(pattern, f"[:{pattern[i + 2 : close]}:] is not a character class ({', '.join(sorted(_CLASSES))})")
    return close + 2


def _check_interval(pattern: str, i: int) -> None:
    """`{m}`, `{m,}`, `{,n}`, `{m,n}` with m <= n <= 255; a `{` that starts none of these is literal (as grep)."""
    m = _INTERVAL.match(pattern, i)
    if m and m[0] == "{}":
        raise _bad(pattern, "{}: an empty count")
    if not m or not (m[1] or m[3]):
        return
    low = int(m[1]) if m[1] else 0
    high = int(m[3]) if m[3] else (low if not m[2] else None)
    if max(low, high or 0) > _MAX_REPEAT:
        raise _bad(pattern, f"{m[0]}: counts above {_MAX_REPEAT} are not supported")
    if high is not None and low > high:
        raise _bad(pattern, f"{m[0]}: the minimum is above the maximum")


def grep_command(pattern: str, path: str) -> str:
    """The host's `grep -anE` over the file, line numbers only (`cut`), then `GREP_RC <status>`.

    Only numbers travel: the lines themselves come from the file's bytes, read
    in the same round trip.  grep's own messages (stderr) follow as text."""
    grep = _sh_join(["grep", "-anE", "-e", pattern, "--", path])
    return f'( LC_ALL=C.UTF-8 {grep}; echo "{GREP_RC} $?" ) | cut -d: -f1'


def parse_grep(output: str, pattern: str) -> list[int]:
    """Line numbers from `grep_command`'s output; UsageError when grep refused the pattern."""
    hits, status, said = [], None, []
    for line in output.splitlines():
        if line.isascii() and line.isdigit() and len(line) <= _MAX_DIGITS:
            hits.append(int(line))
        elif line.startswith(GREP_RC + " "):
            status = line.rsplit(" ", 1)[-1]
        elif line.strip():
            said.append(line.strip())
    if status in ("0", "1"):
        return hits
    why = "; ".join(said)[:300] or f"exit status {status or 'unknown'}"
    if status == "2":
        raise _bad(pattern, f"grep -E refused it: {why}")
    raise CommandFailed(f"grep -E could not run on the file: {why}", command="grep -anE")


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
        if isinstance(node, _DEFINITIONS) and (s.scope + (node.name,))[-len(wanted) :] == wanted:
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


def _sh_join(argv: list[str]) -> str:
    from .shell import join

    return join(argv)


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
        return fields_of(
            self,
            "host path sha256 lines sglang_version version_source parse_error listings",
            lines=self.line_count,
            parse_error=self.parse_error or None,
            listings=[x.to_dict() for x in self.listings],
        )


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
    grep_hits: list[int] | None = None,
) -> SourceView:
    """Build the view for exactly one of lines/grep/symbol (pure); `grep_hits`: the lines
    grep -E matched (`parse_grep`)."""
    if sum(x is not None for x in (lines, grep, symbol)) != 1:
        raise UsageError("give exactly one of --lines A:B, --grep PATTERN, --symbol Class.method")
    text = Text.of(data)
    if lines is not None:
        listings = [lines_view(text, lines, path)]
    elif grep is not None:
        listings = [grep_view(text, grep, path, grep_hits)]
    else:
        listings = symbol_view(text, symbol or "", path)
    return SourceView(path, host, sha256, text.count, version, version_source, listings, text.parse_error)
