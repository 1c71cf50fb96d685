"""The house's shape, from the code's own imports: no circles, no arrow back up.

Every import of a `remote_ops` module counts, wherever it is written (module level, inside a
function, under `TYPE_CHECKING`): a lazy import is still a dependency.  Two checks:
- no two modules reach each other through imports (strongly connected components);
- an import between rooms (`cli`, `workflows`, `hostlab`, ...) goes from a higher floor to a
  lower one (`FLOORS`), never sideways or up.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "remote_ops"

#: Floor of each room, top to bottom: a room imports only rooms on lower floors.
FLOORS: dict[str, float] = {
    "__main__": 9,
    "cli": 8,
    "workflows": 7,
    "hostlab": 6,
    "wheels": 5,
    "probes": 4,
    "serving": 3,
    "engine": 2,
    "remote": 2,
    "core": 1,
    "onhost": 0,
    "dumper": 0,
    "errors": 0,
    "paths": 0,
    "signals": 0.5,
    "": 0,  # the package's own __init__
}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module of remote_ops."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_pkg)
    return found


def _absolute(current: str, is_pkg: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = current.split(".") if is_pkg else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


@lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """Module -> the remote_ops modules it imports (a `from pkg import mod` names the module)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(name, is_pkg, node.module, node.level)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.add(sub if sub in mods else target)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def room(module: str) -> str:
    """`remote_ops.workflows.deploy.plan` -> `workflows`; `remote_ops` itself -> ``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each import from a room to one on the same or a higher floor."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ra, rb = room(a), room(b)
            if ra != rb and FLOORS[ra] <= FLOORS[rb]:
                bad.append(f"{a} ({ra}, floor {FLOORS[ra]}) -> {b} ({rb}, floor {FLOORS[rb]})")
    return bad


def test_every_room_has_a_floor():
    assert {room(m) for m in modules()} <= set(FLOORS)


def test_no_circles():
    assert circles(import_graph()) == []


def test_no_arrow_back_up():
    assert arrows_up(import_graph()) == []


def test_the_scan_finds_a_circle_and_an_arrow_up():
    graph = {
        "remote_ops.core.a": {"remote_ops.core.b"},
        "remote_ops.core.b": {"remote_ops.core.a", "remote_ops.workflows.x"},
        "remote_ops.workflows.x": set(),
    }
    assert circles(graph) == [["remote_ops.core.a", "remote_ops.core.b"]]
    assert arrows_up(graph) == ["remote_ops.core.b (core, floor 1) -> remote_ops.workflows.x (workflows, floor 7)"]
