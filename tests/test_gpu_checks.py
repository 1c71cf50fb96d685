"""The host knows itself (issue 29, item 12): python3 preflight and the GPU checks an SRE runs.

Pure: each rule from captured text (`probes.gpuhealth`, `probes.kernlog`,
`probes.system.HostPython`).  Real shell: the probes' commands run by `/bin/sh`
with the STAND-IN nvidia-smi / dmesg / journalctl first on PATH (the newer
field names, an older driver's aliases, a kernel log that cannot be read), and
python3 off PATH.  Lab: `health`, `facts` and `deploy --dry-run` through the
CLI against a real lab sshd whose session PATH holds the stand-in
(`HostLab.fake_gpus`), healthy and faulty; the existing GPU checks (count, ECC,
stray processes, temperature) keep working with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from conftest import run_cli

from remote_ops.hostlab import gpu_standin
from remote_ops.probes import batch
from remote_ops.probes.base import Answers
from remote_ops.probes.gpuhealth import (
    FIELDS,
    GpuHealthQuery,
    check_driver_cuda,
    check_gpu_health,
    cuda_required,
    parse_gpu_health,
)
from remote_ops.probes.kernlog import KernelXids, check_xid, parse_xids, window
from remote_ops.probes.system import HostPython, parse_python, python_problem

CUDA_129 = {
    "NVIDIA_REQUIRE_CUDA": "cuda>=12.9 brand=unknown,driver>=535,driver<536 brand=nvidia,driver>=535,driver<536",
    "CUDA_VERSION": "12.9.1",
}


def standin_bin(tmp_path, *cases: str, state: dict | None = None):
    """A bin dir holding the stand-in with `cases` (as a lab host's own bin dir would)."""
    bin_dir = tmp_path / "bin"
    gpu_standin.install(bin_dir, state if state is not None else gpu_standin.case(*cases))
    return bin_dir


def run_probe(probe, bin_dir=None, path: str | None = None):
    """The probe's command, framed as a batch would, run by a real /bin/sh; its (status, text)."""
    env = {**os.environ, "PATH": path or f"{bin_dir}:{os.environ['PATH']}"}
    script = batch.script([probe], parallel=True, probe_s=20)
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=60, env=env).stdout
    return Answers([probe], batch.split(out)).output(type(probe))


def by_name(checks):
    return {c.name: c for c in checks}


# -- the stand-in speaks the real tool's format ------------------------------------------------------


