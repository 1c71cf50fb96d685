"""`sandbox up --hosts N`: N sandbox hosts as the group `sandbox`; one host stays `sandbox`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from remote_ops.workflows import sandbox


def test_host_names_and_daemon_keys():
    assert sandbox.host_names(1) == ["sandbox"]
    assert sandbox.host_names(3) == ["sandbox1", "sandbox2", "sandbox3"]
    assert sandbox.daemon_key("sshd", "sandbox", 1) == "sshd"  # one host: as before
    assert sandbox.daemon_key("sshd", "sandbox2", 3) == "sshd:sandbox2"
    with pytest.raises(ValueError):
        sandbox.host_names(0)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(env, *args, timeout=120):
    """The CLI run from an empty directory (no ./inventory), so only the sandbox's inventory file is loaded."""
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=env["HOME_FOR_TEST"],
    )
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr


def test_three_sandbox_hosts_are_the_group_sandbox(tmp_path):
    from conftest import require

    from remote_ops.hostlab import lab_unavailable

    require(lab_unavailable())
    (tmp_path / "cwd").mkdir()
    env = {
        **os.environ,
        "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"),
        "HOME_FOR_TEST": str(tmp_path / "cwd"),
        "PYTHONPATH": REPO,
    }
    env.pop("REMOTE_OPS_INVENTORY", None)  # (an --inventory / $REMOTE_OPS_INVENTORY replaces the sandbox's file)
    try:
        rc, doc, err = _cli(env, "sandbox", "up", "--hosts", "3", timeout=900)
        assert rc == 0 and doc["running"], err
        assert [h["name"] for h in doc["hosts"]] == ["sandbox1", "sandbox2", "sandbox3"]
        assert {"dockerd", "sshd:sandbox1", "sshd:sandbox3", "container:sandbox2"} <= set(doc["daemons"])
        rc, facts, err = _cli(env, "facts", "--host", "sandbox")
        assert rc == 0, err
        assert [h["host"] for h in facts["hosts"]] == ["sandbox1", "sandbox2", "sandbox3"]
        rc, _, err = _cli(env, "sandbox", "up", "--hosts", "2")
        assert rc != 0 and "sandbox down" in err  # another size: refused
        rc, again, err = _cli(env, "sandbox", "up", "--hosts", "3")
        assert rc == 0 and again["hosts"] == doc["hosts"], err  # idempotent
        rc, _, err = _cli(env, "sandbox", "down")
        rc, one, err = _cli(env, "sandbox", "up", timeout=900)  # after down: one host, `sandbox`
        assert rc == 0 and [h["name"] for h in one["hosts"]] == ["sandbox"] and "sshd" in one["daemons"], err
    finally:
        subprocess.run(
            [sys.executable, "-m", "remote_ops", "sandbox", "down"],
            env=env,
            capture_output=True,
            timeout=120,
            cwd=env["HOME_FOR_TEST"],
        )
