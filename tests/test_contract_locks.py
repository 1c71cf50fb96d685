"""The operator's contract under faults (issue 9): the host lock, signals, `unlock`, exit codes.

Defect 1: every command that changes a host takes the one host lock
(`remote_ops.workflows.hostlock`); read-only commands never wait for it.
Defect 2: SIGTERM/SIGHUP end a deploy like SIGINT (lock released, record with
the failed step, exit 143/129); `unlock` shows and releases stale locks,
`--force` any lock, written to the audit log.
Defect 12: health exits 4/6 for refused / unknown host key; usage errors are
caught before connecting; a lost connection during deploy names the step,
is recorded, and prints the lock recovery hint.

Everything runs against real lab hosts (sshd + dockerd); lab hosts share this
machine's filesystem, so the lock dir and audit log are read directly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import connect, run_cli_process

from remote_ops.errors import ExitCode
from remote_ops.probes import lock
from remote_ops.workflows import container, hostlock

pytestmark = [pytest.mark.docker, pytest.mark.slow]


# -- pure --------------------------------------------------------------------------------------------
def test_info_parses_back_and_stale_needs_proof():
    text = hostlock.info_text("deploy: x", "tok", user="alice", client="laptop", client_pid=4242, now=0)
    h = lock.parse_info(text)
    assert (h.user, h.client, h.client_pid, h.what, h.token) == ("alice", "laptop", 4242, "deploy: x", "tok")
    assert "alice on laptop (PID 4242) since 1970-01-01T00:00:00Z: deploy: x" == h.describe()
    assert hostlock.stale_reason(h, "laptop", lambda pid: False) == "stale lock: holder PID 4242 is gone"
    assert hostlock.stale_reason(h, "laptop", lambda pid: True) is None
    assert hostlock.stale_reason(h, "other-machine", lambda pid: False) is None  # cannot prove it from here
    old = lock.parse_info("who=bob@box\nwhat=deploy\n")  # pre-hostlock info files
    assert (old.user, old.client) == ("bob", "box")
    assert lock.parse_read(0, "free\n") is None
    assert "\n" not in hostlock.info_text("a\nb").split("what=")[1].split("\n")[0]


# -- helpers -----------------------------------------------------------------------------------------
cli = run_cli_process


def inventory_env(lab_env, tmp_path, spec, **server) -> dict:
    """lab_env with an inventory holding exactly `spec` (with `server` overrides)."""
    if server:
        spec = spec.model_copy(update={"server": spec.server.model_copy(update=server)})
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        yaml.safe_dump({"hosts": {spec.name: spec.model_dump(mode="json", exclude={"name", "source", "groups"})}})
    )
    return {**lab_env, "REMOTE_OPS_INVENTORY": str(inv)}


def lock_info(spec) -> str | None:
    p = Path(spec.lock_dir) / "info"
    return p.read_text() if p.exists() else None


def audit_lines(spec) -> list[dict]:
    p = Path(spec.audit_log)
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []


def records(env, host: str) -> list[dict]:
    """The deploy run records the CLI wrote under env's REMOTE_OPS_STATE_DIR."""
    from remote_ops import paths

    old = os.environ.get("REMOTE_OPS_STATE_DIR")
    os.environ["REMOTE_OPS_STATE_DIR"] = env["REMOTE_OPS_STATE_DIR"]
    try:
        runs = sorted((paths.host_dir(host) / "runs").glob("*-deploy.json"))
    finally:
        if old is None:
            os.environ.pop("REMOTE_OPS_STATE_DIR")
        else:
            os.environ["REMOTE_OPS_STATE_DIR"] = old
    return [json.loads(p.read_text()) for p in runs]


def wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not seen in {path} within {timeout}s:\n{path.read_text()[-3000:]}")


def slow_spec(spec, load_s: int = 600):
    """A spec whose stand-in server takes `load_s` to come up: deploy sits in its `wait` step."""
    env = {**spec.container.env, "STANDIN_LOAD_SECONDS": str(load_s)}
    return spec.model_copy(update={"container": spec.container.model_copy(update={"env": env})})


