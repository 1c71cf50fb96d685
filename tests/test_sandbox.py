"""Sandbox pieces: inventory overrides (pure) and the SGLang stand-in server on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from remote_ops.hostlab._proc import free_port
from remote_ops.workflows import sandbox

REPO = Path(__file__).resolve().parents[1]


def test_standin_overrides_point_at_standin_image_and_launcher():
    entry = {"address": "127.0.0.9", "server": {"port": 31000}}
    out = sandbox.standin_overrides(entry, "remote-ops/sglang-standin:v0.5.9")
    assert out["sglang"]["base_image"] == "remote-ops/sglang-standin:v0.5.9"
    assert out["server"]["launcher"] == sandbox.STANDIN_LAUNCHER and out["server"]["port"] == 31000
    assert entry == {"address": "127.0.0.9", "server": {"port": 31000}}, "input not mutated"


def _get(url: str, data: bytes | None = None) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(urllib.request.Request(url, data=data), timeout=5) as r:
        return json.loads(r.read() or b"null") if r.headers.get("Content-Type") == "application/json" else {}


@pytest.fixture
def standin(tmp_path):
    """The stand-in server on 127.0.0.1 with the real 0.5.9 tree (cached wheel) and dumps on."""
    from remote_ops.wheels import fetch_sglang_wheel, unpack_python_tree

    try:
        unpack_python_tree(fetch_sglang_wheel("0.5.9"), tmp_path / "tree")
    except Exception as exc:
        pytest.skip(f"no SGLang 0.5.9 wheel: {exc}")
    shutil.copytree(REPO / "remote_ops" / "dumper", tmp_path / "py" / "remote_ops_dump")
    sandbox.write_model_config(tmp_path / "model")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'py'}:{tmp_path / 'tree' / 'python'}",
        "SGLANG_HS_DUMP_DIR": str(tmp_path / "dumps"),
        "STANDIN_LOAD_SECONDS": "0",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "docker/standin/sglang_standin_server.py"),
            "--model-path",
            str(tmp_path / "model"),
            "--port",
            str(port),
            "--tp",
            "8",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", tmp_path
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


def test_standin_speaks_the_cheap_endpoints(standin):
    base, _ = standin
    info = _get(base + "/get_server_info")
    assert info["version"] == "0.5.9" and info["standin"] is True
    assert _get(base + "/model_info")["hidden_size"] == 64
    assert _get(base + "/v1/models")["data"][0]["standin"] is True
    assert _get(base + "/health") == {}


def test_standin_generate_writes_contract_dumps(standin):
    base, tmp = standin
    body = json.dumps({"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 1}}).encode()
    out = _get(base + "/generate", body)
    assert out["meta_info"]["prompt_tokens"] == 5
    from remote_ops.dumper import dumpfile

    report = dumpfile.verify_dir(str(tmp / "dumps"), hidden_size=64)
    assert report.ok and report.files == 1 and report.tokens == 5
