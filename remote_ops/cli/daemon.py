"""The fork server behind `remote-ops daemon start`: imports once, forks a worker per run.

`remote_ops.cli.launch` (the console script) hands a run over to it; see there for
the rules the hand-over keeps.  This side:

- `serve()` imports every command module and the libraries they load lazily
  (paramiko, fabric, pydantic and the inventory models, rich, jinja2, the
  Docker SDK), freezes those objects out of the garbage collector, and listens
  on `<runtime dir>/<fingerprint>.sock` (mode 0600 in a 0700 directory).
- Each connection from this user becomes one forked worker.  The worker takes
  the client's stdin/stdout/stderr as its fds 0-2, its argv, working directory,
  umask and environment (replacing the server's), answers `launch.ACCEPTED`,
  and runs `remote_ops.cli.main.run()`, exactly what the client would have run.
  It reads the inventory afresh and opens its own SSH connections.
- A byte from the client is a signal to raise in the worker; the client's
  socket closing (it was killed) raises SIGHUP, so a run never outlives its
  operator unnoticed.  The worker's exit code goes back as 4 bytes.
- The worker ends as the interpreter would (non-daemon threads joined, atexit
  handlers run), then reports; only then does the client exit.
- The server has no threads when it forks (a fork copies only the calling
  thread), reaps its workers, and exits after `idle_timeout` seconds without a
  run, on SIGTERM/SIGINT, or when its socket file is gone or replaced.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from . import launch

#: seconds without a run after which a server exits
DEFAULT_IDLE_TIMEOUT_S = 1800.0
#: what a worker gets to read the client's request once connected
REQUEST_TIMEOUT_S = 5.0
#: libraries the commands import inside functions (the walk below finds the module-level ones)
PRELOAD = (
    "paramiko",
    "fabric",
    "invoke",
    "yaml",
    "jinja2",
    "docker",
    "rich.console",
    "rich.table",
    "rich.progress",
    "rich.live",
    "rich.text",
    "rich.markup",
)
#: remote_ops subpackages whose modules the CLI imports (not the dumper or on-host scripts)
PACKAGES = ("cli.commands", "workflows", "core", "remote", "engine", "hostlab")


def pid_file(fp: str) -> Path:
    return Path(launch.runtime_dir()) / f"{fp}.json"


def serve(fp: str, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S) -> None:
    """Import, listen, fork a worker per run until idle, stopped, or the socket is gone."""
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    failed = preload()
    print(f"serving {fp}: pid {os.getpid()}, {len(sys.modules)} modules; not preloaded: {failed or 'none'}", flush=True)
    if threading.active_count() != 1:  # a fork copies only the forking thread: nothing may run beside it
        raise SystemExit(f"remote-ops daemon: {threading.active_count()} threads after the imports; refusing to fork")
    gc.collect()
    gc.freeze()
    listener, inode = _listen(launch.socket_path(fp))
    _write_pid_file(fp, idle_timeout)
    stop = {"now": False}
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.update(now=True))
    try:
        _loop(listener, inode, launch.socket_path(fp), idle_timeout, stop)
    finally:
        _cleanup(listener, inode, fp)


def preload() -> list[str]:
    """Import what runs will need; the names that failed (an optional dependency missing)."""
    import importlib
    import pkgutil

    failed = []
    names = ["remote_ops.cli.main", *PRELOAD]
    for package in PACKAGES:
        module = importlib.import_module(f"remote_ops.{package}")
        names += [m.name for m in pkgutil.walk_packages(module.__path__, prefix=f"remote_ops.{package}.")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional dependency; the worker imports it itself
            failed.append(name)
    return failed


def _listen(path: str) -> tuple[socket.socket, int]:
    """Bind at a temporary name, then rename into place (a client never sees a half-made socket)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if not launch.private_dir_ok(directory):
        raise SystemExit(f"remote-ops daemon: {directory} must be a directory of this user with mode 0700")
    temporary = f"{path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(temporary)
    os.chmod(temporary, 0o600)
    listener.listen(64)
    os.replace(temporary, path)
    return listener, os.stat(path).st_ino


def _write_pid_file(fp: str, idle_timeout: float) -> None:
    record = {
        "pid": os.getpid(),
        "fingerprint": fp,
        "started_at": time.time(),
        "idle_timeout_s": idle_timeout,
        "python": sys.executable,
        "package": os.path.dirname(os.path.abspath(launch.__file__)),
    }
    path = pid_file(fp)
    path.write_text(json.dumps(record) + "\n")


