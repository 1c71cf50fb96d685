"""The operator's contract under faults, data side (issue 9: defects 3, 6, 7, 10, 11), over real lab hosts.

Each test turns one reproduction into a regression: it asserts the exit code, the
counts, that nothing is left behind (temp files, file sha256) and that a re-run
resumes.  Extraction runs against the SGLang STAND-IN (docker/standin/), which
writes dump files in the contract's format; dumps are pulled with the real
`dumps pull` over ssh; the full disks are real small tmpfs mounts.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_extract import fresh_run, standin  # noqa: F401  (fixtures: the stand-in server, a clean work dir)

from remote_ops import extract, extract_client


def _cli(env, *args, timeout=180):
    """The real CLI in a subprocess, `--json`: (exit code, stdout document or None, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "remote_ops", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout, env=env)
    try:
        doc = json.loads(proc.stdout) if proc.stdout.strip() else None
    except ValueError:
        doc = None
    return proc.returncode, doc, proc.stderr


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- 3: resume by dump key

def _write_dataset(path: Path, rows: list[tuple[str, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"id": sid, "input_ids": ids}) + "\n" for sid, ids in rows))
    return path


def _manifest(host) -> list[dict]:
    path = host.paths.logs_dir / "extract" / "manifest.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def _dump_keys(host) -> set[str]:
    return {p.name[:-len(".safetensors")] for p in host.paths.dump_dir.glob("rank*/*.safetensors")}


def test_plan_samples_decides_by_dump_key_not_by_id():
    a = [1, 2, 3]
    records = [{"id": "s0", "key": extract_client.dump_key(a), "status": "ok"}]
    pending, done, reused, adopt = extract_client.plan_samples([("s0", [9, 9]), ("x", a), ("s0", a)], records)
    assert [p[0] for p in pending] == ["s0"] and pending[0][1] == [9, 9]       # same id, new content: sent
    assert [d[0] for d in done] == ["x", "s0"]                                 # same content: done
    assert reused == ["s0"] and [x[0] for x in adopt] == ["x"]


def test_a_new_dataset_reusing_ids_gets_new_dumps_and_a_rerun_is_a_noop(lab, host, lab_env, standin, fresh_run,
                                                                        tmp_path):
    first = _write_dataset(tmp_path / "a.jsonl", [(f"s{i}", [100 + i, 7, i]) for i in range(5)])
    rc, doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(first), "--wait", "90")
    assert rc == 0, err
    assert doc["summary"]["done"] == 5 and doc["summary"]["total"] == 5 and doc["manifest_ok"] == 5
    keys_a, lines_a = _dump_keys(host), len(_manifest(host))
    assert len(keys_a) == 5 and lines_a == 5

    rc, doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(first), "--wait", "90")
    assert rc == 0, err                                         # the same dataset again: a no-op
    assert doc["summary"]["done"] == 5 and doc["summary"]["total"] == 5
    assert _dump_keys(host) == keys_a and len(_manifest(host)) == lines_a
    started = [l for l in (host.paths.logs_dir / "extraction.log").read_text().splitlines() if " started " in l]
    assert len(started) == 2 and " pending=0 " in started[-1] and " reused_ids=0 " in started[-1]

    # ids s0..s2 again, other token ids; s9 carries s4's tokens (done already, under another id)
    second = _write_dataset(tmp_path / "b.jsonl", [(f"s{i}", [200 + i, 8, i]) for i in range(3)]
                            + [("s9", [104, 7, 4])])
    rc, doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(second), "--wait", "90")
    assert rc == 0, err
    assert doc["summary"]["done"] == 4 and doc["summary"]["total"] == 4      # not "9/4": this dataset only
    assert doc["manifest_ok"] == 4 and doc["dataset_total"] == 4 and doc["missing"] == []
    new_keys = {extract_client.dump_key([200 + i, 8, i]) for i in range(3)}
    assert _dump_keys(host) == keys_a | new_keys                             # three new dumps, none lost
    started = [l for l in (host.paths.logs_dir / "extraction.log").read_text().splitlines() if " started " in l]
    assert " pending=3 " in started[-1] and " reused_ids=3 " in started[-1]
    ok = [(r["id"], r["key"]) for r in _manifest(host) if r["status"] == "ok"]
    assert ("s9", extract_client.dump_key([104, 7, 4])) in ok                # adopted without a request
    for i in range(3):
        assert (f"s{i}", extract_client.dump_key([200 + i, 8, i])) in ok

    rc, doc, err = _cli(lab_env, "extract", "status", "--host", host.name)
    assert rc == 0 and doc["manifest_ok"] == 4 and doc["dataset_total"] == 4
