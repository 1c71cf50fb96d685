"""deploy of a vLLM host (`serving.engine: vllm`): the plan from one probe, the dry run's diffs
and the preflight (pure: probe answers as records, no host)."""

from __future__ import annotations

import json

from remote_ops.core.inventory import parse_inventory_data
from remote_ops.engine import labels as labels_
from remote_ops.serving import vllm as serving
from remote_ops.workflows import container, deploy, facts
from remote_ops.workflows.deploy import vllm as vdeploy

ENTRY = {
    "address": "127.0.0.2",
    "serving": {"engine": "vllm"},
    "vllm": {"version": "0.32.0", "base_image": "remote-ops/vllm-cpu:0.32.0"},
    "model": {"path": "/models/tiny", "served_name": "tiny", "num_layers": 4, "hidden_size": 128},
    "dump": {"dir": "/data/dumps", "layers": [1, 2, 3]},
    "server": {"port": 8000, "tp": 1},
    "container": {"name": "vllm-eagle3", "image": "remote-ops/vllm-eagle3", "gpus": "none"},
}


def host(**over):
    return parse_inventory_data({"hosts": {"v1": {**ENTRY, **over}}}, "t.yaml")[0]


def probe(h, *, image=True, running=True, ctx=None, run_config=None, health="healthy"):
    ref = serving.image_ref(h)
    img = container.ImageInfo("sha256:i", (ref,), {labels_.CONTEXT_HASH: ctx or serving.context_hash(h)})
    ctr = container.ContainerInfo(
        "c1",
        h.container.name,
        "sha256:i",
        ref,
        "running" if running else "exited",
        health,
        labels={labels_.RUN_CONFIG: run_config or container.expected_run_config(h, ref)},
    )
    f = facts.Facts(host=h.name, target_sha256=None, docker={"server": "28.0"})
    return deploy.Probe(f, "buildkit", img if image else None, ctr, None), ref


def test_a_current_vllm_host_is_up_to_date_and_never_patched():
    h = host()
    p, ref = probe(h)
    plan = vdeploy.make_plan(h, p, ref)
    assert plan.up_to_date and not plan.patch and not plan.wait
    assert plan.reasons == {"patch": serving.NO_PATCH}


def test_a_missing_image_or_a_new_vllm_release_rebuilds_and_restarts():
    h = host()
    p, ref = probe(h, image=False)
    plan = vdeploy.make_plan(h, p, ref)
    assert plan.build and plan.start and plan.wait and plan.reasons["build"] == "image missing"
    newer = host(vllm={"version": "0.33.0", "base_image": "remote-ops/vllm-cpu:0.33.0"})
    p, _ = probe(h)  # the image built for 0.32.0
    plan = vdeploy.make_plan(newer, p, serving.image_ref(newer))
    assert plan.build and plan.reasons["build"] == "build inputs changed"


def test_changed_capture_layers_restart_without_a_rebuild():
    h = host()
    p, ref = probe(h)
    moved = host(dump={"dir": "/data/dumps", "layers": [1, 2, 2]})
    plan = vdeploy.make_plan(moved, p, ref)
    assert not plan.build and plan.start and plan.reasons["start"] == "run settings changed"


def test_the_dry_run_shows_the_vllm_dockerfile_and_the_extraction_command_line():
    h = host()
    p, ref = probe(h, image=False)
    d = vdeploy.diffs(h, vdeploy.make_plan(h, p, ref), ref)
    assert "FROM remote-ops/vllm-cpu:0.32.0" in d["Dockerfile"]
    run = d["docker run"]
    assert "vllm.entrypoints.openai.api_server" in run and "--no-enable-chunked-prefill" in run
    assert json.dumps(serving.speculative_config(h), separators=(",", ":")) in run.replace("'", "")
    assert "SGLANG_HS_DUMP" not in run


def test_a_vllm_host_needs_no_patch_target_in_its_preflight():
    h = host()
    assert facts.target_of(h) is None
    p, _ = probe(h)
    assert deploy.preflight_problems(h, p) == []
    assert not any(type(x).__name__ == "PatchTarget" for x in deploy.probes_for(h, "x"))


def test_facts_of_a_vllm_host_name_its_serving_engine_and_ask_no_sglang_checkout():
    h = host()
    assert not any(type(x).__name__ in ("SglangVersion", "PatchTarget") for x in facts.probes(h))
    f = facts.parse(h, {})
    assert f.serving == "vllm" and f.vllm_version == "0.32.0" and f.sglang_version is None


def test_render_of_a_vllm_host_is_its_vllm_dockerfile_offline():
    from remote_ops.workflows.deploy import render_for_host

    text = render_for_host(host())
    assert text == serving.render_dockerfile(host()) and "FROM remote-ops/vllm-cpu:0.32.0" in text
