"""Issue 13 item 8: right after `deploy` reports healthy, `health` exits 0.

Deploy's wait and health agree on "healthy": a running container whose docker
health check is still `starting` (its first probe runs one interval after the
start) is ok when every cheap endpoint answers.  And `dumps/growth` warns only
while an extraction is running: a dump dir that stands still with no
extraction client alive is expected.
"""

from __future__ import annotations

import json

import pytest

from remote_ops.core.inventory import HostSpec
from remote_ops.errors import ExitCode
from remote_ops.workflows import deploy, health

HOST = HostSpec(name="gpu-node", gpus={"count": 0}, dump={"dir": "/data/d", "min_free_gb": 1})
DF = "Filesystem 1-blocks Used Available Capacity Mounted on\n/dev/x 1 1 900000000000 1% /data\n"


def _sections(health_status: str, endpoint_status: int = 200, extraction: int | None = None) -> dict:
    c = {
        "Id": "c",
        "Image": "sha256:i",
        "RestartCount": 0,
        "Config": {"Image": "img:t"},
        "State": {
            "Running": True,
            "Status": "running",
            "ExitCode": 0,
            "OOMKilled": False,
            "Health": {"Status": health_status},
        },
    }
    img = {"Id": "sha256:i", "RepoTags": ["img:t"], "Config": {"Labels": {"org.remote-ops.patch.hash": "h"}}}
    info = json.dumps({"version": HOST.sglang.version})
    http = {
        "/model_info": {"path": "/model_info", "status": endpoint_status, "ms": 1, "body": "{}"},
        "/server_info": {"path": "/server_info", "status": 200, "ms": 1, "body": info},
        "/v1/models": {"path": "/v1/models", "status": 200, "ms": 1, "body": "{}"},
    }
    sec = {
        "docker": (0, '{"Client":{"Version":"27"},"Server":{"Version":"27","ApiVersion":"1.46"}}'),
        "gpus": (127, ""),
        "gpu_procs": (127, ""),
        "container": (0, json.dumps([c, img])),
        "patch": (0, "f" * 64 + "  /x/deepseek_v2.py\n2\n"),
        "http": (0, json.dumps(http)),
        "dumps": (0, "5 500\n" + DF),
    }
    if extraction is not None:
        sec["extraction"] = (extraction, "")
    return sec


def _by_name(checks):
    return {f"{c.tier}/{c.name}": c for c in checks}


def test_starting_with_answering_endpoints_is_ok():
    state = _by_name(health.evaluate(HOST, _sections("starting")))["container/state"]
    assert state.status == "ok" and "endpoints answer" in state.reason


def test_starting_with_a_failing_endpoint_still_warns():
    state = _by_name(health.evaluate(HOST, _sections("starting", endpoint_status=503)))["container/state"]
    assert state.status == "warn"


def test_standing_dumps_warn_only_while_an_extraction_runs():
    base = {"files": 5, "bytes": 500, "time": 0.0}
    idle = _by_name(health.evaluate(HOST, _sections("healthy", extraction=1), last_dumps=base, now=100.0))
    running = _by_name(health.evaluate(HOST, _sections("healthy", extraction=0), last_dumps=base, now=100.0))
    assert idle["dumps/growth"].status == "ok" and "no extraction running" in idle["dumps/growth"].reason
    assert running["dumps/growth"].status == "warn"


@pytest.mark.docker
@pytest.mark.slow
def test_health_right_after_deploy_exits_0_twice(sglang_remote, deployed, tmp_path):
    """The deploy fixture has just reported healthy (fresh container: docker health `starting`)."""
    for _ in range(2):  # the second run compares dump growth with the first
        result = health.check_host(
            lambda _h: sglang_remote, deployed, expected_image=deploy.image_ref(deployed), state_dir=tmp_path
        )
        warned = [c for c in result.checks if c.status != "ok" and c.status != "skip"]
        assert health.exit_code([result]) == ExitCode.OK, warned
