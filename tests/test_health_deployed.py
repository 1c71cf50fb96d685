"""`health` against a real deployed container (lab host, stand-in server image).

Each broken state fails the right check: a stopped container, a wrong image,
a missing patch.  The deploy itself is covered in test_deploy_e2e.py.
"""

from __future__ import annotations

import pytest

from remote_ops.core import shell
from remote_ops.errors import ExitCode
from remote_ops.probes.patch import PatchInContainer, exec_patch_probe
from remote_ops.workflows import deploy, health

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def checks(remote, spec, **kw) -> dict[str, health.Check]:
    result = health.check_host(lambda _h: remote, spec, expected_image=deploy.image_ref(spec), **kw)
    return {f"{c.tier}/{c.name}": c for c in result.checks}


def test_deployed_host_is_healthy_in_one_round_trip(sglang_remote, deployed, tmp_path):
    result = health.check_host(
        lambda _h: sglang_remote, deployed, expected_image=deploy.image_ref(deployed), state_dir=tmp_path
    )
    by = {f"{c.tier}/{c.name}": c for c in result.checks}
    for name in (
        "ssh/connect",
        "engine/docker",
        "container/image",
        "patch/in_container",
        "sglang/model_info",
        "sglang/server_info",
        "sglang/v1_models",
        "sglang/version",
    ):
        assert by[name].status == "ok", (name, by[name])
    # docker's own HEALTHCHECK reports "starting" until its first interval has passed
    assert by["container/state"].status in ("ok", "warn"), by["container/state"]
    assert result.round_trips == 1
    deep = checks(sglang_remote, deployed, deep=True)
    assert deep["generation/generate"].status == "ok"


def test_stopped_container_fails_state(sglang_remote, deployed):
    sglang_remote.run(["docker", "stop", "-t", "2", deployed.container.name])
    by = checks(sglang_remote, deployed)
    assert by["container/state"].status == "fail" and by["sglang/model_info"].status == "fail"


def test_wrong_image_fails_image_check(sglang_remote, deployed, base_image):
    name = deployed.container.name
    sglang_remote.run(["docker", "rm", "-f", name])
    sglang_remote.run(["docker", "run", "-d", "--pull=never", "--name", name, base_image, "sleep", "300"])
    by = checks(sglang_remote, deployed)
    assert by["container/image"].status == "fail"


def test_missing_patch_fails_patch_check(sglang_remote, deployed):
    locate = (
        "import importlib.util; s=importlib.util.find_spec('sglang'); "
        "print(s.submodule_search_locations[0] + '/srt/models/deepseek_v2.py')"
    )
    strip = f"f=$(python3 -c {shell.quote(locate)}) && sed -i '/remote-ops/d' \"$f\""
    sglang_remote.run(["docker", "exec", deployed.container.name, "sh", "-c", strip])
    by = checks(sglang_remote, deployed)
    assert by["patch/in_container"].status == "fail"


def test_patch_probe_reads_the_same_file_through_proc_root_and_through_docker_exec(sglang_remote, deployed):
    """The fast path (the container's root seen from the host, no process started) and the
    `docker exec` fallback (a user who may not read /proc/PID/root) see the same file."""
    sha = shell.sha256_of_word('"$f"')
    count = "grep -c '>>> remote-ops' \"$f\""
    fast = sglang_remote.run(PatchInContainer(deployed).command()).stdout.split()
    slow = sglang_remote.run(exec_patch_probe(deployed, sha, count)).stdout.split()
    assert fast == slow and len(fast[0]) == 64 and fast[-1] == "2", (fast, slow)


def test_health_cli_exit_code_on_deployed_host(lab, deployed, lab_env, tmp_path):
    """Through the CLI: everything up -> exit 0 (or 11 while docker's own check is still starting)."""
    import subprocess
    import sys

    inv = tmp_path / "inv.yaml"
    import yaml

    inv.write_text(
        yaml.safe_dump(
            {"hosts": {deployed.name: deployed.model_dump(mode="json", exclude={"name", "source", "groups"})}}
        )
    )
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", "health", "--host", deployed.name],
        env={**lab_env, "REMOTE_OPS_INVENTORY": str(inv)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode in (ExitCode.OK, ExitCode.HEALTH_WARN), p.stderr


def test_a_dump_dir_made_again_fails_dumps_mount_until_deploy_recreates_the_container(sglang_remote, deployed):
    """The dump dir removed and made again under the running server: its mount is the deleted dir.
    `health` fails `dumps/mount` (exit 12) naming the remedy, `deploy` (its dry run says why)
    recreates the container, `health` passes, and deploy again is a no-op.  A dump dir removed and
    not made again: deploy makes it and recreates the container, and the next deploy is a no-op."""
    from remote_ops.engine import labels
    from remote_ops.workflows import container

    dump_dir, name = deployed.dump.dir, deployed.container.name
    first = container.inspect_container(sglang_remote, name)
    assert first.labels[labels.DUMP_DIR_ID] and checks(sglang_remote, deployed)["dumps/mount"].status == "ok"
    sglang_remote.run(shell.and_then(["rm", "-rf", dump_dir], ["mkdir", dump_dir]))
    stale = health.check_host(lambda _h: sglang_remote, deployed, expected_image=deploy.image_ref(deployed))
    mount = {f"{c.tier}/{c.name}": c for c in stale.checks}["dumps/mount"]
    assert mount.status == "fail" and "removed and made again" in mount.reason, mount
    assert "`remote-ops deploy` recreates the container" in mount.reason
    assert health.exit_code([stale]) == ExitCode.HEALTH_FAIL
    dry = deploy.deploy(sglang_remote, deployed, dry_run=True)
    assert dry.plan["start"] and not dry.plan["build"] and dry.plan["reasons"]["start"].startswith("stale mount: ")
    assert f"{labels.DUMP_DIR_ID}=" in dry.diffs["docker run"]
    fixed = deploy.deploy(sglang_remote, deployed, why="test")
    assert fixed.container_id != first.id and {s.name: s.status for s in fixed.steps}["start"] == "changed"
    after = checks(sglang_remote, deployed)
    assert after["dumps/mount"].status == "ok" and not [c for c in after.values() if c.status == "fail"], after
    assert deploy.deploy(sglang_remote, deployed, why="test").up_to_date

    sglang_remote.run(["rm", "-rf", dump_dir])  # gone: deploy makes it and records the new one
    remade = deploy.deploy(sglang_remote, deployed, why="test")
    assert remade.plan["reasons"]["start"].startswith("stale mount: ") and remade.container_id != fixed.container_id
    again = deploy.deploy(sglang_remote, deployed, why="test")
    assert again.up_to_date and again.container_id == remade.container_id
    assert checks(sglang_remote, deployed)["dumps/mount"].status == "ok"
