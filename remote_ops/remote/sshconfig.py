"""Resolve how to reach a host: inventory > ssh_config > defaults (pure).

The result is an `SshTarget`: plain data the SSH seam connects with.  Only the
options that matter for a strict, non-interactive connection are honoured:
HostName, User, Port, IdentityFile, ProxyJump, UserKnownHostsFile,
ConnectTimeout, ServerAliveInterval.  Parsing uses paramiko's SSHConfig so
`Match`/`Host` patterns behave as OpenSSH users expect.

The defaults are OpenSSH's: port 22, and the login user is the local user
(`local_user`, what `ssh HOST` logs in as) when neither the inventory nor
ssh_config's `User` names one; a ProxyJump hop likewise.  Nothing assumes root.
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    import paramiko

    from ..core.inventory import HostSpec

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


@dataclass(frozen=True)
class Timeouts:
    """Seconds.  `command` is the default per-command deadline."""

    connect: float = 10.0
    banner: float = 15.0
    auth: float = 20.0
    command: float = 120.0
    keepalive: int = 15


def local_user() -> str:
    """The local login name, OpenSSH's default remote user (`$LOGNAME`, `$USER`, ..., else the
    password database).  A ConfigError (exit 3) when there is none: name a user instead."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login variable and no passwd entry for this uid
        raise _no_local_user() from None


def _no_local_user() -> ConfigError:
    return ConfigError(
        "no local user name to log in as (no $LOGNAME/$USER and no passwd entry for this uid)",
        hint="set `user:` in the inventory or `User` in ssh_config",
    )


def _lookup(config: paramiko.SSHConfig, host: str) -> Any:
    """ssh_config's options for `host`.  paramiko expands `%u` tokens with the local user name
    even where none is used, so a machine without one is the same ConfigError."""
    try:
        return config.lookup(host)
    except (KeyError, OSError):  # getpass.getuser() inside paramiko's token expansion
        raise _no_local_user() from None


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to open one SSH connection, already resolved."""

    name: str  # inventory name (what the user calls it)
    hostname: str  # what we connect to
    port: int = 22
    user: str = field(default_factory=local_user)  # OpenSSH's default: the local user
    identity_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = (DEFAULT_KNOWN_HOSTS,)
    jump: tuple["SshTarget", ...] = ()
    host_key_policy: str = "strict"  # strict | accept-new
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def known_hosts_file(self) -> Path:
        """The file new keys are written to (the first UserKnownHostsFile)."""
        return Path(os.path.expanduser(self.known_hosts[0]))

    @property
    def display(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def load_ssh_config(path: str | Path | None) -> paramiko.SSHConfig:
    """Parse `path`, or ~/.ssh/config when it exists, or nothing."""
    paramiko = _paramiko()
    if path is None:
        default = Path("~/.ssh/config").expanduser()
        return parse_ssh_config(default.read_bytes(), str(default)) if default.exists() else paramiko.SSHConfig()
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError("ssh_config file does not exist", source=str(p))
    return parse_ssh_config(p.read_bytes(), str(p))


def parse_ssh_config(raw: bytes, source: str) -> paramiko.SSHConfig:
    """Decode, check the numeric options line by line, then parse with paramiko (pure).

    Like `ssh` itself, a bad value anywhere in the file is an error, whichever
    host it belongs to; the error names the file, the line and the option.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x}", source=f"{source}:{line}") from None
    check_numbers(text, source)
    try:
        return _paramiko().SSHConfig.from_text(text)
    except Exception as exc:  # paramiko raises several types for bad files
        raise ConfigError(f"cannot parse ssh_config: {exc}", source=source) from None


def _paramiko() -> Any:
    """paramiko, imported on first use (after `_lean`: invoke without `unittest.mock`)."""
    from ._lean import import_invoke

    import_invoke()
    import paramiko

    return paramiko


