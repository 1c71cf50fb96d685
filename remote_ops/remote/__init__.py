"""The one seam to a host: `Remote` (run / put / get / pull / close) and its implementations.

Everything else in remote-ops talks to a `Remote`.  Only this package (and the
engine seam, `remote_ops.engine`, which rides on its connection) imports
fabric, paramiko, docker, or starts ssh as a process.

    base.py      Remote (the interface), RunResult, BaseRemote: the run protocol
                 (deadline, streaming, typed errors, the `on_command` hook)
    fabric.py    FabricRemote: one strict Fabric/paramiko connection (+ ProxyJump hops)
    local.py     LocalRemote: the same protocol with /bin/sh here (`--local-file`)
    hostkeys.py  HostKeyPolicy: known_hosts + strict/accept-new, for paramiko and for ssh
    transfer.py  bulk pull over the system ssh (resumable, verified, parallel)

The SSH libraries load with the first module that needs them (`fabric.py`,
`sshconfig.load_ssh_config`), not with this package: a workflow that only names
`Remote` or `transfer`, and a command that never connects (`render`, `hosts`),
import none of paramiko, invoke or Fabric.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import BaseRemote, CommandHook, LineSink, Remote, RunResult, command_deadline
from .local import LocalRemote

if TYPE_CHECKING:
    from .fabric import FabricRemote, connect
    from .hostkeys import HostKeyPolicy, fingerprint

#: names exported from a module that imports the SSH stack, loaded on first use
_ON_USE = {"FabricRemote": "fabric", "connect": "fabric", "HostKeyPolicy": "hostkeys", "fingerprint": "hostkeys"}


def __getattr__(name: str) -> Any:
    if name in _ON_USE:
        return getattr(importlib.import_module(f"{__name__}.{_ON_USE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BaseRemote",
    "CommandHook",
    "FabricRemote",
    "HostKeyPolicy",
    "LineSink",
    "LocalRemote",
    "Remote",
    "RunResult",
    "command_deadline",
    "connect",
    "fingerprint",
]
