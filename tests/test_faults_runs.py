"""Fault matrix (issue 36): no run ends "ok" with data missing, stale locks are taken over, the
stand-in server is bounded.

- Scenario 3: a dump dir deleted before a run (`extract start` refuses, exit 9, naming the path),
  during a run (the client stops on the cause, `fatal cause=dump_dir_missing`, and `--wait` /
  `extract status` name it; exit 7), a run whose samples failed (`--wait` exit 7, as
  `dataset regenerate --wait`), `health` while the server cannot write its dumps (fail, exit 12),
  and a symlinked dump dir (resolved once on the host, that path used and reported); a dump dir
  made again under the running server (a stale mount: `extract start` refuses, exit 9, until
  `deploy` recreates the container).
- Scenario 9 / Deliver 5: a killed `dataset regenerate` left the host lock: the next one takes
  it over (its holder's PID is gone) and says so in the host's audit log.
- The stand-in's context limit and body cap (SGLang's own 400 message).

Hostile state is made on real lab hosts (sshd + dockerd; their paths are on this machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli_process, stop_process

from remote_ops.core import extractplan
from remote_ops.core.logparse import ExtractionSummary
from remote_ops.errors import ExitCode
from remote_ops.hostlab._proc import free_port
from remote_ops.onhost import extract_onhost
from remote_ops.probes import dumpdir
from remote_ops.probes.extract import fatal_of
from remote_ops.workflows import extract, health, hostlock

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "docker" / "standin" / "sglang_standin_server.py"


# --------------------------------------------------------------------------- pure


def test_the_dump_dir_state_parses_and_names_each_problem():
    ok = dumpdir.parse_state("/d", "dir=1\nwritable=1\nresolved=/mnt/real dumps\n")
    assert ok.problem() is None and ok.path == "/mnt/real dumps" and ok.named() == "/d (-> /mnt/real dumps)"
    gone = dumpdir.parse_state("/d", "dir=0\nwritable=0\nresolved=\n")
    assert gone.problem() == (dumpdir.MISSING, "dump dir /d does not exist") and gone.path == "/d"
    assert dumpdir.parse_state("/d", "dir=0\nwritable=1\nresolved=/d\n").problem()[0] == dumpdir.NOT_A_DIR
    assert dumpdir.parse_state("/d", "dir=1\nwritable=0\nresolved=/d\n").problem()[0] == dumpdir.NOT_WRITABLE
    assert dumpdir.parse_state("/d", "dir=1\nwritable=1\nresolved=/a\nb\n").resolved == "/a\nb"  # one name
    assert dumpdir.parse_state("/d", "").problem()[0] == dumpdir.MISSING  # no answer: not usable
    # health: a fail only while the server is up with capture on
    fail = dumpdir.check_dump_dir(gone, server_up=True, capturing=True)
    assert fail.status == "fail" and "/d does not exist" in fail.reason and fail.data["cause"] == dumpdir.MISSING
    assert dumpdir.check_dump_dir(gone, server_up=False, capturing=True) is None
    assert dumpdir.check_dump_dir(gone, server_up=True, capturing=False) is None
    assert dumpdir.check_dump_dir(ok, True, True).status == "ok"  # a symlink: the resolved path named


def test_a_finished_run_s_outcome_is_7_for_failures_or_a_fatal_cause_10_for_missing_dumps():
    def st(**kw):
        summary = ExtractionSummary(state="finished", failed=kw.pop("failed", 0), error_lines=kw.pop("lines", []))
        return extractplan.ExtractStatus("h", False, None, summary, 0, kw.pop("missing", []), "", **kw)

    assert st().outcome() == (0, None)
    code, why = st(failed=5, lines=["t failed id=s1 error=HTTP"]).outcome()
    assert code == ExitCode.COMMAND_FAILED and why.startswith("5 sample(s) failed; last: t failed id=s1")
    assert st(missing=[{"id": "a"}]).outcome()[0] == ExitCode.VERIFY_FAILED
    fatal = {"cause": "dump_dir_missing", "dir": "/d", "says": "dump dir /d does not exist"}
    assert st(fatal=fatal).outcome() == (7, "the client stopped: dump dir /d does not exist")


def test_the_fatal_line_of_the_current_run_is_read_from_the_log():
    log = (
        '2026-01-01T00:00:00Z started pending=3\n2026-01-01T00:00:01Z fatal cause=dump_dir_missing dir=/d says="x y"\n'
    )
    assert fatal_of(log) == {"cause": "dump_dir_missing", "dir": "/d", "says": "x y", "since": "2026-01-01T00:00:01Z"}
    assert fatal_of(log + "2026-01-01T00:00:05Z started pending=3\n") is None  # a new run since


def test_the_client_watches_its_dump_dir_by_identity(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    watch = extract_onhost.DumpDirWatch(str(d))
    assert watch.problem() is None
    d.rmdir()
    assert watch.problem()[0] == "dump_dir_missing"
    d.mkdir()  # made again: the server's mount still holds the removed one
    assert watch.problem()[0] == "dump_dir_replaced"
    assert extract_onhost.DumpDirWatch(None).problem() is None


def test_the_client_sends_nothing_when_its_dump_dir_is_gone_at_start(tmp_path):
    ds = tmp_path / "ds.jsonl"
    ds.write_text('{"id": "a", "input_ids": [1, 2]}\n{"id": "b", "input_ids": [3]}\n')
    argv = [sys.executable, str(REPO / "remote_ops" / "onhost" / "extract_onhost.py"), "--dataset", str(ds)]
    argv += ["--server", "http://127.0.0.1:9", "--workdir", str(tmp_path / "w"), "--log", str(tmp_path / "x.log")]
    argv += ["--dump-dir", str(tmp_path / "gone"), "--retries", "50"]
    t = time.monotonic()
    assert subprocess.run(argv, timeout=60, capture_output=True).returncode == 4
    assert time.monotonic() - t < 20  # no retries: the cause is fatal
    lines = (tmp_path / "x.log").read_text().splitlines()
    assert " fatal cause=dump_dir_missing dir=" + str(tmp_path / "gone") in lines[1]
    assert " stopped cause=dump_dir_missing " in lines[-1] and not (tmp_path / "w" / "manifest.jsonl").exists()


def test_a_takeover_removes_only_the_stale_holder_s_lock_and_logs_it(tmp_path):
    lock, audit = tmp_path / "lock", tmp_path / "log" / "audit.jsonl"
    lock.mkdir()
    (lock / "info").write_text("token=old\n")
    cmd = hostlock.takeover_cmd(str(lock), "other", str(audit), {"action": "lock-takeover"})
    assert subprocess.run(["sh", "-c", cmd], capture_output=True, text=True).stdout == ""
    assert lock.exists() and not audit.exists()  # not that holder's lock: left alone, nothing logged
    cmd = hostlock.takeover_cmd(str(lock), "old", str(audit), {"action": "lock-takeover"})
    assert subprocess.run(["sh", "-c", cmd], capture_output=True, text=True).stdout == "taken-over\n"
    assert not lock.exists() and json.loads(audit.read_text()) == {"action": "lock-takeover"}


# --------------------------------------------------------------------------- lab hosts: helpers


def _dataset(path: Path, n: int, tokens: int) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"s{i}", "input_ids": [(i * 7919 + t) % 500 for t in range(tokens)]}) + "\n")
    return path


@pytest.fixture
def fresh_logs(host):
    """lab1's logs dir empty, its dump dir present again afterwards; a client left running is killed."""
    subprocess.run(["rm", "-rf", str(host.paths.logs_dir)], check=True, timeout=30)
    host.paths.logs_dir.mkdir(parents=True)
    yield host
    _kill_client(host.paths.logs_dir / "extract")
    _restore_dir(host.paths.dump_dir)


