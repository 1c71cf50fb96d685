"""`App.preconnect`: connections opened in the background are taken over by `App.remote`,
with the connect's own typed error; `close` closes what was never taken over.  Plus the
CLI process's start-up GC policy and the console's lazy rich (issue 13, start-up).

The connection itself is a stand-in object here (no sshd): what is tested is the
hand-over between threads; the real connect over sshd is covered by every lab test
of `health`, which preconnects."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import paramiko
import pytest

from remote_ops.cli.app import App
from remote_ops.cli.console import Console
from remote_ops.core.inventory import HostSpec
from remote_ops.errors import Unreachable


class Conn:
    """Stands in for an open FabricRemote: records whether it was closed."""

    def __init__(self, name: str) -> None:
        self.name, self.closed, self.thread = name, False, threading.current_thread().name

    def close(self) -> None:
        self.closed = True


def _app(monkeypatch, opened: list, fail: set[str] = frozenset(), delay: float = 0.0) -> App:
    app = App(console=Console(quiet=True))

    def fake_open(host: HostSpec) -> Conn:
        time.sleep(delay)
        if host.name in fail:
            raise Unreachable(f"connection to {host.name} refused", host=host.name)
        conn = Conn(host.name)
        opened.append(conn)
        return conn

    monkeypatch.setattr(app, "_open", fake_open)
    return app


def hosts(*names: str) -> list[HostSpec]:
    return [HostSpec(name=n, address="127.0.0.1") for n in names]


def test_remote_takes_over_the_connection_opened_in_the_background(monkeypatch):
    opened: list[Conn] = []
    app = _app(monkeypatch, opened, delay=0.05)
    a, b = hosts("a", "b")
    app.preconnect([a, b])
    assert app.remote(a).thread == "connect a" and app.remote(b).thread == "connect b"
    assert app.remote(a) is app.remote(a) and len(opened) == 2  # one connection per host, not two


def test_a_failed_background_connect_raises_its_typed_error_where_the_host_is_used(monkeypatch):
    app = _app(monkeypatch, [], fail={"down"})
    (down,) = hosts("down")
    app.preconnect([down])
    with pytest.raises(Unreachable, match="refused") as err:
        app.remote(down)
    assert err.value.exit_code == 4


def test_close_closes_connections_never_taken_over(monkeypatch):
    opened: list[Conn] = []
    app = _app(monkeypatch, opened, delay=0.02)
    a, b = hosts("a", "b")
    app.preconnect([a, b])
    app.remote(a)
    app.close()  # b is closed in the background once its attempt ends: close() does not wait for it
    deadline = time.monotonic() + 5
    while not (len(opened) == 2 and all(c.closed for c in opened)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(c.name for c in opened) == ["a", "b"] and all(c.closed for c in opened)


def test_a_host_not_preconnected_is_opened_inline(monkeypatch):
    opened: list[Conn] = []
    app = _app(monkeypatch, opened)
    (a,) = hosts("a")
    assert app.remote(a).thread == threading.current_thread().name


def test_the_cli_process_runs_its_first_second_without_cyclic_gc_then_resumes_it():
    probe = (
        "import gc, sys, time, remote_ops.cli.main as c\n"
        "c._defer_gc(); print(gc.isenabled()); time.sleep(c.GC_GRACE_S + 0.5); print(gc.isenabled())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30).stdout
    assert out.split() == ["False", "True"]


def test_console_output_keeps_emoji_codes_as_text(capsys):
    Console().say("build log: :fire: done")
    assert ":fire:" in capsys.readouterr().err


def test_deploys_build_timeout_default_is_the_workflows():
    from remote_ops.cli.commands import deploy as deploy_cmd
    from remote_ops.workflows import deploy as deploy_mod

    assert deploy_cmd.BUILD_TIMEOUT_S == deploy_mod.BUILD_TIMEOUT_S


# -- speculation: handshakes started from the raw inventory, before validation ------------------

INVENTORY = """
defaults:
  user: root
  known_hosts: /tmp/ro-test-known-hosts
hosts:
  gpu-a: {address: 127.0.0.11, port: 2222}
  gpu-b: {address: 127.0.0.12}