#: Options remote-ops reads as numbers: name (lowercase) -> (smallest, largest) allowed.
NUMERIC_OPTIONS = {"port": (1, 65535), "connecttimeout": (0, 10**6), "serveraliveinterval": (0, 10**6)}
_OPTION = re.compile(r"\s*([A-Za-z]+)(?:\s*=\s*|\s+)(.*)")  # the value is stripped after: `(.*?)\s*$` was quadratic


def check_numbers(text: str, source: str) -> None:
    """ConfigError `FILE:LINE:Option` for `Port abc`, `Port 70000`, `ConnectTimeout x`."""
    for number, line in enumerate(text.splitlines(), 1):
        m = _OPTION.match(line)
        if not m or m[1].lower() not in NUMERIC_OPTIONS or line.lstrip().startswith("#"):
            continue
        value, (low, high) = m[2].strip().strip('"'), NUMERIC_OPTIONS[m[1].lower()]
        if not value.isdigit() or len(value) > 9 or not low <= int(value) <= high:
            raise ConfigError(
                f"{m[1]} must be a number from {low} to {high}, not {m[2].strip()[:80]!r}",
                source=f"{source}:{number}",
                field=m[1],
            )


def resolve_target(
    host: HostSpec, config: paramiko.SSHConfig, *, policy: str = "strict", timeouts: Timeouts | None = None
) -> SshTarget:
    """Combine an inventory host with its ssh_config entry into an `SshTarget`."""
    entry = _lookup(config, host.connect_address)
    timeouts = timeouts or _timeouts_from(entry)
    known = _known_hosts(host.known_hosts, entry)
    jumps = tuple(
        _jump_target(j, config, policy, timeouts, known)
        for j in _split_jumps(host.proxy_jump or entry.get("proxyjump"))
    )
    identities = (host.identity_file,) if host.identity_file else tuple(entry.get("identityfile", ()))
    return SshTarget(
        name=host.name,
        hostname=entry.get("hostname", host.connect_address) if not host.address else host.address,
        port=host.port or int(entry.get("port", 22)),
        user=host.user or entry.get("user") or local_user(),
        identity_files=tuple(os.path.expanduser(i) for i in identities),
        known_hosts=known,
        jump=jumps,
        host_key_policy=policy,
        timeouts=timeouts,
    )


def _jump_target(
    spec: str, config: paramiko.SSHConfig, policy: str, timeouts: Timeouts, known: tuple[str, ...]
) -> SshTarget:
    """A ProxyJump hop `[user@]host[:port]`, itself resolved through ssh_config."""
    user, _, rest = spec.rpartition("@")
    hostpart, _, port = rest.partition(":")
    if port and not port.isdigit():
        raise ConfigError(f"bad port in ProxyJump hop '{spec}'", field="ProxyJump")
    entry = _lookup(config, hostpart)
    return SshTarget(
        name=hostpart,
        hostname=entry.get("hostname", hostpart),
        port=int(port or entry.get("port", 22)),
        user=user or entry.get("user") or local_user(),
        identity_files=tuple(os.path.expanduser(i) for i in entry.get("identityfile", ())),
        known_hosts=_known_hosts(None, entry) if "userknownhostsfile" in entry else known,
        host_key_policy=policy,
        timeouts=timeouts,
    )


def _split_jumps(value: str | None) -> list[str]:
    if not value or value.lower() == "none":
        return []
    return [v.strip() for v in value.split(",") if v.strip()]


def _known_hosts(explicit: str | None, entry: dict) -> tuple[str, ...]:
    if explicit:
        return (explicit,)
    files = entry.get("userknownhostsfile")
    if files:
        parts = files.split() if isinstance(files, str) else list(files)
        return tuple(parts)
    return (DEFAULT_KNOWN_HOSTS,)


def _timeouts_from(entry: dict) -> Timeouts:
    base = Timeouts()
    if "connecttimeout" in entry:
        base = replace(base, connect=float(entry["connecttimeout"]))
    if "serveraliveinterval" in entry:
        base = replace(base, keepalive=int(entry["serveraliveinterval"]))
    return base
