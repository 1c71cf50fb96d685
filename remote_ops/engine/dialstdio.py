"""The host's Engine API as HTTP over one SSH channel running the engine kind's dial command.

The dial command (`DockerEngine.dial`) connects its stdin/stdout to the
engine's API socket on the host: for docker, `docker system dial-stdio`, which
reaches the daemon the host's docker CLI would use (it honours `DOCKER_HOST`
and the current context there; it is what the docker CLI itself runs for
`ssh://` hosts); for podman, a relay to its API socket (engine/podman.py).
Here it runs on an exec channel of remote-ops' own strict paramiko transport
(`open_stream`), so the Engine API is reached with the host key already
checked and without a new TCP connection or a CLI process per call.

The layers, bottom up:

- `ChannelSocket`: the paramiko channel dressed as the socket http.client and
  urllib3 expect.  `fileno()` is what urllib3's liveness check polls before it
  reuses a kept-alive connection; stderr of the dial process is drained into a
  short tail (kept for error messages) so it never reads as "connection
  dropped".
- `DialStdioConnection` / `DialStdioPool`: a urllib3 connection whose "connect"
  is opening that channel; the pool keeps it alive, so one channel serves many
  requests.  A connection found dropped (the dial process exited, a timeout
  closed it) is discarded and the next request opens a fresh channel.
- `DialStdioAdapter`: a requests adapter returning that one pool for every URL;
  mounted on `http://` of a `docker.APIClient(base_url="tcp://localhost:2375")`
  (APIClient rejects unknown URL schemes; `localhost:2375` is never dialled).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import requests.adapters
import urllib3.connection
import urllib3.connectionpool

from ..errors import tail


class StreamOpener(Protocol):
    """The one thing the adapter needs from the SSH seam (`FabricRemote.open_stream`)."""

    name: str

    def open_stream(self, command: Any) -> Any: ...


class ChannelSocket:
    """A paramiko Channel behaving like the connected socket http.client reads and writes."""

    def __init__(self, chan: Any) -> None:
        self._chan = chan
        self._stderr = bytearray()

    # what http.client and urllib3 call
    def sendall(self, data: bytes) -> None:
        self._chan.sendall(data)

    def send(self, data: bytes) -> int:
        return self._chan.send(data)

    def recv(self, n: int) -> bytes:
        return self._chan.recv(n)

    def makefile(self, mode: str = "rb", *args: Any) -> Any:
        return self._chan.makefile(mode)

    def settimeout(self, timeout: float | None) -> None:
        self._chan.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._chan.gettimeout()

    def setsockopt(self, *args: Any) -> None:
        """No socket options on a channel (TCP_NODELAY is set once on the SSH socket)."""

    def fileno(self) -> int:
        """The channel's poll pipe, after draining stderr (which would also make it readable)."""
        self.drain_stderr()
        return self._chan.fileno()

    def close(self) -> None:
        self._chan.close()

    def shutdown(self, how: int) -> None:
        self._chan.shutdown(how)

    # diagnostics
    def drain_stderr(self) -> None:
        while self._chan.recv_stderr_ready():
            self._stderr += self._chan.recv_stderr(4096)
            del self._stderr[:-8192]

    def stderr_tail(self) -> str:
        self.drain_stderr()
        return tail(bytes(self._stderr), 5)

    def transport_alive(self) -> bool:
        """Is the SSH connection under this channel still up?"""
        transport = self._chan.get_transport()
        return transport is not None and transport.is_active()

    def exit_status(self) -> int | None:
        """The dial process's exit status once it has exited, else None."""
        return self._chan.recv_exit_status() if self._chan.exit_status_ready() else None


class DialStdioConnection(urllib3.connection.HTTPConnection):
    """An HTTP connection whose transport is a fresh dial channel (opened on connect)."""

    def __init__(self, *, open_socket: Callable[[], ChannelSocket], timeout: Any) -> None:
        super().__init__("localhost", 2375, timeout=timeout)
        self._open_socket = open_socket

    def _new_conn(self) -> Any:
        sock = self._open_socket()
        if isinstance(self.timeout, (int, float)):
            sock.settimeout(self.timeout)
        return sock


class DialStdioPool(urllib3.connectionpool.HTTPConnectionPool):
    """A keep-alive pool of dial channels (usually one)."""

    def __init__(self, open_socket: Callable[[], ChannelSocket], *, maxsize: int = 2) -> None:
        super().__init__("localhost", 2375, maxsize=maxsize, block=False)
        self._open_socket = open_socket

    def _new_conn(self) -> DialStdioConnection:
        self.num_connections += 1
        return DialStdioConnection(open_socket=self._open_socket, timeout=self.timeout.connect_timeout)


class DialStdioAdapter(requests.adapters.HTTPAdapter):
    """requests adapter: every request goes to the host's Engine API over a dial channel.

    `channels_opened` and `requests` count what the benchmarks and tests look at;
    `paths` keeps the last request lines (method + path) for tests that must
    prove a request was never made (no pull).
    """

    def __init__(self, opener: StreamOpener, dial: tuple[str, ...], *, maxsize: int = 2) -> None:
        super().__init__(pool_connections=1, pool_maxsize=maxsize, max_retries=0)
        self._opener, self._dial = opener, dial
        self._pool = DialStdioPool(self._new_socket, maxsize=maxsize)
        self._lock = threading.Lock()
        self.channels_opened = 0
        self.requests = 0
        self.paths: list[str] = []
        self.last_socket: ChannelSocket | None = None

    def _new_socket(self) -> ChannelSocket:
        sock = ChannelSocket(self._opener.open_stream(list(self._dial)))
        with self._lock:
            self.channels_opened += 1
            self.last_socket = sock
        return sock

    def get_connection(self, url: Any, proxies: Any = None) -> DialStdioPool:
        return self._pool

    def get_connection_with_tls_context(
        self, request: Any, verify: Any, proxies: Any = None, cert: Any = None
    ) -> DialStdioPool:
        return self._pool

    def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.requests += 1
            self.paths.append(f"{request.method} {request.path_url}")
            del self.paths[:-200]
        return super().send(request, *args, **kwargs)

    def dial_diagnostics(self) -> tuple[int | None, str]:
        """(exit status, stderr tail) of the most recent dial process, for error messages."""
        sock = self.last_socket
        return (sock.exit_status(), sock.stderr_tail()) if sock else (None, "")

    def close(self) -> None:
        self._pool.close()
        super().close()
