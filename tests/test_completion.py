"""`remote-ops completion SHELL` and one TAB through click's protocol: names from the raw inventory,
without pydantic (no models built for a keypress)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli_process

INVENTORY = """\
hosts:
  gpu-01: {address: 127.0.0.5}
  gpu-02: {address: 127.0.0.6}
groups:
  rack-2: {hosts: [gpu-02]}
  gpu-tier: {children: [rack-2]}
"""

#: Run one completion in-process, then report whether the models' library was imported.
PROBE = """\
import sys
from remote_ops.cli.main import main
try:
    main()
except SystemExit:
    pass
print("PYDANTIC", "pydantic" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_script_for_each_shell_names_remote_ops(shell, tmp_path):
    p = run_cli_process(dict(os.environ), "completion", shell, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "_REMOTE_OPS_COMPLETE" in p.stdout and "remote-ops" in p.stdout
    assert f"{shell}_complete" in p.stdout  # the protocol's per-shell mode


def test_unknown_shell_is_a_usage_error(tmp_path):
    p = run_cli_process(dict(os.environ), "completion", "tcsh", cwd=tmp_path)
    assert p.returncode == 2 and "tcsh" in p.stderr


def _complete(tmp_path: Path, words: str) -> tuple[list[str], bool]:
    inv = tmp_path / "inv"
    inv.mkdir(exist_ok=True)
    (inv / "fleet.yaml").write_text(INVENTORY)
    env = dict(os.environ, REMOTE_OPS_INVENTORY=str(inv), _REMOTE_OPS_COMPLETE="bash_complete")
    env.update(COMP_WORDS=words, COMP_CWORD=str(len(words.split()) - (0 if words.endswith(" ") else 1)))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    names = [line.split(",", 1)[1] for line in p.stdout.splitlines()]
    return names, "PYDANTIC True" in p.stderr


def test_host_completion_reads_names_without_loading_the_models(tmp_path):
    names, pydantic = _complete(tmp_path, "remote-ops health --host g")
    assert names == ["gpu-01", "gpu-02", "gpu-tier"]
    assert not pydantic


def test_host_completion_offers_file_and_groups_section_names_after_a_pattern_separator(tmp_path):
    names, pydantic = _complete(tmp_path, "remote-ops logs summary --host gpu-01:&")
    assert names == [
        "gpu-01:&gpu-01",
        "gpu-01:&gpu-02",
        "gpu-01:&fleet",
        "gpu-01:&rack-2",
        "gpu-01:&gpu-tier",
        "gpu-01:&all",
    ]
    assert not pydantic
