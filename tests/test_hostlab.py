"""The host lab itself: hosts answer, dockerd works offline, images import, teardown is clean."""

from __future__ import annotations

import time
import urllib.request

import pytest

from remote_ops.errors import RemoteOpsError
from remote_ops.hostlab import HostLab, lab_unavailable
from remote_ops.hostlab._proc import alive, free_port


def test_hosts_have_distinct_addresses_and_per_host_paths(lab):
    assert len({h.address for h in lab.hosts}) == len(lab.hosts) == 3
    assert all(h.address.startswith("127.") and h.address not in ("127.0.0.1",) for h in lab.hosts)
    inv = lab.inventory()
    checkouts = {inv.hosts[h.name].sglang.checkout for h in lab.hosts}
    assert len(checkouts) == 3
    for h in lab.hosts:
        spec = inv.hosts[h.name]
        assert spec.dump.dir.startswith(str(lab.dir)) and spec.lock_dir.startswith(str(lab.dir))
        assert spec.container.name == h.container_name


def test_ssh_session_reaches_lab_dockerd(remote, lab):
    out = remote.run("echo $DOCKER_HOST; command -v docker; docker version --format '{{.Server.Version}}'").stdout
    docker_host, docker_path, server = out.split("\n")[:3]
    assert docker_host == lab.docker_host
    assert docker_path == str(lab.session_bin / "docker")
    assert server.startswith("20.10")


def test_unknown_image_fails_fast_without_registry(remote):
    start = time.monotonic()
    res = remote.run(
        ["docker", "run", "--rm", "--pull=never", "remote-ops/no-such-image:x", "true"], check=False, timeout=60
    )
    assert res.exit_status != 0
    assert "No such image" in res.stderr or "not found" in res.stderr.lower()
    assert time.monotonic() - start < 30


def test_published_port_and_gpus_all(remote, busybox_image, host):
    port = free_port()
    name = f"lab-httpd-{port}"
    remote.run(
        [
            "docker",
            "run",
            "-d",
            "--pull=never",
            "--name",
            name,
            "--gpus",
            "all",
            "-p",
            f"127.0.0.1:{port}:{port}",
            busybox_image,
            "httpd",
            "-f",
            "-p",
            str(port),
            "-h",
            "/etc",
        ]
    )
    try:
        deadline = time.monotonic() + 20
        body = None
        while time.monotonic() < deadline and body is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/passwd", timeout=2).read()
            except OSError:
                time.sleep(0.2)
        assert body is not None and b"root:" in body
        env = remote.run(["docker", "run", "--rm", "--pull=never", "--gpus", "all", busybox_image, "env"]).stdout
        assert "NVIDIA_VISIBLE_DEVICES=all" in env
    finally:
        remote.run(["docker", "rm", "-f", name], check=False)


def test_base_image_has_python3(remote, base_image):
    out = remote.run(["docker", "run", "--rm", "--pull=never", base_image, "python3", "-c", "print(6*7)"]).stdout
    assert out.strip() == "42"


def test_buildkit_build_with_session_docker(remote, base_image, host, tmp_path):
    ctx = host.paths.root / "buildctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "Dockerfile").write_text(f"FROM {base_image}\nRUN echo built > /built.txt\n")
    tag = f"remote-ops/lab-buildkit-test:{host.name}"
    remote.run(f"cd {ctx} && DOCKER_BUILDKIT=1 docker build --pull=false -q -t {tag} .", timeout=180)
    out = remote.run(["docker", "run", "--rm", "--pull=never", tag, "cat", "/built.txt"]).stdout
    assert out.strip() == "built"


def test_sglang_host_has_real_tree(sglang_remote, sglang_host):
    target = sglang_host.paths.checkout / "python/sglang/srt/models/deepseek_v2.py"
    out = sglang_remote.run(["grep", "-c", "self.capture_aux_hidden_states = False", str(target)]).stdout
    assert int(out) >= 1
    status = sglang_remote.run(["git", "-C", str(sglang_host.paths.checkout), "status", "--porcelain"]).stdout
    assert status == ""