"""


def _spec_app(monkeypatch, tmp_path, text: str = INVENTORY, policy: str = "strict") -> tuple[App, list]:
    inv = tmp_path / "fleet.yaml"
    inv.write_text(text)
    app = App(console=Console(quiet=True), inventory_paths=[inv], host_key_policy=policy)
    app._ssh_config = paramiko.SSHConfig()  # no ~/.ssh/config of this machine
    opened: list = []

    def fake_open_target(target, name):
        conn = Conn(name)
        conn.target = target
        opened.append(conn)
        return conn

    monkeypatch.setattr(app, "_open_target", fake_open_target)
    return app, opened


def test_raw_hosts_reads_one_host_or_one_files_group_with_defaults(tmp_path):
    from remote_ops.core.rawinv import raw_hosts

    inv = tmp_path / "fleet.yaml"
    inv.write_text(INVENTORY)
    one = raw_hosts("gpu-a", [inv])
    assert one == {
        "gpu-a": {
            "address": "127.0.0.11",
            "user": "root",
            "port": 2222,
            "identity_file": None,
            "known_hosts": "/tmp/ro-test-known-hosts",
            "proxy_jump": None,
        }
    }
    assert sorted(raw_hosts("fleet", [inv]) or {}) == ["gpu-a", "gpu-b"]
    assert raw_hosts("nope", [inv]) is None


@pytest.mark.parametrize(
    "text",
    [
        "hosts:\n  gpu-a: {address: 127.0.0.11, proxy_jump: bastion}\n",  # a jump host: not speculated
        "hosts:\n  gpu-a: {address: '127.0.0.11; rm -rf /'}\n",  # not a plain value
        "hosts:\n  gpu-a: [1, 2]\n",  # not a mapping
        "hosts: {gpu-a: {address: 127.0.0.11}\n",  # not YAML
    ],
)
def test_raw_hosts_gives_up_on_anything_unusual(tmp_path, text):
    from remote_ops.core.rawinv import raw_hosts

    inv = tmp_path / "x.yaml"
    inv.write_text(text)
    assert raw_hosts("gpu-a", [inv]) is None


def test_a_speculative_connection_is_kept_when_the_validated_host_goes_to_the_same_target(monkeypatch, tmp_path):
    app, opened = _spec_app(monkeypatch, tmp_path)
    app.speculate("gpu-a")
    (host,) = app.select("gpu-a")
    app.preconnect([host])
    conn = app.remote(host)
    assert opened == [conn] and conn.thread == "connect gpu-a"
    assert (conn.target.hostname, conn.target.port) == ("127.0.0.11", 2222)


def test_a_speculative_connection_to_another_target_is_closed_and_the_right_one_opened(monkeypatch, tmp_path):
    app, opened = _spec_app(monkeypatch, tmp_path)
    app.speculate("gpu-a")
    app.host_key_policy = "accept-new"  # the validated host now resolves to another target
    (host,) = app.select("gpu-a")
    used = app.remote(host)
    deadline = time.monotonic() + 5
    while not opened[0].closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(opened) == 2 and opened[0].closed and opened[1] is used and not used.closed
    assert used.target.host_key_policy == "accept-new"


def test_close_closes_a_speculative_connection_never_used(monkeypatch, tmp_path):
    app, opened = _spec_app(monkeypatch, tmp_path)
    app.speculate("gpu-a")
    app.close()  # e.g. the command failed before it connected
    deadline = time.monotonic() + 5
    while not (opened and opened[0].closed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c.name for c in opened] == ["gpu-a"] and opened[0].closed


def test_no_speculation_for_a_group(monkeypatch, tmp_path):
    app, opened = _spec_app(monkeypatch, tmp_path)
    app.speculate("fleet")  # a refused many-host deploy must open nothing
    assert app._speculative == {} and opened == []


def test_no_speculation_unless_host_keys_are_strict(monkeypatch, tmp_path):
    app, opened = _spec_app(monkeypatch, tmp_path, policy="accept-new")  # it may write known_hosts
    app.speculate("gpu-a")
    assert app._speculative == {} and opened == []


def test_raw_hosts_skips_a_missing_path_like_the_loader(tmp_path):
    from remote_ops.core.rawinv import raw_hosts

    inv = tmp_path / "fleet.yaml"
    inv.write_text(INVENTORY)
    assert sorted(raw_hosts("gpu-a", [tmp_path / "inventory", inv]) or {}) == ["gpu-a"]
