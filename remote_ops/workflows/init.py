"""`remote-ops init`: start an inventory from the shipped, commented example.

The example is the repository's `inventory/` (shipped in the wheel as package data,
found with `paths.repo_resource`).  Files are written only when none of them exists
(else `Refused`, exit 9, unless `force`).  With a host address, the example host's
`address` (and `user`/`port` if given) become that host's, its `known_hosts` names the
inventory's own `known_hosts` file, and the host key is fetched (key exchange only,
`remote.keyscan`) so the caller can show its fingerprint and ask before recording it.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, NotFound, Refused, UsageError
from ..paths import repo_resource

#: The example host's connection lines, replaced when `init --host` names a host.
EXAMPLE_CONNECTION = "    address: 10.1.230.174\n    user: root\n"
KNOWN_HOSTS = "known_hosts"


@dataclass(frozen=True)
class Target:
    """The host `init --host` names: address, optional user and port."""

    address: str
    user: str | None
    port: int | None

    @property
    def ssh_port(self) -> int:
        return self.port or 22


def example_files() -> dict[str, str]:
    """{file name: text} of the shipped example inventory."""
    source = repo_resource("inventory")
    files = sorted(p for p in source.glob("*.y*ml") if p.is_file()) if source.is_dir() else []
    if not files:
        raise NotFound(f"the example inventory is missing from this install ({source})")
    return {p.name: p.read_text() for p in files}


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")
_USER = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}$")


def check_host_ref(ref: str) -> None:
    """`[user@]address[:port]` checked as text, before any lookup (pure): the address a host
    name (RFC 1123 labels) or an IP address, the user a login name, the port 1-65535.  A
    UsageError (exit 2) names the part: `root@$(id)` never reaches DNS."""
    user, at, rest = ref.rpartition("@")
    address, port = rest, ""
    if rest.count(":") == 1:
        address, _, port = rest.partition(":")
    if at and not _USER.match(user):
        raise UsageError(f"--host {ref!r}: {user!r} is not a user name (letters, digits, '.', '_', '-')")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise UsageError(f"--host {ref!r}: {port!r} is not a port (1-65535)")
    if rest.count(":") == 1 and not port:
        raise UsageError(f"--host {ref!r}: empty port")
    if not _HOSTNAME.match(address):
        try:
            ipaddress.ip_address(address.removeprefix("[").removesuffix("]"))
        except ValueError:
            raise UsageError(
                f"--host {ref!r}: {address!r} is neither a host name nor an IP address",
                hint="give [USER@]ADDRESS[:PORT], e.g. root@10.1.230.174 or root@gpu-node.example:2222",
            ) from None


def parse_target(ref: str) -> Target:
    """`[user@]address[:port]`, as `--host` takes an ad-hoc host: checked as text first
    (`check_host_ref`, UsageError), then as the inventory's ad-hoc host (ConfigError)."""
    from ..core.inventory import adhoc_host

    check_host_ref(ref)
    spec = adhoc_host(ref)
    return Target(spec.name, spec.user, spec.port)


def plan(directory: Path, target: Target | None) -> dict[Path, str]:
    """{path: text} to write: the example, with `target`'s connection in the example host (pure
    apart from reading the example)."""
    files = example_files()
    if target is not None:
        files = {name: _with_target(text, target, directory / KNOWN_HOSTS) for name, text in files.items()}
    return {directory / name: text for name, text in files.items()}


def _with_target(text: str, target: Target, known_hosts: Path) -> str:
    if EXAMPLE_CONNECTION not in text:
        return text
    lines = [f"    address: {target.address}"]
    lines += (
        [f"    user: {target.user}"]
        if target.user
        else ["    # user: root   # unset: ssh_config User, else the local user"]
    )
    lines += [f"    port: {target.port}"] if target.port else []
    lines += [f"    known_hosts: {known_hosts.absolute()}   # written by remote-ops init"]
    return text.replace(EXAMPLE_CONNECTION, "\n".join(lines) + "\n")


def existing(files: dict[Path, str]) -> list[Path]:
    return [p for p in files if p.exists()]


def refuse_overwrite(files: dict[Path, str], force: bool) -> None:
    """Refused (exit 9) when any file to write exists and `force` is not given."""
    found = existing(files)
    if found and not force:
        raise Refused(
            f"{', '.join(map(str, found))} already exist{'s' if len(found) == 1 else ''}; nothing written",
            hint="edit the inventory there, choose another --dir, or pass --force to overwrite",
            details={"reason": "exists", "files": [str(p) for p in found]},
        )


def write(files: dict[Path, str]) -> list[Path]:
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)


def scan_key(target: Target, timeout: float = 10.0):
    """The key the host offers (`remote.keyscan.ScannedKey`); Unreachable if no SSH answers."""
    from ..remote.keyscan import scan

    return scan(target.address, target.ssh_port, timeout=timeout)


def already_known(known_hosts: Path, line: str) -> bool:
    """Whether `line` (a known_hosts line) is in `known_hosts` already (a re-run adds nothing)."""
    return known_hosts.is_file() and line in known_hosts.read_text().splitlines()


def check_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory", field="--dir")