def test_crash_kills_open_sessions_and_restart_keeps_key(lab, faults, spare_host):
    r = lab.connect(spare_host.name)
    fp = r.host_key_fingerprint
    r.run("true")
    faults.crash(spare_host)
    with pytest.raises(RemoteOpsError):  # the seam turns a dead session into a typed error
        r.run("true", timeout=10)
    r.close()
    faults.restart(spare_host)
    with lab.connect(spare_host.name) as again:
        assert again.host_key_fingerprint == fp


def test_separate_lab_teardown_is_clean():
    """A second, small lab starts beside the session one and leaves no process behind."""
    if lab_unavailable():
        pytest.skip(lab_unavailable())
    lab = HostLab(hosts=1, docker=False).start()
    pid = lab.hosts[0].sshd.pid
    with lab.connect("lab1") as r:
        r.run("true")
    lab.stop()
    lab.stop()  # idempotent
    assert not alive(pid)
    assert not lab.dir.exists()


def test_kept_lab_is_stopped_from_its_record(tmp_path):
    """`keep=True` (the sandbox's mode) survives its object; `HostLab.attach(dir).stop()` ends it by PID."""
    if lab_unavailable():
        pytest.skip(lab_unavailable())
    lab = HostLab(tmp_path / "kept", hosts=2, keep=True).start()
    try:
        pids = [h.sshd.pid for h in lab.hosts] + [lab.dockerd.pid]
        recorded = HostLab.attach(lab.dir)
        assert recorded.running()
        assert {h["name"] for h in recorded.state["hosts"]} == {"lab1", "lab2"}
        recorded.stop()
        for h in lab.hosts:
            h.sshd.proc.poll()
        lab.dockerd.proc.poll()
        assert not any(alive(p) for p in pids)
        assert not recorded.running()
        assert lab.dockerd.bridge not in open("/proc/net/dev").read()
    finally:
        lab.stop()


def test_a_kept_lab_restarts_on_a_new_address(tmp_path):
    """A kept lab (the sandbox) started again picks a new address; its sshd_config must follow."""
    from conftest import require

    from remote_ops.hostlab import HostLab, lab_unavailable

    require(lab_unavailable())
    first = HostLab(tmp_path / "lab", names=["box"], docker=False, keep=True).start()
    first.stop()
    second = HostLab(tmp_path / "lab", names=["box"], docker=False, keep=True).start()
    try:
        assert second.connect("box").run(["true"]).ok
        assert f"ListenAddress {second.host('box').address}:" in second.host("box").sshd.config_file.read_text()
    finally:
        second.stop()


def test_a_recorded_lab_stopped_from_another_process_is_recorded_as_stopped(tmp_path):
    """`sandbox down` stops the lab by its lab.json; `sandbox status` must then read "not running"."""
    import json

    from conftest import require

    from remote_ops.hostlab import HostLab, lab_unavailable

    require(lab_unavailable())
    HostLab(tmp_path / "lab", names=["h"], docker=False, keep=True).start()
    HostLab.attach(tmp_path / "lab").stop()
    state = json.loads((tmp_path / "lab" / "lab.json").read_text())
    assert state["stopped"] is True and not HostLab.attach(tmp_path / "lab").running()


def test_same_root_tells_a_chrooted_process_from_ours(tmp_path):
    """A lab path is unique only within one root: a chroot on this machine may run a lab at the same
    path, and its shims must never be found (and killed) by `pids_with_arg` here."""
    import os
    from pathlib import Path

    from remote_ops.hostlab._proc import pids_with_arg, same_root

    assert same_root(os.getpid())
    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    ours = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()

    def child(chroot: bool) -> int:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: our command line, maybe another root
            if chroot:
                os.chroot(tmp_path)
            os.write(write_fd, b"x")
            time.sleep(30)
            os._exit(0)
        os.read(read_fd, 1)
        return pid

    plain, chrooted = child(False), child(True)
    try:
        assert same_root(plain) and not same_root(chrooted)
        found = pids_with_arg(ours)
        assert plain in found and chrooted not in found
    finally:
        for pid in (plain, chrooted):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
