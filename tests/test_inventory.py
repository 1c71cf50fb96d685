"""Inventory loading/validation and ssh_config resolution (pure, no network)."""

from pathlib import Path

import paramiko
import pytest

from remote_ops.core.inventory import adhoc_host, load_inventory, parse_inventory_data
from remote_ops.errors import ConfigError, ExitCode
from remote_ops.remote.sshconfig import resolve_target

REPO = Path(__file__).resolve().parent.parent


def test_shipped_example_inventory_loads():
    inv = load_inventory([REPO / "inventory"])
    host = inv.one("gpu-node")
    assert host.address == "10.1.230.174"
    assert host.user == "root"
    assert host.gpus.count == 8
    assert host.sglang.target_file == "/root/sglang/python/sglang/srt/models/deepseek_v2.py"
    assert inv.one("10.1.230.174").name == "gpu-node"  # by listed address


def test_error_names_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts:\n  h1:\n    server:\n      port: not-a-port\n")
    with pytest.raises(ConfigError) as exc:
        load_inventory([bad])
    assert str(bad) in str(exc.value) and "hosts.h1.server.port" in str(exc.value)
    assert exc.value.exit_code == ExitCode.CONFIG


def test_unknown_field_is_rejected_with_its_name():
    with pytest.raises(ConfigError, match=r"hosts\.h1\.dump\.dri"):
        parse_inventory_data({"hosts": {"h1": {"dump": {"dri": "/x"}}}}, source="f.yaml")


def test_invalid_yaml_names_file(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("hosts: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_inventory([bad])


def test_defaults_merge_and_groups(tmp_path):
    (tmp_path / "rack.yaml").write_text(
        "defaults:\n  user: ops\n  dump: {dir: /d}\nhosts:\n  a: {address: 127.0.0.2}\n"
        "  b: {address: 127.0.0.3, dump: {min_free_gb: 5}}\n"
    )
    inv = load_inventory([tmp_path])
    assert [h.name for h in inv.resolve("rack")] == ["a", "b"]
    assert inv.one("b").dump.dir == "/d" and inv.one("b").dump.min_free_gb == 5
    assert inv.one("a").user == "ops"
    with pytest.raises(ConfigError, match="group of 2"):
        inv.one("rack")


def test_duplicate_host_across_files(tmp_path):
    (tmp_path / "a.yaml").write_text("hosts:\n  h: {}\n")
    (tmp_path / "b.yaml").write_text("hosts:\n  h: {}\n")
    with pytest.raises(ConfigError, match="also defined"):
        load_inventory([tmp_path])


def test_adhoc_hosts():
    h = adhoc_host("ops@10.9.8.7:2200")
    assert (h.user, h.port, h.connect_address) == ("ops", 2200, "10.9.8.7")
    with pytest.raises(ConfigError):
        adhoc_host("host:notaport")


def _config(text: str) -> paramiko.SSHConfig:
    return paramiko.SSHConfig.from_text(text)


def test_ssh_config_fills_what_inventory_leaves_out():
    cfg = _config(
        "Host gpu\n  HostName 127.0.0.5\n  User ubuntu\n  Port 2201\n"
        "  IdentityFile /keys/id\n  UserKnownHostsFile /kh/a /kh/b\n  ProxyJump jump@127.0.0.6:2202\n"
        "  ConnectTimeout 4\n  ServerAliveInterval 7\n"
    )
    t = resolve_target(adhoc_host("gpu"), cfg)
    assert (t.hostname, t.user, t.port) == ("127.0.0.5", "ubuntu", 2201)
    assert t.identity_files == ("/keys/id",)
    assert t.known_hosts == ("/kh/a", "/kh/b")
    assert t.timeouts.connect == 4 and t.timeouts.keepalive == 7
    assert len(t.jump) == 1 and (t.jump[0].hostname, t.jump[0].user, t.jump[0].port) == ("127.0.0.6", "jump", 2202)


def test_inventory_wins_over_ssh_config():
    inv = parse_inventory_data({"hosts": {"gpu": {"address": "127.0.0.7", "user": "root", "port": 22}}}, "f")
    cfg = _config("Host 127.0.0.7\n  User other\n  Port 2222\n  IdentityFile /k\n")
    t = resolve_target(inv[0], cfg, policy="accept-new")
    assert (t.hostname, t.user, t.port, t.identity_files) == ("127.0.0.7", "root", 22, ("/k",))
    assert t.host_key_policy == "accept-new"
