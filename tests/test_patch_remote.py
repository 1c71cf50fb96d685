"""inspect-source and patch apply/verify/revert over the real sshd test host holding SGLang 0.5.9."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
from pathlib import Path

import pytest

from remote_ops.cli.main import main
from remote_ops.core import anchors
from remote_ops.errors import Refused
from remote_ops.workflows import patching

SHA_059 = "4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35"


@pytest.fixture
def cli_env(lab, lab_env, monkeypatch):
    """Run `remote_ops.cli.main` in-process against the lab inventory."""
    for key in ("REMOTE_OPS_INVENTORY", "REMOTE_OPS_STATE_DIR"):
        monkeypatch.setenv(key, lab_env[key])
    return lab_env


@pytest.fixture
def target(lab, sglang_host) -> patching.PatchTarget:
    return patching.PatchTarget.for_host(lab.spec(sglang_host.name))


def git_status(checkout: str) -> str:
    return subprocess.run(
        ["git", "-C", checkout, "status", "--porcelain"], capture_output=True, text=True, check=True, timeout=30
    ).stdout


def test_inspect_source_lines_over_ssh(sglang_host, cli_env, capsys):
    rc = main(["inspect-source", "--host", sglang_host.name, "--lines", "2830:2845", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sha256"] == SHA_059 and doc["lines"] == 2986 and doc["sglang_version"] == "0.5.9"
    assert doc["version_source"] == "python/sglang/_version.py"
    rows = doc["listings"][0]["rows"]
    assert [r["n"] for r in rows] == list(range(2830, 2846))
    assert rows[7]["text"] == "        self.capture_aux_hidden_states = False"
    assert rows[7]["scope"] == "DeepseekV2ForCausalLM.__init__"


def test_inspect_source_bad_input_over_ssh(sglang_host, cli_env):
    assert main(["inspect-source", "--host", sglang_host.name, "--lines", "2845:2830"]) == 2
    assert main(["inspect-source", "--host", sglang_host.name, "--file", "/nonexistent/x.py", "--lines", "1:2"]) == 13


def test_apply_verify_revert_round_trips(sglang_remote, target, sglang_host):
    """apply = 2 round trips (read, write); verify = 1; re-apply = 1; revert byte-identical."""
    checkout = str(sglang_host.paths.checkout)
    result = patching.apply(sglang_remote, target)
    assert result.action == "applied" and result.round_trips == 2 and result.verify.ok
    assert result.verify.compile_ok is True
    on_host = Path(target.path).read_bytes()  # the lab host shares this filesystem
    assert hashlib.sha256(on_host).hexdigest() == result.sha_after
    lines = on_host.decode().split("\n")
    assert lines[2837 - 1] == "        self.capture_aux_hidden_states = False"
    assert lines[2838 - 1].startswith("        # >>> remote-ops:eagle3-hs-dump:init")

    verified = patching.verify(sglang_remote, target)
    assert verified.ok and verified.compile_ok is True
    assert patching.apply(sglang_remote, target).round_trips == 1

    reverted = patching.revert(sglang_remote, target)
    assert reverted.identical and reverted.round_trips == 2
    assert hashlib.sha256(Path(target.path).read_bytes()).hexdigest() == SHA_059
    assert git_status(checkout) == ""


def test_cli_end_to_end_over_ssh(sglang_host, cli_env, capsys):
    name = sglang_host.name
    assert main(["patch", "check", "--host", name]) == 0
    assert main(["patch", "apply", "--host", name, "--dry-run"]) == 0
    assert (
        hashlib.sha256(Path(patching.PatchTarget.for_host(_spec(cli_env, name)).path).read_bytes()).hexdigest()
        == SHA_059
    )
    assert main(["patch", "apply", "--host", name]) == 0
    capsys.readouterr()
    assert main(["inspect-source", "--host", name, "--grep", "capture_aux_hidden_states", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["listings"][0]["rows"]
    assert [r["n"] for r in rows] == [2837, 2929, 2978, 2982]
    assert main(["patch", "apply", "--host", name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "noop"
    assert main(["patch", "verify", "--host", name]) == 0
    capsys.readouterr()  # verify's evidence listings are data: stdout (issue 13)
    assert main(["patch", "status", "--host", name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "applied"
    assert main(["patch", "revert", "--host", name]) == 0
    assert git_status(str(sglang_host.paths.checkout)) == ""


def _spec(env, name):
    from remote_ops.core.inventory import load_inventory

    return load_inventory([Path(env["REMOTE_OPS_INVENTORY"])]).one(name)


def test_misplaced_file_fails_verify_over_ssh(sglang_host, target, cli_env, capsys):
    path = Path(target.path)
    patched = anchors.plan(path.read_bytes(), target.spec()).new_text.split("\n")
    block = patched[2837:2843]
    del patched[2837:2843]
    patched[2828:2828] = block
    path.write_text("\n".join(patched))
    assert main(["patch", "verify", "--host", sglang_host.name]) == 10
    err = capsys.readouterr().err
    assert "misplaced" in err and "after line 2828" in err
    assert main(["patch", "apply", "--host", sglang_host.name]) == 0  # apply moves the marked block
    assert main(["patch", "verify", "--host", sglang_host.name]) == 0


def test_concurrent_apply_waits_for_the_host_lock(lab, sglang_host, target, monkeypatch):
    """Two applies at once over two connections: one writes, the other waits for the lock, re-reads, no-op."""
    results, errors = [], []

    def run():
        r = lab.connect(sglang_host.name)
        try:
            results.append(patching.apply(r, target).action)
        except Refused as exc:
            errors.append(exc.details.get("reason"))
        finally:
            r.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == ["applied", "noop"] and errors == []
    assert not Path(target.lock_dir).exists()


def test_lock_held_refuses_over_ssh(lab, sglang_remote, target, monkeypatch):
    holder = subprocess.Popen(["sleep", "60"])
    try:
        Path(target.lock_dir).mkdir(parents=True)
        (Path(target.lock_dir) / "info").write_text(f"pid={holder.pid}\nwho=someone\nwhat=deploy\n")
        monkeypatch.setattr(patching, "LOCK_WAIT_S", 1.0)
        with pytest.raises(Refused) as info:
            patching.apply(sglang_remote, target)
        assert info.value.details["reason"] == "lock_held" and "deploy" in info.value.message
        assert hashlib.sha256(Path(target.path).read_bytes()).hexdigest() == SHA_059
    finally:
        holder.kill()
        holder.wait()
        subprocess.run(["rm", "-rf", target.lock_dir], check=True)
