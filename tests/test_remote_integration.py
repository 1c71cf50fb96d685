"""The SSH seam (`remote_ops.remote.FabricRemote`) against real sshd lab hosts.

Timing assertions are generous upper bounds ("it did not hang"), never speed
targets (those live in bench/).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from conftest import connect

from remote_ops.errors import CommandFailed, CommandTimedOut, ExitCode, HostKeyChanged, HostKeyUnknown, Unreachable
from remote_ops.hostlab import hang_command
from remote_ops.hostlab.lab import random_loopback
from remote_ops.hostlab.sshd import make_key
from remote_ops.remote import FabricRemote
from remote_ops.remote.sshconfig import Timeouts

SHORT = Timeouts(connect=2.0, banner=3.0, auth=3.0, command=30.0, keepalive=1)
AWKWARD = "dir with spaces; rm -rf nothing $(echo x) 'q' \"dq\""


def elapsed(fn):
    """Run fn, return (exception or None, seconds)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


# -- commands and files ------------------------------------------------------
def test_run_returns_output_and_status(remote):
    res = remote.run("echo out; echo err >&2; exit 0")
    assert (res.exit_status, res.stdout, res.stderr) == (0, "out\n", "err\n")
    assert remote.run("exit 3", check=False).exit_status == 3


def test_nonzero_exit_is_command_failed(remote):
    with pytest.raises(CommandFailed) as info:
        remote.run("echo boom >&2; exit 7")
    assert info.value.exit_status == 7 and "boom" in info.value.stderr_tail
    assert info.value.exit_code == ExitCode.COMMAND_FAILED


def test_input_and_streamed_lines(remote):
    lines = []
    res = remote.run(["sh", "-c", "cat; echo tail >&2"], input=b"a\nb\n", on_line=lambda s, l: lines.append((s, l)))
    assert res.stdout == "a\nb\n"
    assert ("stdout", "a") in lines and ("stdout", "b") in lines and ("stderr", "tail") in lines


def test_put_and_get_roundtrip(remote, host, tmp_path):
    remote_path = str(host.paths.root / "put-get.bin")
    payload = bytes(range(256)) * 4096
    remote.put(payload, remote_path, mode=0o600)
    assert remote.run(["stat", "-c", "%a %s", remote_path]).stdout.split() == ["600", str(len(payload))]
    local = tmp_path / "back.bin"
    remote.get(remote_path, local)
    assert local.read_bytes() == payload


def test_awkward_path_is_one_argument(remote, host, tmp_path):
    """Spaces, `;`, `$()` and quotes reach the remote as one argv element, for run and put/get."""
    target = host.paths.root / AWKWARD
    remote.run(["mkdir", "-p", str(target)])
    out = remote.run(
        ["python3", "-c", "import sys; print(len(sys.argv) - 1); print(sys.argv[1])", str(target)]
    ).stdout.splitlines()
    assert out == ["1", str(target)]
    assert target.is_dir()  # the hosts share this filesystem
    remote.put(b"hello", str(target / "f;1.txt"))
    remote.get(str(target / "f;1.txt"), tmp_path / "f.txt")
    assert (tmp_path / "f.txt").read_bytes() == b"hello"
    assert not (host.paths.root / "dir with spaces").exists()


# -- host keys -----------------------------------------------------------------
def test_unknown_host_key_is_refused(lab, host, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyUnknown) as info:
        FabricRemote(lab.target(host.name, known_hosts=str(empty))).connect()
    assert info.value.exit_code == ExitCode.HOST_KEY == 6
    assert "SHA256:" in str(info.value)
    assert empty.read_text() == ""  # strict never writes


def test_changed_host_key_is_refused_clearly(lab, host, tmp_path):
    other = make_key(tmp_path / "other_host_key").public_line().split()
    bad = tmp_path / "known_hosts"
    name = host.address if host.port == 22 else f"[{host.address}]:{host.port}"
    bad.write_text(f"{name} {other[0]} {other[1]}\n")
    for policy in ("strict", "accept-new"):
        with pytest.raises(HostKeyChanged) as info:
            FabricRemote(lab.target(host.name, known_hosts=str(bad), policy=policy)).connect()
        assert info.value.exit_code == ExitCode.HOST_KEY
        assert "CHANGED" in str(info.value) and str(bad) in (info.value.hint or "")


def test_accept_new_records_key_then_strict_works(lab, host, tmp_path):
    kh = tmp_path / "known_hosts"
    with FabricRemote(lab.target(host.name, known_hosts=str(kh), policy="accept-new")) as r:
        r.run("true")
    recorded = kh.read_text().split()
    expected_name = host.address if host.port == 22 else f"[{host.address}]:{host.port}"
    assert recorded[0] == expected_name and recorded[1] == "ssh-ed25519"
    with FabricRemote(lab.target(host.name, known_hosts=str(kh))) as r:
        assert r.run("echo ok").stdout == "ok\n"


def test_cli_exit_code_for_unknown_host_key(lab, host, tmp_path, lab_env):
    empty = tmp_path / "kh"
    empty.write_text("")
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        f"hosts:\n  {host.name}:\n    address: {host.address}\n    port: {host.port}\n"
        f"    identity_file: {lab.client_key.private}\n    known_hosts: {empty}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "remote_ops", "facts", "--host", host.name, "--inventory", str(inv)],
        capture_output=True,
        text=True,
        timeout=60,
        env=lab_env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 6, proc.stderr


