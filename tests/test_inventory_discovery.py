"""Inventory discovery (issue 29, item 3): --inventory, then $REMOTE_OPS_INVENTORY, then
./inventory, then the user's config directory; no inventory or an empty one is exit 3
naming where it looked; `remote-ops init` writes the shipped example (and records a
host key only when accepted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli_process

from remote_ops.core.rawinv import default_inventory_paths, user_inventory_dir

HOST = "hosts:\n  {name}:\n    address: 127.0.0.1\n"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no $REMOTE_OPS_INVENTORY, a private config and state directory."""
    env = {k: v for k, v in os.environ.items() if k != "REMOTE_OPS_INVENTORY"}
    return {**env, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"), **extra}


def _cli(tmp_path: Path, *args: str, cwd: Path | None = None, **env: str):
    work = cwd or tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    p = run_cli_process(_env(tmp_path, **env), *args, cwd=work)
    return p.returncode, p.stdout, p.stderr


def _inventory(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(HOST.format(name=name))
    return directory


@pytest.fixture
def places(tmp_path, monkeypatch):
    """Env, ./inventory and the config directory each holding a different host."""
    monkeypatch.delenv("REMOTE_OPS_INVENTORY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("REMOTE_OPS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    return {
        "config": _inventory(tmp_path / "cfg" / "remote-ops" / "inventory", "from-config"),
        "cwd": _inventory(tmp_path / "inventory", "from-cwd"),
        "env": _inventory(tmp_path / "envinv", "from-env"),
    }


def test_discovery_order_env_then_cwd_then_config(places, monkeypatch, tmp_path):
    assert user_inventory_dir() == places["config"]
    monkeypatch.setenv("REMOTE_OPS_INVENTORY", str(places["env"]))
    assert default_inventory_paths() == [places["env"]]
    monkeypatch.delenv("REMOTE_OPS_INVENTORY")
    assert default_inventory_paths() == [Path("inventory")]
    (tmp_path / "inventory" / "from-cwd.yaml").unlink()
    (tmp_path / "inventory").rmdir()
    assert default_inventory_paths() == [places["config"]]
    (places["config"] / "from-config.yaml").unlink()
    places["config"].rmdir()
    assert default_inventory_paths() == []


def test_config_dir_defaults_to_dot_config(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_inventory_dir() == tmp_path / ".config" / "remote-ops" / "inventory"


def test_cli_takes_the_first_place_found(tmp_path):
    _inventory(tmp_path / "cfg" / "remote-ops" / "inventory", "from-config")
    _inventory(tmp_path / "work" / "inventory", "from-cwd")
    _inventory(tmp_path / "envinv", "from-env")
    _inventory(tmp_path / "flag", "from-flag")
    names = lambda *a, **e: [h["name"] for h in json.loads(_cli(tmp_path, "hosts", "--json", *a, **e)[1])["hosts"]]  # noqa: E731
    assert names("--inventory", str(tmp_path / "flag"), REMOTE_OPS_INVENTORY=str(tmp_path / "envinv")) == ["from-flag"]
    assert names(REMOTE_OPS_INVENTORY=str(tmp_path / "envinv")) == ["from-env"]
    assert names() == ["from-cwd"]
    assert names(cwd=tmp_path / "elsewhere") == ["from-config"]


@pytest.mark.parametrize("args", [("hosts",), ("inventory", "check"), ("facts", "--host", "gpu-node")])
def test_no_inventory_is_exit_3_naming_where_it_looked(tmp_path, args):
    rc, out, err = _cli(tmp_path, *args)
    assert rc == 3, err
    assert "no inventory found" in err and "Traceback" not in err
    for place in ("--inventory", "$REMOTE_OPS_INVENTORY", str(tmp_path / "work" / "inventory"), str(tmp_path / "cfg")):
        assert place in err
    assert "remote-ops init" in err
    assert "valid" not in out + err


@pytest.mark.parametrize("args", [("hosts",), ("inventory", "check")])
def test_empty_inventory_is_exit_3(tmp_path, args):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "none.yaml").write_text("hosts: {}\n")
    rc, out, err = _cli(tmp_path, *args, "--inventory", str(empty))
    assert rc == 3, err
    assert "inventory has no hosts" in err and str(empty) in err
    assert "valid" not in out


def test_adhoc_host_needs_no_inventory(tmp_path):
    """`--host user@addr` works with no inventory: the dry run plans without one (no connection)."""
    rc, _, err = _cli(tmp_path, "unlock", "--host", "root@127.0.0.1:1", "--dry-run", "--connect-timeout", "1")
    assert "no inventory" not in err
    assert rc == 4, err  # it got as far as connecting (nothing listens on port 1)


def test_init_writes_an_inventory_that_check_accepts_and_refuses_to_overwrite(tmp_path):
    rc, _, err = _cli(tmp_path, "init")
    assert rc == 0, err
    written = tmp_path / "cfg" / "remote-ops" / "inventory"
    assert sorted(p.name for p in written.iterdir()) == ["gpu-node.yaml", "groups.yaml"]
    assert (written / "gpu-node.yaml").read_text().startswith("#")  # commented, as shipped
    rc, out, err = _cli(tmp_path, "inventory", "check", cwd=tmp_path / "elsewhere")
    assert rc == 0, err
    assert "1 hosts: valid" in out + err
    (written / "gpu-node.yaml").write_text("# mine\n" + HOST.format(name="mine"))
    rc, _, err = _cli(tmp_path, "init")
    assert rc == 9, err
    assert "already exist" in err and "--force" in err
    assert (written / "gpu-node.yaml").read_text().startswith("# mine")
    rc, _, err = _cli(tmp_path, "init", "--force")
    assert rc == 0, err
    assert "gpu-node:" in (written / "gpu-node.yaml").read_text()


def test_init_dir(tmp_path):
    rc, _, err = _cli(tmp_path, "init", "--dir", "inventory")
    assert rc == 0, err
    rc, out, err = _cli(tmp_path, "hosts", "--json")
    assert rc == 0, err
    assert [h["name"] for h in json.loads(out)["hosts"]] == ["gpu-node"]


@pytest.mark.hosts
def test_init_host_accept_new_records_a_key_a_strict_connection_accepts(lab, host, tmp_path):
    from remote_ops.remote import FabricRemote

    directory = tmp_path / "inv"
    ref = f"root@{host.address}:{host.port}"
    rc, _, err = _cli(tmp_path, "init", "--dir", str(directory), "--host", ref)  # stdin closed: no answer
    assert rc == 6, err
    assert "SHA256:" in err and not directory.exists()
    rc, out, err = _cli(tmp_path, "init", "--dir", str(directory), "--host", ref, "--accept-new", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    known = directory / "known_hosts"
    assert doc["host_key"]["known_hosts"] == str(known) and doc["host_key"]["fingerprint"] in err
    assert known.read_text().count("\n") == 1
    assert f"address: {host.address}" in (directory / "gpu-node.yaml").read_text()
    remote = FabricRemote(lab.target(host.name, known_hosts=str(known))).connect()  # strict policy
    try:
        assert remote.run("echo ok").stdout.strip() == "ok"
    finally:
        remote.close()
    strangers = tmp_path / "other_known_hosts"
    strangers.write_text("")
    with pytest.raises(Exception, match="not in"):  # the same connection with an empty file is refused
        FabricRemote(lab.target(host.name, known_hosts=str(strangers))).connect()
