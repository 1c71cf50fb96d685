"""`FabricRemote`: the `Remote` run protocol over one Fabric/paramiko connection.

Its choices, and why:

- Host keys are checked against known_hosts (the ssh_config's
  UserKnownHostsFile where given) by `hostkeys.HostKeyPolicy`, the policy
  bulk transfers use too.  Unknown keys are refused unless the policy is
  `accept-new`, which records them; changed keys are always refused.
  Fabric's default (AutoAddPolicy, no known_hosts) is replaced.
- Connect, banner and auth timeouts, a per-command deadline and keepalive are
  always set: a dead link becomes a typed error, never a hang.  A port that
  accepts TCP but never sends an SSH banner is one `Unreachable` (exit 4,
  reason `no_banner`) with a hint, and the half-open transport is closed.
- paramiko logs a failed handshake at ERROR, with a traceback, from its
  transport thread; with no handler configured, Python's last-resort handler
  would print that on stderr before remote-ops' one-line error, even under
  `-q --json`.  A NullHandler on the `paramiko` logger keeps it off stderr;
  `-vv` adds a stderr handler to that logger and shows it
  (`cli/commands/_options.py`).
- One connection serves every command of a run; TCP_NODELAY is set on it
  (Nagle + delayed ACK otherwise cost ~40 ms per command).
- Local stdin is never read.  Input for a remote command is passed as bytes.
- Commands are executed on a raw session channel of Fabric's transport, with
  select() on the channel, so output can be streamed line by line and the
  deadline is exact.
- The deadline holds on the host too: each command is sent wrapped in
  `core.shell.deadline` (coreutils `timeout -k 2`, 1 s past the local
  deadline, over the command's process group).  Closing the channel at the
  deadline ends only the local wait; sshd leaves a command with no terminal
  running (a `cat` of a FIFO was still there 15 minutes later).  `on_command`
  and errors show the command as given, not the wrapper.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from pathlib import Path
from typing import Any

from ..core import shell
from ..errors import AuthFailed, CommandFailed, CommandTimedOut, HostKeyChanged, RemoteOpsError, Unreachable
from . import _lean  # noqa: F401 - before Fabric and paramiko: invoke without unittest.mock (see _lean)
from .base import BaseRemote, LineSink
from .hostkeys import HostKeyPolicy, fingerprint
from .sshconfig import SshTarget

logging.getLogger("paramiko").addHandler(logging.NullHandler())  # see the module doc


class FabricRemote(BaseRemote):
    """`Remote` over one Fabric/paramiko connection, strict about host keys."""

    def __init__(self, target: SshTarget, *, gateway: "FabricRemote | None" = None) -> None:
        super().__init__()
        self.target = target
        self.name = target.name
        self._gateway = gateway
        self._conn: Any = None  # fabric.Connection (untyped library)
        self._sftp: Any = None  # paramiko.SFTPClient
        self._fingerprint = ""

    # -- connection ---------------------------------------------------------
    def connect(self) -> "FabricRemote":
        """Open the connection (and any ProxyJump hops); map failures to typed errors."""
        if self._conn is not None:
            return self
        if self._gateway is None and self.target.jump:
            self._gateway = _chain(self.target.jump)
        from fabric import Config, Connection

        t = self.target
        conn = Connection(
            t.hostname,
            user=t.user,
            port=t.port,
            config=Config(overrides={"load_ssh_configs": False}),
            gateway=self._gateway._fabric() if self._gateway else False,
            connect_timeout=t.timeouts.connect,
            connect_kwargs=self._connect_kwargs(),
        )
        conn.client = HostKeyPolicy.of(t).client()
        try:
            conn.open()
        except Exception as exc:  # paramiko raises a zoo; translate once, here
            error = self._translate_connect_error(exc, conn)
            _close_quietly(conn)  # a transport still waiting for a banner: stop its thread now
            raise error from None
        transport = conn.client.get_transport()
        transport.set_keepalive(t.timeouts.keepalive)
        _nodelay(transport.sock)
        self._fingerprint = fingerprint(transport.get_remote_server_key())
        self._conn = conn
        return self

    def _fabric(self) -> Any:
        self.connect()
        return self._conn

    def _connect_kwargs(self) -> dict[str, Any]:
        t = self.target
        kwargs: dict[str, Any] = {
            "banner_timeout": t.timeouts.banner,
            "auth_timeout": t.timeouts.auth,
            "channel_timeout": t.timeouts.connect,
            "allow_agent": True,
            "look_for_keys": not t.identity_files,
        }
        if t.identity_files:
            kwargs["key_filename"] = [f for f in t.identity_files if Path(f).exists()] or list(t.identity_files)
        return kwargs

    def _translate_connect_error(self, exc: Exception, conn: Any) -> RemoteOpsError:
        """Map what paramiko/socket raised while connecting to one typed error (exit 4, 5 or 6)."""
        import paramiko

        if isinstance(exc, RemoteOpsError):
            return exc
        if isinstance(exc, paramiko.BadHostKeyException):
            return self._host_key_changed(exc)
        if isinstance(exc, paramiko.AuthenticationException):
            return AuthFailed(
                f"authentication failed for {self.target.display}: {exc}",
                host=self.name,
                hint="check User and IdentityFile (inventory or ssh_config)",
            )
        if not _banner_seen(conn) and isinstance(exc, (paramiko.SSHException, EOFError)):
            return self._no_banner(exc)
        reason, text = _unreachable_reason(exc, self.target)
        return Unreachable(text, host=self.name, details={"reason": reason})

    def _no_banner(self, exc: Exception) -> Unreachable:
        """The port took the TCP connection but sent no SSH banner: within the deadline (paramiko's
        banner timeout, or the connect deadline ending the handshake: "No existing session"), or
        it closed first.  Not a host key or auth problem: the handshake never began."""
        t = self.target
        if isinstance(exc, EOFError) or isinstance(exc.__context__, (EOFError, ConnectionError)):  # EOF, reset
            what = "closed the connection before sending an SSH banner"
        else:
            what = f"sent no SSH banner within {min(t.timeouts.connect, t.timeouts.banner):g}s"
        return Unreachable(
            f"SSH handshake with {t.display} failed: the port accepts TCP connections but {what}",
            host=self.name,
            hint=f"is {t.port} the host's SSH port (`port` in the inventory, `Port` in ssh_config)? "
            "An overloaded sshd (MaxStartups) or a frozen host also sends none",
            details={"reason": "no_banner"},
        )

    def _host_key_changed(self, exc: Any) -> HostKeyChanged:
        offered, expected = fingerprint(exc.key), fingerprint(exc.expected_key)
        return HostKeyChanged(
            f"host key for {self.target.display} CHANGED: known_hosts has {expected}, server offered "
            f"{offered}; refusing (possible man-in-the-middle)",
            host=self.name,
            hint=f"if the host was reinstalled, remove its line from {self.target.known_hosts_file}",
            details={"offered": offered, "expected": expected},
        )

    @property
    def host_key_fingerprint(self) -> str:
        self.connect()
        return self._fingerprint

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._gateway is not None:
            self._gateway.close()

    def __enter__(self) -> "FabricRemote":
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands -----------------------------------------------------------
    def _execute(
        self, line: str, input: bytes | None, deadline_s: float, on_line: LineSink | None
    ) -> tuple[int | None, bytes, bytes]:
        """Run `line` on a fresh session channel, streaming lines to `on_line`, within the deadline."""
        deadline = time.monotonic() + deadline_s
        chan = self._open_channel(deadline, line, deadline_s)
        self._count()
        out, err, status = None, b"", None
        try:
            _exec_pipelined(chan, shell.deadline(line, deadline_s))
            if input:
                chan.sendall(input)
            chan.shutdown_write()
            out, err = _pump(chan, deadline, on_line)
            status = chan.recv_exit_status() if out is not None else None
        except socket.timeout:
            status = None
        finally:
            chan.close()
        if status == -1 and _connection_lost(chan):
            raise Unreachable(
                f"connection to {self.target.display} was lost while running a command",
                host=self.name,
                details={"reason": "connection_lost", "command": line},
            )
        return status, out or b"", err

    def pull(self, root: str, items: list, **kwargs: Any) -> Any:
        """Bulk pull of `items` under `root` (transfer.py: the system ssh, same target and
        host-key policy as this connection); returns the `PullReport`."""
        from . import transfer

        return transfer.pull(self.target, root, items, **kwargs)

    def open_stream(self, command: str | shell.Argv) -> Any:
        """Start `command` on a new session channel of this connection; return the live channel.

        For byte-stream protocols spoken over the command's stdin/stdout (the
        engine seam runs `docker system dial-stdio` to reach the host's Engine
        API).  Same strict transport, same host key, no new TCP connection.
        The caller owns the paramiko Channel: it reads, writes and closes it.
        Counted as one round trip (the requests it carries are not).
        """
        chan = self._open_channel()
        self._count()
        try:
            chan.exec_command(shell.cmd(command))
        except Exception as exc:  # paramiko: SSHException / EOFError when the session is refused
            chan.close()
            raise Unreachable(
                f"cannot start a stream on {self.target.display}: {exc}", host=self.name, details={"reason": "session"}
            ) from None
        return chan

    def _open_channel(self, deadline: float | None = None, line: str = "", deadline_s: float | None = None) -> Any:
        """A session channel, opened within the command's deadline (and the connect timeout).

        On a live connection whose host stops answering (frozen), that is the
        command's timeout (exit 8), not a connection failure."""
        transport = self._fabric().client.get_transport()
        if transport is None or not transport.is_active():
            raise Unreachable(
                f"connection to {self.target.display} was lost", host=self.name, details={"reason": "connection_lost"}
            )
        wait, shown = self.target.timeouts.connect, self.target.timeouts.connect
        if deadline is not None and deadline - time.monotonic() < wait:
            wait, shown = max(0.1, deadline - time.monotonic()), deadline_s or wait
        try:
            return transport.open_session(timeout=wait)
        except Exception as exc:
            if transport.is_active() and "timeout" in str(exc).lower():
                raise CommandTimedOut(
                    f"command timed out after {shown:g}s: the host did not open a session "
                    "(not answering: frozen or overloaded?)",
                    host=self.name,
                    command=line,
                    timeout=wait,
                ) from None
            raise Unreachable(
                f"cannot open a session on {self.target.display}: {exc}", host=self.name, details={"reason": "session"}
            ) from None

    # -- files --------------------------------------------------------------
    def _sftp_client(self) -> Any:
        if self._sftp is None:
            self._sftp = self._fabric().client.open_sftp()
            self._sftp.get_channel().settimeout(self.target.timeouts.command)
        return self._sftp

    def put(self, local: str | Path | bytes, remote_path: str, *, mode: int | None = None) -> None:
        """Upload a file (or bytes) to `remote_path`; the parent must exist."""
        import io

        sftp = self._sftp_client()
        self._count()
        try:
            if isinstance(local, bytes):
                sftp.putfo(io.BytesIO(local), remote_path)
            else:
                sftp.put(str(local), remote_path)
            if mode is not None:
                sftp.chmod(remote_path, mode)
        except (OSError, socket.timeout) as exc:
            raise CommandFailed(
                f"upload to {remote_path} failed: {exc}", host=self.name, command=f"sftp put {remote_path}"
            ) from None

    def get(self, remote_path: str, local: str | Path) -> None:
        """Download `remote_path` to `local` (written in place; callers rename)."""
        sftp = self._sftp_client()
        self._count()
        try:
            sftp.get(remote_path, str(local))
        except FileNotFoundError:
            from ..errors import NotFound

            raise NotFound(f"{remote_path} does not exist", host=self.name) from None
        except (OSError, socket.timeout) as exc:
            raise CommandFailed(
                f"download of {remote_path} failed: {exc}", host=self.name, command=f"sftp get {remote_path}"
            ) from None


