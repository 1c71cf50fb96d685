"""`dumps sync`: the plan and the grant (pure), the on-host key rewrite, and real syncs between lab
hosts (lab1, lab2 -> lab3): every sample once on the destination, verified, the key gone after."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remote_ops.core import dumpcheck, shell, syncplan
from remote_ops.dumper import dumpfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import run_cli  # noqa: E402

H = 64  # the lab inventory's hidden size
SOURCES, DEST = ("lab1", "lab2"), "lab3"


# --------------------------------------------------------------------------- pure


def _rec(key, sha="s", size=10):
    return {"key": key, "file": f"rank0/{key}.safetensors", "bytes": size, "sha256": sha}


def _recon(*recs, missing=()):
    return dumpcheck.Reconciliation("d", records=list(recs), missing_files=list(missing))


def test_plan_moves_each_key_once_names_conflicts_and_skips_what_the_destination_has():
    plan = syncplan.plan(
        {
            "a": _recon(_rec("k1"), _rec("k2"), _rec("k4"), _rec("k6", "x"), missing=()),
            "b": _recon(_rec("k2"), _rec("k3"), _rec("k4", "other"), _rec("k5"), missing=["rank0/k5.safetensors"]),
        },
        "d",
        _recon(_rec("k1"), _rec("k6", "y")),
    )
    assert [r["key"] for r in plan.moves["a"]] == ["k2"]  # k1 on d already; k2 from a only
    assert [r["key"] for r in plan.moves["b"]] == ["k3"]  # k5 has no file on b
    assert plan.present == ["k1"] and plan.duplicates == {"k2": ["a", "b"]}
    conflicts = {c["key"]: [(x["host"], x["sha256"]) for x in c["copies"]] for c in plan.conflicts}
    assert conflicts == {"k4": [("a", "s"), ("b", "other")], "k6": [("d", "y"), ("a", "x")]}
    assert plan.to_dict()["per_source"] == {"a": {"files": 1, "bytes": 10}, "b": {"files": 1, "bytes": 10}}


def test_grant_line_is_restricted_to_a_read_of_the_dump_dir_from_the_destination():
    line = syncplan.grant_line(
        "ssh-ed25519 AAAAC3Nza== remote-ops-sync:lab3:x",
        "/usr/bin/rrsync",
        '/data/my "dumps"/',
        "127.5.6.7",
        "lab3",
        "abc",
        expiry="202612031200Z",
    )
    assert line == (
        'restrict,from="127.5.6.7",command="/usr/bin/rrsync -ro \'/data/my \\"dumps\\"\'",expiry-time="202612031200Z" '
        "ssh-ed25519 AAAAC3Nza== remote-ops-sync:lab3:abc"
    )
    for bad in ("a,b", 'x" y', "127.0.0.1\n"):
        with pytest.raises(ValueError):
            syncplan.grant_line("ssh-ed25519 AAAA", "rrsync", "/d", bad, "lab3", "abc")
    with pytest.raises(ValueError):
        syncplan.grant_line("ssh-ed25519 AAAA", "rrsync", "/d\nssh-rsa AAAA", "127.0.0.1", "lab3", "abc")
    with pytest.raises(ValueError):
        syncplan.mark("lab 3")
    with pytest.raises(ValueError):
        shell.authorized_keys_value("a\\")


def _onhost(*args: str, cwd=None) -> dict:
    script = Path(__file__).resolve().parents[1] / "remote_ops" / "onhost" / "sync_onhost.py"
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout.splitlines()[-1])


def test_grant_and_revoke_rewrite_authorized_keys_keeping_other_lines_and_the_mode(tmp_path):
    ak = tmp_path / "ssh" / "authorized_keys"
    ak.parent.mkdir()
    ak.write_text("ssh-ed25519 AAAA operator\nrestrict ssh-ed25519 BBBB remote-ops-sync:lab3:old\n")
    ak.chmod(0o640)
    mark = syncplan.mark("lab3")
    assert (
        _onhost("grant", "--file", str(ak), "--mark", mark, "--line", f"restrict ssh-ed25519 CCCC {mark}new")["removed"]
        == 1
    )
    assert ak.read_text() == f"ssh-ed25519 AAAA operator\nrestrict ssh-ed25519 CCCC {mark}new\n"
    assert ak.stat().st_mode & 0o777 == 0o640
    assert _onhost("revoke", "--file", str(ak), "--mark", mark)["removed"] == 1
    assert ak.read_text() == "ssh-ed25519 AAAA operator\n"
    assert _onhost("revoke", "--file", str(ak), "--mark", mark)["removed"] == 0


# --------------------------------------------------------------------------- the lab


def write_dumps(root: Path, n: int, seed: int, tokens: int = 1000, keys_from: int = 0) -> list[dict]:
    """`n` dump files (seeded stand-in data: random bf16 bytes) through the format's own writer."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        ids = b"".join((keys_from + i * 100_003 + t).to_bytes(4, "little") for t in range(tokens))
        pos = b"".join(t.to_bytes(4, "little") for t in range(tokens))
        records.append(
            dumpfile.write_span(
                str(root), 0, ids, pos, rng.randbytes(tokens * H * 2), rng.randbytes(tokens * 3 * H * 2), H, fsync=False
            )
        )
    return records


