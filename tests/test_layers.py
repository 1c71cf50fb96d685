"""Commands parse and render; workflows act.

A command module (`remote_ops/cli/commands/*.py`) reads its options, calls a
workflow and renders the result.  It never talks to a host itself: no `.run`,
`.put` or `.get` on a connection, and no import of the transfer
(`remote_ops.remote.transfer`).  This is an AST scan, so it reads what the code
does, not what a comment says.  A connection is what `<anything>.remote(...)`
returns, a name bound to such a call, or a name or attribute called `remote`;
`dict.get`, `specbench.run(app.remote(spec), ...)` and the like are not.
"""

from __future__ import annotations

import ast
from pathlib import Path

COMMANDS = Path(__file__).resolve().parents[1] / "remote_ops" / "cli" / "commands"
HOST_CALLS = {"run", "put", "get"}
TRANSFER = "remote_ops.remote.transfer"
PACKAGE = "remote_ops.cli.commands"


def _absolute(module: str | None, level: int, package: str = PACKAGE) -> str:
    """`from ..x import y`'s module as an absolute name, from inside `package`."""
    if not level:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join([*base, *([module] if module else [])])


def _transfer_imports(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            lines += [node.lineno for a in node.names if a.name == TRANSFER or a.name.startswith(TRANSFER + ".")]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level)
            names = {f"{module}.{a.name}" for a in node.names}
            if module == TRANSFER or module.startswith(TRANSFER + ".") or TRANSFER in names:
                lines.append(node.lineno)
    return lines


def _is_connect(node: ast.AST) -> bool:
    """`<anything>.remote(...)`: the run's connection to a host (`App.remote`)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"


def _connection_names(tree: ast.AST) -> set[str]:
    """Names bound to `<x>.remote(...)` anywhere in the module, plus the name `remote` itself."""
    names = {"remote"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if _is_connect(node.value):
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.withitem) and _is_connect(node.context_expr):
            if isinstance(node.optional_vars, ast.Name):
                names.add(node.optional_vars.id)
    return names


def _is_connection(node: ast.AST, names: set[str]) -> bool:
    if _is_connect(node):
        return True
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr == "remote"


def _host_calls(tree: ast.AST) -> list[tuple[int, str]]:
    names = _connection_names(tree)
    return [
        (node.lineno, node.func.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in HOST_CALLS
        and _is_connection(node.func.value, names)
    ]


def violations(source: str) -> list[str]:
    """`line: what` for each host call and transfer import in a command module's source."""
    tree = ast.parse(source)
    found = [f"{line}: .{attr}() on a connection" for line, attr in _host_calls(tree)]
    found += [f"{line}: imports the transfer" for line in _transfer_imports(tree)]
    return sorted(found, key=lambda s: int(s.split(":")[0]))


def test_no_command_module_acts_on_a_host():
    found = {
        path.name: v for path in sorted(COMMANDS.glob("*.py")) if (v := violations(path.read_text(encoding="utf-8")))
    }
    assert not found, f"command modules that act on a host (move the call into a workflow): {found}"


def test_the_scan_finds_host_calls_and_transfer_imports():
    source = """
from ...remote import transfer
from ...remote.transfer import pull
import remote_ops.remote.transfer
def a(app, spec):
    app.remote(spec).run("true")
def b(app, spec):
    r = app.remote(spec)
    r.put("a", "b")
def c(remote):
    remote.get("x", "y")
def d(self):
    self.remote.run("x")
"""
    assert violations(source) == [
        "2: imports the transfer",
        "3: imports the transfer",
        "4: imports the transfer",
        "6: .run() on a connection",
        "9: .put() on a connection",
        "11: .get() on a connection",
        "13: .run() on a connection",
    ]


def test_the_scan_passes_dict_get_and_workflow_calls():
    source = """
from ...remote import hostkeys
from ...workflows import specbench as sb, dumps
def a(app, spec, report: dict, options):
    report.get("ok")
    options.get("x", 1)
    sb.run(app.remote(spec), spec)
    dumps.pull(app.target(spec), spec.dump.dir, [], None, None)
    app.console.progress("x").get("y")
"""
    assert violations(source) == []


def test_spec_deploy_builds_no_server_flags_in_the_command():
    """The drafter's server flags (SGLang's `--speculative-*`, vLLM's `--speculative-config`) are
    decided below the CLI (`remote_ops.serving`, `workflows.specdeploy`), not in the command:
    no string in cli/commands/spec.py is such a flag (help texts may name them)."""
    import re

    tree = ast.parse((COMMANDS / "spec.py").read_text(encoding="utf-8"))
    flag = re.compile(r"^--speculative-[a-z-]+(=.*)?$")
    built = [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and flag.match(n.value)
    ]
    assert not built, f"cli/commands/spec.py builds speculative flags: {built}"