def start_deploy(env, host: str, tmp_path, *extra) -> tuple[subprocess.Popen, Path]:
    err = tmp_path / "deploy.err"
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_ops", "deploy", "--host", host, "--yes", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(err, "w"),
        stdin=subprocess.DEVNULL,
    )
    return proc, err


# -- defect 1: one lock for every change; reads never wait ------------------------------------------
def test_container_lifecycle_refused_while_deploy_lock_held(lab, deployed, sglang_remote, lab_env, tmp_path):
    env = inventory_env(lab_env, tmp_path, deployed)
    name = deployed.name
    token = hostlock.take(sglang_remote, deployed, "deploy: held by the test")  # as a running deploy does
    try:
        held = lock_info(deployed)
        for action in ("stop", "restart", "start"):
            p = cli(env, "container", action, "--host", name)
            assert p.returncode == ExitCode.REFUSED, (action, p.stderr)
            assert "held by" in p.stderr and "deploy: held by the test" in p.stderr
        ctr = container.inspect_container(sglang_remote, deployed.container.name)
        assert ctr.running, "the container must keep running while another run holds the lock"
        assert lock_info(deployed) == held, "a refused command must not touch the holder's lock"
        t = time.monotonic()
        assert cli(env, "container", "status", "--host", name).returncode == 0  # reads never wait
        assert cli(env, "container", "stop", "--host", name, "--dry-run").returncode == 0
        dry = cli(env, "deploy", "--host", name, "--dry-run", "--json")
        assert dry.returncode == 0 and "HELD" in dry.stderr
        assert cli(env, "health", "--host", name).returncode in (ExitCode.OK, ExitCode.HEALTH_WARN)
        assert time.monotonic() - t < 60
    finally:
        hostlock.release(sglang_remote, deployed, token)
    assert lock_info(deployed) is None
    p = cli(env, "container", "stop", "--host", name, "--grace", "2")
    assert p.returncode == 0, p.stderr
    assert not container.inspect_container(sglang_remote, deployed.container.name).running
    assert lock_info(deployed) is None, "container stop releases the lock it took"


def test_patch_apply_uses_the_same_lock(lab, sglang_host, sglang_remote, lab_env, monkeypatch):
    """The patch write script's lock is the same directory and info format (hostlock)."""
    from remote_ops.errors import Refused
    from remote_ops.workflows import patching

    spec = lab.spec(sglang_host.name)
    monkeypatch.setattr(patching, "LOCK_WAIT_S", 1.0)
    token = hostlock.take(sglang_remote, spec, "container stop: held by the test")
    try:
        with pytest.raises(Refused) as info:
            patching.apply(sglang_remote, spec)
        assert info.value.details["reason"] == "lock_held"
        assert "container stop: held by the test" in info.value.message
        assert info.value.details["lock"]["client_pid"] == os.getpid()
    finally:
        hostlock.release(sglang_remote, spec, token)
    assert cli(lab_env, "patch", "apply", "--host", spec.name).returncode == 0
    assert lock_info(spec) is None


# -- defect 2: signals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_during_deploy_releases_lock_and_records_the_step(spec, lab_env, tmp_path, sglang_remote, sig, code):
    slow = slow_spec(spec)
    env = inventory_env(lab_env, tmp_path, slow, healthy_timeout_s=600)
    proc, err = start_deploy(env, slow.name, tmp_path)
    try:
        wait_for_text(err, "waiting for health", 300)
        assert lock_info(slow) is not None
        t = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
        sglang_remote.run(["docker", "rm", "-f", slow.container.name], check=False)
    text = err.read_text()
    assert rc == code, text
    assert took < 30, f"cleanup after {signal.Signals(sig).name} took {took:.1f}s"
    assert lock_info(slow) is None, "the lock is released"
    assert f"wait: interrupted by {signal.Signals(sig).name}" in text
    rec = records(env, slow.name)[-1]
    assert rec["ok"] is False and rec["failed_step"] == "wait" and rec["lock"] == "released"
    assert rec["error"]["signal"] == signal.Signals(sig).name and rec["error"]["exit_code"] == code
    audit = audit_lines(slow)[-1]
    assert audit["action"] == "deploy" and audit["ok"] is False and audit["failed_step"] == "wait"