def _restore_dir(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)


def _kill_client(workdir: Path) -> None:
    pidfile = workdir / "client.pid"
    if pidfile.exists():
        pid = int(pidfile.read_text())
        try:
            if b"_onhost" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _cli(env, *args, timeout=180):
    p = run_cli_process(env, *args, "--json", timeout=timeout)
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else None), p.stderr


# --------------------------------------------------------------------------- scenario 3: before a run


def test_extract_start_refuses_a_deleted_dump_dir_naming_it(lab, fresh_logs, lab_env, tmp_path):
    host = fresh_logs
    subprocess.run(["rm", "-rf", str(host.paths.dump_dir)], check=True, timeout=30)
    ds = _dataset(tmp_path / "ds.jsonl", 5, 8)
    rc, doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(ds), "--wait", "30")
    assert rc == ExitCode.REFUSED, err
    assert f"dump dir {host.paths.dump_dir} does not exist" in err and "Traceback" not in err
    assert doc["reason"] == "dump_dir_missing" and doc["dump_dir"] == str(host.paths.dump_dir)
    assert not (host.paths.logs_dir / "extract" / "client.pid").exists(), "nothing was started"
    rc, _doc, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(ds), "--dry-run")
    assert rc == ExitCode.REFUSED and "does not exist" in err  # the dry run refuses as the start does


