"""Progress on a terminal, nothing extra when piped (issue 29, item 8): wheel downloads (bytes and
rate), build steps (n of total), extraction (samples/s and ETA), export (`Console.progress`).

A terminal here is a real pseudo-terminal (`os.openpty`): the console writes to its slave end and
the test reads the master.  Piped is a pipe or a StringIO.  Checks are on content only (what
the bar says), never on timing.  The download runs end to end: `render` against a package
index served on loopback by this test (PEP 691 JSON and the real SGLang 0.5.9 wheel), in a
pseudo-terminal and through pipes."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import require

from remote_ops import wheels
from remote_ops.cli.commands.extract import _progress
from remote_ops.cli.console import Console, duration, progress_tail
from remote_ops.core.buildsteps import BuildStep, step
from remote_ops.core.extractplan import ExtractStatus
from remote_ops.core.logparse import ExtractionSummary

VERSION = "0.5.9"
BAR = "━"  # rich's bar character

# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("#7 [3/9] RUN pip install -e python", BuildStep(3, 9, "RUN pip install -e python")),
        ("#12 [builder 2/5] COPY . /src", BuildStep(2, 5, "COPY . /src")),
        ("Step 4/11 : RUN python3 verify_patch.py", BuildStep(4, 11, "RUN python3 verify_patch.py")),
        ("STEP 1/6: FROM lmsysorg/sglang:v0.5.9", BuildStep(1, 6, "FROM lmsysorg/sglang:v0.5.9")),
        ("#4 [internal] load build definition from Dockerfile", None),
        ("#7 0.512 Collecting torch", None),
        ("#7 DONE 3.1s", None),
        ("Step 0/3 : nonsense", None),
    ],
)
def test_build_step_lines_of_buildkit_docker_and_podman(line, found):
    assert step(line) == found


def test_the_counter_tail_shows_what_is_known():
    assert progress_tail("samples", 12.5, 200, "running") == "12.5 samples/s, ETA 3m20s, running"
    assert progress_tail("samples", None, None, "running") == "running"
    assert progress_tail("steps", None, None, "RUN x") == "RUN x"
    assert [duration(s) for s in (0, 42, 200, 7500)] == ["0s", "42s", "3m20s", "2h05m"]


# --------------------------------------------------------------------------- the console


class Pty:
    """A pseudo-terminal: `file` is its slave end (a terminal to whoever writes), `read` the master."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self.file = os.fdopen(os.dup(self.slave), "w", buffering=1, encoding="utf-8")

    def read(self) -> str:
        self.file.flush()
        chunks = []
        while select.select([self.master], [], [], 0.2)[0]:
            chunks.append(os.read(self.master, 65536))
        return b"".join(chunks).decode("utf-8", "replace")

    def close(self) -> None:
        self.file.close()
        os.close(self.slave)
        os.close(self.master)


@pytest.fixture
def tty(monkeypatch):
    for var in ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "120")
    p = Pty()
    yield p
    p.close()


def _draw_everything(c: Console) -> None:
    with c.transfer("sglang 0.5.9 wheel") as update:
        update(3 * 1024 * 1024, 5 * 1024 * 1024)
    with c.counter("gpu-node: build", "steps") as bar:
        bar(3, 9, note="RUN pip install")
    with c.progress("gpu-node: export") as advance:
        advance(1, description="gpu-node: export shard 1")


def test_a_terminal_shows_the_bars(tty):
    c = Console(stderr=tty.file, stdout=io.StringIO())
    assert c.live()
    _draw_everything(c)
    shown = tty.read()
    assert "sglang 0.5.9 wheel" in shown and "3.1/5.2 MB" in shown and BAR in shown
    assert "gpu-node: build (steps)" in shown and "3/9" in shown and "RUN pip install" in shown
    assert "gpu-node: export shard 1" in shown


