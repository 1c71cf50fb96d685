"""Fetch a host's public key without logging in (what `ssh-keyscan` does), for `remote-ops init`.

Only the key exchange runs: no authentication, no command.  The key comes back with its
known_hosts name (`addr`, or `[addr]:port` off port 22, as OpenSSH and paramiko look it up)
so that `hostkeys.append_known_host` records it where a strict connection will find it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import Unreachable
from .hostkeys import append_known_host, fingerprint


@dataclass(frozen=True)
class ScannedKey:
    """A host's key as the server offered it."""

    known_name: str  # the known_hosts host field
    key: Any  # a paramiko PKey

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def key_type(self) -> str:
        return str(self.key.get_name())

    def known_hosts_line(self) -> str:
        return f"{self.known_name} {self.key.get_name()} {self.key.get_base64()}"

    def record(self, path: Path) -> None:
        """Append the key to `path` (never rewriting it)."""
        append_known_host(path, self.known_name, self.key)


def known_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def scan(address: str, port: int = 22, timeout: float = 10.0) -> ScannedKey:
    """The key `address:port` offers (key exchange only); Unreachable when none comes in `timeout`."""
    import paramiko

    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise Unreachable(f"cannot reach {address}:{port}: {exc}", host=address) from None
    transport = paramiko.Transport(sock)
    transport.banner_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
        key = transport.get_remote_server_key()
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise Unreachable(f"no SSH key exchange with {address}:{port}: {exc}", host=address) from None
    finally:
        transport.close()
    return ScannedKey(known_name(address, port), key)
