"""`remote-ops inventory schema|check` (issue 13, item 5): the schema comes from the models, check lists
every error of every file (not only the first) and exits 3."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from conftest import run_cli

from remote_ops.cli.commands.inventory import file_problems, file_schema

ROOT = Path(__file__).resolve().parent.parent

BAD = """\
defaults:
  user: root
hosts:
  a:
    address: 127.0.0.1
    port: 99999
    gpus:
      cont: 3
  b:
    adress: x
    server:
      port: -1
  c:
    address: 127.0.0.2
"""


cli = run_cli  # (rc, stdout, stderr) of `python -m remote_ops ARGS` (tests/conftest.py)


def test_schema_is_printed_on_stdout_and_describes_every_host_field(tmp_path):
    rc, out, _ = cli({**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path)}, "inventory", "schema")
    schema = json.loads(out)
    assert rc == 0 and schema == file_schema()
    settings = schema["$defs"]["HostSettings"]["properties"]
    assert {"address", "user", "port", "gpus", "sglang", "container", "dump", "server"} <= set(settings)
    assert not {"name", "source", "groups"} & set(settings)  # filled in by the loader, never written


def unknown_keys(value, node: dict, defs: dict, path: str = "") -> list[str]:
    """Keys of `value` the schema does not allow (additionalProperties: false), recursively."""
    node = defs[node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node
    if not isinstance(value, dict) or "properties" not in node:
        return []
    out = []
    for key, sub in value.items():
        if key not in node["properties"]:
            out.append(f"{path}{key}")
        else:
            out += unknown_keys(sub, node["properties"][key], defs, f"{path}{key}.")
    return out


def test_the_example_inventory_fits_the_schema():
    schema = file_schema()
    doc = yaml.safe_load((ROOT / "inventory" / "gpu-node.yaml").read_text())
    settings = schema["$defs"]["HostSettings"]
    assert set(doc) <= set(schema["properties"])
    assert all(unknown_keys(body, settings, schema["$defs"]) == [] for body in doc["hosts"].values())
    assert unknown_keys({"gpus": {"cont": 8}}, settings, schema["$defs"]) == ["gpus.cont"]


def test_check_lists_every_error_with_field_and_line(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD)
    good, problems = file_problems(tmp_path / "bad.yaml")
    assert good == 1  # host c
    found = {(p.field, p.line) for p in problems}
    assert found == {("hosts.a.port", 6), ("hosts.a.gpus.cont", 8), ("hosts.b.adress", 10), ("hosts.b.server.port", 12)}
    assert any("did you mean 'address'" in p.message for p in problems)


def test_check_cli_exits_3_and_lists_all_errors(tmp_path):
    (tmp_path / "inv").mkdir()
    (tmp_path / "inv" / "bad.yaml").write_text(BAD)
    env = {**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path / "s")}
    rc, out, err = cli(env, "inventory", "check", "--inventory", str(tmp_path / "inv"), "--json")
    doc = json.loads(out)
    assert rc == 3 and len(doc["errors"]) == 4 and doc["hosts"] == 1
    rc, out, _ = cli(env, "inventory", "check", "--inventory", str(ROOT / "inventory"))
    assert rc == 0 and "valid" in out