def test_a_run_whose_samples_failed_is_not_a_success(lab, fresh_logs, lab_env, tmp_path):
    host = fresh_logs
    ds = _dataset(tmp_path / "ds.jsonl", 3, 8)
    rc, doc, err = _cli(
        lab_env,
        "extract",
        "start",
        "--host",
        host.name,
        "--dataset",
        str(ds),
        "--server-url",
        "http://127.0.0.1:9",  # discard port: every request refused
        "--retries",
        "0",
        "--wait",
        "60",
    )
    assert rc == ExitCode.COMMAND_FAILED, err
    assert doc["summary"]["failed"] == 3 and doc["summary"]["state"] == "finished"
    assert "3 sample(s) failed" in err


def test_a_symlinked_dump_dir_is_resolved_once_and_that_path_used(lab, fresh_logs, lab_env, tmp_path):
    host = fresh_logs
    real = host.paths.root / "elsewhere-dumps"
    real.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(host.paths.dump_dir)], check=True, timeout=30)
    host.paths.dump_dir.symlink_to(real)
    ds = _dataset(tmp_path / "ds.jsonl", 2, 8)
    rc, plan, err = _cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(ds), "--dry-run")
    assert rc == 0, err
    assert plan["dump_dir"] == str(real) and f"--dump-dir {real} " in plan["command"]


# --------------------------------------------------------------------------- scenario 3: the deployed server


def _ok_lines(workdir: Path) -> int:
    manifest = workdir / "manifest.jsonl"
    return manifest.read_text().count('"ok"') if manifest.exists() else 0


def _remove_while_written(path: Path) -> None:
    """`rm -rf` of a dir the server writes into (a file may land between rm's reads: again)."""
    deadline = time.monotonic() + 20
    while subprocess.run(["rm", "-rf", str(path)], capture_output=True, timeout=30).returncode != 0:
        assert time.monotonic() < deadline, f"could not remove {path}"


def test_a_dump_dir_deleted_mid_run_stops_the_client_naming_it(sglang_remote, deployed, sglang_host, tmp_path):
    """The server in its container keeps the removed dir mounted: its dumper raises FileNotFoundError.
    The client names that cause and stops; it does not retry without end."""
    spec, dump_dir = deployed, Path(deployed.dump.dir)
    p = extractplan.paths_for(spec)
    subprocess.run(["rm", "-rf", p.workdir], check=True, timeout=30)
    ds = _dataset(tmp_path / "ds.jsonl", 4000, 200)
    try:
        extract.start(sglang_remote, spec, str(ds), concurrency=2, retries=8, dump_grace=1)
        deadline = time.monotonic() + 60
        while _ok_lines(Path(p.workdir)) < 5:
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.1)
        _remove_while_written(dump_dir)
        t = time.monotonic()
        st = extract.wait_finished(sglang_remote, spec, 60)
        assert time.monotonic() - t < 30, "the client gave up at once, not after its retries"
        assert st.fatal and st.fatal["cause"] == "dump_dir_missing" and st.fatal["dir"] == str(dump_dir)
        assert st.summary.state == "stopped" and st.summary.done < 4000
        code, why = st.outcome()
        assert code == ExitCode.COMMAND_FAILED and f"dump dir {dump_dir} does not exist" in why
    finally:
        _kill_client(Path(p.workdir))
        dump_dir.mkdir(parents=True, exist_ok=True)


def test_health_fails_while_the_running_server_has_no_dump_dir(sglang_remote, deployed):
    dump_dir = Path(deployed.dump.dir)
    try:
        subprocess.run(["rm", "-rf", str(dump_dir)], check=True, timeout=30)
        res = health.check_host(lambda _h: sglang_remote, deployed)
        by = {(c.tier, c.name): c for c in res.checks}
        assert by[("dumps", "dir")].status == "fail", res.checks
        assert f"dump dir {dump_dir} does not exist" in by[("dumps", "dir")].reason
        assert ("dumps", "growth") not in by  # not "does not exist yet": the fail says it
        assert health.exit_code([res]) == ExitCode.HEALTH_FAIL
    finally:
        dump_dir.mkdir(parents=True, exist_ok=True)


