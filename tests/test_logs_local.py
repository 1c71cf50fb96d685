"""`logs summary --local FILE...`: logs already on this machine, summarised and plotted without SSH."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_cli_process

DATA = Path(__file__).parent / "data" / "logs"
PNG = b"\x89PNG\r\n\x1a\n"


def _env(tmp_path: Path) -> dict:
    """No inventory and no state outside tmp_path: a command that tried to reach a host would fail."""
    env = dict(os.environ)
    env.update(
        REMOTE_OPS_INVENTORY=str(tmp_path / "no-inventory"),
        REMOTE_OPS_STATE_DIR=str(tmp_path / "state"),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
    )
    return env


def test_extraction_and_specforge_logs_are_told_apart_by_content_and_plotted(tmp_path):
    pytest.importorskip("matplotlib")
    ext = shutil.copy(DATA / "extraction.log", tmp_path / "client.txt")  # names say nothing: content decides
    train = shutil.copy(DATA / "specforge_epochs.log", tmp_path / "run1.txt")
    p = run_cli_process(_env(tmp_path), "logs", "summary", "--local", ext, "--local", train, "--plot", "--json")
    assert p.returncode == 0, p.stderr
    files = json.loads(p.stdout)["files"]
    assert [(f["file"], f["kind"]) for f in files] == [(str(ext), "extraction"), (str(train), "training")]
    e = files[0]["extraction"]
    assert (e["done"], e["total"], e["tokens"], e["state"], e["eta_s"]) == (8, 10, 13840, "running", 4.0)
    t = files[1]["training"]
    assert [r["index"] for r in t["records"] if r["phase"] == "train"] == [1, 2, 3]
    assert "training" not in files[0] and "extraction" not in files[1]
    assert [Path(x).name for x in files[0]["plots"]] == ["extraction.png"]
    assert sorted(Path(x).name for x in files[1]["plots"]) == [
        "training_acc.png",
        "training_loss.png",
        "training_positions.png",
        "training_tau.png",
    ]
    for x in files[0]["plots"] + files[1]["plots"]:
        assert Path(x).parent.parent == tmp_path / "plots" and Path(x).read_bytes()[:8] == PNG


def test_train_eagle3_progress_bar_log_is_a_training_log(tmp_path):
    log = shutil.copy(DATA / "specforge_train_eagle3_tqdm.log", tmp_path / "t.log")
    p = run_cli_process(_env(tmp_path), "logs", "summary", "--local", log, "--json")
    assert p.returncode == 0, p.stderr
    [doc] = json.loads(p.stdout)["files"]
    assert doc["kind"] == "training" and doc["training"]["steps"] and doc["plots"] == []


def test_a_file_of_neither_kind_is_unknown_and_a_huge_line_is_read_bounded(tmp_path):
    big = tmp_path / "one-line.log"
    with open(big, "w") as fh:  # 32 MiB in one line: read in LINE_LIMIT pieces, never whole
        for _ in range(32):
            fh.write("x" * (1 << 20))
    p = run_cli_process(_env(tmp_path), "logs", "summary", "--local", big, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["files"] == [{"file": str(big), "kind": "unknown", "plots": []}]


def test_missing_local_file_is_a_usage_error_before_anything_else(tmp_path):
    p = run_cli_process(_env(tmp_path), "logs", "summary", "--local", tmp_path / "nope.log")
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr


def test_host_and_local_are_mutually_exclusive(tmp_path):
    log = str(DATA / "extraction.log")
    for target in (["--host", "gpu-01"], ["--all"]):
        p = run_cli_process(_env(tmp_path), "logs", "summary", *target, "--local", log)
        assert p.returncode == 2 and "--local" in p.stderr and "Traceback" not in p.stderr
