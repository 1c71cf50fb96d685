"""`remote-ops inventory schema|check`: the inventory's JSON Schema, and every error of its files.

`schema` prints the JSON Schema of one inventory file (`defaults:`, `hosts:`
with each host's settings, and `groups:`), generated from the pydantic models in
`remote_ops.core.inventory`, so it is never out of date: editors that speak JSON
Schema (the YAML language server: `# yaml-language-server: $schema=...`)
complete and check fields with it.

`check` validates every file and lists ALL errors (each with file, field and
line), not only the first one that loading stops at; exit 3 if there is any.
What spans files (a host defined twice, a group's unknown member or child, a
cycle of children, a name both host and group) is checked by loading the whole
inventory once the files are valid one by one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ._options import app_options

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

#: HostSpec fields the loader fills in; they are not written in a file.
_INTERNAL = ("name", "source", "groups")


@click.group("inventory")
def inventory_group() -> None:
    """Print the inventory's JSON Schema, or check inventory files (all errors).

    \b
      remote-ops inventory schema > inventory.schema.json
      remote-ops inventory check        # first found: --inventory, $REMOTE_OPS_INVENTORY, ./inventory, ~/.config/remote-ops/inventory
    """


def file_schema() -> dict:
    """The JSON Schema of one inventory file, from `HostSpec` (pure)."""
    from ...core.inventory import HostSpec

    host = HostSpec.model_json_schema()
    defs = host.pop("$defs", {})
    settings = {
        "type": "object",
        "title": "HostSettings",
        "additionalProperties": False,
        "description": "A host's settings; every key is optional.",
        "properties": {k: v for k, v in host["properties"].items() if k not in _INTERNAL},
    }
    names_are = "a list of names, or a mapping of names to nothing (Ansible's YAML form)"
    names = {
        "anyOf": [
            {"type": "array", "items": {"type": "string"}},
            {"type": "object", "additionalProperties": {"type": "null"}},
            {"type": "null"},
        ]
    }
    group = {
        "type": ["object", "null"],
        "title": "Group",
        "additionalProperties": False,
        "description": "A group: inventory hosts and other groups (children); a host may be in several groups.",
        "properties": {
            "hosts": {**names, "description": f"hosts of the inventory (any file) in this group: {names_are}"},
            "children": {**names, "description": f"groups whose hosts are in this group: {names_are}"},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "remote-ops inventory file",
        "description": "Hosts and groups.  A file with several hosts is also a group named after the file.  "
        "`defaults` apply to every host of the file; a host's own keys win.  `groups` name hosts of any "
        "file, and other groups as `children`.",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "defaults": {"$ref": "#/$defs/HostSettings"},
            "hosts": {"type": "object", "additionalProperties": {"$ref": "#/$defs/HostSettings"}},
            "groups": {"type": "object", "additionalProperties": {"$ref": "#/$defs/Group"}},
        },
        "$defs": {**defs, "HostSettings": settings, "Group": group},
    }


@inventory_group.command("schema")
def schema_cmd() -> None:
    """Print the JSON Schema of an inventory file (stdout)."""
    click.echo(json.dumps(file_schema(), indent=2))


@dataclass
class Problem:
    """One inventory error: where (file, field, line) and what."""

    source: str
    field: str
    line: int | None
    message: str

    def to_dict(self) -> dict:
        return {"file": self.source, "field": self.field, "line": self.line, "message": self.message}


def file_problems(path: Path) -> tuple[int, list[Problem]]:
    """(hosts that validated, every problem) of one inventory file."""
    from ...core import inventory as inv
    from ...errors import ConfigError

    try:
        data, lines = inv.load_yaml(path.read_bytes(), str(path))
        data = {} if data is None else data
        if not isinstance(data, dict):
            return 0, [Problem(str(path), "", None, "top level must be a mapping with 'hosts:'")]
        problems = [
            Problem(str(path), k, lines.get((k,)), "unknown key; expected 'defaults', 'hosts' and 'groups'")
            for k in map(str, data)
            if k not in inv.FILE_KEYS
        ]
        defaults = inv._mapping(data, "defaults", str(path), lines)
        entries = inv._mapping(data, "hosts", str(path), lines)
    except ConfigError as exc:
        return 0, [_from_error(exc, str(path))]
    try:
        inv.parse_group_data(data, str(path), lines)
    except ConfigError as exc:
        problems.append(_from_error(exc, str(path)))
    good = 0
    for name, body in entries.items():
        found = host_problems(str(name), body, defaults, str(path), lines)
        problems += found
        good += not found
    return good, problems


def host_problems(name: str, body, defaults: dict, source: str, lines) -> list[Problem]:
    """Every validation error of one host (pydantic reports them all; loading shows the first)."""
    from pydantic import ValidationError

    from ...core import inventory as inv

    if body is not None and not isinstance(body, dict):
        return [Problem(source, f"hosts.{name}", lines.get(("hosts", name)), "must be a mapping of settings")]
    merged = inv._merge(defaults, body or {})
    refused = inv.loader_field_error(name, merged, source, lines)
    if refused:
        return [_from_error(refused, source)]
    try:
        inv.HostSpec(name=name, source=source, **{str(k): v for k, v in merged.items()})
        return []
    except ValidationError as exc:
        return [_from_pydantic(err, name, source, lines) for err in exc.errors()]


def _from_pydantic(err: ErrorDetails, name: str, source: str, lines) -> Problem:
    from ...core import inventory as inv

    loc = tuple(str(p) for p in err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = f"unknown field '{loc[-1]}'{inv._did_you_mean(loc[-1], inv._fields_at(loc[:-1]))}"
    e = inv._config_error(message, source, ("hosts", name, *loc), lines, also=("defaults", *loc))
    return Problem(source, ".".join(("hosts", name, *loc)), e.details.get("line"), message)


def _from_error(exc, source: str) -> Problem:
    """A ConfigError raised by the loader (not YAML, duplicate key, duplicate host) as a Problem."""
    details = getattr(exc, "details", {}) or {}
    return Problem(details.get("source") or source, details.get("field") or "", details.get("line"), str(exc))


@inventory_group.command("check")
@app_options
def check_cmd(app) -> int:
    """Validate the inventory files and list every error (file, field, line); exit 3 if any."""
    from ...core import inventory as inv

    files = inv._inventory_files(app.inventory_paths or inv.default_inventory_paths())
    problems: list[Problem] = []
    hosts = 0
    for path in files:
        good, found = file_problems(path)
        hosts, problems = hosts + good, problems + found
    if not files or (hosts == 0 and not problems):  # none found, or none in it: an error, not "valid"
        raise app.no_inventory(files)
    if not problems:  # files valid one by one; the whole (duplicate hosts, groups) is checked on load
        try:
            app.inventory()
        except Exception as exc:  # a ConfigError: the cross-file problem
            problems.append(_from_error(exc, ""))
    rows = [[p.source, p.field, p.line or "", p.message] for p in problems]
    if rows:
        app.console.table(["file", "field", "line", "error"], rows, title=f"{len(problems)} inventory errors")
    else:
        app.console.status("ok", f"{len(files)} files, {hosts} hosts: valid", data=True)
    app.console.emit({"files": [str(f) for f in files], "hosts": hosts, "errors": problems})
    return 3 if problems else 0


commands = [inventory_group]
