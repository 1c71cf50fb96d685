"""`dumps sync`'s faults (issue 36): grants edited under a lock and revokes read back, no success
with rows missing on a source, bad addresses refused before connecting, hints and leftovers.

Every test runs the real CLI or the real on-host program over ssh against the lab hosts
(lab1, lab2 -> lab3, as tests/test_sync.py); the hostile states (a symlinked dump dir, a
FIFO row, a corrupt source file) are made on the lab host's own filesystem.

`REMOTE_OPS_SYNC_RACE_RUNS` (default 10) sets how many rounds of two concurrent syncs from one
source the race test runs; the issue's Done-when figure is 100.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from remote_ops.core import syncplan
from remote_ops.workflows.sync import on_host

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import connect, run_cli  # noqa: E402
from test_sync import DEST, _clear, _onhost, dest_state, grants_left, sync, write_dumps  # noqa: E402

SOURCE = "lab1"


def _ak(lab, name: str = SOURCE) -> Path:
    return lab.host(name).sshd.dir / "authorized_keys"


def _marked(lab, mark: str, name: str = SOURCE) -> list[str]:
    return [line for line in _ak(lab, name).read_text().splitlines() if mark in line]


def _drop_marked(lab, name: str = SOURCE) -> None:
    """Remove every transfer-key line a failed test left (the file also lets the tests in)."""
    path = _ak(lab, name)
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if syncplan.MARK not in line))


# --------------------------------------------------------------------------- grants under a lock


def test_concurrent_grant_and_revoke_loops_on_one_source_never_bring_back_a_revoked_line(lab):
    """Three loops (three destinations' marks) grant and revoke on lab1 at once, over ssh.  After
    each revoke its line is gone from the file and the report says `revoked`; nothing is left."""
    rounds = 15
    ak = str(_ak(lab))
    problems: list[str] = []
    reports: list[dict] = []

    def loop(dest: str) -> None:
        mark = syncplan.mark(dest)
        remote = connect(lab, SOURCE)
        try:
            for i in range(rounds):
                on_host(remote, "grant", "--file", ak, "--mark", mark, "--line", f"restrict ssh-ed25519 AAAA {mark}{i}")
                out = on_host(remote, "revoke", "--file", ak, "--mark", mark)
                reports.append(out)
                left = _marked(lab, mark)
                if left:
                    problems.append(f"{dest} round {i}: revoke said {out}, the file still holds {left}")
        except Exception as exc:  # the thread's failure, named in the assertion below
            problems.append(f"{dest}: {exc!r}")
        finally:
            remote.close()

    threads = [threading.Thread(target=loop, args=(d,)) for d in ("race-a", "race-b", "race-c")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a loop did not end within 120 s"
        assert not problems, problems[:5]
        assert not _marked(lab, syncplan.MARK)
        assert len(reports) == 3 * rounds and all(r.get("revoked") is True for r in reports), reports[:3]
    finally:
        _drop_marked(lab)


def test_a_grant_waits_for_the_lock_and_gives_up_at_its_deadline_naming_the_file(tmp_path):
    ak = tmp_path / "authorized_keys"
    ak.write_text("ssh-ed25519 AAAA operator\n")
    mark = syncplan.mark("lab3")
    script = Path(__file__).resolve().parents[1] / "remote_ops" / "onhost" / "sync_onhost.py"
    with open(tmp_path / "authorized_keys.remote-ops.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, str(script), "grant", "--file", str(ak), "--mark", mark, "--line", f"x {mark}1"]
            + ["--lock-timeout", "1"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        waited = time.monotonic() - t0
    doc = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode != 0 and doc["error"] == "locked" and doc["file"] == str(ak), (p.stdout, p.stderr)
    assert 0.9 <= waited < 10
    assert ak.read_text() == "ssh-ed25519 AAAA operator\n"  # nothing written without the lock
    assert _onhost("grant", "--file", str(ak), "--mark", mark, "--line", f"x {mark}1")["removed"] == 0
    assert _onhost("revoke", "--file", str(ak), "--mark", mark) == {
        "file": str(ak),
        "removed": 1,
        "revoked": True,
    }


def test_a_symlinked_authorized_keys_stays_a_symlink_and_its_target_is_edited(tmp_path):
    real = tmp_path / "managed" / "keys"
    real.parent.mkdir()
    real.write_text("ssh-ed25519 AAAA operator\n")
    real.chmod(0o644)
    link = tmp_path / "ssh" / "authorized_keys"
    link.parent.mkdir()
    link.symlink_to(real)
    mark = syncplan.mark("lab3")
    _onhost("grant", "--file", str(link), "--mark", mark, "--line", f"x {mark}1")
    assert link.is_symlink() and real.read_text().endswith(f"x {mark}1\n")
    assert _onhost("revoke", "--file", str(link), "--mark", mark)["revoked"] is True
    assert link.is_symlink() and real.read_text() == "ssh-ed25519 AAAA operator\n"
    assert real.stat().st_mode & 0o777 == 0o644


@pytest.fixture
def one_source(lab):
    """lab1 holds 3 samples; lab2 and lab3 (two destinations) none.  {key: sha256}."""
    _clear(lab)
    recs = write_dumps(lab.host(SOURCE).paths.dump_dir, 3, seed=7)
    yield {r["key"]: r["sha256"] for r in recs}
    _clear(lab)
    _drop_marked(lab)


def _sync_proc(lab_env, dest: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "remote_ops", "dumps", "sync", "--from", SOURCE, "--to", dest, "--json", *extra]
    return subprocess.Popen(
        argv, env=lab_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )


def test_concurrent_syncs_from_one_source_leave_no_grant_and_every_revoked_is_true(lab, lab_env, one_source):
    """The issue's Done-when: rounds of two concurrent syncs from lab1 (to lab2 and to lab3); after
    each round no grant line is left and every `revoked` report is true (its line is gone)."""
    runs = int(os.environ.get("REMOTE_OPS_SYNC_RACE_RUNS", "10"))
    t0 = time.monotonic()
    for i in range(runs):
        for name in ("lab2", DEST):
            _clear_dest(lab, name)
        procs = {d: _sync_proc(lab_env, d) for d in ("lab2", DEST)}
        docs = {}
        for dest, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"round {i} -> {dest}: exit {proc.returncode}: {err}"
            docs[dest] = json.loads(out)
        for dest, doc in docs.items():
            assert doc["moved"] == 3, (i, dest, doc)
            revoked = doc["revoked"][SOURCE]
            assert revoked["revoked"] is True and revoked["removed"] == 1, (i, dest, revoked)
        left = _marked(lab, syncplan.MARK)
        assert not left, f"round {i}: grant lines left on {SOURCE}: {left}"
    sys.stderr.write(f"\n{runs} rounds of two concurrent syncs from one source: {time.monotonic() - t0:.1f} s\n")


def _clear_dest(lab, name: str) -> None:
    import shutil

    d = lab.host(name).paths.dump_dir
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)


# --------------------------------------------------------------------------- rows missing on a source


@pytest.fixture
def shards_one_source(lab):
    """lab1 holds 4 samples, lab2 none, lab3 (the destination) none; {key: sha256}."""
    _clear(lab)
    recs = write_dumps(lab.host(SOURCE).paths.dump_dir, 4, seed=11)
    yield {r["key"]: r["sha256"] for r in recs}
    _clear(lab)
    _drop_marked(lab)


def test_rows_missing_on_a_source_exit_10_and_are_named_on_stderr(lab, lab_env, shards_one_source):
    gone = sorted((lab.host(SOURCE).paths.dump_dir / "rank0").glob("*.safetensors"))[0]
    gone.unlink()
    code, doc, err = sync(lab_env)
    assert code == 10, err
    assert f"1 manifest row(s) missing on {SOURCE}" in err and f"rank0/{gone.name}" in err, err
    files, _ = dest_state(lab)
    assert len(files) == 3  # the rest still moved
    assert doc["missing_on_source"] == [f"{SOURCE}:rank0/{gone.name}"]
    assert not grants_left(lab)

    code, doc, err = sync(lab_env, "--allow-missing")
    assert code == 0, err
    assert "missing" in err and f"rank0/{gone.name}" in err  # still named, as a warning


def test_dry_run_names_rows_missing_on_a_source_and_exits_10(lab, lab_env, shards_one_source):
    gone = sorted((lab.host(SOURCE).paths.dump_dir / "rank0").glob("*.safetensors"))[0]
    gone.unlink()
    code, doc, err = sync(lab_env, "--dry-run")
    assert code == 10, err
    assert f"rank0/{gone.name}" in err
    code, doc, err = sync(lab_env, "--dry-run", "--allow-missing")
    assert code == 0, err


def test_rows_without_a_regular_file_are_split_into_missing_and_not_regular_and_never_planned():
    from remote_ops.core import dumpcheck

    manifest = "".join(
        json.dumps({"key": k, "file": f"{r}/{k}.safetensors", "bytes": 10, "sha256": "s"}) + "\n"
        for k, r in [("a", "rank0"), ("b", "rank0"), ("c", "rank1"), ("d", "rank0")]
    )
    files = {"rank0/d.safetensors": 10}
    irregular = {"rank0/b.safetensors": "p", "rank1": "l"}
    r = dumpcheck.reconcile("/d", files, manifest, unsafe=[], irregular=irregular)
    rows = syncplan.source_rows({"src": r})
    assert rows.missing == ["src:rank0/a.safetensors"]
    assert [x.split(": ", 1)[0] for x in rows.not_regular] == [
        "src:rank0/b.safetensors",
        "src:rank1",
        "src:rank1/c.safetensors",
    ]
    assert all("not a regular file" in x for x in rows.not_regular)
    assert rows.unsafe == []  # named once, as not regular
    plan = syncplan.plan({"src": r}, "dst", dumpcheck.Reconciliation("/x"))
    assert [rec["key"] for rec in plan.moves["src"]] == ["d"]


@pytest.fixture
def linked_dump_dir(lab, shards_one_source):
    """lab1's dump dir moved to `bigdisk/eagle3-dumps` and replaced by a symlink to it."""
    d = lab.host(SOURCE).paths.dump_dir
    real = d.parent / "bigdisk" / "eagle3-dumps"
    real.parent.mkdir(exist_ok=True)
    d.rename(real)
    d.symlink_to(real)
    yield real
    d.unlink()
    real.rename(d)
    real.parent.rmdir()


def test_a_symlinked_dump_dir_is_resolved_on_the_host_granted_and_reported(
    lab, lab_env, shards_one_source, linked_dump_dir
):
    code, doc, err = sync(lab_env, "--dry-run")
    assert code == 0, err
    assert doc["plan"]["files"] == 4
    code, doc, err = sync(lab_env)
    assert code == 0, err
    assert doc["moved"] == 4 and not doc["missing_on_source"]
    assert doc["dump_dirs"][SOURCE] == str(linked_dump_dir)
    assert f'-ro {linked_dump_dir}"' in doc["grants"][SOURCE]["line"]  # rrsync confined to the resolved dir
    assert str(linked_dump_dir) in err  # the resolved dir is named
    files, _ = dest_state(lab)
    assert files == shards_one_source


def test_a_fifo_or_symlink_row_on_a_source_is_not_a_regular_file_not_missing(lab, lab_env, shards_one_source):
    rank0 = lab.host(SOURCE).paths.dump_dir / "rank0"
    fifo, link = sorted(rank0.glob("*.safetensors"))[:2]
    fifo.unlink()
    os.mkfifo(fifo)
    link.unlink()
    link.symlink_to("/dev/zero")
    code, doc, err = sync(lab_env)
    assert code == 10, err
    assert f"rank0/{fifo.name}" in err and f"rank0/{link.name}" in err
    assert "not a regular file" in err, err
    files, _ = dest_state(lab)
    assert len(files) == 2 and fifo.name[: -len(".safetensors")] not in files
    assert not grants_left(lab)


# --------------------------------------------------------------------------- usage errors before connecting


@pytest.mark.parametrize("dry", [True, False])
def test_a_bad_dest_address_is_a_usage_error_before_anything_connects(lab, lab_env, dry):
    # the source is an address nothing listens on: connecting would be exit 4
    args = ["dumps", "sync", "--from", "root@127.250.0.1", "--to", DEST, "--dest-address", '127.0.0.1",command="sh']
    code, out, err = run_cli(lab_env, *args, *(["--dry-run"] if dry else []), timeout=60)
    assert code == 2, err
    assert "--dest-address" in err and "Traceback" not in err
    assert not (lab.host(DEST).paths.dump_dir / syncplan.WORK_DIR / "key").exists()


def test_check_address_takes_ip_literals_and_plain_host_names_only():
    assert syncplan.check_address("::1") == "::1"
    assert syncplan.check_address("10.0.0.5") == "10.0.0.5"
    assert syncplan.check_address("gpu-01.example.org") == "gpu-01.example.org"
    for bad in ('127.0.0.1",command="sh', "a b", "-oProxyCommand=x", "", "a,b", "x\n", "h_1"):
        with pytest.raises(ValueError):
            syncplan.check_address(bad)


def test_to_naming_several_hosts_names_the_to_option(lab, lab_env):
    code, out, err = run_cli(lab_env, "dumps", "sync", "--from", SOURCE, "--to", "lab2,lab3", "--dry-run")
    assert code == 2, err
    assert "--to 'lab2,lab3'" in err and "--host" not in err, err


# --------------------------------------------------------------------------- a failed sync


def _corrupt_on_source(lab) -> Path:
    """Flip a byte of one lab1 dump: same size (the plan moves it), another sha256 (it never verifies)."""
    f = sorted((lab.host(SOURCE).paths.dump_dir / "rank0").glob("*.safetensors"))[-1]
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    return f


def test_a_verification_failure_hint_speaks_of_the_failed_files_not_conflicts(lab, lab_env, shards_one_source):
    bad = _corrupt_on_source(lab)
    code, doc, err = sync(lab_env)
    assert code == 10, err
    assert doc["failed"] == {f"{SOURCE}:rank0/{bad.name}": "sha256 differs from the source manifest"}
    assert "conflict" not in (doc.get("hint") or "") and "conflict" not in err.split("hint", 1)[-1], err
    assert "sha256" in (doc.get("hint") or "")


def test_a_failed_sync_leaves_no_plan_and_no_lock_in_the_destination_work_dir(lab, lab_env, shards_one_source):
    _corrupt_on_source(lab)
    code, doc, err = sync(lab_env)
    assert code == 10, err
    work = lab.host(DEST).paths.dump_dir / syncplan.WORK_DIR
    left = sorted(str(p.relative_to(work)) for p in work.rglob("*")) if work.exists() else []
    assert not [p for p in left if p.startswith("plan-") or p.endswith(".lock") or "key" in p], left


def test_a_killed_transfer_leaves_no_plan_and_no_lock(lab, lab_env, shards_one_source):
    """The destination's transfer SIGKILLed (it cannot clean up): the workflow does, afterwards."""
    from test_sync import _started, _transfer_rsync_pids

    proc = _sync_proc(lab_env, DEST, "--bwlimit", "0.2")
    try:
        _started(lab, proc, lambda: bool(_transfer_rsync_pids(lab)), "a running transfer")
        for pid in _transfer_rsync_pids(lab):
            transfer = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
            for victim in (transfer, pid):
                try:
                    os.kill(victim, 9)
                except ProcessLookupError:
                    pass
        proc.communicate(timeout=90)
        assert proc.returncode not in (0, None)
    finally:
        if proc.poll() is None:
            proc.kill()
    work = lab.host(DEST).paths.dump_dir / syncplan.WORK_DIR
    left = sorted(str(p.relative_to(work)) for p in work.rglob("*")) if work.exists() else []
    assert not [p for p in left if p.startswith("plan-") or p.endswith(".lock") or "key" in p], left
    assert not grants_left(lab)
