"""One host or a pattern (issue 29, item 6): `train status` and `train stop` take a host pattern
and report each host (the many-host document and the worst host's exit), on the lab's real sshd
hosts; a one-host command given the same pattern stops with exit 2 before connecting."""

from __future__ import annotations

import json

from conftest import run_cli


def test_train_status_and_stop_take_a_pattern(lab, lab_env):
    rc, out, err = run_cli(lab_env, "train", "status", "--host", "lab1,lab2", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [h["host"] for h in doc["hosts"]] == ["lab1", "lab2"] and doc["exit_code"] == 0
    assert all(h["exit_code"] == 0 and h["result"]["running"] is False for h in doc["hosts"])
    rc, out, err = run_cli(lab_env, "train", "stop", "--host", "lab1,lab2", "--dry-run", "--json")
    assert rc == 0, err
    assert [h["host"] for h in json.loads(out)["hosts"]] == ["lab1", "lab2"]


def test_one_host_status_keeps_its_own_document(lab, lab_env):
    rc, out, err = run_cli(lab_env, "train", "status", "--host", "lab1", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["host"] == "lab1" and doc["running"] is False and "hosts" not in doc


def test_train_start_given_a_pattern_is_a_usage_error(lab, lab_env):
    rc, out, err = run_cli(lab_env, "train", "start", "--host", "lab1,lab2", "--json")
    assert rc == 2, err
    doc = json.loads(out)
    assert doc["error"] == "usage" and doc["hosts"] == ["lab1", "lab2"]
    assert "`train start` takes one host" in err and "Traceback" not in err
