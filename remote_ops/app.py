"""The per-invocation context: options, inventory, connections, console.

Commands receive an `App`; it loads the inventory once, resolves hosts to SSH
targets and keeps one connection per host for the whole run (closed at exit).
Workflows take a `Remote` (not an App) so they stay testable over any host.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .console import Console
from .inventory import HostSpec, Inventory, default_inventory_paths, load_inventory
from .remote import FabricRemote, Remote
from .sshconfig import SshTarget, Timeouts, load_ssh_config, resolve_target


@dataclass
class App:
    console: Console = field(default_factory=Console)
    inventory_paths: list[Path] | None = None
    ssh_config_path: str | None = None
    host_key_policy: str = "strict"
    connect_timeout: float | None = None
    command_timeout: float | None = None
    _inventory: Inventory | None = None
    _ssh_config: object | None = None
    _remotes: dict[str, FabricRemote] = field(default_factory=dict)

    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = load_inventory(self.inventory_paths or default_inventory_paths())
        return self._inventory

    def host(self, ref: str) -> HostSpec:
        """The one host a `--host` value names."""
        return self.inventory().one(ref)

    def hosts(self, ref: str) -> list[HostSpec]:
        return self.inventory().resolve(ref)

    def select(self, pattern: str | None, *, all_hosts: bool = False, limit: str | None = None) -> list[HostSpec]:
        """The hosts `--host PATTERN` / `--all` / `--limit` name (`remote_ops.targets`)."""
        from .targets import select

        return select(self.inventory(), pattern, all_hosts=all_hosts, limit=limit)

    def target(self, host: HostSpec) -> SshTarget:
        """Resolve inventory + ssh_config + command-line overrides for `host`."""
        if self._ssh_config is None:
            self._ssh_config = load_ssh_config(self.ssh_config_path)
        target = resolve_target(host, self._ssh_config, policy=self.host_key_policy)
        return replace(target, timeouts=self.timeouts(target.timeouts))

    def timeouts(self, t: Timeouts) -> Timeouts:
        """The run's deadlines: `--connect-timeout` bounds the whole connect (TCP, banner and
        auth, so a frozen sshd fails in that time), `--command-timeout` every remote command."""
        if self.connect_timeout:
            c = self.connect_timeout
            t = replace(t, connect=c, banner=min(t.banner, c), auth=min(t.auth, c))
        return replace(t, command=self.command_timeout or t.command)

    def remote(self, host: HostSpec) -> Remote:
        """The run's one connection to `host` (opened on first use)."""
        if host.name not in self._remotes:
            self._remotes[host.name] = FabricRemote(self.target(host)).connect()
        return self._remotes[host.name]

    def forget(self, host_name: str) -> None:
        """Close and drop `host_name`'s connection (after it failed), so the next use reconnects."""
        remote = self._remotes.pop(host_name, None)
        if remote is not None:
            remote.close()

    def close(self) -> None:
        for remote in self._remotes.values():
            remote.close()
        self._remotes.clear()
