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

from remote_ops.onhost import extract_onhost


def _cli(env, *args, timeout=180):
    """The real CLI in a subprocess, `--json`: (exit code, stdout document or None, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json"], capture_output=True, text=True, timeout=timeout, env=env
    )
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
    return {p.name[: -len(".safetensors")] for p in host.paths.dump_dir.glob("rank*/*.safetensors")}


def test_plan_samples_decides_by_dump_key_not_by_id():
    a = [1, 2, 3]
    records = [{"id": "s0", "key": extract_onhost.dump_key(a), "status": "ok"}]
    pending, done, reused, adopt = extract_onhost.plan_samples([("s0", [9, 9]), ("x", a), ("s0", a)], records)
    assert [p[0] for p in pending] == ["s0"] and pending[0][1] == [9, 9]  # same id, new content: sent
    assert [d[0] for d in done] == ["x", "s0"]  # same content: done
    assert reused == ["s0"] and [x[0] for x in adopt] == ["x"]


def test_a_new_dataset_reusing_ids_gets_new_dumps_and_a_rerun_is_a_noop(
    lab, host, lab_env, standin, fresh_run, tmp_path
):
    first = _write_dataset(tmp_path / "a.jsonl", [(f"s{i}", [100 + i, 7, i]) for i in range(5)])
    rc, doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(first), "--wait", "90")
    assert rc == 0, err
    assert doc["summary"]["done"] == 5 and doc["summary"]["total"] == 5 and doc["manifest_ok"] == 5
    keys_a, lines_a = _dump_keys(host), len(_manifest(host))
    assert len(keys_a) == 5 and lines_a == 5

    rc, doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(first), "--wait", "90")
    assert rc == 0, err  # the same dataset again: a no-op
    assert doc["summary"]["done"] == 5 and doc["summary"]["total"] == 5
    assert _dump_keys(host) == keys_a and len(_manifest(host)) == lines_a
    started = [l for l in (host.paths.logs_dir / "extraction.log").read_text().splitlines() if " started " in l]
    assert len(started) == 2 and " pending=0 " in started[-1] and " reused_ids=0 " in started[-1]

    # ids s0..s2 again, other token ids; s9 carries s4's tokens (done already, under another id)
    second = _write_dataset(
        tmp_path / "b.jsonl", [(f"s{i}", [200 + i, 8, i]) for i in range(3)] + [("s9", [104, 7, 4])]
    )
    rc, doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(second), "--wait", "90")
    assert rc == 0, err
    assert doc["summary"]["done"] == 4 and doc["summary"]["total"] == 4  # not "9/4": this dataset only
    assert doc["manifest_ok"] == 4 and doc["dataset_total"] == 4 and doc["missing"] == []
    assert doc["reused_ids"] == 3 and "3 sample id(s) of this dataset were done earlier" in err
    new_keys = {extract_onhost.dump_key([200 + i, 8, i]) for i in range(3)}
    assert _dump_keys(host) == keys_a | new_keys  # three new dumps, none lost
    started = [l for l in (host.paths.logs_dir / "extraction.log").read_text().splitlines() if " started " in l]
    assert " pending=3 " in started[-1] and " reused_ids=3 " in started[-1]
    ok = [(r["id"], r["key"]) for r in _manifest(host) if r["status"] == "ok"]
    assert ("s9", extract_onhost.dump_key([104, 7, 4])) in ok  # adopted without a request
    for i in range(3):
        assert (f"s{i}", extract_onhost.dump_key([200 + i, 8, i])) in ok

    rc, doc, err = _cli(lab_env, "extract", "status", "--host", host.name)
    assert rc == 0 and doc["manifest_ok"] == 4 and doc["dataset_total"] == 4


# --------------------------------------------------------------------------- 6 and 7: dumps pull

H = 64


def _host_dumps(host, count: int, tokens: int, seed: int = 0) -> list[dict]:
    """`count` contract dump files of `tokens` tokens (H=64) in the host's dump dir, via dumpfile.write_span."""
    from remote_ops.dumper import dumpfile

    subprocess.run(["rm", "-rf", str(host.paths.dump_dir)], check=True, timeout=60)
    records = []
    for i in range(count):
        ids = dumpfile.token_ids_bytes([(seed * 1000003 + i * 7919 + t) % 32000 for t in range(tokens)])
        blob = hashlib.sha256(ids).digest() * (tokens * H * 2 // 32 + 1)
        records.append(
            dumpfile.write_span(
                str(host.paths.dump_dir),
                0,
                ids,
                dumpfile.token_ids_bytes(range(tokens)),
                blob[: tokens * H * 2],
                (blob * 3)[: tokens * 3 * H * 2],
                H,
                fsync=False,
            )
        )
    return records


def _local_files(root: Path) -> dict[str, str]:
    """{relative name: sha256} of every file under `root` (temp and .part files included)."""
    return {str(p.relative_to(root)): _sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_pull_names_missing_and_torn_entries_and_exits_10_unless_allowed(lab, host, lab_env, tmp_path):
    records = _host_dumps(host, 5, 50)
    gone = host.paths.dump_dir / records[2]["file"]
    gone.unlink()  # a manifest row with no file
    with open(host.paths.dump_dir / "rank0" / "manifest.jsonl", "a") as fh:
        fh.write('{"key": "abc-p0", "file": "rank0/ab')  # a torn last line (a crash mid-append)
    dest = tmp_path / "pulled"
    rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", host.name, "--dest", str(dest))
    assert rc == 10, err
    assert records[2]["file"] in err and "torn" in err and "rank0/manifest.jsonl:6" in err
    assert doc["problems"]["missing"] == [records[2]["file"]] and len(doc["problems"]["torn"]) == 1
    assert doc["pull"]["fetched"] == 4  # everything that exists was pulled
    want = {r["file"]: r["sha256"] for r in records if r is not records[2]}
    got = _local_files(dest)
    assert {k: v for k, v in got.items() if k.endswith(".safetensors")} == want
    assert not [k for k in got if k.endswith(".part") or "/.tmp-" in k]

    rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", host.name, "--dest", str(dest), "--allow-missing")
    assert rc == 0, err  # accepted, but still named
    assert doc["problems"]["missing"] == [records[2]["file"]] and doc["pull"]["skipped"] == 4
    assert records[2]["file"] in err


def test_pull_of_corrupt_file_is_10_even_with_allow_missing(lab, host, lab_env, tmp_path):
    records = _host_dumps(host, 3, 40, seed=1)
    path = host.paths.dump_dir / records[0]["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, other bytes
    rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", host.name, "--dest", str(tmp_path / "d"), "--allow-missing")
    assert rc == 10, err
    assert records[0]["file"] in err and "sha256" in err
    assert not (tmp_path / "d" / records[0]["file"]).exists()  # never under its final name


@pytest.fixture
def small_fs(tmp_path):
    """mount(size) -> a real tmpfs of that many bytes under tmp_path; unmounted in teardown."""
    mounted = []

    def mount(size: int) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(point)], check=True, timeout=30
        )
        mounted.append(point)
        return point

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False, timeout=30)


