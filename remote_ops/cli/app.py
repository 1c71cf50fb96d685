"""The per-invocation context: options, inventory, connections, console.

Commands receive an `App`; it loads the inventory once, resolves hosts to SSH
targets and keeps one connection per host for the whole run (closed at exit).
Connections may be opened early, in background threads (`speculate` from the
raw inventory, `preconnect` after validation), so the handshake overlaps
start-up; `remote` takes them over.
Workflows take a `Remote` (not an App) so they stay testable over any host.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..core.rawinv import default_inventory_paths, inventory_places, raw_hosts
from ..errors import ConfigError, UsageError
from .console import Console

if TYPE_CHECKING:  # the SSH stack (paramiko, Fabric, invoke) is imported on the first connection
    from ..core.inventory import HostSpec, Inventory
    from ..remote import FabricRemote, Remote
    from ..remote.sshconfig import SshTarget, Timeouts


@dataclass
class App:
    console: Console = field(default_factory=Console)
    inventory_paths: list[Path] | None = None
    ssh_config_path: str | None = None
    host_key_policy: str = "strict"
    connect_timeout: float | None = None
    command_timeout: float | None = None
    verbose: int = 0  # -v: each remote command and its time; -vv: whole commands + SSH events
    _inventory: Inventory | None = None
    _ssh_config: object | None = None
    _remotes: dict[str, FabricRemote] = field(default_factory=dict)
    _opening: dict[str, "_Opening"] = field(default_factory=dict)
    _speculative: dict[str, tuple[SshTarget, "_Opening"]] = field(default_factory=dict)

    def inventory(self, *, required: bool = True) -> Inventory:
        """The validated inventory (loaded once).  `required`: no inventory found, or one with
        no hosts, is a ConfigError naming where discovery looked (`no_inventory`), never an
        empty success; `select` asks with required=False, so ad-hoc addresses need none."""
        if self._inventory is None:
            from ..core.inventory import load_inventory  # pydantic: after `speculate` has started

            self._inventory = load_inventory(self.inventory_paths or default_inventory_paths())
        if required and not self._inventory.hosts:
            raise self.no_inventory(self._inventory.sources)
        return self._inventory

    def no_inventory(self, files: "tuple[str, ...] | list[str] | list[Path]" = ()) -> ConfigError:
        """The error for a missing (no files) or empty (files, no hosts) inventory: it names the
        places looked, in discovery order, and how to start one."""
        if self.inventory_paths:
            looked = [f"--inventory / $REMOTE_OPS_INVENTORY: {', '.join(map(str, self.inventory_paths))}"]
        else:
            looked = inventory_places()
        what = f"inventory has no hosts ({', '.join(map(str, files))})" if files else "no inventory found"
        err = ConfigError(
            f"{what}; looked in: {'; '.join(looked)}",
            field="inventory",
            hint="run `remote-ops init` (writes one to ~/.config/remote-ops/inventory), "
            "pass --inventory PATH, or name a host by address (--host user@addr)",
        )
        err.details.update(looked=looked, files=[str(f) for f in files])
        return err

    def host(self, ref: str) -> HostSpec:
        """The one host a `--host` value names (through `remote_ops.core.targets`: an unknown bare
        name is a ConfigError with close matches; ad-hoc hosts need an address form).  A pattern
        that names several hosts is a usage error (exit 2), found before anything connects."""
        hosts = self.select(ref)
        if len(hosts) != 1:
            raise one_host_only(ref, [h.name for h in hosts])
        return hosts[0]

    def hosts(self, ref: str) -> list[HostSpec]:
        return self.select(ref)

    def select(self, pattern: str | None, *, all_hosts: bool = False, limit: str | None = None) -> list[HostSpec]:
        """The hosts `--host PATTERN` / `--all` / `--limit` name (`remote_ops.core.targets`)."""
        from ..core.targets import select

        inventory = self.inventory(required=False)
        try:
            return select(inventory, pattern, all_hosts=all_hosts, limit=limit)
        except ConfigError:
            if inventory.hosts:
                raise
            raise self.no_inventory(inventory.sources) from None  # a name, with nothing to look it up in

    def target(self, host: HostSpec) -> SshTarget:
        """Resolve inventory + ssh_config + command-line overrides for `host`."""
        from ..remote.sshconfig import load_ssh_config, resolve_target

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
        """The run's one connection to `host` (opened on first use, or taken over from
        `preconnect`, whose connect error, if any, is raised here as if connecting now)."""
        if host.name not in self._remotes and host.name in self._speculative:
            self.preconnect([host])
        if host.name not in self._remotes:
            opening = self._opening.pop(host.name, None)
            self._remotes[host.name] = opening.result() if opening else self._open(host)
        return self._remotes[host.name]

    def preconnect(self, hosts: list[HostSpec]) -> None:
        """Start opening the connections to `hosts`, each in a background thread.

        The SSH handshake is mostly waiting: round trips (about five, before the
        first command can run) and the server's session set-up.  A command calls
        this as soon as it knows its hosts, then imports and plans while the
        handshakes run; `remote()` takes each connection over.  Same target,
        host-key policy and timeouts as `remote()`; nothing is reported here."""
        for host in hosts:
            if host.name not in self._remotes and host.name not in self._opening:
                self._opening[host.name] = self._adopt(host) or _Opening(lambda h=host: self._open(h), host.name)
        if self._opening:
            self.console.warm()  # the output library loads while the handshakes wait too

    def speculate(self, ref: str) -> None:
        """Start the handshake of the one inventory host `ref` names from the raw inventory,
        before the inventory is validated (pydantic, ~0.1 s of CPU on the lab VM).

        Only with the strict host-key policy (nothing is written before validation), only
        for one host (a group's hosts are opened after validation, by `preconnect`, so a
        refused many-host deploy opens nothing) and only for plain values (`core.rawinv`).
        `preconnect` keeps the connection only when the validated host resolves to the same
        target; otherwise, or if the run ends first, it is closed unused."""
        if self.host_key_policy != "strict":
            return
        raw = raw_hosts(ref, self.inventory_paths or default_inventory_paths())
        if raw is None or list(raw) != [ref]:
            return
        duck = SimpleNamespace(name=ref, connect_address=raw[ref]["address"] or ref, **raw[ref])
        try:
            target = self.target(duck)  # type: ignore[arg-type]  # the connection fields are all it reads
        except (ConfigError, ValueError, TypeError):
            return  # validation will say what is wrong
        self._speculative[ref] = (target, _Opening(lambda: self._open_target(target, ref), ref))

    def _adopt(self, host: HostSpec) -> _Opening | None:
        """The speculative connection to `host` if it went where the validated host resolves."""
        target, opening = self._speculative.pop(host.name, (None, None))
        if opening is None:
            return None
        if target == self.target(host):
            return opening
        _close_when_settled(opening)
        return None

    def _open(self, host: HostSpec) -> FabricRemote:
        return self._open_target(self.target(host), host.name)

    def _open_target(self, target: SshTarget, name: str) -> FabricRemote:
        from ..remote.fabric import FabricRemote

        remote = FabricRemote(target)
        if self.verbose:
            remote.on_command = self._tracer(name)
        return remote.connect()

    def _tracer(self, name: str):
        """The -v line for each remote command: host, command (secrets masked), round trip, exit."""
        from ..core.secrets import mask_text

        def trace(command: str, duration_s: float, status: int | None) -> None:
            text = mask_text(command) if self.verbose > 1 else _one_line(mask_text(command))
            exit_ = "timed out" if status is None else f"exit {status}"
            self.console.trace(f"{name}: {duration_s * 1000:.0f} ms, {exit_}: {text}")

        return trace

    def forget(self, host_name: str) -> None:
        """Close and drop `host_name`'s connection (after it failed), so the next use reconnects."""
        opening = self._opening.pop(host_name, None)
        if opening is not None:
            _close_when_settled(opening)
        remote = self._remotes.pop(host_name, None)
        if remote is not None:
            remote.close()

    def close(self) -> None:
        """Close every connection.  Those still opening, or never taken over, are closed in the
        background once their attempt ends: the run does not wait for a handshake it will not use
        (e.g. after Ctrl-C, or an error before the host was reached)."""
        for opening in [*self._opening.values(), *(o for _, o in self._speculative.values())]:
            _close_when_settled(opening)
        self._opening.clear()
        self._speculative.clear()
        remotes, self._remotes = list(self._remotes.values()), {}  # a host's thread may `forget` meanwhile
        for remote in remotes:
            remote.close()


