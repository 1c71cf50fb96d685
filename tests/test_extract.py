"""The extraction client: pure parts, and a real run on a lab host against the SGLang stand-in
(docker/standin/sglang_standin_server.py, stdlib python, writes contract dumps)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import stop_process

from remote_ops.core import extractplan
from remote_ops.onhost import extract_onhost
from remote_ops.probes.extract import ExtractAlive, WaitExit
from remote_ops.workflows import extract

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "docker" / "standin" / "sglang_standin_server.py"


def test_dump_key_matches_the_contract():
    ids = [1, 2, 3, 70000]
    want = hashlib.sha256(struct.pack("<4i", *ids)).hexdigest()[:32] + "-p0"
    assert extract_onhost.dump_key(ids) == want
    from remote_ops.dumper import dumpfile

    assert dumpfile.dump_key(dumpfile.token_ids_bytes(ids), 0) == want


def test_dataset_and_manifest_reading(tmp_path):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"id": "a", "input_ids": [1, 2]}\n\n{"token_ids": [3]}\n')
    assert extract_onhost.read_dataset(str(ds)) == [("a", [1, 2]), ("2", [3])]
    man = tmp_path / "m.jsonl"
    man.write_text('{"id": "a", "status": "failed"}\n{"id": "a", "status": "ok"}\n{"id": "b", "sta')
    assert extract_onhost.read_manifest(str(man)) == {"a": {"id": "a", "status": "ok"}}


def test_launch_command_runs_detached_in_its_own_session_and_quotes():
    p = extractplan.ExtractPaths("/data/logs x/extract", "/data/logs x/extraction.log", "/data/d")
    cmd = extractplan.launch_command(p, "http://127.0.0.1:30000", 8, 5, p.dataset, limit=3, dump_grace=1)
    assert cmd.startswith("cd '/data/logs x/extract' || exit 1; setsid nohup python3 ")
    assert "--limit 3" in cmd and "--dump-grace 1" in cmd and cmd.endswith("& echo $!")
    assert "/proc/$pid/cmdline" in ExtractAlive(p).command()


# --------------------------------------------------------------------------- on a lab host


@pytest.fixture
def standin(lab, host, tmp_path):
    """The SGLang stand-in on lab1's server port, dumping into lab1's dump dir; stopped by PID."""
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "remote_ops_dump").symlink_to(REPO / "remote_ops" / "dumper")
    env = {
        **os.environ,
        "PYTHONPATH": str(pkg),
        "SGLANG_HS_DUMP_DIR": str(host.paths.dump_dir),
        "STANDIN_LOAD_SECONDS": "0",
    }
    subprocess.run(["rm", "-rf", str(host.paths.dump_dir)], check=True, timeout=30)
    log = open(tmp_path / "standin.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), "--port", str(host.server_port), "--model-path", str(host.paths.model_dir)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while b"listening" not in (tmp_path / "standin.log").read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "standin.log").read_text()
        time.sleep(0.1)
    yield proc
    stop_process(proc)
    log.close()


@pytest.fixture
def fresh_run(host):
    """No leftovers of an earlier run in lab1's logs dir; the client is stopped after the test."""
    subprocess.run(["rm", "-rf", str(host.paths.logs_dir)], check=True, timeout=30)
    host.paths.logs_dir.mkdir(parents=True)
    yield
    pidfile = host.paths.logs_dir / "extract" / "client.pid"
    if pidfile.exists():
        pid = int(pidfile.read_text())
        if _is_client(pid):
            os.kill(pid, signal.SIGKILL)


def _is_client(pid: int) -> bool:
    try:
        return b"extract_onhost" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _dataset(path: Path, n: int, tokens: int) -> list[str]:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"s{i}", "input_ids": [(i * 7919 + t) % 32000 for t in range(tokens)]}) + "\n")
    return [f"s{i}" for i in range(n)]