def _loop(listener: socket.socket, inode: int, path: str, idle_timeout: float, stop: dict) -> None:
    """Accept runs; once a second reap workers and check the socket file is still ours."""
    deadline = time.monotonic() + idle_timeout
    while not stop["now"] and time.monotonic() < deadline:
        try:
            ready, _, _ = select.select([listener], [], [], 1.0)
        except InterruptedError:
            ready = []
        _reap()
        if ready:
            _accept(listener)
            deadline = time.monotonic() + idle_timeout
        elif not _still_ours(path, inode):
            return


def _still_ours(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _accept(listener: socket.socket) -> None:
    """Read one request (bounded by REQUEST_TIMEOUT_S) and fork its worker."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        if not _peer_is_us(conn):
            return
        conn.settimeout(REQUEST_TIMEOUT_S)
        request, fds = _read_request(conn)
        if request is None or len(fds) != 3:
            return
        pid = os.fork()
        if pid == 0:
            _worker(listener, conn, request, fds)  # never returns
        _log_run(pid, request["argv"])
    except OSError:
        return
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()


def _log_run(pid: int, argv: list[str]) -> None:
    """One line per worker in the server's log: its PID and the command word (no arguments)."""
    command = next((a for a in argv if not a.startswith("-")), "")
    print(f"run worker={pid} command={command} at={time.strftime('%Y-%m-%dT%H:%M:%S')}", flush=True)


def _peer_is_us(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


def _read_request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    import marshal

    header, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    header += launch.recv_exact(conn, 4 - len(header))
    if len(header) < 4:
        return None, fds
    (size,) = struct.unpack("!I", header)
    payload = launch.recv_exact(conn, size)
    return (marshal.loads(payload) if len(payload) == size else None), fds


def _worker(listener: socket.socket, conn: socket.socket, request: dict, fds: list[int]) -> None:
    """The forked run: become the client's process (fds, cwd, env), run the CLI, report, exit."""
    code = 1
    try:
        listener.close()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        _become_client(request, fds)
        conn.settimeout(None)
        conn.sendall(launch.ACCEPTED)
        threading.Thread(target=_watch_client, args=(conn,), daemon=True).start()
        code = _run_cli(request["argv"])
    except BaseException:  # noqa: BLE001 - the worker must always report and exit
        import traceback

        traceback.print_exc()
    finally:
        _finish(conn, code)


def _become_client(request: dict, fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    fds.clear()
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    _rebind_stdio(request["encoding"], request["errors"])
    sys.argv = ["remote-ops", *request["argv"]]


def _rebind_stdio(encodings: list, errors: list) -> None:
    """New sys.stdin/stdout/stderr on fds 0-2, buffered as Python would for the client's streams."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        mode = "r" if fd == 0 else "w"
        line = fd == 2 or (fd == 1 and os.isatty(1))
        stream = open(  # noqa: SIM115 - lives as sys.<name> for the whole run
            fd, mode, buffering=1 if line else -1, encoding=encodings[fd], errors=errors[fd], closefd=False
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _watch_client(conn: socket.socket) -> None:
    """A byte from the client is a signal for this worker; the client gone is SIGHUP."""
    while True:
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if not data:
            os.kill(os.getpid(), signal.SIGHUP)
            return
        if data[0] in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(os.getpid(), data[0])


def _run_cli(argv: list[str]) -> int:
    from .main import run

    try:
        run()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def _finish(conn: socket.socket, code: int) -> None:
    """End as the interpreter would (wait for non-daemon threads, run atexit handlers: temporary
    directories, executors, logging), flush, send the exit code, and leave.  The client's EOF
    is ignored from here on."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001,S110 - a closed pipe: nothing more to say
            pass
    try:
        conn.sendall(struct.pack("!i", code))
    except OSError:
        pass
    os._exit(code & 0xFF)


def _cleanup(listener: socket.socket, inode: int, fp: str) -> None:
    listener.close()
    path = launch.socket_path(fp)
    if _still_ours(path, inode):
        os.unlink(path)
    try:
        record = json.loads(pid_file(fp).read_text())
        if record.get("pid") == os.getpid():
            pid_file(fp).unlink()
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> None:
    """`python -c 'from remote_ops.cli.daemon import main; main()' FINGERPRINT IDLE_S` (what `daemon start` runs)."""
    args = sys.argv[1:] if argv is None else argv
    fp = launch.fingerprint()
    if args and args[0] != fp:
        raise SystemExit(f"remote-ops daemon: this process sees code {fp}, the caller expected {args[0]}")
    serve(fp, float(args[1]) if len(args) > 1 else DEFAULT_IDLE_TIMEOUT_S)
