"""Start-up: each command imports only what it uses.

`--help` and `--version` import no SSH, pydantic, Jinja2 or rich; `hosts` no SSH
library; a module that only names `Remote` or the transfer no SSH library; a
run whose output goes to pipes no rich (unless it prints a table); `health` on
a host no docker SDK.  The times are measured in bench/README.md "startup.py";
here only the import sets."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import click
import pytest

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


def imported(*argv: str, env: dict | None = None) -> set[str]:
    """The modules a whole run of `remote-ops ARGV` imported, its output on pipes."""
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, env=env)
    return set(json.loads(p.stderr.rsplit("@@", 1)[1]))


SSH_STACK = ("fabric", "paramiko", "invoke", "cryptography")


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


def test_hosts_imports_no_ssh_library(tmp_path):
    (tmp_path / "fleet.yaml").write_text("hosts:\n  gpu-a: {address: 127.0.0.11}\n")
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(tmp_path), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    mods = imported("hosts", env=env)
    assert "pydantic" in mods and "remote_ops.cli.commands.hosts" in mods
    assert [m for m in SSH_STACK + ("docker", "jinja2") if m in mods] == []


#: what the in-process `hosts` path must not import: the SSH stack, the Engine API client (and the
#: requests it stands on), templates, rich (its output goes to pipes here), the ML stack, the anchor
#: engine (the inventory checks a spec name against the catalog, which needs none of it) and
#: importlib.metadata (pydantic's plugin lookup, skipped: PYDANTIC_DISABLE_PLUGINS)
NOT_FOR_HOSTS = SSH_STACK + (
    "docker",
    "requests",
    "urllib3",
    "jinja2",
    "rich",
    "transformers",
    "torch",
    "numpy",
    "remote_ops.core.anchors",
    "importlib.metadata",
    "email",
)


RUN_PROBE = """
import json, sys
from remote_ops.cli.main import run
sys.argv[0] = "remote-ops"
try:
    run()
except SystemExit:
    pass
