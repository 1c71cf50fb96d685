"""Faults for lab hosts: crash, refuse, drop, freeze, and a command that hangs.

- `crash`: kill the host's sshd and every session under it (like a reboot
  without goodbye).  `HostLab.restart` (or `heal`) brings it back, same key.
- `refuse`: `-j REJECT --reject-with tcp-reset` on the host's address:port:
  new connections are refused at once.
- `drop`: `-j DROP`: SYNs and in-flight data vanish, so connects and open
  sessions time out.
- `freeze`: SIGSTOP the sshd tree: TCP still connects (the kernel answers)
  but nothing replies, so banners and running commands hang.
- `hang_command`: a shell command that never finishes on its own.

Firewall rules go in a chain of our own per host (`ROLAB-<labid>-<n>`),
hooked into INPUT by one rule that matches only that host's address and port;
healing deletes the hook and the chain, leaving the rest of the firewall
untouched.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Sequence
from typing import Any, Protocol

from ..core.shell import join
from ._proc import LabError, descendants, run, signal_all


class LabHost(Protocol):
    """What a fault needs of a lab host (`lab.LabHost` is one): named as protocols, so that this
    module imports nothing of `lab.py`, which imports it."""

    @property
    def name(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def sshd(self) -> Any: ...


class HostLab(Protocol):
    """What a fault needs of a lab (`lab.HostLab` is one)."""

    @property
    def id(self) -> str: ...

    @property
    def hosts(self) -> Sequence[Any]: ...

    @property
    def _stopped(self) -> bool: ...

    def host(self, name: str) -> Any: ...

    def restart(self, name: str) -> Any: ...


def iptables_available() -> str | None:
    """None if iptables works here, else why not."""
    if not shutil.which("iptables"):
        return "iptables not found (apt-get install iptables)"
    if run(["iptables", "-w", "5", "-S", "INPUT"], check=False).returncode != 0:
        return "iptables cannot read the INPUT chain (need root and netfilter)"
    return None


def chain_name(lab: "HostLab", host: "LabHost") -> str:
    """The host's own chain: `ROLAB-<labid>-<index>` (< 29 chars, as iptables requires)."""
    return f"ROLAB-{lab.id}-{lab.hosts.index(host) + 1}"


def _hook(host: "LabHost", chain: str) -> list[str]:
    return ["INPUT", "-d", f"{host.address}/32", "-p", "tcp", "--dport", str(host.port), "-j", chain]


def _ipt(*args: str, check: bool = True):
    return run(["iptables", "-w", "10", *args], check=check, timeout=30)


def _block(lab: "HostLab", host: "LabHost", *target: str) -> None:
    """(Re)make the host's chain holding one rule with `target`, hooked into INPUT once."""
    chain = chain_name(lab, host)
    if _ipt("-nL", chain, check=False).returncode != 0:
        _ipt("-N", chain)
    _ipt("-F", chain)
    _ipt("-A", chain, "-p", "tcp", "-j", *target)
    if _ipt("-C", *_hook(host, chain), check=False).returncode != 0:
        _ipt("-I", *_hook(host, chain))


def refuse(lab: "HostLab", host: "LabHost") -> None:
    """New TCP connections to the host get a reset (ECONNREFUSED)."""
    _block(lab, host, "REJECT", "--reject-with", "tcp-reset")


def drop(lab: "HostLab", host: "LabHost") -> None:
    """Every packet to the host's sshd port is dropped: connects and open sessions hang."""
    _block(lab, host, "DROP")


def unblock(lab: "HostLab", host: "LabHost") -> None:
    """Remove the host's hook and chain (no error if absent)."""
    chain = chain_name(lab, host)
    while _ipt("-D", *_hook(host, chain), check=False).returncode == 0:
        pass
    _ipt("-F", chain, check=False)
    _ipt("-X", chain, check=False)


def crash(host: "LabHost") -> None:
    """Kill the host's sshd and all its sessions."""
    host.sshd.stop()


def freeze(host: "LabHost") -> None:
    """SIGSTOP sshd and all its sessions: the host stops answering but TCP still connects."""
    pid = host.sshd.pid
    if not host.sshd.running or pid is None:
        raise LabError(f"{host.name} is not running")
    signal_all([pid, *descendants(pid)], signal.SIGSTOP)


def thaw(host: "LabHost") -> None:
    """SIGCONT everything `freeze` stopped."""
    pid = host.sshd.pid
    if host.sshd.running and pid is not None:
        signal_all([pid, *descendants(pid)], signal.SIGCONT)


def hang_command(seconds: int = 3600) -> str:
    """A remote command that prints a line, then hangs (until killed or `seconds` pass)."""
    return join(["sh", "-c", f"echo started; exec sleep {int(seconds)}"])


def heal(lab: "HostLab", host: "LabHost") -> None:
    """Undo every fault on `host`: unblock, thaw, restart if crashed."""
    if iptables_available() is None:
        unblock(lab, host)
    thaw(host)
    if not host.sshd.running and not lab._stopped:
        lab.restart(host.name)


def heal_lab(lab: "HostLab") -> None:
    """Remove every firewall chain the lab made (used by `HostLab.stop`)."""
    if shutil.which("iptables") and lab.hosts:
        for host in lab.hosts:
            unblock(lab, host)
            thaw(host)


def heal_recorded(lab_id: str) -> None:
    """Remove chains of a lab known only by id (another process started it)."""
    if not lab_id or not shutil.which("iptables"):
        return
    rules = _ipt("-S", "INPUT", check=False).stdout.decode().splitlines()
    for rule in rules:
        if f"-j ROLAB-{lab_id}-" in rule:
            _ipt("-D", *rule.split()[1:], check=False)
            chain = rule.split("-j ")[-1].strip()
            _ipt("-F", chain, check=False)
            _ipt("-X", chain, check=False)


class Faults:
    """Fault helpers bound to one lab; `heal_all()` undoes whatever was done."""

    def __init__(self, lab: "HostLab") -> None:
        self.lab = lab
        self.touched: list["LabHost"] = []

    def _host(self, host: "LabHost | str") -> "LabHost":
        h = self.lab.host(host) if isinstance(host, str) else host
        if h not in self.touched:
            self.touched.append(h)
        return h

    def crash(self, host: "LabHost | str") -> None:
        crash(self._host(host))

    def refuse(self, host: "LabHost | str") -> None:
        refuse(self.lab, self._host(host))

    def drop(self, host: "LabHost | str") -> None:
        drop(self.lab, self._host(host))

    def freeze(self, host: "LabHost | str") -> None:
        freeze(self._host(host))

    def thaw(self, host: "LabHost | str") -> None:
        thaw(self._host(host))

    def unblock(self, host: "LabHost | str") -> None:
        unblock(self.lab, self._host(host))

    def restart(self, host: "LabHost | str") -> None:
        self.lab.restart(self._host(host).name)

    hang_command = staticmethod(hang_command)

    def heal_all(self) -> None:
        """Undo every fault on every host this object touched."""
        for h in self.touched:
            heal(self.lab, h)
        self.touched.clear()
