"""`remote-ops daemon start|stop|status`: the warm fork server that makes runs start at once.

See `remote_ops.cli.launch` (the hand-over, and the rules that keep it transparent)
and `remote_ops.cli.daemon` (the server).  These commands always run in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from ...errors import Refused, RemoteOpsError, tail
from .. import launch
from ..console import Console

#: seconds `start` waits for the server to import and listen; `stop` for it to exit
START_DEADLINE_S = 30.0
STOP_DEADLINE_S = 5.0


class DaemonFailed(RemoteOpsError):
    """The fork server could not be started or stopped (its log tail in `details`)."""

    kind = "daemon"


def _console(as_json: bool) -> Console:
    return Console(json_mode=as_json)


@click.group("daemon")
def daemon_cmd() -> None:
    """A warm fork server: runs start without re-importing (opt-in; `REMOTE_OPS_DAEMON=0` bypasses it).

    \b
    remote-ops daemon start      # once per login (exits after --idle-timeout)
    remote-ops health --host gpu-node   # now handed to a worker forked from it
    remote-ops daemon status
    remote-ops daemon stop
    """


@daemon_cmd.command("start")
@click.option(
    "--idle-timeout",
    type=click.FloatRange(min=1),
    default=1800.0,
    show_default=True,
    help="seconds without a run after which the server exits",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def start_cmd(idle_timeout: float, as_json: bool) -> None:
    """Start the server for the code installed now (a no-op if one is running)."""
    console = _console(as_json)
    _runtime_dir()
    fp = launch.fingerprint()
    running = _record(fp)
    if running and _alive(running["pid"]) and _answers(fp):
        console.status("ok", f"already running: pid {running['pid']} ({launch.socket_path(fp)})")
        console.emit({"started": False, **running})
        return
    record = _spawn(fp, idle_timeout)
    console.status("ok", f"started: pid {record['pid']}, idle timeout {idle_timeout:g} s ({launch.socket_path(fp)})")
    console.emit({"started": True, **record})


@daemon_cmd.command("stop")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def stop_cmd(as_json: bool) -> None:
    """Stop every server of this user (the workers of runs in progress finish their runs)."""
    console = _console(as_json)
    stopped = [_stop(record) for record in _records()]
    for record in stopped:
        console.status("ok", f"stopped pid {record['pid']}")
    if not stopped:
        console.say("no server running")
    console.emit({"stopped": [r["pid"] for r in stopped]})


@daemon_cmd.command("status")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def status_cmd(as_json: bool) -> None:
    """List the servers of this user and whether one serves the code installed now."""
    console = _console(as_json)
    current = launch.fingerprint()
    rows = [_status_row(record, current) for record in _records()]
    console.table(
        ["pid", "alive", "serves this code", "age", "idle timeout", "python"],
        [
            [r["pid"], r["alive"], r["current"], f"{r['age_s']:.0f} s", f"{r['idle_timeout_s']:g} s", r["python"]]
            for r in rows
        ],
    )
    if not rows:
        console.say(f"no server running ({launch.runtime_dir()})")
    console.emit({"runtime_dir": launch.runtime_dir(), "fingerprint": current, "servers": rows})


def _status_row(record: dict, current: str) -> dict:
    return {
        **record,
        "alive": _alive(record["pid"]),
        "current": record.get("fingerprint") == current,
        "age_s": time.time() - record.get("started_at", time.time()),
    }


def _runtime_dir() -> Path:
    """The private directory, made if missing; refused if someone else could enter it."""
    path = Path(launch.runtime_dir())
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not launch.private_dir_ok(str(path)):
        raise Refused(
            f"{path} is not a private directory of this user (mode 0700, owned by uid {os.getuid()})",
            hint="remove it, or set XDG_RUNTIME_DIR to a directory of yours",
        )
    return path


def _records() -> list[dict]:
    directory = Path(launch.runtime_dir())
    if not launch.private_dir_ok(str(directory)):
        return []
    return [r for r in (_read(p) for p in sorted(directory.glob("*.json"))) if r]


def _record(fp: str) -> dict | None:
    return _read(Path(launch.runtime_dir()) / f"{fp}.json")


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def source_root() -> Path:
    """The folder holding this very `remote_ops` package: the server's working directory, which
    `-c` puts first on sys.path, so the server imports the code this process runs (a source
    checkout run with `python -m`, too)."""
    return Path(launch.__file__).resolve().parents[2]  # remote_ops/cli/launch.py -> the folder


def _spawn(fp: str, idle_timeout: float) -> dict:
    """Start the server in its own session; wait (bounded) until it answers."""
    directory = _runtime_dir()
    log = directory / f"{fp}.log"
    with open(log, "ab") as sink:
        proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-c", "from remote_ops.cli.daemon import main; main()", fp, str(idle_timeout)],
            cwd=source_root(),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _answers(fp) and (record := _record(fp)) and record["pid"] == proc.pid:
            return record
        time.sleep(0.05)
    if proc.poll() is None:
        proc.terminate()
    raise DaemonFailed(
        f"the server did not start within {START_DEADLINE_S:g} s",
        hint=f"its log: {log}",
        details={"log_tail": tail(log.read_text(errors="replace"), 20)},
    )


def _answers(fp: str) -> bool:
    """Something accepts connections on the server's socket."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(launch.socket_path(fp))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    """`pid` runs and is a remote-ops fork server (not a recycled PID of something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"remote_ops.cli.daemon" in cmdline


def _stop(record: dict) -> dict:
    """SIGTERM, then wait (bounded) for it to exit; a stale record is just removed."""
    pid = record["pid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_DEADLINE_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            raise DaemonFailed(f"server pid {pid} did not exit within {STOP_DEADLINE_S:g} s of SIGTERM")
    (Path(launch.runtime_dir()) / f"{record.get('fingerprint')}.json").unlink(missing_ok=True)
    return record


commands = [daemon_cmd]