def _unreachable_reason(exc: Exception, t: SshTarget) -> tuple[str, str]:
    """(reason code, message) for a connect failure that is not about keys or auth."""
    import paramiko

    where = t.display
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "connect_timeout", f"connect to {where} timed out after {t.timeouts.connect:g}s"
    if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
        return "refused", f"connection to {where} refused"
    if isinstance(exc, socket.gaierror):
        return "dns", f"cannot resolve {t.hostname}: {exc}"
    if isinstance(exc, OSError):
        return "os_error", f"cannot reach {where}: {exc}"
    if isinstance(exc, (paramiko.SSHException, EOFError)):
        return "handshake", f"SSH handshake with {where} failed: {exc or type(exc).__name__}"
    return "other", f"cannot connect to {where}: {type(exc).__name__}: {exc}"


def _banner_seen(conn: Any) -> bool:
    """Did the server send its SSH version banner before the connect failed?"""
    transport = conn.client.get_transport() if conn.client is not None else None
    return bool(transport is not None and transport.remote_version)


def _close_quietly(conn: Any) -> None:
    """Close a connection whose open failed (its transport thread may still be reading)."""
    try:
        conn.client.close()
    except Exception:  # closing what never opened: nothing to report
        pass


def _chain(hops: tuple[SshTarget, ...]) -> FabricRemote | None:
    """ProxyJump hops, first hop first, each one strict about its own host key."""
    gateway: FabricRemote | None = None
    for hop in hops:
        gateway = FabricRemote(hop, gateway=gateway)
    return gateway


