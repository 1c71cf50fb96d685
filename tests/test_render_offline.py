"""`render` offline first (issue 29, item 7): a local SGLang checkout of the host's release, then the
cached wheel, and only then the package index; an index that cannot be reached is exit 15
(`index_unreachable`), naming REMOTE_OPS_INDEX_URL, with no traceback.

The index is a closed loopback port: a socket bound on 127.0.0.1 that never listens, so every
connect to it is refused (never the internet).  The wheel is the real SGLang 0.5.9 wheel
(the lab's cache, `wheels.fetch_sglang_wheel`); each test has its own empty cache dir."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

from remote_ops import wheels
from remote_ops.errors import ExitCode

VERSION = "0.5.9"

INVENTORY = f"""\
hosts:
  node:
    address: 127.0.0.1
    port: 1
    sglang: {{checkout: /root/sglang, patch: deepseek-v2, version: "{VERSION}"}}
    model: {{path: /models/m, num_layers: 61, hidden_size: 7168}}
    dump: {{dir: /data/dumps, layers: [2, 30, 58]}}
"""


@pytest.fixture(scope="module")
def real_wheel() -> Path:
    try:
        return wheels.fetch_sglang_wheel(VERSION)
    except Exception as exc:  # no cached wheel and no index: the lab's own requirement
        require(f"cannot get the SGLang {VERSION} wheel: {exc}")
        raise


@pytest.fixture
def closed_index():
    """http://127.0.0.1:PORT/simple where PORT is bound and never listened on: connects are refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/simple"
    finally:
        sock.close()


@pytest.fixture
def env(tmp_path: Path, closed_index: str) -> dict[str, str]:
    inv = tmp_path / "inventory"
    inv.mkdir()
    (inv / "node.yaml").write_text(INVENTORY)
    e = {k: v for k, v in os.environ.items() if k not in ("REMOTE_OPS_SGLANG_CHECKOUT", "REMOTE_OPS_INVENTORY")}
    e.update(
        REMOTE_OPS_CACHE_DIR=str(tmp_path / "cache"),
        REMOTE_OPS_INDEX_URL=closed_index,
        REMOTE_OPS_STATE_DIR=str(tmp_path / "state"),
        REMOTE_OPS_DAEMON="0",
        REMOTE_OPS_INVENTORY=str(inv),
    )
    return e


def render(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", "render", "--host", "node", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stdout, p.stderr


def test_an_unreachable_index_is_its_own_exit_code_and_names_the_variable(env, closed_index):
    rc, out, err = render(env)
    assert rc == ExitCode.INDEX_UNREACHABLE == 15, err
    assert "Traceback" not in err
    assert "cannot reach the package index" in err and closed_index in err
    assert "REMOTE_OPS_INDEX_URL" in err  # the hint names what to set
    rc, out, err = render(env, "--json")
    doc = json.loads(out)
    assert rc == 15 and doc["error"] == "index_unreachable" and doc["exit_code"] == 15
    assert doc["env"] == "REMOTE_OPS_INDEX_URL" and doc["index_url"] == closed_index


def test_the_cached_wheel_is_used_with_the_index_unreachable(env, real_wheel):
    cache = Path(env["REMOTE_OPS_CACHE_DIR"]) / "wheels"
    cache.mkdir(parents=True)
    shutil.copy(real_wheel, cache / real_wheel.name)
    rc, out, err = render(env, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["source"] == {"kind": "cached wheel", "path": str(cache / real_wheel.name), "version": VERSION}
    assert "FROM " in doc["dockerfile"]


def test_a_local_checkout_of_the_release_is_used_before_any_wheel(env, real_wheel, tmp_path):
    checkout = tmp_path / "sglang"
    wheels.unpack_python_tree(real_wheel, checkout)
    assert wheels.checkout_version(checkout) == VERSION
    rc, out, err = render(env, "--json", "--sglang-checkout", str(checkout))
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["source"]["kind"] == "checkout" and doc["source"]["path"] == str(checkout)
    # the same file as the wheel's: the same Dockerfile (its labels carry the file's shas)
    cache = Path(env["REMOTE_OPS_CACHE_DIR"]) / "wheels"
    cache.mkdir(parents=True)
    shutil.copy(real_wheel, cache / real_wheel.name)
    rc, out2, err = render(env, "--json")
    assert rc == 0 and json.loads(out2)["dockerfile"] == doc["dockerfile"], err
    # through the environment variable too
    rc, out3, err = render({**env, "REMOTE_OPS_SGLANG_CHECKOUT": str(checkout)}, "--json")
    assert rc == 0 and json.loads(out3)["source"]["kind"] == "checkout", err


def test_a_checkout_of_another_release_is_passed_over(env, real_wheel, tmp_path):
    checkout = tmp_path / "sglang"
    wheels.unpack_python_tree(real_wheel, checkout)
    for name in ("version.py", "_version.py"):
        f = checkout / "python" / "sglang" / name
        if f.exists():
            f.write_text('__version__ = "0.5.8"\n')
    rc, out, err = render(env, "--sglang-checkout", str(checkout))
    assert rc == 15 and "REMOTE_OPS_INDEX_URL" in err, err  # not that checkout: on to the (closed) index


def test_a_missing_checkout_dir_is_a_usage_error(env, tmp_path):
    rc, _out, err = render(env, "--sglang-checkout", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist here" in err, err


def test_locate_prefers_checkout_then_cache_then_index(tmp_path, monkeypatch, real_wheel):
    monkeypatch.setenv("REMOTE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    assert wheels.locate(VERSION).kind == "index"
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    shutil.copy(real_wheel, tmp_path / "cache" / "wheels" / real_wheel.name)
    assert wheels.locate(VERSION).kind == "cached wheel"
    checkout = tmp_path / "co"
    (checkout / "python" / "sglang").mkdir(parents=True)
    (checkout / "python" / "sglang" / "version.py").write_text(f'__version__ = "{VERSION}"\n')
    assert wheels.locate(VERSION, checkout).kind == "checkout"
    assert wheels.locate("0.5.8", checkout).kind == "index"
