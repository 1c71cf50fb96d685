"""The product docs stay a guide a newcomer can read, and stay true to the code.

- docs/commands.md and the generated tables of docs/models.md and docs/inventory.md are
  what `scripts/gen-docs` makes from the code now (the click commands, `patch specs
  --markdown`, `inventory schema`);
- README.md is at most 250 lines; no table cell of README.md, docs/*.md or bench/README.md
  is over 300 characters, and none of them speaks of sessions (docs/lab/ is the frozen
  record of how the figures came about, and is not checked);
- every relative link of README.md and docs/*.md reaches a file of the repository (and,
  for a Markdown file, the heading its #anchor names);
- the package description the wheel carries (pyproject's `readme`) holds no relative
  link: the wheel ships neither docs/ nor bench/.

Pure: reads files and runs this checkout's own CLI and setuptools' metadata step.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
PRODUCT_DOCS = [README, *DOC_PAGES, ROOT / "bench" / "README.md"]
LINKED_DOCS = [README, *DOC_PAGES]

README_MAX_LINES = 250
CELL_MAX_CHARS = 300
#: "session" as a technical term, not as a period of work: a POSIX process session (setsid),
#: docker's /session (BuildKit's gRPC session protocol) and an SSH session.
TECHNICAL_SESSIONS = ("process session", "session protocol", "/session", "ssh session")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """`text` without fenced code blocks (links and tables there are examples, not the doc's)."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)


# --- generated pages ----------------------------------------------------------------------


def test_generated_docs_match_the_code():
    stale = [_name(path) for path, text in _gen_docs().pages().items() if not path.exists() or path.read_text() != text]
    assert not stale, f"out of date: {', '.join(stale)}; regenerate with: scripts/gen-docs"


def test_command_reference_lists_every_command():
    gen = _gen_docs()
    page = (ROOT / "docs" / "commands.md").read_text()
    names = [name for name, *_ in gen.leaf_commands()]
    assert {"remote-ops deploy", "remote-ops health", "remote-ops dumps pull", "remote-ops patch check"} <= set(names)
    for name in names:
        assert f"### `{name}`" in page, f"{name} has no section in docs/commands.md"


# --- shape of the product docs ------------------------------------------------------------


def test_readme_is_a_short_guide():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def _table_cells(text: str) -> list[tuple[int, str]]:
    cells = []
    in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.lstrip().startswith("|"):
            cells += [(number, cell.strip()) for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    return cells


@pytest.mark.parametrize("path", PRODUCT_DOCS, ids=_name)
def test_no_table_cell_is_over_300_characters(path):
    long = [(n, len(c), c[:60]) for n, c in _table_cells(path.read_text()) if len(c) > CELL_MAX_CHARS]
    assert not long, f"{_name(path)}: cells over {CELL_MAX_CHARS} characters (line, length, start): {long}"


@pytest.mark.parametrize("path", PRODUCT_DOCS, ids=_name)
def test_no_doc_speaks_of_sessions(path):
    hits = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        rest = line.lower()
        for phrase in TECHNICAL_SESSIONS:
            rest = rest.replace(phrase, "")
        if re.search(r"\bsessions?\b", rest):
            hits.append((number, line.strip()[:100]))
    assert not hits, f"{_name(path)} speaks of sessions on {len(hits)} lines (history belongs in docs/lab/): {hits[:5]}"


def test_the_checks_catch_what_they_are_for():
    """The cell and session checks see a long cell and a session (and not a code block's)."""
    text = "| a | " + "x" * 301 + " |\n```\n| " + "y" * 400 + " |\n```\n"
    assert [len(c) for _, c in _table_cells(text)] == [1, 301]
    assert _anchors("## `remote-ops dumps pull`\n### 4. Extract hidden states\n## A b\n## A b\n") == {
        "remote-ops-dumps-pull",
        "4-extract-hidden-states",
        "a-b",
        "a-b-1",
    }


# --- links --------------------------------------------------------------------------------


def _links(text: str) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def _anchors(text: str) -> set[str]:
    """The #anchors GitHub gives the headings of a Markdown text."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


@pytest.mark.parametrize("path", LINKED_DOCS, ids=_name)
def test_relative_links_reach_a_file_and_heading(path):
    broken = []
    for link in _links(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists() or ROOT not in (file, *file.parents):
            broken.append(link)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(link)
    assert not broken, f"{_name(path)}: broken links {broken}"


# --- the wheel's description ----------------------------------------------------------------


def test_the_wheels_description_has_no_relative_link(tmp_path):
    """The METADATA setuptools writes for the wheel: its description is pyproject's `readme`,
    and a relative link there would point into files the wheel does not ship."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel(sys.argv[1])",
            str(tmp_path),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (metadata,) = tmp_path.glob("*.dist-info/METADATA")
    description = metadata.read_text().partition("\n\n")[2]
    assert description.strip(), "the wheel carries no description (pyproject.toml: project.readme)"
    relative = [link for link in _links(description) if not re.match(r"[a-z][a-z0-9+.-]*:", link)]
    assert not relative, (
        f"the wheel's description (pyproject.toml: project.readme) links into the repository: {relative}"
    )
