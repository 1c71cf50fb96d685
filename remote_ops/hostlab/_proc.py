"""Process and socket helpers for the host lab: spawn, find, stop by PID.

Every daemon the lab starts runs in its own process session, its PID is
recorded, and it is stopped by PID together with its descendants (found by
walking /proc by PPID).  Every wait has a deadline.  Nothing here matches
processes by name.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

from ..errors import RemoteOpsError


class LabError(RemoteOpsError):
    """A lab host or daemon could not be started, checked or stopped."""

    kind = "lab"


class LabDaemon:
    """What a lab daemon (`SshdHost`, `Dockerd`) shares: its files under `dir`, its log there
    (`LOG`), and its process once started (`proc`)."""

    LOG: ClassVar[str]
    dir: Path
    proc: subprocess.Popen | None

    @property
    def log_file(self) -> Path:
        return self.dir / self.LOG

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def spawn(
    argv: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None, subreaper: bool = False
) -> subprocess.Popen:
    """Start a daemon in its own session, output appended to `log`, stdin closed.

    `subreaper=True` makes the daemon a child subreaper (kept across exec), so
    processes orphaned below it (a remote `sleep` whose SSH session timed out,
    a `nohup … &`) are reparented to it rather than to init: they stay in its
    tree and die with it at teardown.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_become_subreaper if subreaper else None,
        )


def _become_subreaper() -> None:
    """prctl(PR_SET_CHILD_SUBREAPER, 1) in the child before exec (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def run(
    argv: list[str],
    *,
    timeout: float = 60.0,
    check: bool = True,
    input: bytes | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run a short helper command with a deadline; raise LabError on failure."""
    try:
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            timeout=timeout,
            env=env,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise LabError(f"{argv[0]} timed out after {timeout:g}s: {' '.join(argv)}") from None
    except FileNotFoundError:
        raise LabError(f"{argv[0]} is not installed") from None
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).decode("utf-8", "replace").strip()
        raise LabError(f"{' '.join(argv)} exited {proc.returncode}: {err[-800:]}")
    return proc


def wait_for(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.02,
    alive: Callable[[], bool] | None = None,
) -> None:
    """Poll `predicate` until true; raise LabError at the deadline or if `alive()` turns false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if alive is not None and not alive():
            raise LabError(f"{what}: the process exited while waiting")
        time.sleep(interval)
    raise LabError(f"{what}: not ready after {timeout:g}s")


def port_open(address: str, port: int, timeout: float = 0.5) -> bool:
    """True if a TCP connect to address:port succeeds now."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def can_bind(address: str, port: int) -> bool:
    """True if address:port is free to listen on (probed with SO_REUSEADDR, as sshd binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
            s.listen(1)
            return True
        except OSError:
            return False


#: Ports handed out by `free_port` to live processes: one file per port holding the taker's PID.
#: A port is free when nothing listens on it *now*; a lab takes it minutes later (a container's
#: published port), and another process (a pytest-xdist worker, a concurrent run) may be handed
#: the same one in between.  The file keeps it for the taker's lifetime.
PORT_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "remote-ops-ports"


def _reserve(port: int) -> bool:
    """Claim `port` for this process (True), unless a live process holds it already."""
    PORT_DIR.mkdir(parents=True, exist_ok=True)
    path = PORT_DIR / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                holder = int(path.read_text() or "0")
            except (OSError, ValueError):
                holder = 0
            if holder == os.getpid():
                return False  # handed to this process before: still its own, not a second time
            if holder and alive(holder):
                return False
            path.unlink(missing_ok=True)  # its taker is gone
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(str(os.getpid()))
        return True
    return False


def free_port(address: str = "127.0.0.1", tries: int = 50) -> int:
    """A TCP port free on `address` now (the kernel's choice) that no other live process of
    this machine was handed by this function (`PORT_DIR`), nor this one before."""
    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        if _reserve(port):
            return port
    raise LabError(f"no free port on {address} after {tries} tries (reservations in {PORT_DIR})")


def children_map() -> dict[int, list[int]]:
    """PPID -> child PIDs for every process visible in /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ppid = _ppid(int(entry))
        if ppid is not None:
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """All descendants of `pid` (children first-level first), found by PPID."""
    tree, out, todo = children_map(), [], [pid]
    while todo:
        kids = tree.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except OSError as exc:  # pragma: no cover - EPERM would be a lab bug
            if exc.errno != errno.ESRCH:
                raise


def kill_tree(
    pid: int, *, term_timeout: float = 0.0, timeout: float = 10.0, proc: subprocess.Popen | None = None
) -> None:
    """Stop `pid` and every descendant.

    The tree is frozen first (SIGSTOP until no new process appears) so no child
    can escape by being reparented while we kill; then SIGTERM (when
    `term_timeout` > 0, to let the daemon shut down cleanly) and SIGKILL.
    """
    if term_timeout > 0 and alive(pid):
        os.kill(pid, signal.SIGTERM)
        _wait_gone([pid], term_timeout, proc)
    tree = _freeze(pid)
    signal_all(tree, signal.SIGKILL)
    signal_all(tree, signal.SIGCONT)
    if proc is not None:
        _reap(proc, timeout)
    _wait_gone(tree, timeout, None)


def _freeze(pid: int, rounds: int = 20) -> list[int]:
    """SIGSTOP `pid` and its descendants until the set stops growing; return it."""
    seen: list[int] = []
    for _ in range(rounds):
        tree = [pid] + descendants(pid) if alive(pid) else descendants(pid)
        new = [p for p in tree if p not in seen]
        if not new:
            break
        signal_all(new, signal.SIGSTOP)
        seen += new
    return seen


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LabError(f"process {proc.pid} did not exit within {timeout:g}s") from None


def _wait_gone(pids: list[int], timeout: float, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        if not any(alive(p) for p in pids):
            return
        time.sleep(0.02)


def same_root(pid: int) -> bool:
    """True if `pid` sees the same filesystem root as this process.

    A lab path such as `~/.local/state/remote-ops/sandbox/lab` is only unique
    within one root: a chroot or container on the same machine (sharing its
    PID namespace) can run a lab at the very same path.  Its processes are
    not ours to find or stop."""
    try:
        theirs, mine = os.stat(f"/proc/{pid}/root"), os.stat("/")
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino)


def pids_with_arg(fragment: str) -> list[int]:
    """PIDs under our own root whose command line contains `fragment` (a unique lab path, never a name).

    Used only to find containerd shims a killed dockerd left behind: their
    command line names the lab's own socket path, which no other process
    with the same root has (see `same_root`).
    """
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if fragment.encode() in cmdline and same_root(int(entry)):
                found.append(int(entry))
    return found