def test_standin_answers_in_nvidia_smis_csv_format(tmp_path):
    smi = standin_bin(tmp_path, "degraded-link") / "nvidia-smi"
    q = "index,name,pcie.link.width.current,retired_pages.pending,memory.used,clocks_throttle_reasons.hw_slowdown"
    out = subprocess.run([smi, f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True).stdout
    lines = out.splitlines()
    assert lines[0] == (
        "index, name, pcie.link.width.current, retired_pages.pending, memory.used [MiB], "
        "clocks_throttle_reasons.hw_slowdown"
    )
    assert lines[3] == "2, NVIDIA RTX PRO 6000 Blackwell Server Edition, 8, [N/A], 81234 MiB, Not Active"
    nounits = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    assert (
        nounits.stdout.splitlines()[0].endswith(", 16, [N/A], 81234, Not Active")
        and len(nounits.stdout.splitlines()) == 8
    )
    bad = subprocess.run([smi, "--query-gpu=index,nope", "--format=csv"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout.startswith('Field "nope" is not a valid field to query.')


# -- pure rules ---------------------------------------------------------------------------------------


def _health(tmp_path, *cases, cuda_env=CUDA_129):
    out = run_probe(GpuHealthQuery(), standin_bin(tmp_path, *cases))
    return by_name(check_gpu_health(out, cuda_env))


def test_healthy_host_passes_every_gpu_check(tmp_path):
    checks = _health(tmp_path)
    assert {n: c.status for n, c in checks.items()} == {
        "pcie_link": "ok",
        "memory_rows": "ok",
        "throttle": "ok",
        "persistence": "ok",
        "driver_cuda": "ok",
    }
    assert checks["pcie_link"].reason == "8 GPU(s) at their maximum PCIe link"
    assert checks["driver_cuda"].reason == "driver 580.95.05 >= 575.51.03 (CUDA 12.9)"


def test_each_fault_is_named_by_its_check(tmp_path):
    checks = _health(tmp_path, "degraded-link", "remap-pending", "hw-slowdown", "persistence-off", "old-driver")
    link, rows, throttle = checks["pcie_link"], checks["memory_rows"], checks["throttle"]
    assert link.status == "warn" and "GPU2 Gen5 x8 of Gen5 x16 at 85% busy" in link.reason
    assert rows.status == "warn" and "GPU5 (row remap)" in rows.reason
    assert throttle.status == "fail" and "GPU1 hw_thermal_slowdown" in throttle.reason
    assert checks["persistence"].status == "warn" and "GPU0" in checks["persistence"].reason
    driver = checks["driver_cuda"]
    assert driver.status == "warn" and "535.104.05 is older than CUDA 12.9's 575.51.03" in driver.reason


def test_an_idle_gpus_downshifted_link_is_not_a_fault(tmp_path):
    """NVIDIA: the current link "may be reduced when the GPU is not in use" (Gen1 at P8)."""
    link = _health(tmp_path, "idle-downshift")["pcie_link"]
    assert link.status == "skip" and "8 idle GPU(s) downshifted, not judged" in link.reason


def test_remap_failure_fails_and_soft_slowdowns_warn(tmp_path):
    assert _health(tmp_path, "remap-failure")["memory_rows"].status == "fail"
    assert _health(tmp_path, "sw-thermal")["throttle"].status == "warn"
    capped = _health(tmp_path, "power-capped")["throttle"]
    assert capped.status == "ok" and "sw_power_cap" in capped.reason  # at the power limit under load


def test_not_supported_fields_are_skipped_not_judged(tmp_path):
    checks = _health(tmp_path, "not-supported")
    assert checks["pcie_link"].status == "skip" and checks["persistence"].status == "skip"


def test_driver_against_the_images_cuda_uses_nvidias_tables():
    assert cuda_required(CUDA_129) == (12, 9)
    assert cuda_required({"CUDA_VERSION": "12.8.1"}) == (12, 8)
    assert cuda_required({"PATH": "/usr/bin"}) is None
    assert check_driver_cuda("570.26", {"CUDA_VERSION": "12.8.0"}).status == "ok"
    assert check_driver_cuda("570.25", {"CUDA_VERSION": "12.8.0"}).status == "warn"  # minor version compat only
    assert check_driver_cuda("520.61.05", {"CUDA_VERSION": "12.8.0"}).status == "fail"  # below 12.x's 525.60.13
    assert check_driver_cuda("580.95.05", {"CUDA_VERSION": "13.0.1"}).status == "ok"
    assert check_driver_cuda("575.57.08", {"CUDA_VERSION": "13.0.1"}).status == "fail"  # 13.x needs >= 580
    assert check_driver_cuda("580.95.05", {"CUDA_VERSION": "13.9.0"}).status == "skip"  # newer than the table
    assert check_driver_cuda("580.95.05", None).status == "skip"  # no image


def test_no_nvidia_smi_is_no_sre_check_and_a_broken_one_is_skip(tmp_path):
    assert check_gpu_health((127, "no NVIDIA driver"), CUDA_129) == []
    broken = run_probe(GpuHealthQuery(), standin_bin(tmp_path, "driver-not-loaded"))
    assert broken[0] == 9
    checks = check_gpu_health(broken, CUDA_129)
    assert {c.status for c in checks} == {"skip"} and "couldn't communicate with the NVIDIA driver" in checks[0].reason


def test_an_older_driver_is_asked_with_the_older_field_names(tmp_path):
    """A driver that does not know clocks_event_reasons.* / pcie.link.gen.gpucurrent: the probe
    asks again with clocks_throttle_reasons.* / pcie.link.gen.current, same order."""
    smi = standin_bin(tmp_path, "legacy-driver", "hw-slowdown") / "nvidia-smi"
    new = subprocess.run([smi, "--query-gpu=" + ",".join(FIELDS), "--format=csv,noheader,nounits"], capture_output=True)
    assert new.returncode == 2  # the stand-in's older driver refuses the newer names, as the real one does
    status, text = run_probe(GpuHealthQuery(), smi.parent)
    answer = parse_gpu_health(status, text)
    assert status == 0 and len(answer.gpus) == 8 and answer.gpus[1].reasons["hw_thermal_slowdown"] is True
    assert answer.gpus[0].driver == "525.60.13" and answer.gpus[0].link_gen == 5


# -- Xids ---------------------------------------------------------------------------------------------

DMESG = """boot 1700000000
source dmesg
lines 3
[  100.000000] NVRM: Xid (PCI:0000:38:00): 13, pid=4242, name=python3, Graphics SM Warp Exception
[ 5000.500000] NVRM: Xid (PCI:0000:48:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
NVRM: Xid (PCI:0000:58:00): 31, pid=1, name=x, MMU Fault
"""


def test_xid_lines_are_read_with_their_wall_clock_time():
    log = parse_xids(0, DMESG)
    assert [(x.code, x.pci, x.at) for x in log.xids] == [
        (13, "PCI:0000:38:00", 1700000100.0),
        (79, "PCI:0000:48:00", 1700005000.5),
        (31, "PCI:0000:58:00", None),
    ]


def test_xids_count_since_the_container_started():
    gpus = {"0000:38:00": 2, "0000:48:00": 3}
    since_boot = check_xid((0, DMESG), window(None, gpus))[0]
    assert since_boot.status == "fail" and since_boot.reason.startswith("3 Xid(s) since boot: Xid 79 on GPU3")
    after_79 = check_xid((0, DMESG), window(1700006000.0, gpus))[0]
    assert after_79.status == "warn" and after_79.data["xids"] == [31]  # an unstamped line still counts
    late = check_xid((0, DMESG.replace("NVRM: Xid (PCI:0000:58:00)", "")), window(1700006000.0, gpus))[0]
    assert late.status == "ok" and late.reason.startswith("no Xid in the kernel log (dmesg) since the container")


def test_unreadable_kernel_log_is_skipped_with_the_reason(tmp_path):
    out = run_probe(KernelXids(), standin_bin(tmp_path, "kernel-log-denied"))
    check = check_xid(out, window(None))[0]
    assert check.status == "skip" and "dmesg: read kernel buffer failed: Operation not permitted" in check.reason
    assert check_xid(out, window(None), driver=False) == []  # no NVIDIA driver: no Xid check


def test_the_kernel_log_probe_reads_the_standins_dmesg(tmp_path):
    status, text = run_probe(KernelXids(), standin_bin(tmp_path, "xid-fatal"))
    log = parse_xids(status, text)
    assert status == 0 and log.source == "dmesg" and [x.code for x in log.xids] == [79]
    assert abs((log.xids[0].at or 0) - (time.time() - 60)) < 5  # boot time + stamp = when it was logged


# -- python3 ------------------------------------------------------------------------------------------


def test_python3_missing_or_old_names_what_needs_it(tmp_path):
    (tmp_path / "empty").mkdir()  # a PATH without python3 (the probe needs only sh's builtins then)
    run = subprocess.run(
        ["/bin/sh", "-c", HostPython().command()], env={"PATH": str(tmp_path / "empty")}, capture_output=True, text=True
    )
    status, text = run.returncode, run.stdout
    version, error = parse_python(status, text)
    assert (status, version, error) == (127, None, "python3 not found on PATH")
    problem = python_problem(version, error) or ""
    assert "extraction client" in problem and "dumps verify" in problem and "exporter" in problem
    assert python_problem((3, 6, 9), None).startswith("python3 3.6.9 is older than 3.8")
    assert python_problem(*parse_python(*run_probe(HostPython(), path=os.environ["PATH"]))) is None


# -- through the CLI, against a lab host with the stand-in on its PATH --------------------------------


@pytest.fixture
def gpu_host(lab, host):
    """`lab1` with the GPU stand-in; taken away after the test."""
    yield host
    lab.no_fake_gpus(host.name)


def _health_json(lab_env, host):
    rc, out, err = run_cli(lab_env, "health", "--host", host.name, "--json", timeout=120)
    doc = json.loads(out)
    doc = doc[0] if isinstance(doc, list) else doc.get("hosts", [doc])[0] if "hosts" in doc else doc
    return rc, {f"{c['tier']}/{c['name']}": c for c in doc["checks"]}, err


def test_cli_health_on_a_healthy_standin_host(lab, gpu_host, lab_env):
    lab.fake_gpus(gpu_host.name)
    rc, checks, err = _health_json(lab_env, gpu_host)
    assert "Traceback" not in err
    for name in ("gpus/count", "gpus/ecc", "gpus/temperature", "gpus/processes", "gpus/pcie_link", "gpus/throttle"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["gpus/count"]["reason"] == "8 GPUs visible, inventory expects 0"
    assert checks["gpus/memory_rows"]["status"] == "ok" and checks["gpus/persistence"]["status"] == "ok"
    assert checks["gpus/xid"]["status"] == "ok" and "since boot" in checks["gpus/xid"]["reason"]  # no container
    assert checks["gpus/driver_cuda"]["status"] == "skip"  # no container, no image


def test_cli_health_names_each_fault(lab, gpu_host, lab_env):
    state = lab.fake_gpus(gpu_host.name, "degraded-link", "remap-pending", "hw-slowdown", "persistence-off")
    state["processes"] = [{"pid": 4242, "used_memory": 1024, "gpu": 0}]  # a process outside any container
    lab.fake_gpus(gpu_host.name, state=state)
    rc, checks, err = _health_json(lab_env, gpu_host)
    assert rc == 12 and "Traceback" not in err
    assert (
        checks["gpus/pcie_link"]["status"] == "warn"
        and "GPU2 Gen5 x8 of Gen5 x16" in checks["gpus/pcie_link"]["reason"]
    )
    assert checks["gpus/memory_rows"]["status"] == "warn"
    assert checks["gpus/throttle"]["status"] == "fail"
    assert checks["gpus/persistence"]["status"] == "warn"
    assert checks["gpus/processes"]["status"] == "warn" and "pid 4242 (1024 MiB)" in checks["gpus/processes"]["reason"]


def test_cli_health_xid_since_the_container_started_and_driver_vs_image(lab, gpu_host, lab_env, dockerd, busybox_image):
    """A container of an image that needs CUDA 12.9, started now: an Xid logged 3 days ago does not
    count, one logged after the start fails the check; driver 535 warns against CUDA 12.9 (the
    running container's image: the deploy's image does not exist on this host)."""
    image = "remote-ops/cuda-env:lab"
    dockerd.docker("rm", "-f", "ro-cuda-env-src", check=False)
    dockerd.docker("create", "--name", "ro-cuda-env-src", busybox_image, "sleep", "600")
    env = [f'--change=ENV {k}="{v}"' for k, v in CUDA_129.items()]
    dockerd.docker("commit", *env, "ro-cuda-env-src", image)
    dockerd.docker("rm", "-f", "ro-cuda-env-src", gpu_host.container_name, check=False)
    dockerd.docker("run", "-d", "--name", gpu_host.container_name, image, "sleep", "600")
    try:
        state = gpu_standin.case("old-driver", "xid-old")
        gpu_standin.CASES["xid-fatal"](state)  # logged "60 s ago": before the container started
        state["kernel_log"][-1]["at"] = time.time() + 1  # ... moved to just after it started
        lab.fake_gpus(gpu_host.name, state=state)
        rc, checks, err = _health_json(lab_env, gpu_host)
    finally:
        dockerd.docker("rm", "-f", gpu_host.container_name, check=False)
    xid = checks["gpus/xid"]
    assert xid["status"] == "fail" and xid["reason"].startswith("1 Xid(s) since the container started")
    assert "Xid 79 on GPU3 (pid='<unknown>', name=<unknown>, GPU has fallen off the bus.)" in xid["reason"]
    driver = checks["gpus/driver_cuda"]
    assert driver["status"] == "warn" and driver["data"]["cuda"] == "12.9" and driver["data"]["driver"] == "535.104.05"


def test_cli_facts_deploy_and_extract_preflight_name_an_old_python3(lab, host, lab_env, tmp_path):
    """A STAND-IN python3 3.6.9 first on the host's PATH: facts names it, deploy and extract start
    refuse (exit 9, a dry run too) before anything is written on the host."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"id": "a", "input_ids": [1, 2]}\n')
    workdir_before = (host.paths.logs_dir / "extract").exists()
    shim = host.paths.bin / "python3"
    host.paths.bin.mkdir(parents=True, exist_ok=True)
    shim.write_text("#!/bin/sh\n# STAND-IN python3 (tests/test_gpu_checks.py): an interpreter too old\necho 3.6.9\n")
    shim.chmod(0o755)
    try:
        rc, out, err = run_cli(lab_env, "facts", "--host", host.name, "--json", timeout=120)
        doc = json.loads(out)
        doc = doc[0] if isinstance(doc, list) else doc
        assert rc == 0 and doc["python3"] == "3.6.9", err
        assert doc["python3_problem"].startswith("python3 3.6.9 is older than 3.8, which the extraction client")
        rc, out, err = run_cli(lab_env, "deploy", "--host", host.name, "--dry-run", timeout=120)
        assert rc == 9 and "python3 3.6.9 is older than 3.8" in err and "Traceback" not in err, err
        for dry in ((), ("--dry-run",)):
            rc, out, err = run_cli(lab_env, "extract", "start", "--host", host.name, "--dataset", str(dataset), *dry)
            assert rc == 9 and "preflight: python3 3.6.9 is older than 3.8, which the extraction client" in err, err
            assert "hint: install python3 (3.8 or newer)" in err
        assert (host.paths.logs_dir / "extract").exists() == workdir_before  # refused before making it
    finally:
        shim.unlink(missing_ok=True)
    rc, out, _ = run_cli(lab_env, "facts", "--host", host.name, "--json", timeout=120)
    doc = json.loads(out)
    doc = doc[0] if isinstance(doc, list) else doc
    assert doc["python3"] and doc["python3_problem"] is None