def test_extract_start_refuses_a_stale_mount_of_the_dump_dir_until_deploy(sglang_remote, deployed, lab_env, tmp_path):
    """The dump dir made again under the running server (its mount is the deleted dir): `extract
    start` exits 9 naming the host, both identities and `remote-ops deploy`, once, and starts
    nothing (its dry run too); after `deploy` recreates the container it starts."""
    from remote_ops.core import shell
    from remote_ops.engine import labels
    from remote_ops.workflows import container, deploy

    spec, dump_dir = deployed, deployed.dump.dir
    p = extractplan.paths_for(spec)
    subprocess.run(["rm", "-rf", p.workdir], check=True, timeout=30)
    recorded = container.inspect_container(sglang_remote, spec.container.name).labels[labels.DUMP_DIR_ID]
    new = f"{dump_dir}.new"  # made before the old one goes: another inode for sure
    sglang_remote.run(shell.and_then(["mkdir", new], ["rm", "-rf", dump_dir], ["mv", new, dump_dir]))
    start = ("extract", "start", "--host", spec.name, "--dataset", str(_dataset(tmp_path / "ds.jsonl", 3, 8)))
    try:
        rc, doc, err = _cli(lab_env, *start)
        assert rc == ExitCode.REFUSED, err
        assert doc["error"] == "stale_mount" and doc["host"] == spec.name and doc["recorded"] == recorded
        assert doc["now"] not in (None, recorded) and doc["dump_dir"] == dump_dir, doc
        assert err.count("was removed and made again") == 1 and "Traceback" not in err, err  # rendered once
        assert f"{spec.name}: " in err and recorded in err and doc["now"] in err
        assert f"`remote-ops deploy --host {spec.name}` recreates the container" in err
        assert not Path(p.workdir).exists(), "nothing was started (not even the work dir made)"
        rc, _doc, err = _cli(lab_env, *start, "--dry-run")
        assert rc == ExitCode.REFUSED and "removed and made again" in err, err
        assert deploy.deploy(sglang_remote, spec, why="test").plan["reasons"]["start"].startswith("stale mount: ")
        rc, doc, err = _cli(lab_env, *start)
        assert rc == 0 and doc["dataset_total"] == 3, err
        deadline = time.monotonic() + 30  # and its dumps reach the host now
        while _ok_lines(Path(p.workdir)) < 3 or len(list(Path(dump_dir).glob("rank0/*.safetensors"))) < 3:
            assert time.monotonic() < deadline, "the samples were not dumped into the dump dir"
            time.sleep(0.2)
    finally:
        _kill_client(Path(p.workdir))


# --------------------------------------------------------------------------- scenario 9: stale locks


HOLDER = """
import sys, time
from remote_ops.workflows import hostlock
from remote_ops.cli.app import App
app = App()
spec = app.host(sys.argv[1])
hostlock.take(app.remote(spec), spec, "dataset regenerate")
print("locked", flush=True)
time.sleep(300)
"""


def _audit(spec) -> list[dict]:
    path = Path(spec.audit_log)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _start_standin(port: int, model_dir: Path, tmp_path: Path, *args: str, env_extra=None):
    pkg = tmp_path / "pkgs"
    pkg.mkdir(exist_ok=True)
    if not (pkg / "remote_ops_dump").exists():
        (pkg / "remote_ops_dump").symlink_to(REPO / "remote_ops" / "dumper")
    env = {**os.environ, "PYTHONPATH": str(pkg), "STANDIN_LOAD_SECONDS": "0", **(env_extra or {})}
    env.pop("SGLANG_HS_DUMP_DIR", None)
    logf = tmp_path / f"standin-{port}.log"
    argv = [sys.executable, str(STANDIN), "--port", str(port), "--model-path", str(model_dir), *args]
    proc = subprocess.Popen(argv, env=env, stdout=open(logf, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while b"listening" not in logf.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, logf.read_text()
        time.sleep(0.1)
    return proc


def _stop(proc) -> None:
    stop_process(proc)


def test_a_killed_regenerate_s_lock_is_taken_over_and_audited(lab, host, lab_env, tmp_path):
    spec = lab.spec(host.name)
    subprocess.run(["rm", "-rf", str(host.paths.logs_dir / "regenerate"), spec.lock_dir], check=True, timeout=30)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, spec.name],
        env=lab_env,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
    finally:
        holder.kill()  # SIGKILL, as a killed `dataset regenerate`: no cleanup runs
        holder.wait(timeout=30)
    assert f"client_pid={holder.pid}" in (Path(spec.lock_dir) / "info").read_text()
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(3))
    )
    before = len(_audit(spec))
    server = _start_standin(host.server_port, host.paths.model_dir, tmp_path)
    try:
        rc, doc, err = _cli(
            lab_env, "dataset", "regenerate", "--host", spec.name, "--dataset", str(chats),
            "--out", str(tmp_path / "out.jsonl"), "--max-tokens", "4", "--wait", "90",
        )  # fmt: skip
    finally:
        _stop(server)
        _kill_client(host.paths.logs_dir / "regenerate")
    assert rc == 0, err
    assert doc["written"] == 3 and not Path(spec.lock_dir).exists()
    takeovers = [a for a in _audit(spec)[before:] if a["action"] == "lock-takeover"]
    assert len(takeovers) == 1, _audit(spec)[before:]
    line = takeovers[0]
    assert (
        line["holder"]["client_pid"] == holder.pid and line["stale"] == f"stale lock: holder PID {holder.pid} is gone"
    )
    assert line["by"] == "dataset regenerate" and line["holder"]["what"] == "dataset regenerate"