# -- defect 2: stale locks and `unlock` ---------------------------------------------------------------
HOLDER = """
import sys, time
from remote_ops.workflows import hostlock
from remote_ops.cli.app import App
app = App()
spec = app.host(sys.argv[1])
hostlock.take(app.remote(spec), spec, "deploy: killed with -9")
print("locked", flush=True)
time.sleep(300)
"""


def _killed_holder(spec, lab_env) -> subprocess.Popen:
    """A process that took the host lock, then was killed with -9 (the lock stays behind)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, spec.name],
        env=lab_env,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
    finally:
        holder.kill()  # SIGKILL: no cleanup can run
        holder.wait(timeout=30)
    assert f"client_pid={holder.pid}" in lock_info(spec)
    return holder


def test_kill_9_leaves_a_stale_lock_that_unlock_releases(lab, spare_host, lab_env):
    spec = lab.spec(spare_host.name)
    holder = _killed_holder(spec, lab_env)
    before = len(audit_lines(spec))
    p = cli(lab_env, "container", "restart", "--host", spec.name)  # the next taker takes the stale lock over
    assert p.returncode != ExitCode.REFUSED and lock_info(spec) is None, p.stderr
    line = next(a for a in audit_lines(spec)[before:] if a["action"] == "lock-takeover")
    assert line["stale"] == f"stale lock: holder PID {holder.pid} is gone" and line["by"] == "container restart"
    holder = _killed_holder(spec, lab_env)
    p = cli(lab_env, "unlock", "--host", spec.name, "--dry-run")
    assert p.returncode == 0 and lock_info(spec) is not None
    before = len(audit_lines(spec))
    p = cli(lab_env, "unlock", "--host", spec.name, "--json")
    assert p.returncode == 0, p.stderr
    assert f"stale lock: holder PID {holder.pid} is gone" in p.stderr
    doc = json.loads(p.stdout)
    assert (
        doc["released"]
        and doc["holder"]["client_pid"] == holder.pid
        and doc["holder"]["what"] == "deploy: killed with -9"
    )
    assert lock_info(spec) is None
    line = audit_lines(spec)[before]
    assert line["action"] == "unlock" and line["forced"] is False and line["stale"].startswith("stale lock")
    p = cli(lab_env, "unlock", "--host", spec.name)
    assert p.returncode == 0 and "no lock held" in p.stderr


def test_unlock_refuses_a_live_foreign_lock_unless_forced(lab, spare_host, lab_env):
    spec = lab.spec(spare_host.name)
    Path(spec.lock_dir).mkdir(parents=True, exist_ok=True)
    (Path(spec.lock_dir) / "info").write_text(
        hostlock.info_text("deploy: from a colleague", client="elsewhere", user="carol", client_pid=99999)
    )
    try:
        p = cli(lab_env, "unlock", "--host", spec.name)
        assert p.returncode == ExitCode.REFUSED and "carol on elsewhere (PID 99999)" in p.stderr
        assert "--force" in p.stderr and lock_info(spec) is not None
        before = len(audit_lines(spec))
        p = cli(lab_env, "unlock", "--host", spec.name, "--force")
        assert p.returncode == 0, p.stderr
        assert lock_info(spec) is None
        line = audit_lines(spec)[before]
        assert line["action"] == "unlock" and line["forced"] is True and line["holder"]["user"] == "carol"
    finally:
        subprocess.run(["rm", "-rf", spec.lock_dir], check=False)


# -- defect 12: exit codes ------------------------------------------------------------------------------
def test_health_refused_is_4_and_unknown_host_key_is_6(lab, spare_host, lab_env, faults, tmp_path):
    spec = lab.spec(spare_host.name)
    faults.refuse(spare_host)
    p = cli(lab_env, "health", "--host", spec.name, "--json", "--connect-timeout", "5", timeout=60)
    assert p.returncode == ExitCode.UNREACHABLE, p.stderr
    check = json.loads(p.stdout)["hosts"][0]["checks"][0]
    assert (check["tier"], check["name"], check["status"]) == ("ssh", "connect", "fail")
    assert check["data"]["exit_code"] == ExitCode.UNREACHABLE
    faults.unblock(spare_host)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    env = inventory_env(lab_env, tmp_path, spec.model_copy(update={"known_hosts": str(empty)}))
    p = cli(env, "health", "--host", spec.name, "--json", timeout=60)
    assert p.returncode == ExitCode.HOST_KEY, p.stderr
    doc = json.loads(p.stdout)["hosts"][0]
    assert doc["checks"][0]["name"] == "connect" and "not in" in doc["checks"][0]["reason"]
    assert empty.read_text() == "", "strict policy never records the key"


def test_usage_errors_are_caught_before_connecting(lab, spare_host, lab_env, faults):
    """A refused host would give exit 4: the bad option must give 2, at once."""
    spec = lab.spec(spare_host.name)
    faults.refuse(spare_host)
    for bad in (["--lines", "abc"], ["--lines", "9:3"], ["--grep", "("], ["--symbol", "."]):
        t = time.monotonic()
        p = cli(lab_env, "inspect-source", "--host", spec.name, *bad, "--connect-timeout", "5", timeout=60)
        assert p.returncode == ExitCode.USAGE, (bad, p.returncode, p.stderr)
        assert time.monotonic() - t < 15
    p = cli(lab_env, "facts", "--host", spec.name, "--command-timeout", "abc")
    assert p.returncode == ExitCode.USAGE


def test_lost_connection_during_deploy_names_step_records_it_and_hints_unlock(
    lab, spec, lab_env, tmp_path, sglang_remote, faults
):
    slow = slow_spec(spec)
    env = inventory_env(lab_env, tmp_path, slow, healthy_timeout_s=600)
    proc, err = start_deploy(env, slow.name, tmp_path, "--command-timeout", "10")
    try:
        wait_for_text(err, "waiting for health", 300)
        faults.crash(lab.host(slow.name))  # sshd and every session killed
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert rc == ExitCode.UNREACHABLE, text
    assert "wait:" in text and f"remote-ops unlock --host {slow.name}" in text
    rec = records(env, slow.name)[-1]
    assert rec["failed_step"] == "wait" and rec["lock"] == "maybe held" and "unlock" in rec["lock_hint"]
    assert rec["error"]["exit_code"] == ExitCode.UNREACHABLE
    assert lock_info(slow) is not None, "the lock could not be released over a dead connection"
    faults.restart(lab.host(slow.name))
    p = cli(env, "unlock", "--host", slow.name)
    assert p.returncode == 0 and f"stale lock: holder PID {proc.pid} is gone" in p.stderr, p.stderr
    assert lock_info(slow) is None
    remote = connect(lab, slow.name)
    try:
        remote.run(["docker", "rm", "-f", slow.container.name], check=False)
    finally:
        remote.close()


def test_extract_start_and_stop_take_the_lock(lab, host, remote, lab_env, tmp_path):
    spec = lab.spec(host.name)
    dataset = tmp_path / "samples.jsonl"
    dataset.write_text('{"id": "s1", "input_ids": [1, 2, 3]}\n')
    token = hostlock.take(remote, spec, "deploy: held by the test")
    try:
        for args in (
            ["extract", "start", "--host", spec.name, "--dataset", str(dataset)],
            ["extract", "stop", "--host", spec.name],
        ):
            p = cli(lab_env, *args)
            assert p.returncode == ExitCode.REFUSED and "deploy: held by the test" in p.stderr, (args, p.stderr)
        assert cli(lab_env, "extract", "status", "--host", spec.name).returncode == 0  # reads never wait
    finally:
        hostlock.release(remote, spec, token)
    assert lock_info(spec) is None
