"""Syntax-tree anchors: find where a patch block belongs, insert it, prove it is there.

Why a syntax tree: a block placed one statement too early is silently wrong (the
story this tool comes from: capture code inserted after the `logits_processor`
line of `DeepseekV2ForCausalLM.__init__` is undone 9 lines later by
`self.capture_aux_hidden_states = False`).  Text tools (regex line edits, GNU
patch with fuzz) cannot tell; the tree can.  An anchor is scoped
class -> method -> statement and must match exactly once, as a direct statement
of that method; anything else is an `AnchorRefusal` with a named reason.

This module is pure and stdlib-only (Python >= 3.8 syntax) because it also runs
standalone, shipped to a host or into an image and run with that machine's
`python3`::

    python3 anchors.py verify --spec SPEC.json FILE     # JSON report, exit 0/9/10
    python3 anchors.py apply  --spec SPEC.json FILE     # insert blocks in place
    python3 anchors.py status --spec SPEC.json FILE

Main entry points (all take the file's bytes or text and a `PatchSpec`):

- `plan(data, spec) -> Plan`: pristine text (blocks stripped), new text (blocks
  inserted right after their anchors), the anchor matches; raises AnchorRefusal.
- `verify_placement(data, spec) -> Report`: per-block state (absent / applied / outdated /
  modified / misplaced) and an overall status; never raises for a bad placement.
- `strip(data, spec) -> str`: the file with every marked block removed (revert).

Blocks are framed by marker comments carrying the patch id, block name and a
content hash, in the file's own indentation and line endings.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import textwrap
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

MARKER_RE = re.compile(
    r"^(?P<indent>[ \t]*)# (?P<kind>>>>|<<<) remote-ops:(?P<patch>[\w.-]+):"
    r"(?P<block>[\w.-]+) (?P<hash>[0-9a-f]{16})(?P<rest>.*?)\r?\n?$"
)
BEGIN_NOTE = " begin (inserted by remote-ops; `remote-ops patch revert` removes it)"
END_NOTE = " end"

# Overall statuses, worst last.
NOT_APPLIED, APPLIED, OUTDATED, PARTIAL, MODIFIED, MISPLACED = (
    "not_applied",
    "applied",
    "outdated",
    "partial",
    "modified",
    "misplaced",
)
EXIT_OK, EXIT_USAGE, EXIT_CONFIG, EXIT_REFUSED, EXIT_VERIFY = 0, 2, 3, 9, 10


class AnchorRefusal(Exception):
    """The file cannot be patched safely; `reason` is a short stable code.

    Reasons: not_text, syntax_error, no_class, ambiguous_class, no_capture_class, no_method,
    not_found, ambiguous, wrong_scope, nested, broken_markers, modified_by_hand,
    unmarked_block, capture_before_reset."""

    def __init__(self, reason: str, message: str, lines: Iterable[int] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.lines = list(lines or [])  # [line number, ...] worth showing as evidence

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message, "lines": self.lines}


class SpecError(ValueError):
    """The patch spec itself is invalid; `field` names the offending key."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


# --------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class Anchor:
    """One statement, found only as a direct statement of `cls.method`."""

    cls: str
    method: str
    statement: str  # source text of the statement, parsed and compared as a tree

    @property
    def scope(self) -> str:
        return "%s.%s" % (self.cls, self.method)

    def pattern(self) -> ast.stmt:
        """The anchor statement as a tree (exactly one statement)."""
        body = parse_python(textwrap.dedent(self.statement).strip("\n") + "\n").body
        if len(body) != 1:
            raise SpecError("anchor statement must be exactly one statement", "anchor.statement")
        return body[0]


@dataclass(frozen=True)
class Block:
    """Code inserted right after `anchor`; `after_assignments_to` and `enablers`
    express "must run after every reset of this flag, and nothing may enable
    capture before that reset"."""

    name: str
    text: str
    anchor: Anchor
    after_assignments_to: str = ""
    enabler_assigns: tuple[str, ...] = ()
    enabler_calls: tuple[str, ...] = ()

    @property
    def hash(self) -> str:
        return content_hash(self.text.split("\n"))

    def statements(self) -> list[ast.stmt]:
        return parse_python(self.text).body


@dataclass(frozen=True)
class PatchSpec:
    """One patch bound to one file and class: what every anchor function takes.

    `id` names the patch (it is in the block markers); `name` the model spec
    (e.g. "llama") that bound it to `target` and `model_class`."""

    id: str
    target: str
    blocks: tuple[Block, ...]
    description: str = ""
    grep: str = ""
    validated_versions: tuple[str, ...] = ()
    known_sha256: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    model_class: str = ""
    architectures: tuple[str, ...] = ()

    def block(self, name: str) -> Block:
        return next(b for b in self.blocks if b.name == name)

    @property
    def hash(self) -> str:
        """One hash over every block: names the patch content (image tags, records)."""
        joined = "\n".join("%s:%s" % (b.name, b.hash) for b in self.blocks)
        return hashlib.sha256(joined.encode()).hexdigest()[:16]


