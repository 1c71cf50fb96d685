"""The engine seam keeps its promise: engine command lines live behind `remote_ops/engine/`.

- No module outside `remote_ops/engine/` and `remote_ops/hostlab/` names the
  docker binary: an AST scan of the string literals that look like a docker
  command (`"docker"` followed in a list by a docker subcommand or `*args`;
  `docker <subcommand>` at the start of a shell command inside a string).  Docstrings and prose ("the docker engine") are not commands.
- A second engine kind is one file: outside `engine/podman.py` (and the lab),
  the code names podman in two lines only, the registry's and the inventory
  field's.
- The registry, the inventory field and the classes agree; asking for an
  engine's command lines imports neither the Docker SDK nor requests.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

from remote_ops.core.inventory import HostSpec
from remote_ops.engine import DEFAULT_KIND, KINDS, cli_for, engine_class

PACKAGE = Path(__file__).resolve().parents[1] / "remote_ops"
#: Where engine command lines may be written: the seam itself, and the lab that plays the hosts.
ALLOWED = ("engine", "hostlab")
SUBCOMMANDS = (
    "attach build buildx commit container context cp create diff events exec export history image images "
    "import info inspect kill load logs network pause port ps pull push rename restart rm rmi run save start "
    "stats stop system tag top unpause update version volume wait"
).split()
#: `docker SUBCOMMAND` where a shell command starts: line start, after ; & | ( ` $( or a
#: wrapper (nohup, setsid, exec, env, sudo), after VAR=value assignments.
SHELL_COMMAND = re.compile(
    r"(?:^|[;&|(`]\s*|\b(?:nohup|setsid|exec|env|sudo)\s+)(?:\w+=\S*\s+)*docker\s+(?:" + "|".join(SUBCOMMANDS) + r")\b",
    re.M,
)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string literal that is not a docstring (f-strings: their text parts)."""
    skip = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    ]


def _argv_lists(tree: ast.AST) -> list[int]:
    """Lines of list/tuple literals where "docker" is followed by a docker subcommand or by
    `*args` (an argv list for the docker CLI)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            for word, follows in zip(node.elts, node.elts[1:]):
                if not (isinstance(word, ast.Constant) and word.value == "docker"):
                    continue
                if isinstance(follows, ast.Starred) or (
                    isinstance(follows, ast.Constant) and follows.value in SUBCOMMANDS
                ):
                    lines.append(node.lineno)
    return lines


def docker_commands(source: str) -> list[str]:
    """`line: text` for each docker command line the module's code writes."""
    tree = ast.parse(source)
    found = [f"{line}: {text.strip()[:60]!r}" for line, text in _strings(tree) if SHELL_COMMAND.search(text)]
    found += [f"{line}: an argv list starting the docker CLI" for line in _argv_lists(tree)]
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def _modules(*, outside: tuple[str, ...]) -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in outside and "__pycache__" not in path.parts
    ]


def test_no_module_outside_the_engine_names_the_docker_binary():
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in _modules(outside=ALLOWED)
        if (hits := docker_commands(path.read_text(encoding="utf-8")))
    }
    assert not found, f"docker command lines outside remote_ops/engine/ (ask engine.cli_for(host)): {found}"


def test_the_scan_finds_docker_commands():
    source = """
argv = ["docker", "run", "--rm", image]
tail = [*prefix, "docker", "logs", name]
passed = ["docker", *args]
build = f"DOCKER_BUILDKIT=1 docker build -t {tag} {ctx}"
follow = f"setsid nohup docker logs -f {name} >> {log}"
image = f"$(docker inspect -f '{{{{.Config.Image}}}}' {name})"
status = "true; docker ps -q"
hint = f"see `docker logs {name}` on the host"
"""
    assert [line.split(":")[0] for line in docker_commands(source)] == ["2", "3", "4", "5", "6", "7", "8", "9"]


def test_the_scan_passes_prose_package_names_and_docstrings():
    source = '''
"""A module docstring may say `docker run -d` and `docker logs NAME`."""
def f():
    """So may a function's: docker inspect."""
    return "Check SSH, docker, GPUs and the docker engine's version"
PRELOAD = ("paramiko", "docker", "rich.console")
VERSIONS = ("fabric", "jinja2", "docker")
path = repo_resource("docker", "standin")
row = ["docker", f"{version} (runtimes: {runtimes})"]
kind: Literal["docker", "podman"] = "docker"
dockerd = "dockerd --data-root /x"
'''
    assert docker_commands(source) == []


def _names_podman(path: Path) -> list[int]:
    """Lines of code (not docstrings, not comments) whose strings or names say podman."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = [line for line, text in _strings(tree) if "podman" in text.lower()]
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name and "podman" in name.lower():
            lines.append(node.lineno)
    return sorted(set(lines))


def test_podman_is_one_file_plus_two_lines():
    """engine/podman.py is the engine; elsewhere only the registry's line and the inventory field."""
    hits = {
        f"{path.relative_to(PACKAGE)}:{line}": path.read_text(encoding="utf-8").splitlines()[line - 1].strip()
        for path in _modules(outside=("hostlab",))
        if path.relative_to(PACKAGE) != Path("engine/podman.py")
        for line in _names_podman(path)
    }
    assert len(hits) <= 2, hits
    assert all(
        text.startswith('"podman": ("podman", "PodmanEngine")') or text.startswith("engine: Literal[")
        for text in hits.values()
    ), hits


def test_the_registry_the_inventory_and_the_classes_agree():
    field = HostSpec.model_fields["engine"]
    assert set(get_args(field.annotation)) == set(KINDS) and field.default == DEFAULT_KIND
    for kind in KINDS:
        cls = engine_class(kind)
        assert cls.kind == cls.cli.kind == kind and cli_for(HostSpec(name="h", engine=kind)) is cls.cli
        assert cls.cli.binary and cls.dial, kind


def test_command_lines_import_no_engine_sdk():
    """A shell-probe path (health, a no-op deploy) gets its engine's commands without the SDK."""
    code = (
        "import sys\n"
        "from remote_ops.core.inventory import HostSpec\n"
        "from remote_ops.engine import cli_for\n"
        "for kind in ('docker', 'podman'):\n"
        "    cli = cli_for(HostSpec(name='h', engine=kind))\n"
        "    cli.probe_sections('c', 'i:1', runtimes=True, api=True); cli.build_cmd('/c', 't')\n"
        "print(sorted(m for m in ('docker', 'requests', 'urllib3', 'paramiko') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
