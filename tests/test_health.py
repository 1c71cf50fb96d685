"""Health evaluators from captured probe output (pure)."""

import json

from remote_ops.core.inventory import HostSpec
from remote_ops.engine import labels
from remote_ops.errors import ExitCode
from remote_ops.probes import endpoints, gpu as gpu_probes
from remote_ops.workflows import health

HOST = HostSpec(name="gpu-node", gpus={"count": 2}, dump={"dir": "/data/d", "min_free_gb": 100})
IMAGE_REF = "remote-ops/sglang-eagle3:0.5.9-abc"
LABELS = {labels.PATCH_HASH: "abc", labels.SHA_AFTER: "f" * 64}


def container(running=True, health_status="healthy", image_id="sha256:img", ref=IMAGE_REF, oom=False, restarts=0):
    return {
        "Image": image_id,
        "RestartCount": restarts,
        "Config": {"Image": ref},
        "State": {
            "Running": running,
            "Status": "running" if running else "exited",
            "ExitCode": 0 if running else 137,
            "OOMKilled": oom,
            "Health": {"Status": health_status},
        },
    }


def image(image_id="sha256:img", labels=LABELS):
    return {"Id": image_id, "Config": {"Labels": labels}}


def sections(c=None, img=None, patch=(0, "f" * 64 + "  /x/deepseek_v2.py\n2\n"), version="0.5.9", dumps="3 300\n"):
    inspect = (json.dumps([c]) + "\n" + (json.dumps([img]) if img else "")) if c else "Error: No such container"
    info = json.dumps({"version": version})
    http = {
        "/model_info": {"path": "/model_info", "status": 200, "ms": 1, "body": "{}"},
        "/server_info": {"path": "/get_server_info", "status": 200, "ms": 1, "body": info},
        "/v1/models": {"path": "/v1/models", "status": 200, "ms": 1, "body": "{}"},
    }
    df = "Filesystem 1-blocks Used Available Capacity Mounted on\n/dev/x 1 1 900000000000 1% /data\n"
    nvsmi = "0, GPU, 1, 1, 40, 0, 12.0, 580\n1, GPU, 1, 1, 41, 0, 12.0, 580\n"
    return {
        "docker": (0, '{"Client":{"Version":"27"},"Server":{"Version":"27","ApiVersion":"1.46"}}'),
        "gpus": (0, nvsmi),
        "gpu_procs": (0, ""),
        "container": (0 if c else 1, inspect),
        "patch": patch,
        "http": (0, json.dumps(http)),
        "dumps": (0, dumps + df),
    }


def by_name(checks):
    return {f"{c.tier}/{c.name}": c for c in checks}


def test_all_ok():
    checks = health.evaluate(HOST, sections(container(), image()), expected_image=IMAGE_REF)
    bad = [c for c in checks if c.status not in ("ok", "skip")]
    assert not bad, bad
    r = health.HostHealth("gpu-node", checks)
    assert r.worst == "ok" and health.exit_code([r]) == ExitCode.OK


def test_stopped_container_fails_state():
    checks = by_name(health.evaluate(HOST, sections(container(running=False), image())))
    assert checks["container/state"].status == "fail"
    assert checks["patch/in_container"].status == "skip"


def test_wrong_image_fails_image_check():
    checks = by_name(health.evaluate(HOST, sections(container(ref="other:tag"), image()), expected_image=IMAGE_REF))
    assert checks["container/image"].status == "fail"
    checks = by_name(health.evaluate(HOST, sections(container(), image(labels={}))))
    assert checks["container/image"].status == "fail"


def test_missing_patch_fails_patch_check():
    checks = by_name(health.evaluate(HOST, sections(container(), image(), patch=(1, "  /x/deepseek_v2.py\n0\n"))))
    assert checks["patch/in_container"].status == "fail"
    other = (0, "0" * 64 + "  /x/deepseek_v2.py\n2\n")
    checks = by_name(health.evaluate(HOST, sections(container(), image(), patch=other)))
    assert checks["patch/in_container"].status == "fail"


def test_version_mismatch_and_gpu_count():
    s = sections(container(), image(), version="0.5.10")
    s["gpus"] = (0, "0, GPU, 1, 1, 40, 0, 12.0, 580\n")
    checks = by_name(health.evaluate(HOST, s))
    assert checks["sglang/version"].status == "fail"
    assert checks["gpus/count"].status == "fail"


def test_stray_gpu_process_warns_and_hot_gpu_warns():
    s = sections(container(), image())
    s["gpu_procs"] = (0, "1234 70000 stray\n99 5 ours\n")
    s["gpus"] = (0, "0, GPU, 1, 1, 95, 0, 12.0, 580\n1, GPU, 1, 1, 41, 2, 12.0, 580\n")
    checks = by_name(health.evaluate(HOST, s))
    assert checks["gpus/processes"].status == "warn" and "1234" in checks["gpus/processes"].reason
    assert checks["gpus/temperature"].status == "warn"
    assert checks["gpus/ecc"].status == "fail"