def _clear(lab) -> None:
    for name in (*SOURCES, DEST):
        d = lab.host(name).paths.dump_dir
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)


@pytest.fixture
def shards(lab):
    """lab1 and lab2 hold 3 samples each plus one both have (same bytes); lab3 holds 2 of its own
    and one of lab1's.  Returns {key: sha256} of every distinct sample."""
    _clear(lab)
    d = {n: lab.host(n).paths.dump_dir for n in (*SOURCES, DEST)}
    recs = write_dumps(d["lab1"], 3, seed=1, keys_from=0)
    recs += write_dumps(d["lab2"], 3, seed=2, keys_from=10)
    recs += write_dumps(d[DEST], 2, seed=3, keys_from=20)
    shared = write_dumps(d["lab1"], 1, seed=4, keys_from=30)
    write_dumps(d["lab2"], 1, seed=4, keys_from=30)
    write_dumps(d[DEST], 1, seed=1, keys_from=0)  # lab1's first sample, already here
    yield {r["key"]: r["sha256"] for r in recs + shared}
    _clear(lab)


def dest_state(lab) -> tuple[dict[str, str], list[str]]:
    """({key: sha256 of the file}, manifest keys in order) on the destination."""
    root = lab.host(DEST).paths.dump_dir / "rank0"
    files = {
        p.name[: -len(".safetensors")]: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.glob("*.safetensors")
    }
    keys = [json.loads(l)["key"] for l in (root / "manifest.jsonl").read_text().splitlines() if l.strip()]
    return files, keys


def grants_left(lab) -> list[str]:
    """Transfer-key lines left in every source's authorized_keys."""
    return [
        f"{n}: {line}"
        for n in SOURCES
        for line in (lab.host(n).sshd.dir / "authorized_keys").read_text().splitlines()
        if syncplan.MARK in line
    ]


def sync(lab_env, *extra: str, timeout: float = 120) -> tuple[int, dict, str]:
    code, out, err = run_cli(
        lab_env, "dumps", "sync", "--from", ",".join(SOURCES), "--to", DEST, "--json", *extra, timeout=timeout
    )
    try:
        doc = json.loads(out) if out.strip() else {}
    except ValueError:
        doc = {}
    return code, doc, err


def assert_complete(lab, expected: dict[str, str]) -> None:
    files, keys = dest_state(lab)
    assert files == expected
    assert sorted(keys) == sorted(set(keys)) == sorted(expected)  # every sample once in the manifest


