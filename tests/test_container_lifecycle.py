"""container start/stop/restart over a real deployed container: dry-run, no-op re-runs."""

import pytest

from remote_ops.workflows import container

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_stop_dry_run_then_stop_twice_then_start(sglang_remote, deployed):
    cid = container.inspect_container(sglang_remote, deployed.container.name).id
    cmds, before, after = container.lifecycle(sglang_remote, deployed, "stop", grace_s=2, dry_run=True)
    assert cmds and container.inspect_container(sglang_remote, deployed.container.name).running
    cmds, _, after = container.lifecycle(sglang_remote, deployed, "stop", grace_s=2)
    assert cmds and not after.running
    again, _, _ = container.lifecycle(sglang_remote, deployed, "stop", grace_s=2)
    assert again == []  # re-run is a no-op
    cmds, _, after = container.lifecycle(sglang_remote, deployed, "start", image=None)
    assert after.running and after.id == cid  # resumed, not recreated
