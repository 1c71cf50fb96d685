"""SSH defaults as OpenSSH's, and a port that never says hello (issue 29, item 5).

- The login user comes from the inventory, else ssh_config `User`, else the local
  user (`getpass.getuser()`, what `ssh HOST` logs in as); nothing assumes root.
  Pure tests of `resolve_target` and `transfer.ssh_argv`, then the CLI against a
  real lab sshd: with no user anywhere it logs in as `$LOGNAME` (a name the lab host
  does not have: exit 5, and the message names that user), ssh_config's `User root`
  gets in, and the inventory's `user` wins over ssh_config.
- A listener on 127.x that accepts TCP and sends nothing (or closes without a word):
  the CLI prints exactly the error line and the hint line on stderr and exits 4, for
  `-q --json`, the default and `-v`; paramiko's traceback (logged from its transport
  thread) never reaches stderr.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import paramiko
import pytest
from conftest import run_cli

from remote_ops.core.inventory import adhoc_host, parse_inventory_data
from remote_ops.errors import ConfigError
from remote_ops.hostlab.lab import random_loopback
from remote_ops.remote import transfer
from remote_ops.remote.sshconfig import SshTarget, resolve_target

LOCAL = "ro-local-tester"  # a login name no lab host has


def _config(text: str = "") -> paramiko.SSHConfig:
    return paramiko.SSHConfig.from_text(text)


@pytest.fixture
def local_user(monkeypatch):
    """`getpass.getuser()` answers LOCAL (it reads $LOGNAME first)."""
    monkeypatch.setenv("LOGNAME", LOCAL)
    return LOCAL


# -- who we log in as (pure) --------------------------------------------------------------------


def test_no_user_anywhere_is_the_local_user(local_user):
    t = resolve_target(adhoc_host("10.0.0.9"), _config("Host other\n  User someone\n"))
    assert t.user == local_user and t.display == f"{local_user}@10.0.0.9:22"


def test_ssh_config_user_beats_the_local_user(local_user):
    t = resolve_target(adhoc_host("10.0.0.9"), _config("Host 10.0.0.9\n  User ubuntu\n"))
    assert t.user == "ubuntu"


def test_inventory_user_beats_ssh_config(local_user):
    host = parse_inventory_data({"hosts": {"h": {"address": "10.0.0.9", "user": "ops"}}}, "f")[0]
    assert resolve_target(host, _config("Host 10.0.0.9\n  User ubuntu\n")).user == "ops"


def test_proxy_jump_hop_defaults_to_the_local_user_too(local_user):
    cfg = _config("Host 10.0.0.9\n  ProxyJump bastion\nHost bastion\n  HostName 10.0.0.1\n")
    t = resolve_target(adhoc_host("10.0.0.9"), cfg)
    assert [(j.hostname, j.user) for j in t.jump] == [("10.0.0.1", local_user)]


def test_a_bare_target_and_the_system_ssh_use_the_local_user(local_user):
    assert SshTarget(name="h", hostname="10.0.0.9").user == local_user
    argv = transfer.ssh_argv(resolve_target(adhoc_host("10.0.0.9"), _config()))
    assert argv[argv.index("-l") + 1] == local_user


def test_no_local_user_name_is_a_config_error(monkeypatch):
    def nobody() -> str:
        raise OSError("No username set in the environment")

    monkeypatch.setattr("getpass.getuser", nobody)
    with pytest.raises(ConfigError) as exc:
        resolve_target(adhoc_host("10.0.0.9"), _config())
    assert exc.value.exit_code == 3 and "User" in (exc.value.hint or "")


# -- who we log in as, through the CLI, against a real lab sshd ---------------------------------


def _lab_files(lab, tmp_path, name: str, *, user: str | None, config_user: str | None):
    """An inventory naming lab host `name` (with `user` or none) and an ssh_config for it."""
    h = lab.host(name)
    entry = {"address": h.address, "port": h.port, "identity_file": str(lab.client_key.private)}
    entry |= {"known_hosts": str(lab.known_hosts), **({"user": user} if user else {})}
    inv = tmp_path / "inventory.yaml"
    inv.write_text(json.dumps({"hosts": {name: entry}}))
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host {h.address}\n  User {config_user}\n" if config_user else "")
    return ["--inventory", str(inv), "--ssh-config", str(cfg)]


def _facts(lab_env, args, name):
    env = {**lab_env, "LOGNAME": LOCAL, "USER": LOCAL}
    return run_cli(env, "facts", "--host", name, "--json", *args, timeout=120)


def test_cli_logs_in_as_the_local_user_when_nothing_names_one(lab, host, lab_env, tmp_path):
    rc, out, err = _facts(lab_env, _lab_files(lab, tmp_path, host.name, user=None, config_user=None), host.name)
    assert rc == 5, (rc, err)  # the lab host has no such user: authentication fails
    assert f"{LOCAL}@{host.address}:{host.port}" in json.loads(out)["message"]
    assert "Traceback" not in err


def test_cli_ssh_config_user_then_inventory_user(lab, host, lab_env, tmp_path):
    rc, out, err = _facts(lab_env, _lab_files(lab, tmp_path, host.name, user=None, config_user="root"), host.name)
    assert rc == 0, err
    assert json.loads(out)["ssh"].startswith(f"root@{host.address}")
    rc, out, err = _facts(lab_env, _lab_files(lab, tmp_path, host.name, user="root", config_user=LOCAL), host.name)
    assert rc == 0, err  # the inventory's user wins over ssh_config's


def test_the_lab_inventory_names_its_user(lab):
    """The lab's sshd logins are root: its inventory says so rather than relying on a default."""
    assert {h.name: h.user for h in lab.inventory().hosts.values()} == {h.name: "root" for h in lab.hosts}


