"""container.py and the docker CLI's builders: argv builders and JSON parsers, from captured docker output (pure)."""

from __future__ import annotations

import json

from remote_ops.core import shell
from remote_ops.core.inventory import parse_inventory_data
from remote_ops.engine import cli_for
from remote_ops.workflows import container

CONTAINER_JSON = json.dumps(
    [
        {
            "Id": "abc123",
            "Name": "/sglang-eagle3",
            "Image": "sha256:img1",
            "RestartCount": 2,
            "State": {
                "Status": "running",
                "Running": True,
                "OOMKilled": False,
                "ExitCode": 0,
                "StartedAt": "2026-01-01T00:00:00Z",
                "Health": {"Status": "healthy"},
            },
            "Config": {"Image": "remote-ops/sglang-eagle3:0.5.9-x", "Labels": {"org.remote-ops.run-config": "r1"}},
        }
    ]
)
IMAGE_JSON = json.dumps(
    [
        {
            "Id": "sha256:img1",
            "RepoTags": ["remote-ops/sglang-eagle3:0.5.9-x"],
            "Size": 10,
            "Created": "2026",
            "Config": {"Labels": {"org.remote-ops.patch.id": "eagle3-hs-dump"}},
        }
    ]
)


def host(**over):
    body = {"address": "10.1.230.174", **over}
    return parse_inventory_data({"hosts": {"gpu-node": body}}, "t.yaml")[0]


def test_parse_container_inspect():
    c = container.parse_container_inspect(0, CONTAINER_JSON)
    assert c.running and c.health == "healthy" and c.restart_count == 2 and c.name == "sglang-eagle3"
    assert c.image_id == "sha256:img1" and c.labels["org.remote-ops.run-config"] == "r1"


def test_absent_container_and_image_are_none():
    missing = "[]\nError: No such object: sglang-eagle3"
    assert container.parse_container_inspect(1, missing) is None
    assert container.parse_image_inspect(1, missing) is None
    assert container.parse_image_inspect(0, "not json") is None


def test_parse_image_inspect():
    i = container.parse_image_inspect(0, IMAGE_JSON)
    assert i.id == "sha256:img1" and i.label("patch.id") == "eagle3-hs-dump"


def _choose_builder(buildx_status: int, version_doc: dict) -> str:
    """The docker CLI's choice from its two builder sections (`DockerCLI.builder_sections`)."""
    sections = {"buildx": (buildx_status, ""), "version": (0, json.dumps(version_doc))}
    return cli_for("docker").choose_builder(sections)


def test_choose_builder():
    v20 = {"Client": {"Version": "20.10.24+dfsg1"}}
    v28 = {"Client": {"Version": "28.2.2"}}
    assert _choose_builder(1, v20) == "buildkit"  # built into the 20.10 CLI
    assert _choose_builder(1, v28) == "legacy"  # >= 23 needs the buildx plugin
    assert _choose_builder(0, v28) == "buildkit"
    assert _choose_builder(1, {}) == "legacy"


def test_build_cmd_never_pulls():
    cmd = cli_for("docker").build_cmd("/ctx", "img:tag", "buildkit", "/ctx/.iid")
    assert cmd.startswith("DOCKER_BUILDKIT=1 docker build --pull=false") and "--progress=plain" in cmd
    assert cli_for("docker").build_cmd("/ctx", "t", "legacy", "/i").startswith("DOCKER_BUILDKIT=0 ")


def test_run_argv_for_gpu_node():
    h = host(dump={"layers": [2, 30, 58]})
    argv = container.run_argv(h, "remote-ops/sglang-eagle3:t")
    line = shell.join(argv)
    for part in [
        "--pull=never",
        "--init",
        "--restart unless-stopped",
        "--gpus all",
        "--shm-size 32g",
        "--ipc host",
        "-p 127.0.0.1:30000:30000",
        "-v /models/Kimi-K2.5:/models/Kimi-K2.5:ro",
        "-e SGLANG_HS_DUMP_DIR=/data/eagle3-dumps",
        "-e SGLANG_HS_DUMP_LAYERS=2,30,58",
        "--tp 8",
        "--disable-radix-cache",
        "--chunked-prefill-size 32768",
        "--host 0.0.0.0",
    ]:
        assert part in line, part
    image_at = argv.index("remote-ops/sglang-eagle3:t")
    assert argv[image_at + 1 : image_at + 4] == ["python3", "-m", "sglang.launch_server"]


def test_gpu_device_list_is_csv_quoted():
    assert container.gpu_args(host(container={"gpus": [0, 1]})) == ["--gpus", '"device=0,1"']
    assert container.gpu_args(host(container={"gpus": "none"})) == []


def test_run_config_changes_with_settings_only():
    a = container.expected_run_config(host(), "img:t")
    assert a == container.expected_run_config(host(), "img:t")
    assert a != container.expected_run_config(host(container={"shm_size": "64g"}), "img:t")
    assert a != container.expected_run_config(host(server={"chunked_prefill_size": 65536}), "img:t")


def test_parse_patch_verification():
    ok = container.parse_patch_verification("image x", 0, 'noise\n{"ok": true, "sha256": "s", "file": "f"}', "s")
    assert ok.ok and ok.sha256 == "s"
    bad = container.parse_patch_verification("image x", 1, '{"ok": false, "reason": "sha differs"}', "s")
    assert not bad.ok and bad.reason == "sha differs"
    garbage = container.parse_patch_verification("image x", 127, "python3: not found", None)
    assert not garbage.ok and "not found" in garbage.reason


# -- lifecycle plans (pure): check -> act, no-op re-runs -------------------------------------------
from remote_ops.workflows.container import lifecycle_plan  # noqa: E402


def _info(running: bool):
    import json as _json

    from remote_ops.workflows.container import parse_container_inspect

    doc = [
        {
            "Id": "c1",
            "Name": "/x",
            "Image": "sha256:i",
            "RestartCount": 0,
            "Config": {"Image": "r", "Labels": {}},
            "State": {"Running": running, "Status": "running" if running else "exited", "OOMKilled": False},
        }
    ]
    return parse_container_inspect(0, _json.dumps(doc))


def test_lifecycle_plans_are_noops_when_state_matches():
    from remote_ops.core.inventory import HostSpec

    h = HostSpec(name="h")
    assert lifecycle_plan("start", h, _info(True), "img") == []
    assert lifecycle_plan("stop", h, _info(False), None) == []
    assert lifecycle_plan("stop", h, _info(True), None, 5) == [["docker", "stop", "-t", "5", "sglang-eagle3"]]
    assert lifecycle_plan("start", h, _info(False), "img") == [["docker", "start", "sglang-eagle3"]]
    fresh = lifecycle_plan("start", h, None, "img:tag")
    assert "--pull=never" in fresh[1] and "img:tag" in fresh[1]


def test_lifecycle_without_container_or_image_is_not_found():
    import pytest

    from remote_ops.core.inventory import HostSpec
    from remote_ops.errors import NotFound

    with pytest.raises(NotFound):
        lifecycle_plan("stop", HostSpec(name="h"), None, None)
    with pytest.raises(NotFound):
        lifecycle_plan("start", HostSpec(name="h"), None, None)
