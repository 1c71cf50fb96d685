"""The warm fork server (`remote-ops daemon`) and the hand-over (`remote_ops.cli.launch`).

Every test runs the real console entry (`python -m remote_ops`, this checkout)
against a server started by `remote-ops daemon start` in a private runtime
directory of its own, and stops it by PID at the end.  What is checked:
a run handed over gives the same exit code, stdout and stderr as in-process;
signals reach the worker; a client that disappears hangs its worker up; the
server is skipped when disabled or when its directory is not private; idle
servers exit by themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import run_cli_process

from remote_ops.cli import launch

_cli = run_cli_process


@pytest.fixture
def runtime(tmp_path):
    """A short private runtime dir (Unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rod-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_env(runtime, tmp_path) -> dict[str, str]:
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yaml").write_text("hosts:\n  node-a:\n    address: 127.0.0.9\n    user: ops\n")
    return {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime),
        "REMOTE_OPS_DAEMON": "1",
        "REMOTE_OPS_INVENTORY": str(inventory),
        "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"),
    }


@pytest.fixture
def server(daemon_env, runtime):
    """A running server for this checkout's code; stopped (by PID) afterwards."""
    started = _cli(daemon_env, "daemon", "start", "--json")
    assert started.returncode == 0, started.stderr
    record = json.loads(started.stdout)
    yield record
    _stop_pid(record["pid"])


def _stop_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)


def _runs(runtime: Path, record: dict) -> list[str]:
    """The server log's "run" lines (one per worker forked)."""
    log = runtime / "remote-ops" / f"{record['fingerprint']}.log"
    return [line for line in log.read_text().splitlines() if line.startswith("run ")]


def test_a_handed_over_run_matches_the_in_process_run(server, daemon_env, runtime):
    served = _cli(daemon_env, "hosts", "--json")
    here = _cli({**daemon_env, "REMOTE_OPS_DAEMON": "0"}, "hosts", "--json")
    assert served.returncode == here.returncode == 0
    assert json.loads(served.stdout) == json.loads(here.stdout)
    assert json.loads(served.stdout)["hosts"][0]["name"] == "node-a"
    assert len(_runs(runtime, server)) == 1  # only the first one went to the server


def test_exit_code_and_stderr_come_back(server, daemon_env, runtime):
    served = _cli(daemon_env, "render", "--host", "nosuch")
    here = _cli({**daemon_env, "REMOTE_OPS_DAEMON": "0"}, "render", "--host", "nosuch")
    assert served.returncode == here.returncode == 3
    assert served.stderr == here.stderr and "unknown host or group 'nosuch'" in served.stderr
    assert served.stdout == ""
    assert len(_runs(runtime, server)) == 1


def test_the_worker_gets_the_clients_cwd_umask_and_environment(server, daemon_env, tmp_path):
    here = tmp_path / "elsewhere"
    (here / "inventory").mkdir(parents=True)
    (here / "inventory" / "h.yaml").write_text("hosts:\n  node-cwd:\n    address: 127.0.0.10\n")
    env = {k: v for k, v in daemon_env.items() if k != "REMOTE_OPS_INVENTORY"}
    p = _cli(env, "hosts", "--json", cwd=here)
    assert p.returncode == 0, p.stderr
    assert [h["name"] for h in json.loads(p.stdout)["hosts"]] == ["node-cwd"]


def test_disabled_or_not_private_means_in_process(server, daemon_env, runtime):
    assert _cli({**daemon_env, "REMOTE_OPS_DAEMON": "off"}, "hosts").returncode == 0
    os.chmod(runtime / "remote-ops", 0o755)
    try:
        assert _cli(daemon_env, "hosts").returncode == 0
        refused = _cli(daemon_env, "daemon", "start")
        assert refused.returncode == 9 and "not a private directory" in refused.stderr
    finally:
        os.chmod(runtime / "remote-ops", 0o700)
    assert _runs(runtime, server) == []


