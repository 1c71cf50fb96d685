"""SGLang wheels through the index's JSON Simple API, checked and cached: against a loopback server speaking that API."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import threading
import zipfile

import pytest

from remote_ops import wheels
from remote_ops.errors import NotFound, VerifyFailed

MEMBER = "sglang/srt/models/deepseek_v2.py"


def _wheel_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(MEMBER, "class DeepseekV2ForCausalLM:\n    pass\n")
    return buf.getvalue()


@pytest.fixture
def pypi(tmp_path, monkeypatch):
    """A loopback HTTP server with the JSON Simple API page of sglang and the files it lists."""
    blob = _wheel_bytes()
    state = {"sha": hashlib.sha256(blob).hexdigest(), "hits": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            state["hits"] += 1
            base = f"http://127.0.0.1:{self.server.server_port}"
            if self.path == "/simple/sglang/":
                files = [
                    {"filename": "sglang-9.9.9.tar.gz", "url": "x", "hashes": {"sha256": "0"}},
                    {
                        "filename": "sglang-9.9.9-cp311-cp311-manylinux_2_34_x86_64.whl",
                        "url": f"{base}/wrong",
                        "hashes": {"sha256": "0"},
                    },
                    {
                        "filename": "sglang-9.9.9-py3-none-any.whl",
                        "url": f"{base}/files/w.whl",
                        "hashes": {"sha256": state["sha"]},
                    },
                    {"filename": "sglang-9.9.9.1-py3-none-any.whl", "url": "y", "hashes": {"sha256": "0"}},
                ]
                body = json.dumps({"files": files}).encode()
            elif self.path == "/files/w.whl":
                body = blob
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("REMOTE_OPS_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    monkeypatch.setenv("REMOTE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    yield state
    server.shutdown()
    server.server_close()


def test_the_pure_python_wheel_is_fetched_checked_and_cached(pypi):
    path = wheels.fetch_sglang_wheel("9.9.9", timeout=10)
    assert path.name == "sglang-9.9.9-py3-none-any.whl"
    assert b"DeepseekV2ForCausalLM" in wheels.read_member(path, MEMBER)
    hits = pypi["hits"]
    assert wheels.fetch_sglang_wheel("9.9.9", timeout=10) == path and pypi["hits"] == hits  # from the cache


def test_a_digest_mismatch_keeps_nothing(pypi):
    pypi["sha"] = "0" * 64
    with pytest.raises(VerifyFailed):
        wheels.fetch_sglang_wheel("9.9.9", timeout=10)
    assert not list(wheels.wheel_dir().iterdir())


def test_an_unknown_release_is_not_found(pypi):
    with pytest.raises(NotFound):
        wheels.fetch_sglang_wheel("0.0.0", timeout=10)


def test_platform_wheels_only_pick_the_first_by_name():
    files = [
        {"filename": n, "url": n, "hashes": {"sha256": "s"}} for n in ("sglang-1-cp312-x.whl", "sglang-1-cp311-x.whl")
    ]
    assert wheels.pick_wheel(files, "1")[0] == "sglang-1-cp311-x.whl"
