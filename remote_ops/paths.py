"""Local directories remote-ops uses (XDG-style, overridable by environment).

- state: run records, pulled logs and dumps, the sandbox   ($REMOTE_OPS_STATE_DIR)
- cache: downloaded SGLang wheels, built base rootfs          ($REMOTE_OPS_CACHE_DIR)
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    env = os.environ.get("REMOTE_OPS_STATE_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "remote-ops"
    return base


def cache_dir() -> Path:
    env = os.environ.get("REMOTE_OPS_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "remote-ops"


def host_dir(host_name: str) -> Path:
    """Per-host local directory: run records, logs, dumps."""
    return state_dir() / "hosts" / host_name


def sandbox_dir() -> Path:
    return state_dir() / "sandbox"


def sandbox_lab_dir() -> Path:
    """The sandbox's host lab (sshd and dockerd state, `lab.json`): `sandbox up` makes it, and
    `python -m remote_ops.hostlab.gpu_standin` finds its hosts there."""
    return sandbox_dir() / "lab"


def sandbox_inventory_file() -> Path:
    """The inventory entry `sandbox up` writes (loaded with the user's inventory)."""
    return sandbox_dir() / "inventory" / "sandbox.yaml"


def package_file(*parts: str) -> Path:
    """A file of the remote_ops package itself, e.g. dumper/dumpfile.py (shipped to hosts by path)."""
    return Path(__file__).resolve().parent.joinpath(*parts)


def repo_resource(*parts: str) -> Path:
    """A file shipped beside the package: templates/, docker/, inventory/ (the example `init`
    copies; see pyproject package-dir)."""
    here = Path(__file__).resolve().parent
    for base in (here / "_resources", here.parent):
        candidate = base.joinpath(*parts)
        if candidate.exists():
            return candidate
    return here.parent.joinpath(*parts)