def _wait_state(remote, spec, states, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = extract.status(remote, spec)
        if st.summary.state in states and not st.running:
            return st
        time.sleep(0.3)
    raise AssertionError(f"extraction did not reach {states} in {timeout}s: {st}")


def test_extraction_resumes_after_being_killed(lab, host, remote, standin, fresh_run, tmp_path):
    spec = lab.spec(host.name)
    ids = _dataset(tmp_path / "ds.jsonl", 1500, 40)
    first = extract.start(remote, spec, str(tmp_path / "ds.jsonl"), concurrency=1, dump_grace=5)
    assert first.running and first.pid
    manifest = host.paths.logs_dir / "extract" / "manifest.jsonl"
    deadline = time.monotonic() + 60
    while not manifest.exists() or manifest.read_text().count('"ok"') < 30:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGKILL)  # no goodbye: a crash
    deadline = time.monotonic() + 10
    while _is_client(first.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    done_at_kill = manifest.read_text().count('"ok"')
    assert done_at_kill < len(ids), "too fast to interrupt; make the dataset bigger"
    second = extract.start(remote, spec, str(tmp_path / "ds.jsonl"), concurrency=4, dump_grace=5)
    assert second.pid != first.pid
    final = _wait_state(remote, spec, ("finished",))
    records = [json.loads(l) for l in manifest.read_text().splitlines() if l.strip().endswith("}")]
    ok = [r["id"] for r in records if r["status"] == "ok"]
    assert sorted(ok) == sorted(ids)  # every sample once: nothing lost, nothing repeated
    assert final.summary.done == len(ids) and final.summary.missing_dumps == 0 and final.missing == []
    started = [l for l in (host.paths.logs_dir / "extraction.log").read_text().splitlines() if " started " in l]
    assert len(started) == 2 and f"pending={len(ids) - done_at_kill} " in started[1]
    keys = {r["key"] for r in records}
    files = {p.name[: -len(".safetensors")] for p in host.paths.dump_dir.glob("rank0/*.safetensors")}
    assert keys <= files


def test_samples_without_a_dump_file_are_reported(lab, host, remote, standin, fresh_run, tmp_path):
    spec = lab.spec(host.name)
    _dataset(tmp_path / "ds.jsonl", 6, 20)
    other_dir = spec.model_copy(update={"dump": spec.dump.model_copy(update={"dir": str(tmp_path / "nowhere")})})
    (tmp_path / "nowhere").mkdir()  # a dump dir the server does not write into (a missing one is refused)
    extract.start(remote, other_dir, str(tmp_path / "ds.jsonl"), concurrency=2, dump_grace=0.5)
    final = _wait_state(remote, other_dir, ("finished",))
    assert final.summary.missing_dumps == 6 and len(final.missing) == 6 and final.missing[0]["key"].endswith("-p0")


def test_a_second_start_is_refused_and_stop_uses_the_pid(lab, host, remote, standin, fresh_run, tmp_path):
    from remote_ops.errors import Refused

    spec = lab.spec(host.name)
    _dataset(tmp_path / "ds.jsonl", 3000, 400)
    st = extract.start(remote, spec, str(tmp_path / "ds.jsonl"), concurrency=1, dump_grace=0.5)
    with pytest.raises(Refused):
        extract.start(remote, spec, str(tmp_path / "ds.jsonl"))
    stopped = extract.stop(remote, spec, wait_s=30)
    assert not stopped.running and stopped.summary.state == "stopped" and not _is_client(st.pid)


def test_unreachable_server_is_retried_then_the_sample_fails(lab, host, remote, fresh_run, tmp_path):
    spec = lab.spec(host.name)
    _dataset(tmp_path / "ds.jsonl", 2, 5)
    extract.start(
        remote, spec, str(tmp_path / "ds.jsonl"), retries=2, dump_grace=0.1, server_url="http://127.0.0.1:9"
    )  # discard port: connection refused
    final = _wait_state(remote, spec, ("finished",), timeout=60)
    assert final.summary.failed == 2 and final.summary.errors == 6
    assert any(" failed " in l for l in final.summary.error_lines)


def _cli(host, env):
    """The real CLI in a subprocess against `host`, with --json; asserts exit 0, returns the document."""

    def cli(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "remote_ops", *args, "--host", host.name, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    return cli


def test_cli_extract_status_and_log_summary(lab, host, lab_env, standin, fresh_run, tmp_path):
    _dataset(tmp_path / "ds.jsonl", 5, 10)

    cli = _cli(host, lab_env)
    cli("extract", "start", "--dataset", str(tmp_path / "ds.jsonl"))
    deadline = time.monotonic() + 60
    while cli("extract", "status")["summary"]["state"] != "finished":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    summary = cli("logs", "summary", "--plot")
    assert summary["extraction"]["done"] == 5 and summary["extraction"]["total"] == 5
    assert any(p.endswith("extraction.png") for p in summary["plots"])


def test_cli_extract_dry_run_changes_nothing_then_wait_runs_to_completion(
    lab, host, lab_env, standin, fresh_run, remote, tmp_path
):
    _dataset(tmp_path / "ds.jsonl", 4, 8)

    cli = _cli(host, lab_env)
    plan = cli("extract", "start", "--dataset", str(tmp_path / "ds.jsonl"), "--dry-run")
    assert plan["dry_run"] and plan["upload_client"] and plan["upload_dataset"] and not plan["already_running"]
    p = extractplan.paths_for(lab.spec(host.name))
    assert remote.run(["test", "-e", p.client], check=False).exit_status != 0, "dry run uploaded nothing"
    done = cli("extract", "start", "--dataset", str(tmp_path / "ds.jsonl"), "--wait", "90")
    assert not done["running"] and done["summary"]["done"] == 4 and done["missing"] == []
    assert cli("extract", "stop", "--dry-run")["running"] is False


def test_a_status_that_waits_returns_when_the_client_exits_not_at_its_bound(tmp_path):
    """`extract start --wait` polls with statuses that wait on the host: the wait ends when the
    recorded client exits (checked as the real alive test checks it: PID + its command line)."""
    from remote_ops.core.extractplan import CLIENT_NAME, ExtractPaths

    p = ExtractPaths(str(tmp_path), str(tmp_path / "x.log"), str(tmp_path / "dumps"))
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)", CLIENT_NAME])
    Path(p.file("client.pid")).write_text(f"{client.pid}\n")
    t = time.monotonic()
    subprocess.run(["/bin/sh", "-c", WaitExit(p, 20).command()], check=True, timeout=30)
    waited = time.monotonic() - t
    client.wait(timeout=5)
    assert waited < 10, f"returned after {waited:.1f}s: the 20 s bound, not the client's exit"
    t = time.monotonic()
    subprocess.run(["/bin/sh", "-c", WaitExit(p, 20).command()], check=True, timeout=30)
    assert time.monotonic() - t < 5, "no client running: no wait"


def test_the_done_keys_are_read_after_the_client_is_seen_alive_or_gone():
    """A client that exits between the two reads must not leave its last key out of a status
    that calls the run finished: `alive` is asked before `keys` in the one round trip."""
    from remote_ops.core.inventory import HostSpec
    from remote_ops.probes.extract import DoneKeys, ExtractStatusProbes
    from remote_ops.workflows import extract as ex

    probes = ExtractStatusProbes(ex.paths_for(HostSpec(name="h")), with_keys=True, wait_s=2.0).probes
    kinds = [type(p) for p in probes]
    assert kinds.index(WaitExit) < kinds.index(ExtractAlive) < kinds.index(DoneKeys)
