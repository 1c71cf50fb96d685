"""The seam's shared run protocol (BaseRemote) and its one host-key policy (pure / local)."""

from __future__ import annotations

import pytest

from remote_ops.errors import CommandFailed, CommandTimedOut
from remote_ops.remote import HostKeyPolicy, LocalRemote
from remote_ops.remote.sshconfig import SshTarget
from remote_ops.remote.transfer import ssh_argv


def test_local_remote_shares_the_run_protocol_and_reports_each_command():
    seen = []
    r = LocalRemote(timeout=5)
    r.on_command = lambda command, seconds, status: seen.append((command, status, seconds >= 0))
    assert r.run(["echo", "a b"]).stdout == "a b\n"
    with pytest.raises(CommandFailed) as failed:
        r.run("echo oops >&2; exit 3")
    assert failed.value.exit_status == 3 and "oops" in failed.value.stderr_tail
    assert r.run("exit 4", check=False).exit_status == 4
    with pytest.raises(CommandTimedOut):
        r.run("sleep 5", timeout=0.3)
    assert [(c, s) for c, s, _ in seen] == [
        ("echo 'a b'", 0),
        ("echo oops >&2; exit 3", 3),
        ("exit 4", 4),
        ("sleep 5", None),
    ]
    assert r.round_trips == 4


@pytest.mark.parametrize("policy,word", [("strict", "yes"), ("accept-new", "accept-new")])
def test_ssh_argv_takes_the_policy_from_the_one_definition(tmp_path, policy, word):
    known = (str(tmp_path / "known hosts"), str(tmp_path / "k2"))
    t = SshTarget(name="h", hostname="127.0.0.9", user="u", port=2222, known_hosts=known, host_key_policy=policy)
    options = HostKeyPolicy.of(t).ssh_options()
    argv = ssh_argv(t)
    assert f"StrictHostKeyChecking={word}" in options
    assert options == argv[3 : 3 + len(options)]  # after `ssh -F /dev/null`, verbatim
    assert f'UserKnownHostsFile="{known[0]}" {known[1]}' in argv