print("\\n@@" + json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def test_hosts_in_process_imports_none_of_the_heavy_modules(tmp_path):
    """The whole `hosts` run in one process as the console script runs it (`cli.main.run`), a host
    naming its patch spec so that the inventory checks the name against the spec catalog: none of
    NOT_FOR_HOSTS is in sys.modules afterwards, and no command module but `hosts`."""
    (tmp_path / "fleet.yaml").write_text(
        "hosts:\n  gpu-a: {address: 127.0.0.11, sglang: {patch: deepseek-v2}}\n  gpu-b: {address: 127.0.0.12}\n"
    )
    env = {**_no_force(), "REMOTE_OPS_INVENTORY": str(tmp_path), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    env.pop("PYDANTIC_DISABLE_PLUGINS", None)  # run() sets it
    p = subprocess.run([sys.executable, "-c", RUN_PROBE, "hosts"], capture_output=True, text=True, timeout=120, env=env)
    out, mods = p.stdout, set(json.loads(p.stderr.rsplit("@@", 1)[1]))
    assert "gpu-a\t127.0.0.11" in out and "deepseek-v2" in out  # the path ran, the spec name checked
    assert "remote_ops.core.inventory" in mods and "remote_ops.core.patchspec" in mods
    assert sorted(m for m in mods if any(m == n or m.startswith(n + ".") for n in NOT_FOR_HOSTS)) == []
    assert sorted(m for m in mods if m.startswith("remote_ops.cli.commands.")) == [
        "remote_ops.cli.commands._options",
        "remote_ops.cli.commands.hosts",
    ]


def test_naming_the_seam_imports_no_ssh_library():
    """A workflow that names `Remote` or the transfer, and a command's help, load no SSH library."""
    probe = (
        "import sys; import remote_ops.remote, remote_ops.remote.transfer, remote_ops.remote.sshconfig, "
        "remote_ops.workflows.dumps, remote_ops.workflows.hostlock; from remote_ops.remote import Remote; "
        "print(sorted(m for m in %r if m in sys.modules))" % (SSH_STACK,)
    )
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["[]"], p.stderr
    assert [m for m in SSH_STACK if m in imported("dumps", "pull", "--help")] == []


def test_the_seam_still_exports_the_connection_on_first_use():
    import remote_ops.remote as seam
    from remote_ops.remote.fabric import FabricRemote

    assert seam.FabricRemote is FabricRemote and callable(seam.connect) and callable(seam.fingerprint)
    with pytest.raises(AttributeError):
        seam.nothing_of_that_name  # noqa: B018


LINES = """
import sys
from remote_ops.cli.console import Console
c = Console()
c.say("note :fire:"); c.status("ok", "[b]done[/b]"); c.error("bad", "hint"); c.host_line("h", "stdout", "x", data=True)
print("@@" + " ".join(m for m in ("rich", "rich.console") if m in sys.modules), file=sys.stderr)
"""


def test_lines_to_pipes_are_written_without_rich():
    p = subprocess.run([sys.executable, "-c", LINES], capture_output=True, text=True, timeout=60, env=_no_force())
    err, mods = p.stderr.rsplit("@@", 1)
    assert mods.strip() == "" and p.stdout == "h | x\n"
    assert err.splitlines() == ["note :fire:", "[ ok ] [b]done[/b]", "error: bad", "hint: hint"]


def test_forced_colour_still_goes_through_rich():
    env = {**_no_force(), "FORCE_COLOR": "1"}
    p = subprocess.run([sys.executable, "-c", LINES], capture_output=True, text=True, timeout=60, env=env)
    err, mods = p.stderr.rsplit("@@", 1)
    assert mods.split() == ["rich", "rich.console"]
    assert "\x1b[" in err and "[b]done[/b]" in err and ":fire:" in err  # styled, markup and emoji codes as text


def _no_force() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")}


def test_health_on_a_host_imports_no_docker_sdk_and_no_rich(lab_env, host):
    """health's probes are shell commands: the Engine API client (the docker SDK) is not loaded, and
    its lines on pipes need no rich."""
    mods = imported("health", "--host", "lab1", env={k: v for k, v in lab_env.items() if k != "FORCE_COLOR"})
    assert "remote_ops.workflows.health" in mods and "paramiko" in mods
    assert [m for m in ("docker", "rich", "jinja2") if m in mods] == []


def test_the_ssh_seam_imports_invoke_without_unittest_mock_or_asyncio():
    """The connection (remote_ops.remote.fabric) imports invoke with a stand-in `unittest.mock`
    (30-45 ms of every run); afterwards the real module is importable and invoke's MockContext
    still works."""
    probe = (
        "import sys; import remote_ops.remote.fabric; "
        "print(sorted(m for m in ('unittest.mock', 'asyncio') if m in sys.modules)); "
        "import unittest.mock, invoke; "
        "print(unittest.mock.Mock.__module__, invoke.MockContext(run=invoke.Result('x')).run('true').stdout)"
    )
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["[]", "unittest.mock x"]


def test_the_inventory_imports_pydantic_without_importlib_metadata():
    """core.inventory imports pydantic's plugin loader with a stand-in `importlib.metadata`
    (core._lean): with plugins off (as the CLI runs) the real module is never imported; with
    them on, the loader's lookup imports and asks the real one, and a later import gets it."""
    probe = (
        "import sys; import remote_ops.core.inventory; "
        "m = sys.modules.get('importlib.metadata'); print(getattr(m, '__file__', None) is not None if m else None); "
        "from pydantic.plugin import _loader; print(list(_loader.get_plugins())); "
        "import importlib.metadata; print(importlib.metadata.entry_points.__module__, "
        "type(importlib.metadata.version('pydantic')).__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    runs = [
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=e)
        for e in ({**env, "PYDANTIC_DISABLE_PLUGINS": "__all__"}, env)
    ]
    assert [p.returncode for p in runs] == [0, 0], [p.stderr for p in runs]
    off, on = (p.stdout.splitlines() for p in runs)
    assert off == ["None", "[]", "importlib.metadata str"]
    assert on == ["True", "[]", "importlib.metadata str"]  # the real module, imported by the lookup