def test_pull_to_a_too_small_disk_refuses_before_writing_and_says_how_much(lab, host, lab_env, small_fs):
    records = _host_dumps(host, 8, 1000, seed=2)  # 8 x ~0.52 MB
    need = sum(-(-r["bytes"] // 4096) * 4096 for r in records)  # whole 4 KiB blocks
    fs = small_fs(2 << 20)
    rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", host.name, "--dest", str(fs / "dumps"))
    assert rc == 14, err
    assert "Traceback" not in err and "not enough local disk space" in err
    assert f"{need:,} bytes) still to write for 8 file(s)" in err and f"{2 << 20:,} bytes) free on {fs}" in err
    assert doc["needed_bytes"] == need and doc["free_bytes"] == 2 << 20
    assert not any(fs.rglob("*.part")) and not any(fs.rglob("*.safetensors"))


def test_disk_filling_up_during_the_pull_is_exit_14_and_the_pull_resumes(lab, host, lab_env, faults, small_fs):
    records = _host_dumps(host, 24, 4000, seed=3)  # 24 x ~2 MB = ~49 MB
    need = sum(r["bytes"] for r in records)
    fs = small_fs(need + (24 << 20))
    dest = fs / "dumps"
    env = {**lab_env}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "remote_ops",
            "dumps",
            "pull",
            "--host",
            host.name,
            "--dest",
            str(dest),
            "--jobs",
            "1",
            "--json",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (dest.exists() and any(dest.rglob("*.part"))):  # the pull passed its space check
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    faults.freeze(host)  # hold the stream ...
    filler = fs / "filler"
    room = 5 << 20  # two files still fit, then it is full
    subprocess.run(
        ["fallocate", "-l", str(os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize - room), str(filler)],
        check=True,
        timeout=30,
    )  # ... another writer fills the disk ...
    faults.thaw(host)  # ... and let it go on
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 14, err
    assert "Traceback" not in err and "local disk full during the pull" in err and "free on" in err
    doc = json.loads(out)
    assert doc["needed_bytes"] > doc["free_bytes"] and doc["error"] == "no_space"
    want = {r["file"]: r["sha256"] for r in records}
    kept = {k: v for k, v in _local_files(dest).items() if k.endswith(".safetensors")}
    assert kept and all(want[k] == v for k, v in kept.items())  # only verified files carry final names

    filler.unlink()  # space freed: the same command resumes
    rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", host.name, "--dest", str(dest))
    assert rc == 0, err
    assert doc["pull"]["skipped"] + doc["pull"]["fetched"] == 24 and doc["pull"]["skipped"] > 0
    got = _local_files(dest)
    assert {k: v for k, v in got.items() if k.endswith(".safetensors")} == want
    assert not [k for k in got if k.endswith(".part") or "/.tmp-" in k]


# --------------------------------------------------------------------------- 11: patch apply on a full disk

SHA_059 = "4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35"


@pytest.fixture
def models_on_small_fs(sglang_host, small_fs):
    """lab2's `.../srt/models/` as a 4 MiB tmpfs holding only deepseek_v2.py (unmounted in teardown)."""
    models = sglang_host.paths.checkout / "python" / "sglang" / "srt" / "models"
    original = (models / "deepseek_v2.py").read_bytes()
    fs = small_fs(4 << 20)
    subprocess.run(["mount", "--bind", str(fs), str(models)], check=True, timeout=30)
    try:
        (models / "deepseek_v2.py").write_bytes(original)
        yield models
    finally:
        subprocess.run(["umount", "-l", str(models)], check=False, timeout=30)


def _fill(fs: Path, leave: int) -> Path:
    """Fill `fs` up to `leave` free bytes with one file (fallocate: real blocks, no data written)."""
    filler = fs / "filler"
    st = os.statvfs(fs)
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize - leave), str(filler)], check=True, timeout=30)
    return filler