def test_dump_growth_uses_local_baseline():
    first = by_name(health.evaluate(HOST, sections(container(), image(), dumps="3 300\n"), now=100.0))
    assert first["dumps/growth"].status == "ok" and "baseline" in first["dumps/growth"].reason
    grown = by_name(
        health.evaluate(
            HOST, sections(container(), image(), dumps="5 500\n"), last_dumps=first["dumps/growth"].data, now=110.0
        )
    )
    assert grown["dumps/growth"].status == "ok" and "+2 files" in grown["dumps/growth"].reason
    stuck = by_name(
        health.evaluate(
            HOST, sections(container(), image(), dumps="5 500\n"), last_dumps=grown["dumps/growth"].data, now=200.0
        )
    )
    assert stuck["dumps/growth"].status == "warn"


def test_low_disk_fails():
    s = sections(container(), image())
    s["dumps"] = (0, "1 1\nFilesystem 1-blocks Used Available Capacity Mounted on\n/dev/x 1 1 5000000000 99% /\n")
    assert by_name(health.evaluate(HOST, s))["dumps/free_disk"].status == "fail"


def test_exit_codes_follow_worst():
    warn = health.HostHealth("a", [health.Check("x", "y", "warn", "")])
    ok = health.HostHealth("b", [health.Check("x", "y", "ok", "")])
    assert health.exit_code([ok, warn]) == ExitCode.HEALTH_WARN
    assert health.exit_code([ok]) == ExitCode.OK


def test_allreduce_fusion_window_from_real_gpus_tp_and_version():
    from remote_ops.probes.gpu import Gpu

    def gpu(cc):
        return Gpu(0, "GPU", 1, 1, 40, 0, cc, "580")

    tp8 = HostSpec(name="h", server={"tp": 8})
    assert gpu_probes.check_fusion(tp8, [gpu("12.0")]).status == "ok"  # RTX PRO 6000 (sm120)
    assert gpu_probes.check_fusion(tp8, [gpu("9.0")]).status == "warn"  # H100/H200 (sm90)
    assert gpu_probes.check_fusion(tp8, [gpu("10.0")]).status == "warn"  # B200 (sm100)
    assert gpu_probes.check_fusion(tp8, []).status == "skip"
    assert gpu_probes.check_fusion(HostSpec(name="h", server={"tp": 1}), [gpu("9.0")]).status == "ok"
    newer = HostSpec(name="h", server={"tp": 8}, sglang={"version": "0.5.14"})
    assert gpu_probes.check_fusion(newer, [gpu("9.0")]).status == "ok"


# -- the HTTP probe: curl on the host, python3 where there is no curl ----------------------------

CURL_OUTPUT = (
    '@@http /model_info /model_info 0 200 0.001200\n{"model_path": "m"}\n'
    "@@http /server_info /server_info 0 404 0.000800\n\n"
    '@@http /server_info /get_server_info 0 200 0.000900\n{"version": "0.5.9"}\n'
    "@@http /v1/models /v1/models 7 000 0.000100\n"
    "curl: (7) Failed to connect to 127.0.0.1 port 30000 after 0 ms: Couldn't connect to server\n"
)


def test_curl_output_parses_to_the_python_probe_records():
    res = endpoints.parse_http(CURL_OUTPUT)
    assert res["/model_info"] == {"path": "/model_info", "status": 200, "ms": 1.2, "body": '{"model_path": "m"}'}
    assert res["/server_info"]["path"] == "/get_server_info" and res["/server_info"]["status"] == 200
    assert res["/v1/models"]["error"].startswith("curl exit 7: curl: (7) Failed to connect")
    by = by_name(endpoints.check_http(HOST, (0, CURL_OUTPUT), None))
    assert by["sglang/model_info"].status == "ok" and by["sglang/version"].status == "ok"
    assert by["sglang/v1_models"].status == "fail" and "Failed to connect" in by["sglang/v1_models"].reason


def test_http_probe_gives_the_same_records_with_curl_and_with_python_only(tmp_path):
    """The built probe, run by /bin/sh against a real local HTTP server: once with curl on PATH,
    once with only python3 (hosts without curl) - the parsed records agree."""
    import os
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path in ("/model_info", "/get_server_info", "/v1/models")
            body = json.dumps({"version": "0.5.9", "path": self.path}).encode() if found else b"no"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.do_GET() if self.path != "/generate" else self._generated()

        def _generated(self):
            body = b'{"text": "x"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = HostSpec(name="h", server={"port": server.server_address[1]})
        only_python = tmp_path / "bin"
        only_python.mkdir()
        (only_python / "python3").symlink_to(sys.executable)
        runs = {}
        for name, path in (("curl", os.environ["PATH"]), ("python", str(only_python))):
            proc = subprocess.run(
                ["/bin/sh", "-c", endpoints.HttpEndpoints(host, deep=True, probe_s=20).command()],
                env={"PATH": path},
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert proc.returncode == 0, (name, proc.stderr)
            assert ("@@http" in proc.stdout) == (name == "curl")
            runs[name] = endpoints.parse_http(proc.stdout)
    finally:
        server.shutdown()
    strip = {g: {k: v for k, v in r.items() if k != "ms"} for g, r in runs["curl"].items()}
    assert strip == {g: {k: v for k, v in r.items() if k != "ms"} for g, r in runs["python"].items()}
    assert strip["/server_info"]["path"] == "/get_server_info" and strip["/generate"]["status"] == 200
