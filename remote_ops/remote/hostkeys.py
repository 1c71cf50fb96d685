"""The host-key policy, defined once, for both ways the seam reaches a host.

`HostKeyPolicy.of(target)` reads the resolved `SshTarget` (known_hosts files,
`strict` or `accept-new`).  The paramiko connection (`fabric.py`) gets it as a
strict `SSHClient` (`client()`), the system ssh of bulk transfers
(`transfer.py`) as `-o` options (`ssh_options()`): the same files, the same
answer to an unknown key (refuse, or record it), and a changed key is always
refused.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import HostKeyUnknown
from .sshconfig import SshTarget


def fingerprint(key: Any) -> str:
    """OpenSSH-style SHA256 fingerprint of a paramiko key: `SHA256:base64`."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


@dataclass(frozen=True)
class HostKeyPolicy:
    """Which known_hosts files count, and what an unknown key gets."""

    host: str  # the inventory name (for error messages)
    known_hosts: tuple[str, ...]  # expanded paths; the first one records accepted keys
    accept_new: bool

    @classmethod
    def of(cls, target: SshTarget) -> "HostKeyPolicy":
        return cls(
            target.name,
            tuple(os.path.expanduser(p) for p in target.known_hosts),
            target.host_key_policy == "accept-new",
        )

    @property
    def record_file(self) -> Path:
        return Path(self.known_hosts[0])

    def ssh_options(self) -> list[str]:
        """OpenSSH `-o` options with the same meaning (`BatchMode`: never prompt)."""
        files = " ".join(f'"{p}"' if any(c.isspace() for c in p) else p for p in self.known_hosts)
        return [
            "-o",
            "BatchMode=yes",
            "-o",
            f"StrictHostKeyChecking={'accept-new' if self.accept_new else 'yes'}",
            "-o",
            "UserKnownHostsFile=" + files,
        ]

    def client(self) -> Any:
        """A paramiko SSHClient that knows only these known_hosts files and this policy."""
        import paramiko

        client = paramiko.SSHClient()
        for i, path in enumerate(self.known_hosts):
            if Path(path).exists():
                (client.load_host_keys if i == 0 else client.get_host_keys().load)(path)
        client.set_missing_host_key_policy(_AcceptNew(self) if self.accept_new else _RejectUnknown(self))
        return client


class _RejectUnknown:
    """Refuse a host whose key is not in known_hosts (OpenSSH's `yes`)."""

    def __init__(self, policy: HostKeyPolicy) -> None:
        self.policy = policy

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        raise HostKeyUnknown(
            f"host key for {hostname} is not in {self.policy.record_file} "
            f"(server offered {key.get_name()} {fingerprint(key)}); refusing",
            host=self.policy.host,
            hint="verify the fingerprint out of band, then re-run with "
            "--host-key-policy accept-new (or add it with ssh-keyscan)",
            details={"offered": fingerprint(key)},
        )


class _AcceptNew:
    """Record a first-seen key (OpenSSH's `accept-new`); changed keys still fail."""

    def __init__(self, policy: HostKeyPolicy) -> None:
        self.policy = policy

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        append_known_host(self.policy.record_file, hostname, key)


def append_known_host(path: Path, hostname: str, key: Any) -> None:
    """Append one known_hosts line; never rewrite the user's file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