def one_host_only(ref: str, names: list[str]) -> UsageError:
    """The usage error of a one-host command given a pattern that names several hosts."""
    import click

    ctx = click.get_current_context(silent=True)
    command = f"`{ctx.command_path.removeprefix('remote-ops ')}`" if ctx else "this command"
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    err = UsageError(
        f"--host {ref!r} names {len(names)} hosts ({shown}); {command} takes one host",
        hint="name one host (docs/cli.md lists which commands take a pattern)",
    )
    err.details.update(hosts=names)
    return err


class _Opening:
    """One connection being opened in a daemon thread (`App.preconnect`)."""

    def __init__(self, open_, host: str) -> None:
        self._open = open_
        self._remote: FabricRemote | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"connect {host}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._remote = self._open()
        except BaseException as exc:  # handed to the thread that takes the connection over
            self._error = exc

    def result(self) -> FabricRemote:
        """The open connection, or the connect's own typed error.  The wait is bounded by the
        connect deadline (--connect-timeout covers TCP, banner and auth)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._remote is not None
        return self._remote

    def settled(self) -> FabricRemote | None:
        """The connection once the attempt has ended, or None if it failed."""
        self._thread.join()
        return self._remote


def _close_when_settled(opening: _Opening) -> None:
    """Close a connection nobody takes over, once its attempt ends (in the background)."""

    def close() -> None:
        remote = opening.settled()
        if remote is not None:
            remote.close()

    threading.Thread(target=close, name="close unused", daemon=True).start()


def _one_line(command: str, width: int = 200) -> str:
    """A long or multi-line command cut to one line for -v (-vv shows it whole)."""
    first = command.splitlines()[0] if command else ""
    if len(first) > width or first != command:
        return f"{first[:width]} ... ({len(command)} chars; -vv shows it whole)"
    return first
