"""The host keys this machine has pinned for a target, as known_hosts lines another host can use.

`dumps sync` writes these lines into the destination's known_hosts for the
sync (`StrictHostKeyChecking=yes`), so the destination trusts a source's key
exactly when this machine does: nothing is accepted on first use.  They are
read from the target's own known_hosts files (the inventory's `known_hosts`,
the files `HostKeyPolicy` reads), hashed entries included.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.syncplan import known_hosts_name
from ..errors import HostKeyUnknown
from .sshconfig import SshTarget


def pinned_lines(target: SshTarget, address: str | None = None, port: int | None = None) -> list[str]:
    """known_hosts lines `<address-as-named> <type> <base64>` for every key pinned for `target`
    (looked up as `target.hostname:target.port`); written for `address:port` (default: the same).
    HostKeyUnknown (exit 6) when none is pinned."""
    import paramiko

    lookup = known_hosts_name(target.hostname, target.port)
    name = known_hosts_name(address or target.hostname, port or target.port)
    lines: list[str] = []
    for path in target.known_hosts:
        p = Path(os.path.expanduser(path))
        if not p.exists():
            continue
        keys = paramiko.HostKeys(str(p)).lookup(lookup) or {}
        lines += [f"{name} {kind} {key.get_base64()}" for kind, key in keys.items()]
    if not lines:
        raise HostKeyUnknown(
            f"no host key pinned for {lookup} in {', '.join(target.known_hosts)}; "
            "the destination would have to accept it on first use",
            host=target.name,
            hint=f"connect once with `remote-ops hosts --host {target.name}` (or pin its key out of band), then re-run",
        )
    return sorted(set(lines))