def _pump(chan: Any, deadline: float, on_line: LineSink | None) -> tuple[bytes | None, bytes]:
    """Read stdout/stderr until EOF and exit status, or return (None, …) at the deadline."""
    out, err = bytearray(), bytearray()
    pending = {"stdout": b"", "stderr": b""}
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, bytes(err)
        select.select([chan], [], [], min(remaining, 1.0))
        while chan.recv_ready():
            _take("stdout", chan.recv(65536), out, pending, on_line)
        while chan.recv_stderr_ready():
            _take("stderr", chan.recv_stderr(65536), err, pending, on_line)
        drained = not chan.recv_ready() and not chan.recv_stderr_ready()
        if drained and chan.exit_status_ready() and (chan.eof_received or chan.closed):
            break
    for stream, rest in pending.items():
        if rest and on_line:
            on_line(stream, rest.decode("utf-8", "replace"))
    return bytes(out), bytes(err)


def _exec_pipelined(chan: Any, line: str) -> None:
    """Send the exec request without waiting for its reply, as OpenSSH's client does.

    paramiko's `exec_command` blocks one round trip for the server's "success"
    before stdin can be sent or output read; on a WAN host that is 1 RTT of
    every command.  The request is the same message (want-reply set); a refusal
    arrives later and closes the channel (paramiko's `_request_failed`), which
    the pump sees as a command with no exit status (-1), like a killed one.
    """
    from paramiko.common import cMSG_CHANNEL_REQUEST
    from paramiko.message import Message

    m = Message()
    m.add_byte(cMSG_CHANNEL_REQUEST)
    m.add_int(chan.remote_chanid)
    m.add_string("exec")
    m.add_boolean(True)
    m.add_string(line)
    chan.transport._send_user_message(m)


def _connection_lost(chan: Any, grace: float = 1.0) -> bool:
    """True if a channel that closed without an exit status (paramiko's -1) lost its connection.

    -1 alone would read as a failed command (exit 7); it is also what a command
    killed by a signal gives, with the connection still up.  The transport
    thread closes channels just before it marks itself inactive, so allow it
    `grace` seconds to do so.
    """
    transport = chan.get_transport()
    deadline = time.monotonic() + grace
    while transport.is_active() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not transport.is_active()


def _take(stream: str, data: bytes, buf: bytearray, pending: dict[str, bytes], on_line: LineSink | None) -> None:
    buf += data
    if on_line and data:
        lines = (pending[stream] + data).split(b"\n")
        pending[stream] = lines.pop()
        for line in lines:
            on_line(stream, line.decode("utf-8", "replace"))


def _nodelay(sock: Any) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass  # a ProxyJump channel is not a TCP socket


def connect(target: SshTarget) -> FabricRemote:
    """Open a strict connection to `target` (the usual entry point)."""
    return FabricRemote(target).connect()