# -- a port that accepts TCP and never sends an SSH banner --------------------------------------


class QuietListener:
    """Accepts TCP connections on a random 127.x address and sends nothing; with `close_after`,
    closes each one after that many seconds, still without a word.  Stopped by its handle
    (`stop`: the listening socket closed, the thread joined); it also ends at `deadline_s`."""

    def __init__(self, close_after: float | None = None, deadline_s: float = 60.0) -> None:
        self.sock = socket.socket()
        self.sock.bind((random_loopback(0), 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.address, self.port = self.sock.getsockname()
        self.close_after, self.deadline = close_after, time.monotonic() + deadline_s
        self.conns: list[tuple[socket.socket, float]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="quiet listener", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            try:
                conn, _ = self.sock.accept()
                self.conns.append((conn, time.monotonic()))
            except (TimeoutError, OSError):
                pass
            if self.close_after is not None:
                for conn, since in self.conns:
                    if time.monotonic() - since >= self.close_after:
                        conn.close()
        for conn, _ in self.conns:
            conn.close()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def quiet():
    listener = QuietListener()
    yield listener
    listener.stop()


@pytest.fixture
def closing():
    listener = QuietListener(close_after=0.5)
    yield listener
    listener.stop()


def _quiet_run(tmp_path, listener: QuietListener, *verbosity: str):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(json.dumps({"hosts": {"quiet": {"address": listener.address, "port": listener.port, "user": "t"}}}))
    (tmp_path / "ssh_config").write_text("")
    env = {**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    args = ["--inventory", str(inv), "--ssh-config", str(tmp_path / "ssh_config"), "--connect-timeout", "2"]
    return run_cli(env, "facts", "--host", "quiet", *args, *verbosity, timeout=60)


VERBOSITIES = [("-q", "--json"), (), ("-v",)]


@pytest.mark.parametrize("verbosity", VERBOSITIES, ids=["quiet-json", "default", "verbose"])
def test_silent_port_is_one_error_line_and_exit_4(quiet, tmp_path, verbosity):
    rc, out, err = _quiet_run(tmp_path, quiet, *verbosity)
    where = f"t@{quiet.address}:{quiet.port}"
    assert rc == 4, err
    assert err.splitlines() == [
        f"error: quiet: SSH handshake with {where} failed: the port accepts TCP connections but sent no SSH "
        "banner within 2s",
        f"hint: is {quiet.port} the host's SSH port (`port` in the inventory, `Port` in ssh_config)? "
        "An overloaded sshd (MaxStartups) or a frozen host also sends none",
    ]
    if "--json" in verbosity:
        doc = json.loads(out)
        assert (doc["error"], doc["exit_code"], doc["reason"]) == ("unreachable", 4, "no_banner")


@pytest.mark.parametrize("verbosity", VERBOSITIES, ids=["quiet-json", "default", "verbose"])
def test_port_that_hangs_up_without_a_banner_is_one_error_line(closing, tmp_path, verbosity):
    """paramiko logs this one (with its traceback) from its thread as soon as the port hangs up."""
    rc, _out, err = _quiet_run(tmp_path, closing, *verbosity)
    assert rc == 4, err
    lines = err.splitlines()
    assert len(lines) == 2 and "Traceback" not in err, err
    assert lines[0].endswith("the port accepts TCP connections but closed the connection before sending an SSH banner")
    assert lines[1].startswith("hint: ")


def test_vv_may_show_paramikos_own_account(closing, tmp_path):
    rc, _out, err = _quiet_run(tmp_path, closing, "-vv")
    assert rc == 4 and "ssh: paramiko.transport" in err and err.rstrip().splitlines()[-1].startswith("hint: ")