def test_sync_moves_every_sample_once_verified_and_a_second_run_moves_nothing(lab, lab_env, shards):
    code, doc, err = sync(lab_env, "--dry-run")
    assert code == 0, err
    assert doc["plan"]["files"] == 6 and doc["plan"]["already_on_dest"] == 3 and not doc["plan"]["conflicts"]
    assert not (lab.host(DEST).paths.dump_dir / "rank0" / "manifest.jsonl").read_text().count("host")

    code, doc, err = sync(lab_env)
    assert code == 0, err
    assert doc["moved"] == 6 and not doc["failed"]
    assert_complete(lab, shards)
    manifest = [
        json.loads(l) for l in (lab.host(DEST).paths.dump_dir / "rank0" / "manifest.jsonl").read_text().splitlines()
    ]
    assert {r["host"] for r in manifest if "host" in r} == set(SOURCES)
    assert not grants_left(lab)
    assert {g["file"] for g in doc["grants"].values()} == {
        str(lab.host(n).sshd.dir / "authorized_keys") for n in SOURCES
    }
    audit = [json.loads(l) for l in lab.host("lab1").paths.audit_log.read_text().splitlines()]
    assert [a["action"] for a in audit if a.get("sync_id") == doc["sync_id"]] == ["sync-grant", "sync-revoke"]

    code, doc2, err = sync(lab_env)
    assert code == 0, err
    assert doc2["moved"] == 0 and doc2["plan"]["files"] == 0
    assert_complete(lab, shards)
    code, out, err = run_cli(lab_env, "dumps", "verify", "--host", DEST, "--sha", "--json")
    assert code == 0, err


def _manifest_hosts(lab) -> int:
    text = (lab.host(DEST).paths.dump_dir / "rank0" / "manifest.jsonl").read_text()
    return sum(1 for line in text.splitlines() if '"host"' in line)


def _started(lab, proc, predicate, what: str, deadline_s: float = 60) -> None:
    """Wait (with a deadline) until `predicate()` while the sync runs."""
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert proc.poll() is None, f"the sync ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {deadline_s}s"
        time.sleep(0.05)


def _slow_sync(lab_env) -> subprocess.Popen:
    """A sync at 0.4 MB/s per source (about 4 s), its output in pipes."""
    argv = [sys.executable, "-m", "remote_ops", "dumps", "sync", "--from", ",".join(SOURCES), "--to", DEST]
    return subprocess.Popen(
        [*argv, "--bwlimit", "0.4", "--json"],
        env=lab_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


def _rerun_completes(lab, lab_env, shards) -> dict:
    code, doc, err = sync(lab_env)
    assert code == 0, err
    assert_complete(lab, shards)
    assert not grants_left(lab)
    assert not list((lab.host(DEST).paths.dump_dir / syncplan.WORK_DIR).glob("key*"))
    return doc


def _moved_one(lab):
    return lambda: _manifest_hosts(lab) >= 1


def test_killed_laptop_process_resumes_with_the_same_samples_once_and_no_key_left(lab, lab_env, shards):
    proc = _slow_sync(lab_env)
    try:
        _started(lab, proc, _moved_one(lab), "a moved file")
        proc.kill()
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    doc = _rerun_completes(lab, lab_env, shards)
    assert 0 < doc["moved"] < 6  # the killed run's verified files were kept, not moved again


def test_killed_source_sshd_resumes_after_it_is_back(lab, lab_env, shards):
    proc = _slow_sync(lab_env)
    try:
        _started(lab, proc, _moved_one(lab), "a moved file")
        lab.host("lab1").sshd.stop()
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 4, err.decode()  # connection lost
    finally:
        if proc.poll() is None:
            proc.kill()
        lab.restart("lab1")
    _rerun_completes(lab, lab_env, shards)


def _transfer_rsync_pids(lab) -> list[int]:
    """The destination's rsync processes of this sync (their command line names the staging dir)."""
    stage = str(lab.host(DEST).paths.dump_dir / syncplan.WORK_DIR / "stage")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"rsync") and any(stage.encode() in a for a in argv):
                pids.append(int(entry.name))
    return pids


