"""The CLI with stdout a pipe, as `| grep` and scripts run it (issue 29, items 1 and 2).

- `-v`/`-vv`/`-q` are accepted before the command as well as after it; `-q` with any `-v`
  is a usage error (exit 2) naming both.
- A table to a pipe is tab-separated lines with whole values: a header line, then one row a
  line, no box characters and no ellipsis (`patch specs | grep -c CLASS` counts the row).
- `patch check`/`verify`/`status` print their verdict line on stdout (data), not stderr.

Every run is the real CLI (`python -m remote_ops`) in a subprocess, stdout and stderr pipes;
none connects anywhere (a one-host inventory in a temp dir; `--local-file` for the patch).
"""

from __future__ import annotations

import io
import os

import pytest

from remote_ops import wheels
from remote_ops.cli.console import Console
from tests.conftest import run_cli

DSV2 = "python/sglang/srt/models/deepseek_v2.py"
BOX = set("│┃─━┼╇╋┏┓┗┛┡┩")


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A one-host inventory (never contacted) and a private state dir; no colour forced."""
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "pipes.yaml").write_text("hosts:\n  pipe-host:\n    address: 127.0.0.9\n    user: root\n")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, "REMOTE_OPS_INVENTORY": str(inventory), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}


@pytest.mark.parametrize("args", [("-v", "hosts"), ("hosts", "-v"), ("-vv", "hosts"), ("-v", "hosts", "-v")])
def test_verbose_before_or_after_the_command(env, args):
    rc, out, err = run_cli(env, *args)
    assert rc == 0, err
    assert "pipe-host\t127.0.0.9" in out


@pytest.mark.parametrize("args", [("-q", "hosts"), ("hosts", "-q")])
def test_quiet_before_or_after_the_command(env, args):
    rc, out, err = run_cli(env, *args)
    assert rc == 0, err
    assert "pipe-host" in out


@pytest.mark.parametrize(
    "args", [("-q", "-v", "hosts"), ("-q", "hosts", "-v"), ("-v", "hosts", "-q"), ("hosts", "-q", "-v")]
)
def test_quiet_with_verbose_is_a_usage_error(env, args):
    rc, out, err = run_cli(env, *args)
    assert rc == 2, out + err
    assert "-q/--quiet" in err and "-v/--verbose" in err and "Traceback" not in err
    assert out == ""


def test_hosts_piped_is_tab_separated(env):
    rc, out, err = run_cli(env, "hosts")
    assert rc == 0, err
    lines = out.splitlines()
    header = lines[0].split("\t")
    assert header[:2] == ["host", "address"]
    assert all(len(line.split("\t")) == len(header) for line in lines), out
    assert not BOX & set(out)


def test_patch_specs_piped_keeps_whole_values(env):
    rc, out, err = run_cli(env, "patch", "specs")
    assert rc == 0, err
    assert not BOX & set(out) and "…" not in out
    rows = [line for line in out.splitlines() if "KimiK25ForConditionalGeneration" in line]
    assert len(rows) == 1, out  # what `| grep -c KimiK25ForConditionalGeneration` counts
    header = out.splitlines()[0].split("\t")
    assert len(rows[0].split("\t")) == len(header) and "spec" in header


def test_patch_verdicts_are_on_stdout(env, tmp_path):
    target = tmp_path / "deepseek_v2.py"
    target.write_bytes(wheels.sglang_source("0.5.9", DSV2))
    rc, out, err = run_cli(env, "patch", "check", "--local-file", str(target))
    assert rc == 0, err
    assert "the patch can be applied" in out and "the patch can be applied" not in err
    rc, out, err = run_cli(env, "patch", "apply", "--local-file", str(target))
    assert rc == 0, err
    rc, out, err = run_cli(env, "patch", "verify", "--local-file", str(target))
    assert rc == 0, err
    assert "patch verified" in out and "patch verified" not in err
    rc, out, err = run_cli(env, "patch", "status", "--local-file", str(target))
    assert rc == 0, err
    assert f"[ ok ] local:{target}: applied" in out, out
    assert out.splitlines()[0].startswith("block\tstate\t"), out
    rc, out, err = run_cli(env, "patch", "check", "--local-file", str(target), "--json")
    assert rc == 0, err
    assert out.startswith("{") and "the patch can be applied" not in out


def test_a_piped_table_has_its_title_as_a_comment_line_and_cells_whole():
    """In process, stdout a StringIO (not a terminal): `# title`, header, rows; a tab or an
    escape inside a cell cannot add a column or drive a terminal."""
    out, err = io.StringIO(), io.StringIO()
    long = "x" * 400
    Console(stdout=out, stderr=err).table(["a", "b"], [[long, None], ["t\tab", "\x1b[2J"]], title="facts: h1")
    assert out.getvalue() == f"# facts: h1\na\tb\n{long}\t\nt^Iab\t^[[2J\n"
    assert err.getvalue() == ""
