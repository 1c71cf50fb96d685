"""The operator's contract under faults (issue 9, defect 4): one deadline model.

Every remote call and every wait takes its deadline from `--command-timeout`,
`--connect-timeout` and the inventory; a hung probe is only its own failure.
Durations are asserted as generous upper bounds (the old behaviour took 60,
90, 120 s or more), never as speed targets.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
from test_contract_locks import cli, inventory_env, lock_info, records, slow_spec, start_deploy, wait_for_text

from remote_ops.errors import ExitCode
from remote_ops.probes import batch, endpoints

pytestmark = [pytest.mark.docker, pytest.mark.slow]


# -- pure / local --------------------------------------------------------------------------------------
def test_probe_deadline_follows_the_command_timeout():
    assert batch.probe_deadline(6) == 4.8 and batch.probe_deadline(120) == 96 and batch.probe_deadline(1) == 1
    call_s, generate_s = endpoints.http_budget(4.8)
    assert call_s * 4 + generate_s <= 4.8 + 1e-9


def test_bounded_probe_times_out_alone():
    """`batch.bounded` on a real local sh: the hung probe ends at its deadline, the other answers."""
    from remote_ops.core import shell

    script = shell.parallel_sections(batch.bounded([("hung", "sleep 30"), ("ok", "echo fine")], 2))
    t = time.monotonic()
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=20).stdout
    took = time.monotonic() - t
    sec = shell.split_sections(out)
    assert sec["ok"] == (0, "fine")
    assert sec["hung"][0] == 124 and "no answer within 1s" in sec["hung"][1]
    assert took < 10


# -- helpers -----------------------------------------------------------------------------------------
@contextmanager
def frozen_dockerd(lab):
    """SIGSTOP the lab dockerd: every docker CLI call on every lab host hangs (a frozen engine)."""
    pid = lab.dockerd.pid
    import os

    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


# -- facts and health with a hung probe ----------------------------------------------------------------
def test_facts_with_a_frozen_dockerd_reports_the_rest(lab, host, lab_env):
    with frozen_dockerd(lab):
        t = time.monotonic()
        p = cli(lab_env, "facts", "--host", host.name, "--json", "--command-timeout", "8", timeout=60)
        took = time.monotonic() - t
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert took < 30, f"facts took {took:.1f}s"
    assert "no answer within" in doc["docker"]["error"]
    assert doc["os"] and doc["kernel"] and doc["mem_total_bytes"] and doc["dump_dir_free_bytes"] is not None


def test_health_with_a_frozen_dockerd_reports_the_other_checks(lab, host, lab_env):
    with frozen_dockerd(lab):
        t = time.monotonic()
        p = cli(lab_env, "health", "--host", host.name, "--json", "--command-timeout", "8", timeout=60)
        took = time.monotonic() - t
    assert took < 30, f"health took {took:.1f}s"
    assert p.returncode == ExitCode.HEALTH_FAIL, p.stderr
    checks = {f"{c['tier']}/{c['name']}": c for c in json.loads(p.stdout)["hosts"][0]["checks"]}
    assert checks["ssh/connect"]["status"] == "ok"
    assert checks["engine/docker"]["status"] == "fail" and "no answer within" in checks["engine/docker"]["reason"]
    assert checks["dumps/free_disk"]["status"] != "skip", "the disk probe still answered"
    assert "no answer within" in checks["container/state"]["reason"]
    assert any(k.startswith("sglang/") for k in checks) and any(k.startswith("gpus/") for k in checks)


def test_deploy_preflight_with_a_frozen_dockerd_refuses_in_time(lab, spec, lab_env, tmp_path):
    env = inventory_env(lab_env, tmp_path, spec)
    with frozen_dockerd(lab):
        t = time.monotonic()
        p = cli(env, "deploy", "--host", spec.name, "--yes", "--command-timeout", "8", timeout=90)
        took = time.monotonic() - t
    assert took < 40, f"deploy took {took:.1f}s"
    assert p.returncode == ExitCode.REFUSED, p.stderr
    assert "preflight: docker engine not usable: no answer within" in p.stderr
    assert lock_info(spec) is None
    assert records(env, spec.name)[-1]["failed_step"] == "preflight"


# -- frozen host -------------------------------------------------------------------------------------
def test_deploy_against_a_host_frozen_after_start_ends_in_time(lab, spec, lab_env, tmp_path, faults):
    slow = slow_spec(spec)
    env = inventory_env(lab_env, tmp_path, slow, healthy_timeout_s=600)
    proc, err = start_deploy(env, slow.name, tmp_path, "--command-timeout", "5")
    try:
        wait_for_text(err, "waiting for health", 300)
        faults.freeze(lab.host(slow.name))
        t = time.monotonic()
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
        faults.thaw(lab.host(slow.name))
    text = err.read_text()
    print(f"deploy --command-timeout 5, host frozen during wait: ended {took:.1f}s after the freeze, exit {rc}")
    assert took < 40, f"took {took:.1f}s after the freeze"
    assert rc == ExitCode.TIMEOUT, text
    assert "wait: the host stopped answering while waiting for container" in text
    assert "timed out after 5s" in text and "remote-ops unlock" in text
    rec = records(env, slow.name)[-1]
    assert rec["failed_step"] == "wait" and rec["lock"] == "maybe held"
    assert cli(env, "unlock", "--host", slow.name).returncode == 0
    assert lock_info(slow) is None
    from conftest import connect

    remote = connect(lab, slow.name)
    try:
        remote.run(["docker", "rm", "-f", slow.container.name], check=False)
    finally:
        remote.close()


def test_health_watch_against_a_frozen_host_stays_bounded(lab, spare_host, lab_env, faults):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "remote_ops",
            "health",
            "--host",
            spare_host.name,
            "--watch",
            "1",
            "--watch-for",
            "20",
            "--command-timeout",
            "6",
            "--connect-timeout",
            "3",
        ],
        env=lab_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    t = time.monotonic()
    try:
        time.sleep(4)  # the first rounds ran over a live connection
        faults.freeze(spare_host)
        rc = proc.wait(timeout=90)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    print(f"health --watch 1 --watch-for 20 --command-timeout 6 on a frozen host: {took:.1f}s, exit {rc}")
    assert took < 20 + 6 + 3 + 10, err
    assert rc in (ExitCode.UNREACHABLE, ExitCode.TIMEOUT), err