def _leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if "remote-ops" in p.name)


@pytest.mark.parametrize("room", ["none for the new file", "new file fits, backup does not"])
def test_patch_apply_on_a_full_disk_names_the_cause_and_leaves_no_temp_file(
    sglang_host, lab_env, models_on_small_fs, room
):
    models = models_on_small_fs
    size = (models / "deepseek_v2.py").stat().st_size
    stale = [models / "deepseek_v2.py.remote-ops-backup.tmp.99999", models / ".deepseek_v2.py.remote-ops-tmp.99999"]
    for path in stale:  # what a kill -9 of an earlier apply leaves behind
        path.write_bytes(b"partial")
    leave = 8192 if room.startswith("none") else -(-(size + 4096) // 4096) * 4096 + 8192
    filler = _fill(models, leave)
    rc, doc, err = _cli(lab_env, "patch", "apply", "--host", sglang_host.name)
    assert rc == 7, err
    first = next(l for l in err.splitlines() if l.strip())
    assert "No space left on device" in first and "py_compile" not in first, err
    assert ("cannot write" if room.startswith("none") else "cannot make the backup") in first
    assert _sha(models / "deepseek_v2.py") == SHA_059
    assert _leftovers(models) == [], "every temp file is removed, stale ones too"

    filler.unlink()  # space back: apply and revert work and leave nothing
    rc, doc, err = _cli(lab_env, "patch", "apply", "--host", sglang_host.name)
    assert rc == 0, err
    assert _leftovers(models) == ["deepseek_v2.py.remote-ops-backup", "deepseek_v2.py.remote-ops-backup.sha256"]
    rc, doc, err = _cli(lab_env, "patch", "revert", "--host", sglang_host.name)
    assert rc == 0, err
    assert _sha(models / "deepseek_v2.py") == SHA_059 and not [n for n in _leftovers(models) if ".tmp" in n]


# --------------------------------------------------------------------------- 10: sandbox daemons judged one by one


def test_sandbox_status_judges_each_daemon_and_up_heals_the_dead_one_in_place(tmp_path):
    from conftest import require

    from remote_ops.hostlab import lab_unavailable
    from remote_ops.hostlab._proc import alive

    require(lab_unavailable())
    env = {**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    env.pop("REMOTE_OPS_INVENTORY", None)
    lab_json = tmp_path / "state" / "sandbox" / "lab" / "lab.json"
    try:
        rc, doc, err = _cli(env, "sandbox", "up", timeout=600)
        assert rc == 0 and doc["running"], err
        assert {k: v["state"] for k, v in doc["daemons"].items()} == {
            "sshd": "running",
            "dockerd": "running",
            "container": "absent",
        }
        first = json.loads(lab_json.read_text())
        where = (first["hosts"][0]["address"], first["hosts"][0]["port"])
        marker = tmp_path / "state" / "sandbox" / "lab" / "hosts" / "sandbox" / "sglang" / "MARKER"
        marker.write_text("the checkout is kept")

        for dead, other in (("sshd", "dockerd"), ("dockerd", "sshd")):
            before = json.loads(lab_json.read_text())
            pid = before["hosts"][0]["pid"] if dead == "sshd" else before["dockerd"]["pid"]
            os.kill(pid, 9)  # a crash, no goodbye
            deadline = time.monotonic() + 30
            while alive(pid):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            rc, doc, err = _cli(env, "sandbox", "status")
            assert rc == 13, err  # not "running" with a dead daemon
            assert doc["running"] is False and doc["daemons"][dead]["state"] == "dead"
            assert doc["daemons"][other]["state"] == "running" and f"{dead}: dead" in err

            rc, doc, err = _cli(env, "sandbox", "up", timeout=300)
            assert rc == 0 and doc["running"] and doc["healed"] == [dead], err
            after = json.loads(lab_json.read_text())
            assert (after["hosts"][0]["address"], after["hosts"][0]["port"]) == where
            assert after["id"] == first["id"]  # the same sandbox, not a new one

            def other_pid(s, other=other):
                return s["dockerd"]["pid"] if other == "dockerd" else s["hosts"][0]["pid"]

            assert other_pid(after) == other_pid(before)  # the live daemon was left alone
            assert marker.read_text() == "the checkout is kept"
            rc, doc, err = _cli(env, "inspect-source", "--host", "sandbox", "--lines", "1:2")
            assert rc == 0 and doc["sglang_version"] == "0.5.9", err  # ssh (and the checkout) work again
    finally:
        subprocess.run(
            [sys.executable, "-m", "remote_ops", "sandbox", "down"], env=env, capture_output=True, timeout=300
        )


def test_sandbox_daemon_judgement_is_per_daemon():
    from remote_ops.workflows import sandbox

    h = {"address": "127.9.9.9", "port": 22, "pid": 5}
    assert sandbox.judge_sshd(h, True, True).ok
    assert sandbox.judge_sshd(h, False, True).state == "dead"  # a port held by someone else is no sshd
    assert sandbox.judge_sshd(h, True, False).state == "not answering"
    assert sandbox.judge_dockerd({"pid": 7}, True, False).state == "not answering"
    assert sandbox.judge_container("c", True, 1, "").state == "absent"
    assert sandbox.judge_container("c", True, 0, "exited").ok is False
    assert sandbox.judge_container("c", False, None, "").state == "unknown"