def spec_from_dict(data: dict[str, Any], base_dir: str = "") -> PatchSpec:
    """Build a PatchSpec from its JSON form; block text inline (`text`) or in `file`.

    An anchor without "class" takes the spec's top-level "class" (one patch, many models)."""

    def need(obj: Any, key: str, where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise SpecError("missing key %r" % key, where + key)
        return obj[key]

    blocks = []
    for i, b in enumerate(need(data, "blocks", "") or []):
        where = "blocks[%d]." % i
        anchor = need(b, "anchor", where)
        text = b.get("text")
        if text is None:
            path = os.path.join(base_dir, need(b, "file", where))
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except OSError as exc:
                raise SpecError("cannot read block file: %s" % exc, where + "file") from exc
        en = b.get("enablers") or {}
        block = Block(
            name=need(b, "name", where),
            text=normalise_block(text),
            anchor=Anchor(
                anchor.get("class") or need(data, "class", where + "anchor."),
                need(anchor, "method", where + "anchor."),
                need(anchor, "statement", where + "anchor."),
            ),
            after_assignments_to=b.get("after_assignments_to", ""),
            enabler_assigns=tuple(en.get("assign", ())),
            enabler_calls=tuple(en.get("call", ())),
        )
        _check_block(block, where)
        blocks.append(block)
    if not blocks:
        raise SpecError("a patch spec needs at least one block", "blocks")
    return PatchSpec(
        id=need(data, "id", ""),
        target=data.get("target", ""),
        blocks=tuple(blocks),
        description=data.get("description", ""),
        grep=data.get("grep", ""),
        validated_versions=tuple(data.get("validated_versions", ())),
        known_sha256=dict(data.get("known_sha256", {})),
        name=data.get("name", ""),
        model_class=data.get("class", ""),
        architectures=tuple(data.get("architectures", ())),
    )


def _check_block(block: Block, where: str) -> None:
    """Block text and anchor must parse; a bad spec is caught before any file is read."""
    if not re.match(r"^[\w.-]+$", block.name):
        raise SpecError("block name must be [A-Za-z0-9_.-]+", where + "name")
    try:
        block.anchor.pattern()
        block.statements()
    except SyntaxError as exc:
        raise SpecError("does not parse as Python: %s" % exc, where + "text") from exc


def spec_to_dict(spec: PatchSpec) -> dict[str, Any]:
    """The self-contained JSON form (block text inline): what gets shipped to hosts."""
    return {
        "id": spec.id,
        "name": spec.name,
        "class": spec.model_class,
        "architectures": list(spec.architectures),
        "target": spec.target,
        "description": spec.description,
        "grep": spec.grep,
        "validated_versions": list(spec.validated_versions),
        "known_sha256": dict(spec.known_sha256),
        "blocks": [
            {
                "name": b.name,
                "text": b.text,
                "after_assignments_to": b.after_assignments_to,
                "enablers": {"assign": list(b.enabler_assigns), "call": list(b.enabler_calls)},
                "anchor": {"class": b.anchor.cls, "method": b.anchor.method, "statement": b.anchor.statement},
            }
            for b in spec.blocks
        ],
    }


def load_spec(path: str) -> PatchSpec:
    with open(path, encoding="utf-8") as fh:
        try:
            data = json.load(fh)
        except ValueError as exc:
            raise SpecError("not valid JSON: %s" % exc) from exc
    return spec_from_dict(data, os.path.dirname(os.path.abspath(path)))


def normalise_block(text: str) -> str:
    """Dedent, LF endings, no trailing whitespace or blank lines: the hashed form."""
    lines = [ln.rstrip() for ln in textwrap.dedent(text.replace("\r\n", "\n")).split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines)


def content_hash(lines: list[str]) -> str:
    """16 hex chars of sha256 over normalised block lines (what markers carry)."""
    return hashlib.sha256(normalise_block("\n".join(lines)).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------ source
def split_lines(text: str) -> list[str]:
    """Lines with their endings, split on "\\n" only (as Python's tokenizer counts)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


@dataclass
class Source:
    """Parsed file: text, lines (with endings), tree and a statement index."""

    text: str
    lines: list[str]
    tree: ast.Module
    stmts: list[Stmt]

    @property
    def newline(self) -> str:
        first = self.lines[0] if self.lines else "\n"
        return "\r\n" if first.endswith("\r\n") else "\n"


def decode(data: str | bytes) -> str:
    """bytes -> str, refusing binary or non-UTF-8 content (named reason not_text)."""
    if isinstance(data, str):
        return data
    if b"\0" in data[:65536]:
        raise AnchorRefusal("not_text", "not a text file (NUL byte at offset %d)" % data.index(b"\0"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AnchorRefusal("not_text", "not UTF-8 text (bad byte at offset %d)" % exc.start) from exc


_PARSE_LOCK = threading.Lock()


def parse_python(text: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse` under one lock: CPython 3.11.7's parser is not thread-safe (gh-106905: parallel
    parses raise "SystemError: AST constructor recursion depth mismatch"), and `deploy`/`patch`
    on a group of hosts parse in threads."""
    with _PARSE_LOCK:
        return ast.parse(text, filename=filename)


def parse_source(data: str | bytes | Source, name: str = "<file>") -> Source:
    """Decode and parse; a syntax error is a refusal naming line and message.

    Given a `Source` already, returns it (callers parse a file once)."""
    if isinstance(data, Source):
        return data
    text = decode(data)
    try:
        tree = parse_python(text, filename=name)
    except SyntaxError as exc:
        raise AnchorRefusal(
            "syntax_error", "syntax error at line %s: %s" % (exc.lineno, exc.msg), [exc.lineno] if exc.lineno else []
        ) from exc
    return Source(text, split_lines(text), tree, list(iter_statements(tree)))


@dataclass
class Stmt:
    """A statement with where it sits: its scope (class/def names), body and index."""

    node: ast.stmt
    scope: tuple[str, ...]
    body: list[ast.stmt]
    index: int
    nested: bool  # inside an if/for/with/try of its function, not a direct statement

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def end(self) -> int:
        return self.node.end_lineno or self.node.lineno  # always set by ast.parse (3.8+)

    @property
    def scope_name(self) -> str:
        return ".".join(self.scope) or "<module>"


def iter_statements(tree: ast.Module) -> Iterator[Stmt]:
    """Every statement of the module, depth first, with its enclosing def/class scope."""

    def visit(body: list[ast.stmt], scope: tuple[str, ...], nested: bool) -> Iterator[Stmt]:
        for i, node in enumerate(body):
            yield Stmt(node, scope, body, i, nested)
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for s in visit(node.body, scope + (node.name,), False):
                    yield s
                continue
            for child in _child_bodies(node):
                for s in visit(child, scope, True):
                    yield s

    return visit(tree.body, (), False)


def _child_bodies(node: ast.stmt) -> Iterator[list[ast.stmt]]:
    """Statement lists under a compound statement (if/for/while/with/try/match)."""
    for _name, value in ast.iter_fields(node):
        if isinstance(value, list) and value:
            if isinstance(value[0], ast.stmt):
                yield value
            elif hasattr(value[0], "body"):  # ExceptHandler, match_case
                for item in value:
                    yield item.body


def scope_of_lines(src: Source) -> list[str]:
    """For each line (index 0 = line 1) its enclosing `Class.method` ("" = module level)."""
    names = [""] * (len(src.lines) + 1)
    for s in src.stmts:
        if isinstance(s.node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([d.lineno for d in s.node.decorator_list] + [s.line])
            full = ".".join(s.scope + (s.node.name,))
            for n in range(first, s.end + 1):
                names[n - 1] = full
    return names[: len(src.lines)]


def dotted(node: ast.expr) -> str:
    """`self.model.layers_to_capture` for a Name/Attribute chain, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return ""


def first_line(src: Source, line: int) -> str:
    return src.lines[line - 1].rstrip("\r\n") if 0 < line <= len(src.lines) else ""


def capture_classes(data: str | bytes | Source, flag: str = "self.capture_aux_hidden_states") -> list[tuple[str, int]]:
    """[(class name, line)] of every class whose `__init__` directly assigns `flag = False`.

    The model class of an SGLang file with EAGLE-3 capture is the one such class;
    callers refuse when there are none or several (see `pick_class`)."""
    src = parse_source(data)
    out = []
    for s in src.stmts:
        if len(s.scope) == 2 and s.scope[1] == "__init__" and not s.nested and isinstance(s.node, ast.Assign):
            n = s.node
            if (
                any(dotted(t) == flag for t in n.targets)
                and isinstance(n.value, ast.Constant)
                and n.value.value is False
            ):
                out.append((s.scope[0], s.line))
    return out


def pick_class(data: str | bytes | Source, wanted: str | None = None) -> str:
    """The model class of the file: the one capture class, or `wanted` if it is one; else refuse."""
    found = capture_classes(data)
    names = [c for c, _ in found]
    listed = ", ".join("%s (line %d)" % c for c in found)
    if wanted:
        if wanted in names:
            return wanted
        raise AnchorRefusal(
            "no_class",
            "class %s does not reset capture_aux_hidden_states in its __init__ "
            "(classes that do: %s)" % (wanted, listed or "none"),
            [n for _, n in found],
        )
    if not found:
        raise AnchorRefusal(
            "no_capture_class",
            "no class in this file assigns `self.capture_aux_hidden_states "
            "= False` in its __init__: no EAGLE-3 capture to hook",
        )
    if len(set(names)) > 1:
        raise AnchorRefusal(
            "ambiguous_class",
            "%d classes reset the capture flag in __init__: %s; pick one with --model-class" % (len(found), listed),
            [n for _, n in found],
        )
    return names[0]


# ----------------------------------------------------------------------- anchors
@dataclass
class AnchorMatch:
    """Where an anchor statement is: lines, indentation and its neighbours."""

    block: str
    scope: str
    line: int
    end: int
    indent: str
    text: str
    prev_line: int = 0
    prev_text: str = ""
    next_line: int = 0
    next_text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _key(node: ast.stmt) -> tuple[Any, ...]:
    """A cheap pre-filter before comparing whole dumps (If tests, Assign targets)."""
    if isinstance(node, (ast.If, ast.While)):
        test = node.test.func if isinstance(node.test, ast.Call) else node.test
        return (type(node).__name__, type(node.test).__name__, dotted(test))
    if isinstance(node, ast.Assign):
        return ("Assign", len(node.targets), dotted(node.targets[0]))
    return (type(node).__name__,)


def _signatures(patterns: list[ast.stmt]) -> list[tuple[type, tuple[Any, ...], str]]:
    """(type, key, dump) per pattern: compare cheap parts before whole dumps."""
    return [(type(p), _key(p), ast.dump(p)) for p in patterns]


def matches_any(node: ast.stmt, signatures: list[tuple[type, tuple[Any, ...], str]]) -> bool:
    """True when `node` equals (as a tree, formatting ignored) one of the patterns."""
    for kind, key, dumped in signatures:
        if type(node) is kind and _key(node) == key and ast.dump(node) == dumped:
            return True
    return False


def find_statement(src: Source, pattern: ast.stmt) -> list[Stmt]:
    """Every statement in the file equal (as a tree) to `pattern`."""
    sig = _signatures([pattern])
    return [s for s in src.stmts if matches_any(s.node, sig)]


def find_anchor(src: Source, block: Block) -> AnchorMatch:
    """The one direct statement of `Class.method` matching the block's anchor, or refuse."""
    anchor = block.anchor
    _require_scope(src, anchor)
    hits = find_statement(src, anchor.pattern())
    inside = [s for s in hits if s.scope == (anchor.cls, anchor.method)]
    if not inside:
        raise _missing(src, anchor, hits)
    if len(inside) > 1:
        lines = [s.line for s in inside]
        raise AnchorRefusal(
            "ambiguous",
            "anchor `%s` matches %d statements in %s (lines %s); refusing to guess"
            % (_short(anchor), len(inside), anchor.scope, _join(lines)),
            lines,
        )
    hit = inside[0]
    if hit.nested:
        raise AnchorRefusal(
            "nested",
            "anchor `%s` at line %d is inside a compound statement of %s, not a direct "
            "statement of the method" % (_short(anchor), hit.line, anchor.scope),
            [hit.line],
        )
    return _match(src, block.name, hit)


def _require_scope(src: Source, anchor: Anchor) -> None:
    """The class must exist exactly once and hold the method."""
    classes = [s for s in src.stmts if isinstance(s.node, ast.ClassDef) and s.node.name == anchor.cls]
    if not classes:
        raise AnchorRefusal("no_class", "class %s is not defined in this file" % anchor.cls)
    if len(classes) > 1:
        lines = [c.line for c in classes]
        raise AnchorRefusal(
            "ambiguous_class",
            "class %s is defined %d times (lines %s)" % (anchor.cls, len(classes), _join(lines)),
            lines,
        )
    cls = classes[0].node
    methods = [
        n
        for n in (cls.body if isinstance(cls, ast.ClassDef) else [])
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == anchor.method
    ]
    if len(methods) != 1:
        reason = "no_method" if not methods else "ambiguous_method"
        raise AnchorRefusal(
            reason,
            "class %s (line %d) defines method %s %d times"
            % (anchor.cls, classes[0].line, anchor.method, len(methods)),
            [classes[0].line] + [m.lineno for m in methods],
        )


def _missing(src: Source, anchor: Anchor, hits: list[Stmt]) -> AnchorRefusal:
    """Refusal for zero matches in scope: elsewhere (wrong scope) or not code at all."""
    if hits:
        where = ", ".join("line %d in %s" % (s.line, s.scope_name) for s in hits)
        return AnchorRefusal(
            "wrong_scope",
            "anchor `%s` is not in %s; found only at %s" % (_short(anchor), anchor.scope, where),
            [s.line for s in hits],
        )
    needle = _short(anchor)
    textual = [i + 1 for i, ln in enumerate(src.lines) if needle in ln]
    extra = "; the text appears at line %s but not as code (comment or string)" % _join(textual) if textual else ""
    return AnchorRefusal("not_found", "anchor `%s` not found in %s%s" % (needle, anchor.scope, extra), textual)


def _match(src: Source, block_name: str, hit: Stmt) -> AnchorMatch:
    body, i = hit.body, hit.index
    prev = body[i - 1] if i > 0 else None
    nxt = body[i + 1] if i + 1 < len(body) else None
    line = first_line(src, hit.line)
    return AnchorMatch(
        block=block_name,
        scope=hit.scope_name,
        line=hit.line,
        end=hit.end,
        indent=line[: len(line) - len(line.lstrip())],
        text=line.strip(),
        prev_line=prev.lineno if prev else 0,
        prev_text=first_line(src, prev.lineno).strip() if prev else "",
        next_line=nxt.lineno if nxt else 0,
        next_text=first_line(src, nxt.lineno).strip() if nxt else "",
    )


def _short(anchor: Anchor) -> str:
    return textwrap.dedent(anchor.statement).strip().split("\n")[0]


def _join(lines: Iterable[int]) -> str:
    return ", ".join(str(n) for n in lines)


# ----------------------------------------------------------------------- markers
@dataclass
class Region:
    """A marked block in the file: marker lines, hashes and indentation."""

    block: str
    begin: int
    end: int
    marker_hash: str
    body_hash: str
    indent: str

    @property
    def hand_modified(self) -> bool:
        return self.marker_hash != self.body_hash

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def find_regions(src: Source, spec: PatchSpec) -> list[Region]:
    """Marked blocks of this patch id, paired begin/end; broken pairs refuse."""
    regions, open_ = [], None
    for n, line in enumerate(src.lines, 1):
        m = MARKER_RE.match(line)
        if not m or m.group("patch") != spec.id:
            continue
        if m.group("kind") == ">>>":
            if open_:
                raise AnchorRefusal(
                    "broken_markers",
                    "begin marker at line %d inside block opened at line %d" % (n, open_[0]),
                    [open_[0], n],
                )
            open_ = (n, m)
        else:
            if not open_ or open_[1].group("block") != m.group("block"):
                raise AnchorRefusal("broken_markers", "end marker at line %d has no matching begin" % n, [n])
            regions.append(_region(src, open_[0], n, open_[1]))
            open_ = None
    if open_:
        raise AnchorRefusal("broken_markers", "begin marker at line %d is never closed" % open_[0], [open_[0]])
    return regions


def _region(src: Source, begin: int, end: int, m: re.Match[str]) -> Region:
    indent = m.group("indent")
    body = [ln.rstrip("\r\n") for ln in src.lines[begin : end - 1]]
    body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in body]
    return Region(m.group("block"), begin, end, m.group("hash"), content_hash(body), indent)


def render_block(patch_id: str, block: Block, indent: str) -> list[str]:
    """Marker + body + marker lines (no endings), in the file's indentation."""
    tag = "remote-ops:%s:%s %s" % (patch_id, block.name, block.hash)
    body = [(indent + ln) if ln else "" for ln in block.text.split("\n")]
    return ["%s# >>> %s%s" % (indent, tag, BEGIN_NOTE)] + body + ["%s# <<< %s%s" % (indent, tag, END_NOTE)]


def strip_text(src: Source, regions: list[Region]) -> str:
    """The file with the given regions' lines removed (exactly what insert added)."""
    drop: set[int] = set()
    for r in regions:
        drop.update(range(r.begin, r.end + 1))
    return "".join(ln for n, ln in enumerate(src.lines, 1) if n not in drop)


def strip(data: str | bytes | Source, spec: PatchSpec) -> str:
    """Revert: the text with every marked block of `spec` removed."""
    src = parse_source(data)
    return strip_text(src, find_regions(src, spec))


# ---------------------------------------------------------------------- checking
@dataclass
class Finding:
    """One thing wrong with the placement, with the lines that show it."""

    kind: str  # misplaced | modified | outdated | absent | duplicate
    block: str
    message: str
    lines: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def capture_findings(src: Source, spec: PatchSpec, regions: list[Region]) -> list[Finding]:
    """Capture code (blocks, marked or not, and enablers) that runs before the flag reset.

    This is the story's bug in tree terms: in `__init__`, anything that turns
    capture on and precedes the last `flag = False` is undone by it."""
    out = []
    for block in spec.blocks:
        if not block.after_assignments_to:
            continue
        resets = _flag_assignments(src, block)
        if not resets:
            continue
        last = max(resets)
        for line, what in _enablers(src, block, regions):
            if line < last:
                out.append(
                    Finding(
                        "misplaced",
                        block.name,
                        "%s at line %d runs before the reset `%s` at line "
                        "%d, which undoes it" % (what, line, first_line(src, last).strip(), last),
                        [line, last],
                    )
                )
    return out


def _method_stmts(src: Source, anchor: Anchor) -> list[Stmt]:
    return [s for s in src.stmts if s.scope[:2] == (anchor.cls, anchor.method)]


def _flag_assignments(src: Source, block: Block) -> list[int]:
    """Lines assigning the block's flag to False in the anchor's method."""
    lines = []
    for s in _method_stmts(src, block.anchor):
        n = s.node
        if isinstance(n, ast.Assign) and any(dotted(t) == block.after_assignments_to for t in n.targets):
            if isinstance(n.value, ast.Constant) and n.value.value is False:
                lines.append(s.line)
    return lines


def _enablers(src: Source, block: Block, regions: list[Region]) -> Iterator[tuple[int, str]]:
    """(line, description) of statements in the method that turn capture on."""
    marked = {n for r in regions for n in range(r.begin, r.end + 1)}
    sigs = _signatures(_distinctive(block))
    for s in _method_stmts(src, block.anchor):
        what = _enabler_kind(s.node, block, sigs)
        if what:
            tag = "block %s" % block.name if s.line in marked else what
            yield s.line, tag


def _enabler_kind(node: ast.stmt, block: Block, sigs: list[tuple[type, tuple[Any, ...], str]]) -> str:
    if isinstance(node, ast.Assign):
        names = [dotted(t) for t in node.targets]
        if block.after_assignments_to in names and not (
            isinstance(node.value, ast.Constant) and node.value.value is False
        ):
            return "`%s = ...` (turns capture on)" % block.after_assignments_to
        if any(n in block.enabler_assigns for n in names):
            return "`%s = ...`" % next(n for n in names if n in block.enabler_assigns)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        name = dotted(node.value.func)
        if name and (name in block.enabler_calls or name.split(".")[-1] in block.enabler_calls):
            return "call `%s(...)`" % name
    if matches_any(node, sigs):
        return "unmarked copy of block %s" % block.name
    return ""


def _distinctive(block: Block) -> list[ast.stmt]:
    """Block statements worth recognising elsewhere (not imports, pass, ...)."""
    trivial = (ast.Import, ast.ImportFrom, ast.Pass, ast.Break, ast.Continue)
    return [b for b in block.statements() if not isinstance(b, trivial)]


def unmarked_copies(src: Source, spec: PatchSpec, regions: list[Region]) -> list[Finding]:
    """Statements equal to a block's code that sit outside any marked region."""
    marked = {n for r in regions for n in range(r.begin, r.end + 1)}
    out = []
    for block in spec.blocks:
        sigs = _signatures(_distinctive(block))
        for s in src.stmts:
            if s.line not in marked and matches_any(s.node, sigs):
                out.append(
                    Finding(
                        "modified",
                        block.name,
                        "unmarked copy of block %s at line %d (%s)" % (block.name, s.line, s.scope_name),
                        [s.line],
                    )
                )
    return out


# -------------------------------------------------------------------------- plan
@dataclass
class Plan:
    """What apply would do: pristine text, new text, anchors, and whether it changes."""

    pristine: str
    new_text: str
    anchors: list[AnchorMatch]
    regions: list[Region]
    state: str

    @property
    def changes(self) -> bool:
        return self.state != APPLIED


def plan(data: str | bytes | Source, spec: PatchSpec) -> Plan:
    """Strip our blocks, find every anchor in the pristine tree, insert fresh blocks.

    Refuses (AnchorRefusal) on any anchor problem, hand-modified blocks,
    unmarked capture code, or capture code placed before the flag reset."""
    src = parse_source(data)
    regions = find_regions(src, spec)
    for r in regions:
        if r.hand_modified:
            raise AnchorRefusal(
                "modified_by_hand",
                "block %s (lines %d-%d) was edited by hand (hash %s, marker "
                "says %s)" % (r.block, r.begin, r.end, r.body_hash, r.marker_hash),
                [r.begin, r.end],
            )
    pristine = parse_source(strip_text(src, regions)) if regions else src
    _refuse_foreign_capture(pristine, spec)
    anchors = [find_anchor(pristine, b) for b in spec.blocks]
    new_text = insert_blocks(pristine, spec, anchors)
    state = verify_placement(src, spec).status if regions else NOT_APPLIED
    return Plan(pristine.text, new_text, anchors, regions, APPLIED if new_text == src.text else state)


def _refuse_foreign_capture(pristine: Source, spec: PatchSpec) -> None:
    """Unmarked block code or capture enabled before the reset: a human must look."""
    bad = unmarked_copies(pristine, spec, []) + capture_findings(pristine, spec, [])
    if bad:
        reason = "capture_before_reset" if bad[0].kind == "misplaced" else "unmarked_block"
        lines = sorted({n for f in bad for n in f.lines})
        raise AnchorRefusal(reason, "; ".join(f.message for f in bad), lines)


def insert_blocks(src: Source, spec: PatchSpec, anchors: list[AnchorMatch]) -> str:
    """Insert each block right after its anchor's last line (bottom-up keeps numbers valid)."""
    lines = list(src.lines)
    for match in sorted(anchors, key=lambda a: a.end, reverse=True):
        block = spec.block(match.block)
        newline = "\r\n" if lines[match.end - 1].endswith("\r\n") else src.newline
        if not lines[match.end - 1].endswith("\n"):
            lines[match.end - 1] += newline
        lines[match.end : match.end] = [ln + newline for ln in render_block(spec.id, block, match.indent)]
    return "".join(lines)


# ------------------------------------------------------------------------ verify
@dataclass
class BlockReport:
    name: str
    state: str  # absent | applied | outdated | modified | misplaced
    spec_hash: str
    anchor: AnchorMatch | None = None
    region: Region | None = None
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "spec_hash": self.spec_hash,
            "anchor": self.anchor.to_dict() if self.anchor else None,
            "region": self.region.to_dict() if self.region else None,
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass
class Report:
    """verify_placement()/status: overall status, per-block reports and every finding."""

    status: str
    blocks: list[BlockReport]
    findings: list[Finding]
    refusal: AnchorRefusal | None = None  # when the file could not be analysed
    sha256: str = ""
    pristine_sha256: str = ""

    @property
    def ok(self) -> bool:
        return self.status == APPLIED

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "ok": self.ok,
            "sha256": self.sha256,
            "pristine_sha256": self.pristine_sha256,
            "blocks": [b.to_dict() for b in self.blocks],
            "findings": [f.to_dict() for f in self.findings],
            "refusal": self.refusal.to_dict() if self.refusal else None,
        }


def verify_placement(data: str | bytes | Source, spec: PatchSpec) -> Report:
    """Prove each block sits right after its anchor, in scope, after every flag reset.

    Also reports hand edits (body hash != marker hash), outdated content
    (marker hash != spec hash), unmarked copies and capture code before the
    reset.  A file that cannot be parsed gives status "modified" with the refusal."""
    raw = data.text if isinstance(data, Source) else data
    sha = hashlib.sha256(raw.encode("utf-8") if isinstance(raw, str) else raw).hexdigest()
    try:
        src = parse_source(data)
        regions = find_regions(src, spec)
    except AnchorRefusal as exc:
        return Report(MODIFIED, [], [], exc, sha)
    pristine = hashlib.sha256(strip_text(src, regions).encode("utf-8")).hexdigest()
    blocks = [_block_report(src, spec, b, regions) for b in spec.blocks]
    findings = [f for b in blocks for f in b.findings]
    findings += capture_findings(src, spec, regions) + unmarked_copies(src, spec, regions)
    _attach(blocks, findings)
    return Report(_overall(blocks, findings), blocks, findings, None, sha, pristine)


def _attach(blocks: list[BlockReport], findings: list[Finding]) -> None:
    """Whole-method findings mark their block: misplaced wins over modified."""
    for f in findings:
        for b in blocks:
            if b.name != f.block or f in b.findings:
                continue
            b.findings.append(f)
            if f.kind == MISPLACED or (f.kind == MODIFIED and b.state != MISPLACED):
                b.state = f.kind


def _overall(blocks: list[BlockReport], findings: list[Finding]) -> str:
    states = {b.state for b in blocks}
    if MISPLACED in states:
        return MISPLACED
    if MODIFIED in states or "duplicate" in states:
        return MODIFIED
    if states == {"absent"}:
        return NOT_APPLIED
    if "absent" in states:
        return PARTIAL
    return OUTDATED if OUTDATED in states else APPLIED


def _block_report(src: Source, spec: PatchSpec, block: Block, regions: list[Region]) -> BlockReport:
    mine = [r for r in regions if r.block == block.name]
    report = BlockReport(block.name, "absent", block.hash)
    try:
        report.anchor = find_anchor(src, block)
    except AnchorRefusal as exc:
        report.findings.append(Finding("anchor", block.name, "anchor: " + exc.message, exc.lines))
    if not mine:
        return report
    report.region = mine[0]
    if len(mine) > 1:
        report.state = MODIFIED
        report.findings.append(
            Finding(
                MODIFIED,
                block.name,
                "block %s appears %d times (lines %s)" % (block.name, len(mine), _join(r.begin for r in mine)),
                [r.begin for r in mine],
            )
        )
        return report
    report.state = _region_state(src, block, mine[0], report)
    return report


def _region_state(src: Source, block: Block, region: Region, report: BlockReport) -> str:
    """applied / outdated / modified / misplaced for the one marked region of a block."""
    if region.hand_modified:
        report.findings.append(
            Finding(
                MODIFIED,
                block.name,
                "block %s (lines %d-%d) was edited by hand: body hash "
                "%s, marker %s" % (block.name, region.begin, region.end, region.body_hash, region.marker_hash),
                [region.begin, region.end],
            )
        )
        return MODIFIED
    misplaced = block_placement_problem(src, block, region, report.anchor)
    if misplaced:
        report.findings.append(misplaced)
        return MISPLACED
    return APPLIED if region.marker_hash == block.hash else OUTDATED


def block_placement_problem(src: Source, block: Block, region: Region, anchor: AnchorMatch | None) -> Finding | None:
    """None when the region's first statement is the anchor's next sibling, else a Finding."""
    before = _statement_before(src, region.begin)
    if anchor is None:
        return Finding(
            MISPLACED,
            block.name,
            "block %s at lines %d-%d has no anchor to follow" % (block.name, region.begin, region.end),
            [region.begin],
        )
    first = next((s for s in src.stmts if region.begin < s.line < region.end), None)
    ok = (
        before is not None
        and before.line == anchor.line
        and first is not None
        and first.scope == before.scope
        and first.body is before.body
        and first.index == before.index + 1
    )
    if ok:
        return None
    after = (
        "after line %d `%s` (%s)" % (before.end, first_line(src, before.end).strip(), before.scope_name)
        if before
        else "at the top of the file"
    )
    return Finding(
        MISPLACED,
        block.name,
        "block %s at lines %d-%d is %s, not right after its anchor `%s` at line "
        "%d" % (block.name, region.begin, region.end, after, anchor.text, anchor.line),
        [n for n in (before.end if before else 0, region.begin, anchor.line) if n],
    )


def _statement_before(src: Source, line: int) -> Stmt | None:
    """The outermost statement that ends last before `line` (ties: the enclosing one)."""
    best = None
    for s in src.stmts:
        if s.end < line and (best is None or s.end > best.end or (s.end == best.end and s.line < best.line)):
            best = s
    return best


# ------------------------------------------------------------------- standalone
def _write_atomic(path: str, text: str) -> None:
    """Same-directory temp file, fsync, keep mode, rename: the file is old or new, never half."""
    tmp = os.path.join(
        os.path.dirname(os.path.abspath(path)), ".%s.remote-ops-tmp.%d" % (os.path.basename(path), os.getpid())
    )
    st = os.stat(path)
    with open(tmp, "wb") as fh:
        fh.write(text.encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, st.st_mode & 0o7777)
    try:
        os.chown(tmp, st.st_uid, st.st_gid)
    except OSError:
        pass
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """`python3 anchors.py verify|status|check|apply --spec SPEC.json FILE` -> JSON on stdout."""
    import argparse  # here: importing anchors (health, deploy) should not pay for it

    ap = argparse.ArgumentParser(prog="anchors.py", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["verify", "status", "check", "apply"])
    ap.add_argument("--spec", required=True)
    ap.add_argument("file")
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.spec)
        with open(args.file, "rb") as fh:
            data = fh.read()
    except (SpecError, OSError) as exc:
        print(json.dumps({"error": "config", "message": str(exc)}))
        return EXIT_CONFIG
    return _act(args.action, args.file, data, spec)


def _act(action: str, path: str, data: bytes, spec: PatchSpec) -> int:
    if action in ("verify", "status"):
        report = verify_placement(data, spec)
        print(json.dumps(report.to_dict(), indent=2))
        return EXIT_OK if report.ok or action == "status" else EXIT_VERIFY
    try:
        p = plan(data, spec)
    except AnchorRefusal as exc:
        print(json.dumps({"error": "refused", **exc.to_dict()}, indent=2))
        return EXIT_REFUSED
    if action == "apply" and p.changes:
        _write_atomic(path, p.new_text)
    report = verify_placement(p.new_text, spec)
    print(
        json.dumps(
            {
                "state_before": p.state,
                "changed": action == "apply" and p.changes,
                "anchors": [a.to_dict() for a in p.anchors],
                "verify": report.to_dict(),
            },
            indent=2,
        )
    )
    return EXIT_OK if report.ok else EXIT_VERIFY


if __name__ == "__main__":
    sys.exit(main())
