"""deploy end to end on a real lab host (sshd + dockerd) with the SGLang stand-in image.

Covers: a first deploy (patch, verify, build with live output, start, healthy,
record, audit, unlock), a re-deploy that is a no-op, `--dry-run` changing
nothing, and failed build / failed start exiting non-zero naming the step and
leaving the documented state (checkout patched, lock released).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from remote_ops.engine import labels as labels_
from remote_ops.errors import CommandFailed, Refused
from remote_ops.workflows import container, deploy

pytestmark = [pytest.mark.docker, pytest.mark.slow]


class Recorder(deploy.Events):
    def __init__(self):
        self.steps, self.lines, self.progress_lines = [], [], []

    def step(self, s):
        self.steps.append((s.name, s.status))

    def line(self, stream, text):
        self.lines.append(text)

    def progress(self, text):
        self.progress_lines.append(text)


def _ctr(remote, spec):
    return container.inspect_container(remote, spec.container.name)


def _lock_free(spec):
    from pathlib import Path

    return not Path(spec.lock_dir).exists()


def test_deploy_then_noop_then_dry_run(sglang_remote, spec, tmp_path):
    # a first deploy: no image from an earlier test (deploy rightly reuses a current one)
    sglang_remote.run(["docker", "rm", "-f", spec.container.name], check=False)
    sglang_remote.run(["docker", "rmi", "-f", deploy.image_ref(spec)], check=False)
    ev = Recorder()
    first = deploy.deploy(sglang_remote, spec, events=ev, why="test")
    assert not first.up_to_date
    steps = dict(ev.steps)
    assert steps["patch"] == "changed" and steps["build"] == "changed" and steps["start"] == "changed"
    assert steps["wait"] == "ok" and _lock_free(spec)
    assert any("Step" in l or "#" in l for l in ev.lines), "build output is streamed"
    ctr = _ctr(sglang_remote, spec)
    assert ctr.running and ctr.image_id == first.image_id
    img = container.inspect_image(sglang_remote, first.image)
    assert img.labels[labels_.SHA_AFTER] == first.shas["after"]
    assert img.labels[labels_.PATCH_ID] == "eagle3-hs-dump"
    record = json.loads(open(first.record).read())
    assert record["ok"] and record["fingerprint"].startswith("SHA256:")
    audit = open(spec.audit_log).read().splitlines()
    assert json.loads(audit[-1])["action"] == "deploy"

    ev2 = Recorder()
    second = deploy.deploy(sglang_remote, spec, events=ev2)
    assert second.plan["up_to_date"], second.plan
    assert dict(ev2.steps)["build"] == "ok" and dict(ev2.steps)["start"] == "ok"
    assert _ctr(sglang_remote, spec).id == ctr.id, "no restart"
    assert second.round_trips <= 4, second.round_trips

    # dry run with a changed setting: plans a restart, changes nothing, shows the run diff
    changed = spec.model_copy(update={"container": spec.container.model_copy(update={"shm_size": "2g"})})
    audit_before = open(spec.audit_log).read()
    dry = deploy.deploy(sglang_remote, changed, dry_run=True)
    assert dry.plan["start"] and not dry.plan["build"]
    assert "--shm-size 2g" in dry.diffs["docker run"]
    assert _ctr(sglang_remote, spec).id == ctr.id and open(spec.audit_log).read() == audit_before


def test_dry_run_on_fresh_host_shows_patch_diff_and_changes_nothing(sglang_remote, spec):
    sha = subprocess.run(["sha256sum", spec.sglang.target_file], capture_output=True, text=True).stdout
    result = deploy.deploy(sglang_remote, spec, dry_run=True)
    assert result.plan["patch"] and result.plan["build"]
    diff = result.diffs[spec.sglang.target_file]
    assert "+" in diff and "remote_ops_dump" in diff
    assert "FROM " + spec.sglang.base_image in result.diffs["Dockerfile"]
    assert subprocess.run(["sha256sum", spec.sglang.target_file], capture_output=True, text=True).stdout == sha
    assert _lock_free(spec)


def test_failed_build_names_step_and_leaves_checkout_patched(sglang_remote, spec):
    broken = spec.model_copy(
        update={
            "sglang": spec.sglang.model_copy(update={"base_image": "remote-ops/absent:nope"}),
            "container": spec.container.model_copy(update={"tag": "broken"}),
        }
    )
    with pytest.raises(CommandFailed) as info:
        deploy.deploy(sglang_remote, broken)
    assert str(info.value.message).startswith("build:")
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_ops.core.anchors",
            "verify",
            "--spec",
            str(deploy.patch_spec_path(spec)),
            spec.sglang.target_file,
        ],
        capture_output=True,
        text=True,
    )
    assert json.loads(report.stdout)["ok"], "documented: a failed build leaves the checkout patched"
    assert _lock_free(spec)


def test_failed_start_names_step(sglang_remote, spec):
    bad = spec.model_copy(update={"container": spec.container.model_copy(update={"shm_size": "not-a-size"})})
    with pytest.raises(CommandFailed) as info:
        deploy.deploy(sglang_remote, bad)
    assert info.value.message.startswith("start:")
    assert _lock_free(spec)


def test_lock_held_refuses_with_exit_9(sglang_remote, spec):
    from pathlib import Path

    Path(spec.lock_dir).mkdir(parents=True)
    (Path(spec.lock_dir) / "info").write_text("who=someone@elsewhere\nwhat=patch apply\n")
    try:
        with pytest.raises(Refused) as info:
            deploy.deploy(sglang_remote, spec)
        assert info.value.exit_code == 9 and "someone" in info.value.message
    finally:
        import shutil

        shutil.rmtree(spec.lock_dir)
