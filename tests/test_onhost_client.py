"""The on-host client skeleton (`remote_ops/onhost/client.py`): what a start ships is enough to run
a client on its own, and a third client is a subclass that says only what an item is and how it
is sent (here a toy one against a local HTTP server: retries, resume by key, a fatal cause).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from remote_ops import onhost
from remote_ops.core.extractplan import ExtractPaths
from remote_ops.core.regenplan import RegenPaths

ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _ship(paths: ExtractPaths, dest: Path) -> Path:
    """The files a start uploads (`ExtractPaths.shipped`), alone in `dest`; the client's path."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, _on_host in paths.shipped:
        (dest / name).write_bytes(onhost.source(name))
    return dest / paths.client_name


@pytest.mark.parametrize("layout", [ExtractPaths, RegenPaths])
def test_the_shipped_files_alone_run_the_client(layout, tmp_path):
    client = _ship(layout("/w", "/w/log", "/d"), tmp_path / "host")
    assert {p.name for p in (tmp_path / "host").iterdir()} == {layout.client_name, "client.py"}
    for flags in ([], ["-I"]):  # -I: not even the script's folder on sys.path
        out = subprocess.run(
            [sys.executable, *flags, str(client), "count", "--workdir", str(tmp_path / "w")],
            cwd="/",
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"done": 0, "total": 0, "dataset_id": None}


THIRD = '''
import os, sys
import client as base


class Watch:
    """Fatal once the file STOP exists beside the dataset."""

    def __init__(self, path):
        self.path, self.fields = path, {"file": path}

    def problem(self):
        return ("stop_file", "the stop file %s is there" % self.path) if os.path.exists(self.path) else None


class Echo(base.Run):
    """A third client: each line {"id", "text"} is POSTed to /echo; its key is the text."""

    prog = "echo_onhost"

    def __init__(self, args, items, records, dataset_id):
        self.watch = Watch(args.dataset + ".STOP")
        base.Run.__init__(self, args, items, records, dataset_id)

    @classmethod
    def read(cls, args):
        return [(str(doc["id"]), doc["text"]) for doc, _ in base.read_lines(args.dataset, lambda doc: None)]

    @staticmethod
    def key_of(item):
        return "k-" + item[1]

    def one(self, item):
        sid, text = item
        try:
            answer, attempts = self.attempt(lambda: base.post_json(self.args.server + "/echo", {"text": text}, 5), sid)
        except base.GaveUp as exc:
            return self.record(sid, self.key_of(item), 0, "interrupted" if exc.interrupted else "failed", exc.attempts, exc.error)
        self.record(sid, self.key_of(item), len(answer["text"]), "ok", attempts)


sys.exit(Echo.main())
'''


class _Echo(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_POST(self):
        text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["text"]
        self.seen.append(text)
        status = 503 if text == "flaky" and self.seen.count("flaky") == 1 else 400 if text == "bad" else 200
        body = json.dumps({"text": text.upper()}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_third_client_is_a_subclass_with_retries_resume_and_a_fatal_cause(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "client.py").write_bytes(onhost.source("client.py"))
    (host / "echo_onhost.py").write_text(THIRD)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ds, work, log = tmp_path / "ds.jsonl", tmp_path / "work", tmp_path / "echo.log"
        ds.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(["a", "flaky", "bad"])))
        argv = [sys.executable, str(host / "echo_onhost.py"), "--dataset", str(ds), "--workdir", str(work)]
        argv += ["--log", str(log), "--server", f"http://127.0.0.1:{server.server_port}", "--backoff", "0.01"]

        def run() -> tuple[int, list[str]]:
            rc = subprocess.run(argv, env=ENV, capture_output=True, timeout=60).returncode
            return rc, log.read_text().splitlines()

        rc, lines = run()
        assert rc == 1  # "bad" failed (HTTP 400, not retried); "flaky" answered on its second attempt
        rows = {r["id"]: r for r in map(json.loads, (work / "manifest.jsonl").read_text().splitlines())}
        assert (rows["0"]["status"], rows["1"]["status"], rows["2"]["status"]) == ("ok", "ok", "failed")
        assert rows["1"]["attempts"] == 2 and rows["1"]["key"] == "k-flaky" and rows["1"]["tokens"] == 5
        assert any(" error id=1 attempt=1 error=" in line for line in lines)
        assert " finished done=2 total=3 " in lines[-1]
        rc, lines = run()  # resume by key: only the failed one is sent again
        assert rc == 1 and " started pending=1 " in next(l for l in reversed(lines) if " started " in l)
        Path(str(ds) + ".STOP").write_text("")
        rc, lines = run()  # a fatal cause before the first request: nothing sent
        assert rc == 4 and " fatal cause=stop_file file=" in lines[-2] and " stopped cause=stop_file " in lines[-1]
        assert _Echo.seen.count("bad") == 2
    finally:
        server.shutdown()
