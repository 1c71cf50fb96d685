"""Incremental log pulls over a real lab host (sshd + dockerd)."""

from __future__ import annotations

import subprocess
import time

import pytest

from remote_ops.core import logparse
from remote_ops.workflows import logs


@pytest.fixture
def spec(lab, host):
    return lab.spec(host.name)


@pytest.fixture
def local(tmp_path):
    return tmp_path / "logs"


def _remote_log(host, name="extraction.log"):
    path = host.paths.logs_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path


def test_incremental_pull_after_appends_fetches_only_new_bytes(remote, spec, host, local):
    path = _remote_log(host)
    path.write_bytes(b"2026-11-30T10:00:00Z started done=0 total=4\n")
    first = logs.pull_logs(remote, spec, ("extraction", "training"), local)
    assert first[0].new_bytes == path.stat().st_size and first[1].missing
    appended = b"2026-11-30T10:00:05Z progress done=2 total=4 tokens=10 elapsed=5\n\xff binary ok\n"
    with open(path, "ab") as fh:
        fh.write(appended)
    second = logs.pull_logs(remote, spec, ("extraction",), local)
    assert second[0].new_bytes == len(appended) and second[0].reset is None
    assert (local / "extraction.log").read_bytes() == path.read_bytes()
    assert logs.pull_logs(remote, spec, ("extraction",), local)[0].new_bytes == 0


def test_rotation_and_truncation_keep_the_old_copy(remote, spec, host, local):
    path = _remote_log(host, "training.log")
    path.write_text("Train Epoch [1/2], position 0,  Acc: 0.40\n")
    logs.pull_logs(remote, spec, ("training",), local)
    path.rename(path.with_name("training.log.1"))  # logrotate: new inode
    path.write_text("Train Epoch [2/2], position 0,  Acc: 0.50\n")
    r = logs.pull_logs(remote, spec, ("training",), local)[0]
    assert r.reset == "rotated"
    assert "0.50" in (local / "training.log").read_text() and "0.40" in (local / "training.log.1").read_text()
    with open(path, "r+") as fh:  # copytruncate, regrown past the offset
        fh.truncate(0)
        fh.write("X" * 200 + "\n")
    r = logs.pull_logs(remote, spec, ("training",), local)[0]
    assert r.reset in ("truncated", "rewritten") and (local / "training.log").read_text() == "X" * 200 + "\n"


def test_interrupted_pull_resumes_without_losing_or_repeating_bytes(remote, spec, host, local, monkeypatch):
    path = _remote_log(host)
    path.write_bytes(b"".join(b"2026-11-30T10:00:00Z progress done=%d total=100000\n" % i for i in range(60000)))
    size = path.stat().st_size
    state_path = local / ".pull-state.json"
    local.mkdir(parents=True)
    saves = {"n": 0}
    real_save = logs.PullState.save

    def save_then_die(self, p):
        real_save(self, p)
        saves["n"] += 1
        if saves["n"] == 2:
            raise KeyboardInterrupt  # Ctrl-C after two chunks

    monkeypatch.setattr(logs.PullState, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        logs.pull_file(
            remote, "extraction", str(path), local, logs.PullState.load(state_path), state_path, max_bytes=1 << 20
        )
    monkeypatch.setattr(logs.PullState, "save", real_save)
    done_before = logs.PullState.load(state_path).files["extraction"].offset
    assert done_before == 2 << 20
    r = logs.pull_file(
        remote, "extraction", str(path), local, logs.PullState.load(state_path), state_path, max_bytes=1 << 20
    )
    assert r.new_bytes == size - done_before
    assert (local / "extraction.log").read_bytes() == path.read_bytes()


def test_server_log_pull_from_the_container_has_every_line_once(remote, spec, dockerd, busybox_image, local):
    name = spec.container.name
    dockerd.docker("rm", "-f", name, check=False)
    script = "i=0; while [ $i -lt 40 ]; do echo line$i; i=$((i+1)); sleep 0.05; done; sleep 30"
    dockerd.docker("run", "-d", "--pull=never", "--name", name, busybox_image, "sh", "-c", script)
    try:
        time.sleep(0.8)
        logs.pull_logs(remote, spec, ("server",), local)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and b"line39" not in dockerd.docker("logs", name).stdout:
            time.sleep(0.2)
        logs.pull_logs(remote, spec, ("server",), local)
        logs.pull_logs(remote, spec, ("server",), local)
        texts = [l.split(" ", 1)[1] for l in (local / "server.log").read_text().splitlines()]
        assert texts == [f"line{i}" for i in range(40)]
    finally:
        dockerd.docker("rm", "-f", name, check=False)


def test_follow_streams_new_lines_tagged_with_their_log(remote, spec, host):
    import threading

    path = _remote_log(host)
    path.write_text("old line\n")
    got: list[tuple[str, str]] = []

    def writer():
        time.sleep(1.0)
        with open(path, "a") as fh:
            for i in range(3):
                fh.write(f"new line {i}\n")
                fh.flush()
                time.sleep(0.1)

    t = threading.Thread(target=writer)
    t.start()
    result = remote.run(
        logs.follow_command(spec, ("extraction",), None, 5, duration=3),
        timeout=10,
        check=False,
        on_line=lambda stream, line: got.append(logparse.split_tagged(line)),
    )
    assert result.exit_status == 124 and result.duration_s < 8  # `timeout` ended it on the host
    t.join()
    assert got == [("extraction", "old line")] + [("extraction", f"new line {i}") for i in range(3)]


def test_cli_logs_follow_prefixes_each_line_with_the_host(lab_env, host):
    import sys

    path = _remote_log(host)
    path.write_text("hello from the host\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_ops",
            "logs",
            "follow",
            "--host",
            host.name,
            "--what",
            "extraction",
            "--duration",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**lab_env, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{host.name} | [extraction] hello from the host" in proc.stdout  # data: stdout (issue 13)
