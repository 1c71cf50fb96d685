"""Probe units (`remote_ops.probes`): each one's command run by a real /bin/sh here, its parser
fed captured text, and the batch that asks several in one round trip.

Host tests (tests/test_health_deployed.py, test_facts_health_integration.py, ...)
run the same units against the lab's sshd + dockerd; these need neither.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from remote_ops.core.extractplan import ExtractPaths
from remote_ops.core.inventory import HostSpec
from remote_ops.probes import batch, dumps, extract, gpu, lock, system
from remote_ops.probes.base import Answers, Check, Output, Probe
from remote_ops.probes.disk import DiskFree
from remote_ops.probes.sglang import PatchTarget, SglangVersion
from remote_ops.remote import LocalRemote
from remote_ops.workflows import deploy, facts, health

REPO = Path(__file__).resolve().parents[1]
HOST = HostSpec(name="gpu-node", gpus={"count": 2}, dump={"dir": "/data/d", "min_free_gb": 100})


def sh(script: str) -> str:
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60).stdout


# -- the batch ---------------------------------------------------------------------------------------


def test_a_batch_hands_each_probe_its_own_answer_from_a_real_shell(tmp_path):
    """Facts' system probes, free space, an SGLang tree and a target file, in one script, in order
    and concurrently: each probe reads back what this machine says."""
    checkout = tmp_path / "sg lang; $(id)"
    (checkout / "python/sglang").mkdir(parents=True)
    (checkout / "python/sglang/_version.py").write_text("__version__ = version = '0.5.9'\n")
    target = checkout / "python/sglang/model.py"
    target.write_bytes(b"a\nb\nc\n")
    asked = [
        system.Kernel(),
        system.Memory(),
        DiskFree(str(tmp_path / "dumps/not/yet")),
        SglangVersion(str(checkout)),
        PatchTarget(str(target)),
    ]
    for parallel in (False, True):
        a = Answers(asked, batch.split(sh(batch.script(asked, parallel=parallel))))
        assert a.read(system.Kernel) == sh("uname -srm").strip()
        total, available = a.read(system.Memory)
        assert total and available and 0 < available <= total
        assert a.read(DiskFree) and a.read(DiskFree) > 0  # the nearest existing parent's filesystem
        assert a.read(SglangVersion) == "0.5.9"
        assert a.read(PatchTarget) == (hashlib.sha256(b"a\nb\nc\n").hexdigest(), 3, None)


def test_batch_run_over_the_remote_protocol_bounds_each_probe_but_the_lock(tmp_path):
    """`batch.run` on a LocalRemote (the run protocol of every Remote): with a per-probe deadline
    a hung probe ends alone (exit 124, its note), the lock is taken all the same (never bounded),
    and a probe named `unbounded` is left to run as it is."""
    lock_dir = str(tmp_path / "lock")
    hung, take = Sleeps(30), lock.LockTake(lock_dir, "user=alice\nwhat=test\n")
    start = time.monotonic()
    answers = batch.run(LocalRemote(), [hung, take, PatchTarget(str(tmp_path / "absent"))], parallel=True, probe_s=2)
    assert time.monotonic() - start < 10
    assert answers["sleeps"][0] == 124 and "no answer within 1s" in answers["sleeps"][1]
    assert take.read(answers) == lock.Taken(took=True, held=False, holder=None)
    script = batch.script([hung, take, PatchTarget("/x")], probe_s=2, unbounded=[PatchTarget])
    assert script.count("timeout -k 1") == 1  # the hung probe only


def test_two_probes_with_one_name_are_refused():
    with pytest.raises(ValueError, match="share a section name"):
        batch.script([system.Kernel(), system.Kernel()])


def test_the_probe_deadline_is_80_percent_of_the_command_deadline():
    assert batch.probe_deadline(120) == 96 and batch.probe_deadline(6) == 4.8 and batch.probe_deadline(1) == 1


# -- what health, facts and deploy ask ----------------------------------------------------------------


def asked_by_each(host: HostSpec) -> dict[str, list[Probe]]:
    return {
        "health": health.probes(host, deep=True, expected_image="img:t", probe_s=10),
        "facts": facts.probes(host),
        "deploy (read)": deploy.probes_for(host, "img:t"),
        "deploy (lock)": deploy.probes_for(host, "img:t", "why", "tok"),
    }


def test_every_probe_asked_builds_its_command_and_reads_a_missing_answer_as_unknown():
    """No section name is spelled by a caller, so each round trip's names must be unique (the
    batch refuses two alike) and each probe must read a section that never came back."""
    for who, asked in asked_by_each(HOST).items():
        assert batch.script(asked, parallel=True, probe_s=10), who
        for probe in asked:
            probe.read({})  # no exception: an absent answer is "unknown"
    checks = health.evaluate(HOST, {})
    assert checks and {c.status for c in checks} <= {"fail", "skip", "warn", "ok"}
    assert facts.parse(HOST, {}).gpu_error == "no NVIDIA driver"


def test_no_workflow_that_asks_probes_frames_sections_itself():
    """The one place that batches is `probes.batch`: health, facts, deploy's plan, dumps, extract,
    logs and the host lock never call the section framing of `core.shell` themselves."""
    framing = {"sections", "parallel_sections", "split_sections", "SECTION"}
    for path in ("health.py", "facts.py", "hostlock.py", "deploy/plan.py", "dumps.py", "extract.py", "logs.py"):
        tree = ast.parse((REPO / "remote_ops/workflows" / path).read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in framing}
        assert not used, (path, used)


# -- parsers from captured text ----------------------------------------------------------------------


def test_gpu_processes_name_strays_and_survive_odd_lines():
    procs = gpu.parse_gpu_processes(0, "1234 70000 stray\n99 5 ours\n\n77  stray\ngarbage line here too\n")
    assert [(p.pid, p.memory_mib, p.owner) for p in procs] == [
        ("1234", "70000", "stray"),
        ("99", "5", "ours"),
        ("77", "?", "stray"),
    ]
    assert gpu.parse_gpu_processes(127, "") is None
    assert gpu.check_gpu_processes((0, "99 5 ours\n")).status == "ok"
    assert "pid 77 (? MiB)" in gpu.check_gpu_processes((0, "77  stray\n")).reason


DF = "Filesystem 1-blocks Used Available Capacity Mounted on\n/dev/x 1 1 900000000000 1% /data\n"


def test_dump_usage_reads_counts_absence_and_free_space():
    assert dumps.parse_usage(0, "3 300\n" + DF) == dumps.DumpUse(3, 300, 900000000000)
    assert dumps.parse_usage(0, "absent\n" + DF) == dumps.DumpUse(None, None, 900000000000)
    assert dumps.parse_usage(1, "find: Permission denied\n") == dumps.DumpUse(None, None, None)
    growth, disk = dumps.check_dumps(HOST, (0, "absent\n"), None, 0.0)
    assert growth.status == "skip" and disk.status == "skip"


def test_dump_verify_reads_its_report_whatever_the_exit_status():
    probe = dumps.DumpVerify("/d", None, check_sha=True)
    # the dump dir is resolved once on the host (a symlinked dump dir is followed, its entries never)
    assert probe.command() == 'cd -P -- /d 2>/dev/null || exit 3; python3 - verify "$(pwd -P)" --json'
    assert probe.parse(1, json.dumps({"problems": [{"level": "error"}]})) == {"problems": [{"level": "error"}]}
    assert probe.parse(127, "sh: python3: not found") is None and probe.parse(0, "[1]") is None


def test_extract_status_probes_read_a_captured_round_trip():
    p = ExtractPaths("/w", "/w/x.log", "/d")
    asked = extract.ExtractStatusProbes(p, with_keys=True)
    log = "2026-01-02T03:04:05Z started reused_ids=4\n2026-01-02T03:04:06Z progress done=2 total=5\n"
    text = "".join(
        f"@@remote-ops:{probe.name}:begin\n{out}\n@@remote-ops:{probe.name}:end {rc}\n"
        for probe, (rc, out) in [
            (asked.keys, (0, "0123456789abcdef0123456789abcdef-p0\nnot a key")),
            (asked.alive, (0, "")),
            (asked.pid, (0, "4242")),
            (asked.log, (0, log)),
            (asked.counts, (0, '{"done": 2, "total": "5", "dataset_id": "abc"}')),
            (asked.missing, (0, '{"id": "s1"}\ntorn{')),
            (asked.out, (0, "client output")),
        ]
    )
    sec = batch.split(text)
    st = asked.read("h", sec)
    assert (st.running, st.pid, st.manifest_ok, st.dataset_total, st.dataset_id) == (True, 4242, 2, 5, "abc")
    assert st.missing == [{"id": "s1"}] and st.reused_ids == 4 and st.summary.done == 2
    assert asked.keys is not None and asked.keys.read(sec) == {"0123456789abcdef0123456789abcdef-p0"}
    assert extract.FileSha("/x", "client").parse(1, "sha256sum: /x: No such file") is None


def test_lock_take_and_read_on_a_real_shell(tmp_path):
    lock_dir = str(tmp_path / "locks" / "remote-ops.lock")
    first = lock.LockTake(lock_dir, "user=alice\nclient=laptop\nclient_pid=4242\nwhat=deploy: x\n")
    taken = first.parse(*run(first.command()))
    assert taken == lock.Taken(took=True, held=False, holder=None)
    second = lock.LockTake(lock_dir, "user=bob\n")
    refused = second.parse(*run(second.command()))
    assert not refused.took and refused.held and refused.holder and refused.holder.user == "alice"
    holder = lock.LockRead(lock_dir).parse(*run(lock.LockRead(lock_dir).command()))
    assert holder is not None and holder.client_pid == 4242 and holder.remote_pid_alive is None
    os.remove(f"{lock_dir}/info")
    os.rmdir(lock_dir)
    assert lock.LockRead(lock_dir).parse(*run(lock.LockRead(lock_dir).command())) is None


def run(script: str) -> Output:
    p = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout


# -- a new probe: one unit (command, parser, evaluator) and its test -----------------------------------


class Sleeps(Probe[None]):
    """A probe that never answers in time (for the deadline test above)."""

    name = "sleeps"

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def command(self) -> str:
        return f"sleep {self.seconds}"

    def parse(self, status: int, text: str) -> None:
        return None


class Uptime(Probe[float | None]):
    """How long the host has been up (`/proc/uptime`): the recipe of docs/CONTRIBUTING.md."""

    name = "uptime"

    def command(self) -> str:
        return "cat /proc/uptime"

    def parse(self, status: int, text: str) -> float | None:
        first = text.split()[0] if status == 0 and text.split() else ""
        return float(first) if first.replace(".", "", 1).isdigit() else None


def check_uptime(probe: Output) -> Check:
    seconds = Uptime().parse(*probe)
    if seconds is None:
        return Check("host", "uptime", "skip", "cannot read /proc/uptime")
    return Check("host", "uptime", "warn" if seconds < 600 else "ok", f"up {seconds / 3600:,.1f} h")


def test_a_new_probe_is_a_unit_and_its_test():
    """What adding a health probe takes: the unit above, its parser and verdicts from captured
    text, and its command run for real; `health.probes` asks it and `health.evaluate` judges it
    (one line each)."""
    assert check_uptime((0, "12.5 40.0\n")).status == "warn"
    assert check_uptime((0, "86400.0 1.0\n")).reason == "up 24.0 h"
    assert check_uptime((1, "cat: /proc/uptime: No such file")).status == "skip"
    a = Answers([Uptime()], batch.split(sh(batch.script([Uptime()], parallel=True, probe_s=5))))
    assert check_uptime(a.output(Uptime)).status in ("ok", "warn")
