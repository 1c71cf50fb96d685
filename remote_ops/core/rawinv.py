"""Inventory files read without validation: where they are, and one host's raw connection fields.

`App.speculate` uses this to start the SSH handshake of a `--host NAME` before
pydantic is even imported (the handshake is several round trips; validating
the inventory is ~0.1 s of CPU): the raw fields give a provisional target,
and the connection is kept only if the validated host resolves to the very
same target (`App.preconnect`), else it is closed unused.  Nothing here
decides anything about a host beyond "where would we connect"; errors are
left to `core.inventory`, which validates (this module returns None instead).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

#: The fields that decide where and how we connect (everything `resolve_target` reads).
CONNECT_FIELDS = ("address", "user", "port", "identity_file", "known_hosts", "proxy_jump")

#: A value speculation will use as it stands (validation may refuse anything else; then no speculation).
_PLAIN = re.compile(r"[A-Za-z0-9_.:@~/+%-]{1,255}")


def user_inventory_dir() -> Path:
    """The inventory in the user's config directory: `$XDG_CONFIG_HOME/remote-ops/inventory`
    (default `~/.config/remote-ops/inventory`), where `remote-ops init` writes one."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "remote-ops" / "inventory"


def inventory_places() -> list[str]:
    """Where discovery looks, in order, as an error names them (`--inventory` and
    `$REMOTE_OPS_INVENTORY` first: click passes both as `--inventory`)."""
    env = os.environ.get("REMOTE_OPS_INVENTORY")
    return [
        "--inventory PATH (not given)",
        f"$REMOTE_OPS_INVENTORY ({env or 'unset'})",
        f"./inventory ({Path('inventory').absolute()})",
        str(user_inventory_dir()),
    ]


def default_inventory_paths() -> list[Path]:
    """Discovery when no `--inventory` is given: `$REMOTE_OPS_INVENTORY` (os.pathsep list), else
    ./inventory if it exists, else the user's config directory if it exists (the first found
    wins, as Ansible's inventory does), plus the sandbox's entry when `sandbox up` wrote one.
    An empty list means no inventory was found (commands that need one say where they looked)."""
    env = os.environ.get("REMOTE_OPS_INVENTORY")
    if env:
        paths = [Path(p) for p in env.split(os.pathsep) if p]
    else:
        found = next((p for p in (Path("inventory"), user_inventory_dir()) if p.exists()), None)
        paths = [found] if found else []
    from ..paths import sandbox_inventory_file  # local import: paths is tiny, avoids a cycle

    sandbox = sandbox_inventory_file()
    return paths + ([sandbox] if sandbox.exists() else [])


def inventory_files(paths: list[Path]) -> list[Path]:
    """The YAML files under `paths` (files or directories), in load order; a missing path is
    returned as is (the loader reports it)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and not p.name.startswith("."))
        else:
            files.append(path)
    return files


def raw_hosts(ref: str, paths: list[Path]) -> dict[str, dict[str, Any]] | None:
    """{name: connection fields} for a `--host` that names one inventory host or one file's group,
    from the raw YAML (defaults merged); None when anything is unusual (a missing or unreadable
    file, a name defined twice, a non-plain value, a ProxyJump), so that the caller just does
    not speculate."""
    found: dict[str, dict[str, Any]] = {}
    for file in inventory_files(paths):
        if not file.is_file():  # a missing ./inventory is skipped; any other missing path fails validation
            continue
        doc = _load(file)
        if doc is None:
            return None
        entries, defaults = doc.get("hosts") or {}, doc.get("defaults") or {}
        if not isinstance(entries, dict) or not isinstance(defaults, dict):
            return None
        names = [str(n) for n in entries] if (file.stem == ref and len(entries) > 1) else [ref] * (ref in entries)
        for name in names:
            fields = _fields(defaults, entries.get(name) or {})
            if fields is None or name in found:
                return None
            found[name] = fields
    return found or None


def _load(file: Path) -> dict | None:
    import yaml

    try:
        doc = yaml.load(file.read_bytes(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError):
        return None
    return doc if isinstance(doc, dict) else ({} if doc is None else None)


def _fields(defaults: dict, entry: Any) -> dict[str, Any] | None:
    if not isinstance(entry, dict):
        return None
    merged = {k: entry.get(k, defaults.get(k)) for k in CONNECT_FIELDS}
    if merged["proxy_jump"] is not None:
        return None
    for key, value in merged.items():
        if value is not None and not (isinstance(value, int) and key == "port") and not _plain(value):
            return None
    return merged


def _plain(value: Any) -> bool:
    return isinstance(value, str) and _PLAIN.fullmatch(value) is not None


def raw_names(paths: list[Path]) -> list[str]:
    """The host and group names of the inventory under `paths`, from the raw YAML (no
    validation, no pydantic): hosts, then each file of several hosts (its stem), then the
    `groups:` sections' names, each once, in file order.  For shell completion: what it cannot
    read (a missing or broken file, an odd shape) it skips."""
    names: dict[str, None] = {}
    for file in inventory_files(paths):
        doc = _load(file) if file.is_file() else None
        hosts, groups = (doc.get("hosts"), doc.get("groups")) if doc else (None, None)
        hosts = hosts if isinstance(hosts, dict) else {}
        names.update(dict.fromkeys(map(str, hosts)))
        if len(hosts) > 1:
            names[file.stem] = None
        names.update(dict.fromkeys(map(str, groups if isinstance(groups, dict) else {})))
    return list(names)
