"""deploy's pure parts: the plan from one probe, the lock file, preflight refusals."""

from __future__ import annotations

from remote_ops.core.inventory import parse_inventory_data
from remote_ops.engine import labels as labels_
from remote_ops.workflows import container, deploy, facts

AFTER, BEFORE = "a" * 64, "b" * 64


def host(**over):
    entry = {"address": "10.1.230.174", "sglang": {"patch": "deepseek-v2"}, **over}
    return parse_inventory_data({"hosts": {"gpu-node": entry}}, "t.yaml")[0]


def probe(h, *, image=True, running=True, target=AFTER, ctx=None, run_config=None, image_id="sha256:i"):
    patch = deploy.load_patch(h)
    ref = deploy.image_tag(h, patch)
    labels = {
        labels_.SHA_AFTER: AFTER,
        labels_.SHA_BEFORE: BEFORE,
        labels_.PATCH_HASH: patch.hash,
        labels_.CONTEXT_HASH: ctx or deploy.context_hash(h, patch, BEFORE, AFTER),
    }
    img = container.ImageInfo(image_id, (ref,), labels) if image else None
    ctr = container.ContainerInfo(
        "c1",
        h.container.name,
        "sha256:i",
        ref,
        "running" if running else "exited",
        "healthy",
        labels={labels_.RUN_CONFIG: run_config or container.expected_run_config(h, ref)},
    )
    f = facts.Facts(host=h.name, target_sha256=target, docker={"server": "28.0"})
    return deploy.Probe(f, "buildkit", img, ctr, None), patch, ref


def test_nothing_changed_is_up_to_date():
    h = host()
    p, patch, ref = probe(h)
    plan = deploy.make_plan(h, patch, p, ref)
    assert plan.up_to_date and not plan.wait


def test_unpatched_file_plans_patch_and_build():
    h = host()
    p, patch, ref = probe(h, target="c" * 64)
    plan = deploy.make_plan(h, patch, p, ref)
    assert plan.patch and plan.build and plan.start


def test_changed_build_inputs_rebuild():
    h = host()
    p, patch, ref = probe(h, ctx="old")
    plan = deploy.make_plan(h, patch, p, ref)
    assert not plan.patch and plan.build and plan.reasons["build"] == "build inputs changed"


def test_stopped_container_or_new_settings_restart_without_rebuild():
    h = host()
    p, patch, ref = probe(h, running=False)
    plan = deploy.make_plan(h, patch, p, ref)
    assert plan.start and not plan.build and "exited" in plan.reasons["start"]
    p, patch, ref = probe(h, run_config="other")
    assert deploy.make_plan(h, patch, p, ref).reasons["start"] == "run settings changed"


def test_other_image_id_restarts():
    h = host()
    p, patch, ref = probe(h, image_id="sha256:new")
    assert deploy.make_plan(h, patch, p, ref).reasons["start"] == "container runs another image"


def test_preflight_refuses_wrong_gpu_count_and_no_engine():
    h = host(gpus={"count": 8})
    p, _, _ = probe(h)
    p.facts.docker = {"error": "Cannot connect to the Docker daemon"}
    problems = deploy.preflight_problems(h, p)
    assert any("8 GPUs" in x for x in problems) and any("docker engine" in x for x in problems)


def test_lock_info_has_no_pid_and_parses_back():
    text = deploy.lock_info("test run")
    assert "\npid=" not in "\n" + text
    info = deploy.parse_lock(0, text)
    assert info["what"] == "deploy: test run" and deploy.parse_lock(1, "") is None


def test_image_is_found_when_the_container_is_absent():
    """`inspect NAME REF` with NAME gone prints REF's document then an error line (exit 1): the
    image must still be seen, or deploy would rebuild a current image after `docker rm`."""
    import json

    h = host()
    img = {"Id": "sha256:i", "RepoTags": ["r:t"], "Config": {"Labels": {"a": "b"}}}
    sec = {"container": (1, json.dumps([img], indent=4) + "\nError: No such object: sglang-eagle3\n"), "lock": (0, "")}
    p = deploy.parse_probe(h, sec, locking=True)
    assert p.container is None and p.image is not None and p.image.id == "sha256:i"
