"""Start-up: `--help` and `--version` import no SSH, pydantic, Jinja2 or rich (issue 13, item 1).

The time goal (<= 0.15 s) is measured in bench/README.md "Start-up"; here only the import set."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import click

from remote_ops.cli import main as cli_mod

HEAVY = (
    "fabric",
    "paramiko",
    "invoke",
    "pydantic",
    "jinja2",
    "rich",
    "yaml",
    "docker",
    "cryptography",
    "remote_ops.cli.commands",
    "remote_ops.remote",
    "remote_ops.core.inventory",
    "remote_ops.cli.console",
)

PROBE = """
import json, sys
from remote_ops.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print("\\n@@" + json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def imported(*argv: str) -> set[str]:
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    return set(json.loads(p.stderr.rsplit("@@", 1)[1]))


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_help_imports_no_ssh_pydantic_jinja2_or_rich():
    assert heavy(imported("--help")) == []


def test_version_imports_no_ssh_pydantic_jinja2_or_rich():
    assert heavy(imported("--version")) == []


def test_a_command_imports_what_it_uses():
    mods = imported("inventory", "schema")
    assert "pydantic" in mods and "remote_ops.cli.commands.inventory" in mods
    assert "fabric" not in mods and "remote_ops.cli.commands.deploy" not in mods


def test_the_help_table_names_every_command_of_every_module():
    """COMMAND_HELP (what --help shows without importing) agrees with the modules themselves."""
    indexed = {}
    for name in cli_mod.COMMAND_MODULES:
        module = importlib.import_module(f"remote_ops.cli.commands.{name}")
        for command in module.commands:
            indexed[command.name] = name
    assert {n: m for n, (m, _) in cli_mod.COMMAND_HELP.items()} == indexed


def test_help_lists_every_command_and_a_command_still_loads():
    from click.testing import CliRunner

    out = CliRunner().invoke(cli_mod.cli, ["--help"]).output
    assert all(name in out for name in cli_mod.COMMAND_HELP)
    assert isinstance(cli_mod.cli.get_command(click.Context(cli_mod.cli), "health"), click.Command)


def test_the_ssh_seam_imports_invoke_without_unittest_mock_or_asyncio():
    """remote_ops.remote imports invoke with a stand-in `unittest.mock` (30-45 ms of every run);
    afterwards the real module is importable and invoke's MockContext still works."""
    probe = (
        "import sys; import remote_ops.remote; "
        "print(sorted(m for m in ('unittest.mock', 'asyncio') if m in sys.modules)); "
        "import unittest.mock, invoke; "
        "print(unittest.mock.Mock.__module__, invoke.MockContext(run=invoke.Result('x')).run('true').stdout)"
    )
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["[]", "unittest.mock x"]
