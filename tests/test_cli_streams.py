"""Streams, -v, host names and completion (issue 13, items 2-4): data on stdout, progress on stderr,
`--json` one document (JSON Lines for streams), no colour off a terminal or with NO_COLOR."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from conftest import run_cli

from remote_ops import wheels
from remote_ops.cli.app import App
from remote_ops.cli.console import Console

INVENTORY = """\
defaults:
  sglang: {patch: deepseek-v2}
hosts:
  gpu-01: {address: 127.0.0.1, port: 1}
  gpu-02: {address: 127.0.0.1, port: 2}
  cpu-box: {address: 127.0.0.1, port: 3}
"""


cli = run_cli  # (rc, stdout, stderr) of `python -m remote_ops ARGS` (tests/conftest.py)


@pytest.fixture
def env(tmp_path):
    (tmp_path / "inv").mkdir()
    (tmp_path / "inv" / "fleet.yaml").write_text(INVENTORY)
    return {**os.environ, "REMOTE_OPS_INVENTORY": str(tmp_path / "inv"), "REMOTE_OPS_STATE_DIR": str(tmp_path / "s")}


def test_hosts_table_is_data_on_stdout(env):
    rc, out, err = cli(env, "hosts")
    assert rc == 0 and "gpu-01" in out and "cpu-box" in out and "gpu-01" not in err
    assert "\x1b[" not in out + err  # not a terminal: no colour codes


def test_patch_dry_run_diff_goes_to_a_file(tmp_path):
    target = tmp_path / "deepseek_v2.py"
    target.write_bytes(wheels.sglang_source("0.5.9", "python/sglang/srt/models/deepseek_v2.py"))
    rc, out, err = cli(
        {**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path / "s")},
        "patch",
        "apply",
        "--local-file",
        str(target),
        "--dry-run",
    )
    assert rc == 0, err
    assert out.startswith("--- a/") and "\n+" in out
    assert "anchor" not in out and "dry run" in err  # evidence and notes: stderr
    check = subprocess.run(["patch", "--dry-run", "-p1", "-d", "/"], input=out, text=True, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_an_unknown_bare_name_exits_3_with_close_matches(env):
    rc, out, err = cli(env, "render", "--host", "gpu-1")
    assert rc == 3 and "did you mean" in err and "gpu-01" in err and out == ""
    rc, _, err = cli(env, "render", "--host", "nonexistent-name")
    assert rc == 3, err


def test_render_on_a_glob_prints_each_dockerfile(env):
    rc, out, err = cli(env, "render", "--host", "gpu-0*", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [h["host"] for h in doc["hosts"]] == ["gpu-01", "gpu-02"]
    assert all("FROM " in h["result"]["dockerfile"] for h in doc["hosts"])


def test_completion_offers_inventory_hosts_and_groups(env):
    comp = {
        **env,
        "_REMOTE_OPS_COMPLETE": "bash_complete",
        "COMP_WORDS": "remote-ops health --host gpu",
        "COMP_CWORD": "3",
    }
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", "health", "--host", "gpu"],
        env=comp,
        capture_output=True,
        text=True,
        timeout=60,
    )
    words = [line.split(",", 1)[1] for line in p.stdout.splitlines() if "," in line]
    assert words == ["gpu-01", "gpu-02"], p.stdout + p.stderr
    comp["COMP_WORDS"] = "remote-ops health --host gpu-01,!fl"
    p = subprocess.run([sys.executable, "-m", "remote_ops"], env=comp, capture_output=True, text=True, timeout=60)
    assert "gpu-01,!fleet" in p.stdout


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_color_drops_every_escape_code_even_on_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    coloured = _Tty()
    Console(stderr=coloured).status("fail", "x")
    assert "\x1b[" in coloured.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _Tty()
    Console(stderr=plain).status("fail", "x")
    assert "\x1b[" not in plain.getvalue() and "x" in plain.getvalue()


def test_json_lines_for_streams_and_one_document_otherwise():
    out = io.StringIO()
    c = Console(json_mode=True, stdout=out, stderr=io.StringIO())
    c.emit_line({"a": 1})
    c.emit_line({"a": 2})
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [{"a": 1}, {"a": 2}]


def test_verbose_trace_masks_secrets_and_shows_the_round_trip():
    err = io.StringIO()
    app = App(console=Console(stderr=err), verbose=1)
    app._tracer("gpu-01")("docker run -e HF_TOKEN=hf_abc123 img", 0.0123, 0)
    line = err.getvalue()
    assert "gpu-01: 12 ms, exit 0: docker run -e HF_TOKEN=*** img" in line and "hf_abc123" not in line
    app._tracer("gpu-01")("first line\nsecond", 1.0, None)
    assert "timed out: first line ..." in err.getvalue()


# ---------------------------------------------------------------- over real lab hosts
def test_dash_v_prints_each_remote_command_with_its_time(lab, host, lab_env):
    rc, out, err = cli(lab_env, "facts", "--host", host.name, "-v")
    assert rc == 0, err
    traces = [line for line in err.splitlines() if line.startswith(f"{host.name}: ") and " ms, exit " in line]
    assert traces, err
    rc, _, err = cli(lab_env, "facts", "--host", host.name, "-vv")
    assert rc == 0 and "ssh: paramiko.transport" in err


def test_health_watch_json_is_json_lines(lab, host, lab_env):
    rc, out, err = cli(
        lab_env, "health", "--host", host.name, "--watch", "0.1", "--watch-for", "10", "--json", timeout=180
    )
    rounds = [json.loads(line) for line in out.splitlines()]
    assert len(rounds) >= 2 and all(r["hosts"][0]["host"] == host.name for r in rounds), out + err
    assert rc in (0, 11, 12)


def test_logs_follow_json_is_json_lines(lab, host, lab_env):
    path = host.paths.logs_dir / "extraction.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("one\ntwo\n")
    rc, out, err = cli(
        lab_env, "logs", "follow", "--host", host.name, "--what", "extraction", "--duration", "2", "--json"
    )
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(x["host"], x["kind"], x["line"]) for x in lines] == [
        (host.name, "extraction", "one"),
        (host.name, "extraction", "two"),
    ]