@pytest.mark.parametrize("how", ["pipe", "quiet"])
def test_piped_or_quiet_there_are_no_bars_at_all(tty, how):
    if how == "pipe":
        r, w = os.pipe()
        err = os.fdopen(w, "w")
        c = Console(stderr=err, stdout=io.StringIO())
    else:
        c = Console(stderr=tty.file, stdout=io.StringIO(), quiet=True)
    assert not c.live()
    _draw_everything(c)
    if how == "pipe":
        err.close()
        with os.fdopen(r) as f:
            assert f.read() == ""
    else:
        assert tty.read() == ""


def test_host_text_in_a_bar_is_shown_not_obeyed(tty):
    c = Console(stderr=tty.file, stdout=io.StringIO())
    clipboard = "\x1b]52;c;ZXZpbA==\x07"
    with c.counter(f"lab{clipboard}", "steps") as bar:
        bar(1, 2, note=clipboard)
    shown = tty.read()
    assert "\x1b]52" not in shown and "^[]52;c;ZXZpbA==^G" in shown


def _status(done: int, running: bool) -> ExtractStatus:
    summary = ExtractionSummary(
        done=done, total=40, tokens=done * 100, rate_samples_s=2.5, rate_tokens_s=250.0, eta_s=(40 - done) / 2.5
    )
    summary.state = "running" if running else "finished"
    return ExtractStatus("gpu-node", running, 42 if running else None, summary, done, [], "", 40)


def test_extraction_wait_shows_samples_per_second_and_eta_on_a_terminal(tty):
    """The bar's last frame is drawn when it stops (rich redraws at most 10 times a second, so
    only that frame is certain): one status per bar."""
    c = Console(stderr=tty.file, stdout=io.StringIO())
    with c.counter("gpu-node: extraction", "samples") as bar:
        _progress(c, bar)(_status(10, True))
    shown = tty.read()
    assert "gpu-node: extraction (samples)" in shown and "10/40" in shown
    assert "2.5 samples/s, ETA 12s, running" in shown  # 30 left at 2.5 samples/s
    with c.counter("gpu-node: extraction", "samples") as bar:
        _progress(c, bar)(_status(40, False))
    assert "40/40" in (last := tty.read()) and "ETA 0s, finished" in last
    assert "extraction: 10/40" not in shown + last  # the piped line form is not printed too


def test_extraction_wait_piped_prints_its_lines_and_no_bar():
    err = io.StringIO()
    c = Console(stderr=err, stdout=io.StringIO())
    with c.counter("gpu-node: extraction", "samples") as bar:
        show = _progress(c, bar)
        show(_status(10, True))
        show(_status(40, False))
    lines = err.getvalue().splitlines()
    assert lines == [
        "extraction: 10/40 samples, 1,000 tokens, 250 tokens/s, 0 errors (running)",
        "extraction: 40/40 samples, 4,000 tokens, 250 tokens/s, 0 errors (finished)",
    ]
    assert BAR not in err.getvalue() and "ETA" not in err.getvalue()


# --------------------------------------------------------------------------- a download, end to end


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A PEP 691 index on 127.0.0.1 serving the real sglang 0.5.9 wheel (from the lab's cache)."""
    try:
        wheel = wheels.fetch_sglang_wheel(VERSION)
    except Exception as exc:
        require(f"cannot get the SGLang {VERSION} wheel: {exc}")
        raise
    data = wheel.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/simple/sglang/":
                url = f"http://127.0.0.1:{self.server.server_port}/files/{wheel.name}"
                body = json.dumps(
                    {
                        "files": [
                            {"filename": wheel.name, "url": url, "hashes": {"sha256": hashlib.sha256(data).hexdigest()}}
                        ]
                    }
                ).encode()
            elif self.path == f"/files/{wheel.name}":
                body = data
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
    try:
        yield f"http://127.0.0.1:{server.server_port}/simple"
    finally:
        server.shutdown()
        server.server_close()


INVENTORY = f"""\
hosts:
  node:
    address: 127.0.0.1
    port: 1
    sglang: {{checkout: /root/sglang, patch: deepseek-v2, version: "{VERSION}"}}
    model: {{path: /models/m, num_layers: 61, hidden_size: 7168}}
    dump: {{dir: /data/dumps, layers: [2, 30, 58]}}
"""


def _env(tmp_path: Path, index: str) -> dict[str, str]:
    inv = tmp_path / "inventory"
    inv.mkdir(exist_ok=True)
    (inv / "node.yaml").write_text(INVENTORY)
    drop = ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR", "REMOTE_OPS_SGLANG_CHECKOUT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        REMOTE_OPS_CACHE_DIR=str(tmp_path / "cache"),
        REMOTE_OPS_INDEX_URL=index,
        REMOTE_OPS_STATE_DIR=str(tmp_path / "state"),
        REMOTE_OPS_DAEMON="0",
        REMOTE_OPS_INVENTORY=str(inv),
        COLUMNS="120",
    )
    return env


