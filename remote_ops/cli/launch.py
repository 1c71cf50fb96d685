"""The `remote-ops` entry point: hand the run to a warm fork server if one serves this code.

A CLI run spends most of its start-up importing (paramiko, invoke, pydantic and
the inventory models, click, rich: ~0.45 CPU-s on the 2-core lab VM), and an
operator re-running `health` pays that every time.  `remote-ops daemon start`
starts a fork server (`remote_ops.cli.daemon`) that has imported all of it once.
This module is all a run imports before it knows whether one is there (stdlib
only): it connects to the server's Unix socket, passes its own stdin, stdout
and stderr (SCM_RIGHTS), argv, working directory, umask and environment, and
relays the worker's exit code.  The worker is a fork of the server, so it
writes straight to this process's terminal or pipe, reads the inventory afresh
and opens its own SSH connections; nothing of one run is kept for the next.

Rules that keep it transparent:
- A server is found by a fingerprint of the code it would run (Python
  executable and version, sys.path and its directories' mtimes, every
  remote_ops source file's mtime and size): a server of other code is not
  used, so an edit or an upgrade never runs stale code.
- The socket lives in a directory only this user can enter (checked, not
  assumed), and each side checks the other's uid (SO_PEERCRED).
- If anything fails before the worker accepts the run (no server, a refused
  connect, a closed stdin), the run happens in this process as usual.
- SIGINT, SIGTERM and SIGHUP received here are passed on to the worker (it
  ends the run as `Interrupted`, as in-process); if this process disappears,
  the worker gets SIGHUP.
- `REMOTE_OPS_DAEMON=0` (or `off`) never uses a server; `remote-ops daemon ...`
  itself always runs in-process.
"""

from __future__ import annotations

import os
import sys

#: "0"/"off"/"no": never hand a run to a fork server
DAEMON_ENV = "REMOTE_OPS_DAEMON"
#: the worker's answer once it has taken the run over
ACCEPTED = b"A"


def run() -> None:
    """The console script: a warm fork server's worker runs it if there is one, else this process."""
    argv = sys.argv[1:]
    if _may_hand_over(argv):
        code = hand_over(argv)
        if code is not None:
            sys.exit(code)
    from .main import run as run_here

    run_here()


def _may_hand_over(argv: list[str]) -> bool:
    """Not when disabled, and never for `daemon` commands (they manage the server itself)."""
    if os.environ.get(DAEMON_ENV, "").lower() in ("0", "off", "no", "false"):
        return False
    return "daemon" not in argv[:1]


def runtime_dir() -> str:
    """Where sockets and pid files live: $XDG_RUNTIME_DIR/remote-ops, else /tmp/remote-ops-UID."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(base, "remote-ops") if base else f"/tmp/remote-ops-{os.getuid()}"


def private_dir_ok(path: str) -> bool:
    """True if `path` is a real directory of this user that nobody else may enter (mode 0700)."""
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def fingerprint() -> str:
    """What code a run would execute, as 20 hex digits (the server's socket name).

    Python (executable, version), sys.path without its first entry (the script's
    own directory, which differs between a console script and the server) and
    each entry's mtime (a pip install or upgrade changes it), and every .py file
    of this package with its mtime and size."""
    try:
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - CPython always has it
        from hashlib import blake2b
    digest = blake2b(digest_size=10)
    digest.update(repr((sys.executable, sys.version, sys.path[1:])).encode())
    for entry in sys.path[1:]:
        try:
            digest.update(f"{entry}\0{os.stat(entry).st_mtime_ns}\n".encode())
        except OSError:
            continue
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # remote_ops/
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            st = os.stat(os.path.join(root, name))
            digest.update(f"{root}/{name}\0{st.st_mtime_ns}\0{st.st_size}\n".encode())
    return digest.hexdigest()


def socket_path(fp: str | None = None) -> str:
    return os.path.join(runtime_dir(), f"{fp or fingerprint()}.sock")


def hand_over(argv: list[str]) -> int | None:
    """Run `argv` in a fork server's worker; its exit code, or None if no worker took it."""
    import socket

    if not private_dir_ok(runtime_dir()):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(socket_path())
        if not _same_user(sock):
            return None
        _send_request(sock, argv)
        if recv_exact(sock, 1) != ACCEPTED:
            return None
        sock.settimeout(None)
        return _relay(sock)
    except OSError:
        return None
    finally:
        sock.close()


def _same_user(sock) -> bool:
    """The server runs as this user (SO_PEERCRED: pid, uid, gid as three ints)."""
    import socket
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


def _send_request(sock, argv: list[str]) -> None:
    """Length, then the request (marshal: the server is this same Python), with fds 0, 1, 2."""
    import marshal
    import socket
    import struct

    umask = os.umask(0o022)
    os.umask(umask)
    request = {
        "argv": argv,
        "cwd": os.getcwd(),
        "umask": umask,
        "env": dict(os.environ),
        "encoding": [getattr(s, "encoding", None) for s in (sys.stdin, sys.stdout, sys.stderr)],
        "errors": [getattr(s, "errors", None) for s in (sys.stdin, sys.stdout, sys.stderr)],
    }
    payload = marshal.dumps(request)
    socket.send_fds(sock, [struct.pack("!I", len(payload))], [0, 1, 2])
    sock.sendall(payload)


def _relay(sock) -> int:
    """Pass SIGINT/SIGTERM/SIGHUP on to the worker (one byte each); wait for its exit code."""
    import signal
    import struct

    def forward(signum, _frame) -> None:
        try:
            sock.send(bytes([signum]))
        except OSError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    reply = recv_exact(sock, 4)
    if len(reply) < 4:
        sys.stderr.write(
            "remote-ops: the daemon's worker ended without an exit code (see `remote-ops daemon status`)\n"
        )
        return 1
    return struct.unpack("!i", reply)[0]


def recv_exact(sock, size: int) -> bytes:
    """Up to `size` bytes; fewer only when the peer closed."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data
