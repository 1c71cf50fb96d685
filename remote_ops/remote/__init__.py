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
"""

from __future__ import annotations

from . import _lean  # noqa: F401 - first: imports invoke without unittest.mock (see _lean)
from .base import BaseRemote, CommandHook, LineSink, Remote, RunResult, command_deadline
from .fabric import FabricRemote, connect
from .hostkeys import HostKeyPolicy, fingerprint
from .local import LocalRemote

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
