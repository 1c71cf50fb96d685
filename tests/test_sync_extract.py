"""A sharded extraction over lab1..lab3 (each with its own SGLang stand-in), then `dumps sync` of the
other hosts' shards to lab3: every sample on lab3 exactly once, and `dumps verify --sha` passes there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleet_extract import _dataset, _dumps, cli, three  # noqa: E402,F401  (three: the fixture)

from remote_ops.core import syncplan  # noqa: E402


def test_sharded_extraction_then_sync_leaves_every_sample_on_one_host_once(three, lab, lab_env, tmp_path):  # noqa: F811
    lab1, lab2, lab3 = three
    keys = _dataset(tmp_path / "ds.jsonl", 90, 40)
    rc, doc, err = cli(
        lab_env, "extract", "start", "--host", "lab1,lab2,lab3", "--dataset", str(tmp_path / "ds.jsonl"),
        "--concurrency", "2", "--wait", "120",
    )  # fmt: skip
    assert rc == 0 and doc["done"] == len(keys), err
    shards = {h.name: set(_dumps(h)) for h in three}
    assert all(shards.values()) and set().union(*shards.values()) == keys

    rc, doc, err = cli(lab_env, "dumps", "sync", "--from", "lab1,lab2,lab3:!lab3", "--to", "lab3")
    assert rc == 0, err
    assert doc["moved"] == len(keys - shards["lab3"]) and not doc["failed"]
    assert set(_dumps(lab3)) == keys
    lines = (lab3.paths.dump_dir / "rank0" / "manifest.jsonl").read_text().splitlines()
    listed = [json.loads(line)["key"] for line in lines if line.strip()]
    assert sorted(listed) == sorted(keys)  # every sample exactly once
    rc, report, err = cli(lab_env, "dumps", "verify", "--host", "lab3", "--sha")
    assert rc == 0, err
    for h in (lab1, lab2):
        assert syncplan.MARK not in (h.sshd.dir / "authorized_keys").read_text()
    rc, again, err = cli(lab_env, "dumps", "sync", "--from", "lab1,lab2", "--to", "lab3")
    assert rc == 0 and again["moved"] == 0, err