# -- reachability faults ---------------------------------------------------------
def test_nothing_listening_is_unreachable(lab, host):
    address = random_loopback(host.port)
    exc, took = elapsed(lambda: FabricRemote(lab.target(host.name, address=address, timeouts=SHORT)).connect())
    assert isinstance(exc, Unreachable) and exc.exit_code == ExitCode.UNREACHABLE == 4
    assert exc.details.get("reason") == "refused"
    assert took < 15


def test_refused_port_is_unreachable(lab, faults, spare_host):
    faults.refuse(spare_host)
    exc, took = elapsed(lambda: FabricRemote(lab.target(spare_host.name, timeouts=SHORT)).connect())
    assert isinstance(exc, Unreachable), exc
    assert exc.details.get("reason") == "refused"
    assert took < 15
    faults.unblock(spare_host)
    with connect(lab, spare_host.name) as r:
        r.run("true")


def test_dropped_port_is_connect_timeout(lab, faults, spare_host):
    faults.drop(spare_host)
    exc, took = elapsed(lambda: FabricRemote(lab.target(spare_host.name, timeouts=SHORT)).connect())
    assert isinstance(exc, Unreachable), exc
    assert exc.details.get("reason") == "connect_timeout"
    assert SHORT.connect * 0.9 <= took < 30


def test_frozen_host_times_out_at_banner(lab, faults, spare_host):
    faults.freeze(spare_host)
    exc, took = elapsed(lambda: FabricRemote(lab.target(spare_host.name, timeouts=SHORT)).connect())
    assert isinstance(exc, Unreachable), exc
    assert took < 30


# -- mid-session faults --------------------------------------------------------
def test_hung_command_times_out_and_connection_survives(remote):
    exc, took = elapsed(lambda: remote.run(hang_command(), timeout=2))
    assert isinstance(exc, CommandTimedOut) and exc.exit_code == ExitCode.TIMEOUT == 8
    assert exc.timeout == 2 and 1.5 <= took < 30
    assert remote.run("echo still-here").stdout == "still-here\n"


def test_link_dropped_mid_session_times_out(lab, faults, spare_host):
    r = connect(lab, spare_host.name)
    r.run("true")
    faults.drop(spare_host)
    exc, took = elapsed(lambda: r.run("echo never", timeout=3))
    assert isinstance(exc, (CommandTimedOut, Unreachable)), exc
    assert took < 30
    r.close()


def _fault_mid_command(r, fault, timeout: float, join: float):
    """Run a hanging command on `r`, inject `fault` 0.5 s in; (exception, seconds it took)."""
    box = {}
    t = threading.Thread(target=lambda: box.update(res=elapsed(lambda: r.run(hang_command(), timeout=timeout))))
    t.start()
    time.sleep(0.5)
    fault()
    t.join(join)
    return box["res"]


def test_host_frozen_mid_command_times_out(lab, faults, spare_host):
    r = connect(lab, spare_host.name)
    exc, took = _fault_mid_command(r, lambda: faults.freeze(spare_host), timeout=4, join=60)
    assert isinstance(exc, CommandTimedOut), exc
    assert took < 30
    r.close()


def test_host_killed_mid_command_is_a_typed_error_fast(lab, faults, spare_host):
    """The command's deadline is 60 s, but a dead host must surface long before it."""
    r = connect(lab, spare_host.name)
    exc, took = _fault_mid_command(r, lambda: faults.crash(spare_host), timeout=60, join=90)
    assert isinstance(exc, Unreachable), exc
    assert exc.exit_code == ExitCode.UNREACHABLE
    assert took < 30
    with pytest.raises(Unreachable):
        r.run("true", timeout=5)
    r.close()


# -- ProxyJump -------------------------------------------------------------------
def _jump_target(lab, via: str, to: str, jump_known: str | None = None, final_known: str | None = None):
    target = lab.target(to, proxy_jump=via, **({"known_hosts": final_known} if final_known else {}))
    assert len(target.jump) == 1 and target.jump[0].name == via
    if jump_known:
        target = replace(target, jump=(replace(target.jump[0], known_hosts=(jump_known,)),))
    return target


def test_proxyjump_reaches_second_host(lab):
    with FabricRemote(_jump_target(lab, "lab1", "lab2")) as r:
        assert r.run("echo via-jump").stdout == "via-jump\n"
        assert r.host_key_fingerprint


def test_proxyjump_goes_through_the_jump_host(lab, faults):
    faults.refuse("lab1")
    with pytest.raises(Unreachable):
        FabricRemote(_jump_target(lab, "lab1", "lab2")).connect()


def test_proxyjump_strict_on_both_keys(lab, tmp_path):
    only = {}
    for h in lab.hosts:
        only[h.name] = tmp_path / f"only-{h.name}"
        only[h.name].write_text(h.sshd.known_hosts_line() + "\n")
    # jump host's key unknown
    with pytest.raises(HostKeyUnknown) as info:
        FabricRemote(_jump_target(lab, "lab1", "lab2", jump_known=str(only["lab2"]))).connect()
    assert info.value.host == "lab1"
    # final host's key unknown (jump is fine)
    with pytest.raises(HostKeyUnknown) as info:
        FabricRemote(
            _jump_target(lab, "lab1", "lab2", jump_known=str(only["lab1"]), final_known=str(only["lab1"]))
        ).connect()
    assert info.value.host == "lab2"
