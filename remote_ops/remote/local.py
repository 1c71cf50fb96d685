"""`LocalRemote`: the `Remote` run protocol with /bin/sh on this machine (`--local-file`).

The same scripts run locally and over SSH, so the local path exercises the
exact write/lock/backup logic the remote path uses (`remote_ops.workflows.patching`).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from .base import BaseRemote, LineSink


class LocalRemote(BaseRemote):
    """Commands run by /bin/sh here; files are plain local copies."""

    name = "local"
    target = None

    def __init__(self, timeout: float = 120.0) -> None:
        super().__init__()
        self.timeout = timeout

    def _execute(
        self, line: str, input: bytes | None, deadline_s: float, on_line: LineSink | None
    ) -> tuple[int | None, bytes, bytes]:
        self._count()
        with subprocess.Popen(
            ["/bin/sh", "-c", line],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: the deadline ends all of it
        ) as proc:
            try:
                out, err = proc.communicate(input or b"", timeout=deadline_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return None, b"", b""
        return proc.returncode, out, err

    def put(self, local: str | Path | bytes, remote_path: str, *, mode: int | None = None) -> None:
        data = local if isinstance(local, bytes) else Path(local).read_bytes()
        Path(remote_path).write_bytes(data)
        if mode is not None:
            Path(remote_path).chmod(mode)

    def get(self, remote_path: str, local: str | Path) -> None:
        Path(local).write_bytes(Path(remote_path).read_bytes())


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """KILL the command's whole process group (its pipeline, its children), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
