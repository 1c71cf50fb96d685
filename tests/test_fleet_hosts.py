"""Commands on many hosts over real lab sshd: patterns, isolated failures, one document, worst exit code."""

from __future__ import annotations

import json

from conftest import run_cli

cli = run_cli  # (rc, stdout, stderr) of `python -m remote_ops ARGS` (tests/conftest.py)


def test_facts_on_a_pattern_reports_each_host_in_one_document(lab, lab_env):
    rc, out, err = cli(lab_env, "facts", "--host", "lab1,lab2", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [h["host"] for h in doc["hosts"]] == ["lab1", "lab2"] and doc["exit_code"] == 0
    assert all(h["result"]["host"] == h["host"] and h["result"]["os"] for h in doc["hosts"])


def test_one_dead_host_never_stops_the_others_and_sets_the_exit_code(lab, lab_env, spare_host, faults):
    faults.refuse(spare_host)
    rc, out, err = cli(lab_env, "facts", "--all", "--limit", "lab*", "--json", "--connect-timeout", "3")
    assert rc == 4, err
    doc = json.loads(out)
    by_host = {h["host"]: h for h in doc["hosts"]}
    assert by_host[spare_host.name]["exit_code"] == 4 and doc["failed"] == [spare_host.name]
    assert all(h["exit_code"] == 0 for n, h in by_host.items() if n != spare_host.name)
    assert "3 hosts, 1 failed" in err


def test_an_unknown_name_is_a_config_error_with_suggestions(lab, lab_env):
    rc, _, err = cli(lab_env, "facts", "--host", "lab9")
    assert rc == 3 and "did you mean" in err and "lab1" in err


def test_deploy_serial_stops_the_roll_after_a_failed_batch_unless_keep_going(lab, lab_env, spare_host, faults):
    """The first batch's host refuses connections: with --serial 1 the rest are skipped (exit 4);
    with --keep-going every batch runs.  (--dry-run: nothing is changed either way.)"""
    faults.refuse(spare_host)
    others = [n for n in ("lab1", "lab2", "lab3") if n != spare_host.name]
    pattern = ",".join([spare_host.name, *others])
    rc, out, err = cli(
        lab_env, "deploy", "--host", pattern, "--dry-run", "--serial", "1", "--json", "--connect-timeout", "3"
    )
    doc = json.loads(out)
    assert rc == 4 and doc["hosts"][0]["exit_code"] == 4, err
    assert doc["skipped"] == others and "skipped after a failed batch" in err
    rc, out, err = cli(
        lab_env,
        "deploy",
        "--host",
        pattern,
        "--dry-run",
        "--serial",
        "1",
        "--keep-going",
        "--json",
        "--connect-timeout",
        "3",
    )
    doc = json.loads(out)
    assert doc["skipped"] == [] and [h["host"] for h in doc["hosts"]] == [spare_host.name, *others], err


def test_health_on_a_group_keeps_its_document_shape(lab, lab_env):
    rc, out, err = cli(lab_env, "health", "--host", "lab1,lab2", "--json")
    doc = json.loads(out)
    assert [h["host"] for h in doc["hosts"]] == ["lab1", "lab2"] and all(h["checks"] for h in doc["hosts"])
    assert doc["exit_code"] == rc and "2 hosts" in err