def test_a_live_holder_s_lock_is_never_taken_over(lab, host, remote):
    spec = lab.spec(host.name)
    subprocess.run(["rm", "-rf", spec.lock_dir], check=True, timeout=30)
    Path(spec.lock_dir).mkdir(parents=True)
    (Path(spec.lock_dir) / "info").write_text(
        hostlock.info_text("deploy: a colleague", client="elsewhere", user="carol", client_pid=os.getpid())
    )
    try:
        from remote_ops.errors import Refused

        with pytest.raises(Refused, match="carol on elsewhere"):
            hostlock.take(remote, spec, "extract start")
        assert "carol" in (Path(spec.lock_dir) / "info").read_text()
    finally:
        subprocess.run(["rm", "-rf", spec.lock_dir], check=True, timeout=30)


# --------------------------------------------------------------------------- the stand-in's bounds


def _post(url: str, body: bytes):
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_the_standin_refuses_a_prompt_over_its_context_length_as_sglang_does(tmp_path):
    from remote_ops.workflows import sandbox

    sandbox.write_model_config(tmp_path / "model")
    port = free_port()
    proc = _start_standin(
        port, tmp_path / "model", tmp_path, "--context-length", "64", env_extra={"STANDIN_MAX_BODY_BYTES": "20000000"}
    )
    try:
        url = f"http://127.0.0.1:{port}"
        code, doc = _post(url + "/generate", json.dumps({"input_ids": list(range(64))}).encode())
        assert code == 400 and doc["error"]["message"] == (
            "The input (64 tokens) is longer than the model's context length (64 tokens)."
        )
        code, _doc = _post(
            url + "/generate",
            json.dumps({"input_ids": list(range(63)), "sampling_params": {"max_new_tokens": 1}}).encode(),
        )
        assert code == 200
        rss = _rss_kb(proc.pid)
        chat = {"messages": [{"role": "user", "content": "x" * 10_000_000}]}  # the 10 MB chat of the issue
        t = time.monotonic()
        code, doc = _post(url + "/v1/chat/completions", json.dumps(chat).encode())
        assert code == 400 and doc["object"] == "error" and doc["type"] == "BadRequestError"
        n = len("<|user|>") + 10_000_000 + len("<|assistant|>")
        assert doc["message"] == f"The input ({n} tokens) is longer than the model's context length (64 tokens)."
        # the bound is the memory (19 GB when the prompt was computed); the time only bounds a hang
        assert time.monotonic() - t < 60 and _rss_kb(proc.pid) - rss < 400_000, "refused before any compute"
        import socket

        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:  # a body that is never sent
            conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
            answer = b""
            while chunk := conn.recv(65536):  # headers and body may come in two reads; the server closes
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.0 413") and "over the stand-in's cap" in answer
    finally:
        _stop(proc)


def test_the_one_shell_lock_s_takeover_is_audited_too(tmp_path):
    """patching's write script takes the lock in one remote shell: a dead holder's lock is broken
    there, and written to the audit log as every takeover is."""
    from dataclasses import replace

    from remote_ops import wheels
    from remote_ops.workflows import patching

    path = tmp_path / "deepseek_v2.py"
    path.write_bytes(wheels.sglang_source("0.5.9", "python/sglang/srt/models/deepseek_v2.py"))
    audit = tmp_path / "log" / "audit.jsonl"
    target = replace(patching.PatchTarget.local(path), audit_log=str(audit))
    dead = subprocess.Popen(["true"])
    dead.wait()
    Path(target.lock_dir).mkdir()
    (Path(target.lock_dir) / "info").write_text(f"pid={dead.pid}\nwhat=patch apply\n")
    assert patching.apply(patching.LocalRemote(), target).action == "applied"
    line = json.loads(audit.read_text())
    assert (
        line["action"] == "lock-takeover"
        and line["stale"] == f"stale lock: holder PID {dead.pid} is gone (on the host)"
    )