def test_start_is_a_no_op_when_running_and_status_says_so(server, daemon_env):
    again = _cli(daemon_env, "daemon", "start", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["started"] is False
    status = json.loads(_cli(daemon_env, "daemon", "status", "--json").stdout)
    assert [(s["pid"], s["alive"], s["current"]) for s in status["servers"]] == [(server["pid"], True, True)]
    assert status["fingerprint"] == server["fingerprint"]


def test_stop_ends_it_and_runs_go_back_in_process(server, daemon_env, runtime):
    stopped = _cli(daemon_env, "daemon", "stop", "--json")
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["stopped"] == [server["pid"]]
    assert (
        not Path(f"/proc/{server['pid']}/cmdline").exists()
        or b"remote_ops" not in Path(f"/proc/{server['pid']}/cmdline").read_bytes()
    )
    assert not list((runtime / "remote-ops").glob("*.sock"))
    assert _cli(daemon_env, "hosts").returncode == 0


def test_an_idle_server_exits_by_itself(daemon_env, runtime):
    started = _cli(daemon_env, "daemon", "start", "--idle-timeout", "1", "--json")
    record = json.loads(started.stdout)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (runtime / "remote-ops" / f"{record['fingerprint']}.sock").exists():
            time.sleep(0.1)
        assert not (runtime / "remote-ops" / f"{record['fingerprint']}.sock").exists()
        assert not (runtime / "remote-ops" / f"{record['fingerprint']}.json").exists()
    finally:
        _stop_pid(record["pid"])


def test_a_removed_socket_stops_the_server(server, runtime):
    (runtime / "remote-ops" / f"{server['fingerprint']}.sock").unlink()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{server['pid']}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{server['pid']}").exists()


def test_fingerprint_follows_the_code_and_the_python(tmp_path):
    before = launch.fingerprint()
    assert before == launch.fingerprint() and len(before) == 20
    original = sys.path[:]
    try:
        sys.path.append(str(tmp_path))  # another import path: other code could be found
        assert launch.fingerprint() != before
    finally:
        sys.path[:] = original
    assert launch.fingerprint() == before


def _watch(env: dict, host: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "remote_ops", "health", "--host", host, "--watch", "0.5"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_for_run(runtime: Path, record: dict, count: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(_runs(runtime, record)) < count:
        time.sleep(0.05)
    time.sleep(1.0)  # the worker is past start-up and in its watch loop


@pytest.fixture
def lab_server(lab, host, lab_env, runtime):
    """(env, server record) for a server in front of the lab's hosts; stopped by PID afterwards."""
    env = {**lab_env, "XDG_RUNTIME_DIR": str(runtime), "REMOTE_OPS_DAEMON": "1"}
    record = json.loads(_cli(env, "daemon", "start", "--json").stdout)
    yield env, record
    _stop_pid(record["pid"])


def test_ctrl_c_reaches_the_worker(lab_server, host, runtime):
    env, record = lab_server
    watch = _watch(env, host.name)
    _wait_for_run(runtime, record, 1)
    watch.send_signal(signal.SIGINT)
    _, err = watch.communicate(timeout=30)
    assert watch.returncode == 130, err
    assert "interrupted by SIGINT" in err


def test_a_vanished_client_hangs_up_its_worker(lab_server, host, runtime):
    env, record = lab_server
    watch = _watch(env, host.name)
    _wait_for_run(runtime, record, 1)
    worker = int(_runs(runtime, record)[-1].split()[1].split("=")[1])
    watch.kill()
    watch.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and Path(f"/proc/{worker}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists()


def test_the_hand_over_imports_only_the_standard_library(runtime):
    """What every run pays before it knows whether a server is there: no click, no SSH."""
    probe = (
        "import sys; from remote_ops.cli import launch; "
        "assert launch.hand_over(['hosts']) is None; print(' '.join(sorted(sys.modules)))"
    )
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    p = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    ours = sorted(m for m in p.stdout.split() if m.startswith("remote_ops"))
    assert ours == ["remote_ops", "remote_ops.cli", "remote_ops.cli.launch"]
    assert not {"click", "paramiko", "fabric", "pydantic", "rich", "yaml"} & set(p.stdout.split())


def test_a_worker_ends_as_the_interpreter_would(tmp_path):
    """atexit handlers (temporary directories, executors) and non-daemon threads finish before the
    exit code goes back, as they would in-process."""
    probe = f"""
import atexit, os, socket, struct, threading, time
from remote_ops.cli import daemon
ours, theirs = socket.socketpair()
pid = os.fork()
if pid == 0:
    ours.close()
    atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), open({str(tmp_path / "thread")!r}, "w").write("ran"))).start()
    daemon._finish(theirs, 7)
theirs.close()
print(struct.unpack("!i", ours.recv(4))[0], os.waitpid(pid, 0)[1] >> 8)
"""
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["7", "7"]
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "ran"


def test_the_server_starts_in_the_folder_holding_this_package():
    """`-c` puts the server's working directory first on sys.path: it must hold remote_ops/ (the
    code this process runs), not be remote_ops/ itself (whose modules would shadow top-level ones)."""
    from remote_ops.cli.commands.daemon import source_root

    assert (source_root() / "remote_ops" / "cli" / "launch.py").resolve() == Path(launch.__file__).resolve()