RENDER = [sys.executable, "-m", "remote_ops", "render", "--host", "node"]


def test_a_wheel_download_piped_prints_no_progress(tmp_path, index):
    p = subprocess.run(RENDER, env=_env(tmp_path, index), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [
        f"sglang {VERSION}: downloaded wheel {tmp_path}/cache/wheels/sglang-{VERSION}-py3-none-any.whl"
    ]
    assert p.stdout.startswith("FROM ") or "\nFROM " in p.stdout


def test_a_wheel_download_on_a_terminal_shows_bytes_and_rate(tmp_path, index):
    master, slave = os.openpty()
    proc = subprocess.Popen(RENDER, env=_env(tmp_path, index), stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 0.5)[0]:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=30) == 0
    shown = b"".join(chunks).decode("utf-8", "replace")
    assert f"sglang {VERSION} wheel" in shown and BAR in shown
    assert "5.2/5.2 MB" in shown  # the bytes, whole at the end
    assert re.search(r"\d+(\.\d+)? [kMG]?B/s", shown)  # the rate column (its figure depends on the machine)


def _fleet(done: int, running: list[str]):
    from remote_ops.core.extractplan import FleetStatus

    eta = (40 - done) / 5.0 if running else 0.0
    return FleetStatus("ds", 40, done, running, 5.0 if running else 0.0, 500.0, eta, 0, [], [], [])


@pytest.mark.parametrize("on_terminal", [True, False])
def test_a_group_wait_shows_the_groups_rate_and_eta_on_a_terminal_only(tty, monkeypatch, on_terminal):
    """`extract start --host GROUP --wait`: the group's statuses (STAND-IN: `_group_status` answers
    from a list, no host) as a bar on a terminal, as lines otherwise."""
    from types import SimpleNamespace

    from remote_ops.cli.commands import extract as extract_cmd

    rounds = iter([_fleet(10, ["a", "b"]), _fleet(40, [])])
    monkeypatch.setattr(
        extract_cmd, "_group_status", lambda *a: (next(rounds), SimpleNamespace(exit_code=0, outcomes=[]))
    )
    monkeypatch.setattr(extract_cmd, "_render_group", lambda *a: None)
    err = tty.file if on_terminal else io.StringIO()
    app = SimpleNamespace(console=Console(stderr=err, stdout=io.StringIO()))
    assert extract_cmd._wait_group(app, ["a", "b"], 2, 60.0, {}) == 0
    shown = tty.read() if on_terminal else err.getvalue()
    if on_terminal:
        assert "2 hosts: extraction (samples)" in shown and "40/40" in shown and "ETA 0s, 0 running" in shown
        assert "extraction: 10/40" not in shown
    else:
        assert shown.splitlines() == [
            "extraction: 10/40 samples over 0 hosts, 500 tokens/s, 2 running",
            "extraction: 40/40 samples over 0 hosts, 500 tokens/s, 0 running",
        ]
        assert BAR not in shown and "ETA" not in shown
