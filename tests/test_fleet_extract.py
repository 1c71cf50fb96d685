"""Sharded extraction over a group of lab hosts, each with its own SGLang stand-in server.

The split is decided by dump key (content): the union of the hosts' manifests,
plus the local record of hosts that are no longer selected.  The fault test
crashes one host's sshd mid-run (its client dies with it, as on a reboot) and
re-splits what is left over the survivors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clear_server_port

from remote_ops.core import extractplan
from remote_ops.dumper import dumpfile

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "docker" / "standin" / "sglang_standin_server.py"


def _sample(sid, ids):
    from remote_ops.onhost.extract_onhost import dump_key

    return extractplan.Sample(sid, dump_key(ids), len(ids), json.dumps({"id": sid, "input_ids": ids}))


def test_split_skips_done_keys_keeps_same_content_together_and_balances_tokens():
    samples = [_sample(f"s{i}", [i] * (10 if i % 2 else 30)) for i in range(12)] + [_sample("dup", [3] * 10)]
    done = {samples[0].key, samples[1].key}
    shards = extractplan.split_pending(samples, done, ["a", "b", "c"])
    sent = [s for v in shards.values() for s in v]
    assert {s.key for s in sent} == {s.key for s in samples} - done and len(sent) == 11
    holder = [h for h, v in shards.items() if any(s.id == "s3" for s in v)]
    assert any(s.id == "dup" for s in shards[holder[0]])  # same content: same host
    loads = [sum(s.tokens for s in v) for v in shards.values()]
    assert max(loads) - min(loads) <= 30


def test_merged_status_counts_by_content_and_the_record_of_absent_hosts():
    ledger = {"dataset_id": "d", "keys": ["k1", "k2", "k3", "k4"], "hosts": {"dead": {"done": ["k3"]}}}
    from remote_ops.core.logparse import ExtractionSummary

    def st(name, running, eta):
        return extractplan.ExtractStatus(
            name, running, 1, ExtractionSummary(rate_samples_s=2.0, rate_tokens_s=50.0, eta_s=eta), 0, [], ""
        )

    fs = extractplan.merge_status(
        ledger, {"a": st("a", True, 10.0), "b": st("b", True, 30.0)}, {"a": {"k1", "x"}, "b": {"k1", "k2"}}, []
    )
    assert (fs.total, fs.done, fs.duplicates, fs.eta_s, fs.rate_tokens_s) == (4, 3, 1, 30.0, 100.0)
    assert fs.last_seen == ["dead"]


# --------------------------------------------------------------------------- three lab hosts


def _start_standin(host, tmp_path):
    pkg = tmp_path / "pkgs"
    pkg.mkdir(exist_ok=True)
    if not (pkg / "remote_ops_dump").exists():
        (pkg / "remote_ops_dump").symlink_to(REPO / "remote_ops" / "dumper")
    env = {
        **os.environ,
        "PYTHONPATH": str(pkg),
        "SGLANG_HS_DUMP_DIR": str(host.paths.dump_dir),
        "STANDIN_LOAD_SECONDS": "0",
        # a prefill takes simulated GPU time (40 tokens: 10 ms), so a host is still busy when it is crashed
        "STANDIN_GPU_MS_PER_1K_TOKENS": "250",
    }
    logf = tmp_path / f"standin-{host.name}.log"
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), "--port", str(host.server_port), "--model-path", str(host.paths.model_dir)],
        env=env,
        stdout=open(logf, "wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while b"listening" not in logf.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, logf.read_text()
        time.sleep(0.1)
    return proc


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _kill_client(host):
    pidfile = host.paths.logs_dir / "extract" / "client.pid"
    if pidfile.exists():
        pid = int(pidfile.read_text())
        try:
            if b"extract_onhost" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture
def three(lab, host, spare_host, tmp_path):
    """lab1..lab3, fresh logs and dump dirs, each with its own stand-in; clients and servers stopped after."""
    hosts = [lab.host("lab1"), lab.host("lab2"), spare_host]
    for h in hosts:
        subprocess.run(["rm", "-rf", str(h.paths.logs_dir), str(h.paths.dump_dir)], check=True, timeout=30)
        h.paths.logs_dir.mkdir(parents=True)
    for h in hosts:
        clear_server_port(lab, h)
    procs = [_start_standin(h, tmp_path) for h in hosts]
    yield hosts
    for h in hosts:
        _kill_client(h)
    for p in procs:
        _stop(p)


def cli(env, *args, timeout=240):
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else None), p.stderr


def _dataset(path: Path, n: int, tokens: int) -> set[str]:
    from remote_ops.onhost.extract_onhost import dump_key

    keys = set()
    with open(path, "w") as fh:
        for i in range(n):
            ids = [(i * 7919 + t) % 32000 for t in range(tokens)]
            keys.add(dump_key(ids))
            fh.write(json.dumps({"id": f"s{i}", "input_ids": ids}) + "\n")
    return keys


def _ok_keys(host) -> set[str]:
    from remote_ops.onhost.extract_onhost import done_keys, manifest_records

    return set(done_keys(manifest_records(str(host.paths.logs_dir / "extract" / "manifest.jsonl"))))


def _dumps(host) -> dict[str, Path]:
    return {p.name[: -len(".safetensors")]: p for p in host.paths.dump_dir.glob("rank*/*.safetensors")}


def test_a_group_splits_by_content_and_a_dead_host_is_re_split_without_loss(three, lab_env, faults, tmp_path):
    lab1, lab2, lab3 = three
    keys = _dataset(tmp_path / "ds.jsonl", 2400, 40)
    rc, doc, err = cli(
        lab_env,
        "extract",
        "start",
        "--host",
        "lab1,lab2,lab3",
        "--dataset",
        str(tmp_path / "ds.jsonl"),
        "--concurrency",
        "1",
    )
    assert rc == 0, err
    assert sum(doc["shards"].values()) == len(keys) and all(n == 800 for n in doc["shards"].values())
    deadline = time.monotonic() + 60
    while len(_ok_keys(lab3)) < 40:
        assert time.monotonic() < deadline, "lab3 made no progress"
        time.sleep(0.05)
    rc, status, err = cli(lab_env, "extract", "status", "--host", "lab1,lab2,lab3")
    assert rc == 0 and status["total"] == len(keys) and len(status["running"]) == 3, err
    faults.crash(lab3)  # sshd and every session under it: the client too
    lab3_done = _ok_keys(lab3)
    assert len(lab3_done) < 800, "lab3 finished before the crash; make the dataset bigger"
    record = json.loads(next((Path(lab_env["REMOTE_OPS_STATE_DIR"]) / "extract" / "fleet").glob("*.json")).read_text())
    seen_on_lab3 = set(record["hosts"]["lab3"]["done"])
    rc, merged, err = cli(lab_env, "extract", "status", "--host", "lab1,lab2,lab3", "--connect-timeout", "3")
    assert rc == 4 and merged["unreachable"] == ["lab3"] and merged["last_seen"] == ["lab3"], err
    rc, _, err = cli(
        lab_env,
        "extract",
        "start",
        "--host",
        "lab1,lab2,lab3",
        "--dataset",
        str(tmp_path / "ds.jsonl"),
        "--restart",
        "--connect-timeout",
        "3",
    )
    assert rc == 4 and "cannot read the manifest of lab3" in err and "lab3" in err, err  # nothing stopped or split

    rc, final, err = cli(
        lab_env,
        "extract",
        "start",
        "--host",
        "lab1,lab2,lab3,!lab3",
        "--dataset",
        str(tmp_path / "ds.jsonl"),
        "--restart",
        "--concurrency",
        "4",
        "--wait",
        "200",
    )
    assert rc == 0, err
    assert final["counted_from_record"] == ["lab3"] and final["done"] == final["total"] == len(keys)
    survivors = _ok_keys(lab1) | _ok_keys(lab2)
    assert survivors | lab3_done == keys  # no sample lost
    assert not (_ok_keys(lab1) & _ok_keys(lab2))  # none sent by two survivors
    dumps = {h.name: _dumps(h) for h in three}
    assert set(dumps["lab1"]) | set(dumps["lab2"]) | set(dumps["lab3"]) >= keys
    assert not (set(dumps["lab1"]) & set(dumps["lab2"]))
    twice = (set(dumps["lab1"]) | set(dumps["lab2"])) & set(dumps["lab3"])
    # only what lab3 did after the record last saw it (done since the status, or in flight at the crash)
    assert twice <= set(dumps["lab3"]) - seen_on_lab3, twice & seen_on_lab3
    for key in twice:  # content-keyed: the same tensors (the header's metadata names each host's model config)
        other = dumps["lab1"].get(key) or dumps["lab2"][key]
        assert dumpfile.payload_sha256(str(other)) == dumpfile.payload_sha256(str(dumps["lab3"][key]))
    print(f"lab3 done at crash {len(lab3_done)}, seen by the record {len(seen_on_lab3)}, dumped twice {len(twice)}")


def test_old_limit_spelling_is_max_samples_with_a_note(three, lab_env, tmp_path):
    _dataset(tmp_path / "ds.jsonl", 30, 8)
    rc, doc, err = cli(
        lab_env,
        "extract",
        "start",
        "--host",
        "lab1,lab2",
        "--dataset",
        str(tmp_path / "ds.jsonl"),
        "--limit",
        "10",
        "--dry-run",
    )
    assert rc == 0 and "--max-samples" in err, err
    assert doc["samples"] == 10 and sum(doc["shards"].values()) == 10