def test_killed_transfer_on_the_destination_resumes(lab, lab_env, shards):
    proc = _slow_sync(lab_env)
    try:
        _started(lab, proc, lambda: _moved_one(lab)() and bool(_transfer_rsync_pids(lab)), "a running transfer")
        for pid in _transfer_rsync_pids(lab):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=90)
        assert proc.returncode not in (0, None), err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not grants_left(lab)  # a failed run revokes too
    _rerun_completes(lab, lab_env, shards)


def test_a_corrupt_staged_copy_is_fetched_again_and_never_counted(lab, lab_env, shards):
    src = sorted((lab.host("lab1").paths.dump_dir / "rank0").glob("*.safetensors"))[-1]
    staged = lab.host(DEST).paths.dump_dir / syncplan.WORK_DIR / "stage" / "lab1" / "rank0" / src.name
    staged.parent.mkdir(parents=True)
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF  # same size, same mtime: rsync's quick check alone would keep it
    staged.write_bytes(bytes(data))
    os.utime(staged, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns))
    code, doc, err = sync(lab_env)
    assert code == 0, err
    assert doc["transfers"]["lab1"]["refetched"] == [f"rank0/{src.name}"]
    assert_complete(lab, shards)


def test_a_sample_with_two_contents_is_a_named_conflict_and_not_moved(lab, lab_env, shards):
    rec = write_dumps(lab.host("lab2").paths.dump_dir, 1, seed=99, keys_from=0)[0]  # lab1's first key, other bytes
    code, doc, err = sync(lab_env)
    assert code == 10, err
    conflict = doc["conflicts"]
    assert [c["key"] for c in conflict] == [rec["key"]]
    assert {c["host"] for c in conflict[0]["copies"]} == {"lab1", "lab2", DEST}
    files, keys = dest_state(lab)
    assert files[rec["key"]] == shards[rec["key"]]  # the destination's copy stays as it was
    assert sorted(keys) == sorted(set(keys)) == sorted(shards)


IO_PROBE = """
import json, sys
import paramiko, rich.progress
import remote_ops.cli.commands.dumps, remote_ops.workflows.sync, remote_ops.workflows.dumps, remote_ops.remote.fabric
from remote_ops.cli.launch import run

def io():
    return {k: int(v) for k, v in (l.split(": ") for l in open("/proc/self/io").read().splitlines())}

before = io()
try:
    run()
finally:
    after = io()
    sys.stderr.write("IO " + json.dumps({k: after[k] - before[k] for k in ("rchar", "wchar")}) + "\\n")
"""


def _process_io(lab_env, *args: str) -> tuple[int, dict]:
    p = subprocess.run(
        [sys.executable, "-c", IO_PROBE, *args],
        env=lab_env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    line = next(l for l in p.stderr.splitlines() if l.startswith("IO "))
    return p.returncode, json.loads(line[3:])


def test_no_dump_byte_passes_through_the_remote_ops_process(lab, lab_env, shards, tmp_path):
    total = sum(p.stat().st_size for n in SOURCES for p in (lab.host(n).paths.dump_dir / "rank0").glob("*.safetensors"))
    code, io = _process_io(lab_env, "dumps", "sync", "--from", ",".join(SOURCES), "--to", DEST, "-q")
    assert code == 0
    assert_complete(lab, shards)
    code, idle = _process_io(lab_env, "dumps", "sync", "--from", ",".join(SOURCES), "--to", DEST, "-q")
    assert code == 0
    # what the move added to the process's own reads and writes (the rest is start-up: modules
    # imported on first use, inventory, keys; the same for a run that moves nothing)
    added = io["rchar"] + io["wchar"] - idle["rchar"] - idle["wchar"]
    assert added < total / 10, (io, idle, total)
    # the same probe sees the bytes of a laptop relay (the instrument works)
    code, relay = _process_io(lab_env, "dumps", "pull", "--host", ",".join(SOURCES), "--dest", str(tmp_path), "-q")
    assert code == 0 and relay["rchar"] > total / 2, (relay, total)
