"""Shared fixtures: real local test hosts from `remote_ops.hostlab`.

See tests/README.md for the list, what they need (root, Debian packages) and
how long they take.  Without root/sshd/dockerd the host fixtures skip with the
reason; with REMOTE_OPS_REQUIRE_HOSTS=1 (CI) they fail instead, so a broken
harness can never pass as "all skipped".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from remote_ops.hostlab import Faults, HostLab, iptables_available, lab_unavailable
from remote_ops.remote import FabricRemote

LAB_HOSTS = 3

# CLI subprocesses of the tests run in-process, never through a warm fork server the developer
# may have running (`remote-ops daemon start`); tests/test_daemon.py turns it on for its own.
os.environ["REMOTE_OPS_DAEMON"] = "0"


def require(reason: str | None) -> None:
    """Skip (or fail, under REMOTE_OPS_REQUIRE_HOSTS=1) when `reason` is not None."""
    if reason is None:
        return
    if os.environ.get("REMOTE_OPS_REQUIRE_HOSTS") == "1":
        pytest.fail(f"REMOTE_OPS_REQUIRE_HOSTS=1 but the host lab cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def lab():
    """3 sshd hosts (lab1..lab3) + one dockerd, up for the whole session (~1 s).

    Port 22 on random 127.x addresses; REMOTE_OPS_LAB_PORT=N forces another port.
    """
    require(lab_unavailable())
    port = int(os.environ.get("REMOTE_OPS_LAB_PORT", "0")) or None
    with HostLab(hosts=LAB_HOSTS, port=port) as the_lab:
        yield the_lab


@pytest.fixture(scope="session")
def dockerd(lab):
    """The lab's `Dockerd` (`.socket`, `.host`, `.docker(*args)`)."""
    return lab.dockerd


def _healthy(lab, name):
    """The named host, restarted and thawed if an earlier test broke it."""
    from remote_ops.hostlab.faults import heal

    host = lab.host(name)
    heal(lab, host)
    return host


@pytest.fixture
def host(lab):
    """`lab1`, a running LabHost (address, port, paths, container_name, server_port, sshd)."""
    return _healthy(lab, "lab1")


@pytest.fixture
def spare_host(lab):
    """`lab3`, the host fault tests break (healed again before the next test)."""
    return _healthy(lab, "lab3")


def connect(lab, name: str, **target_overrides) -> FabricRemote:
    """A strict FabricRemote to lab host `name`, resolved from lab inventory + ssh_config."""
    return FabricRemote(lab.target(name, **target_overrides)).connect()


@pytest.fixture
def remote(lab, host):
    """A connected strict `FabricRemote` to `host` (lab1); closed after the test."""
    r = connect(lab, host.name)
    yield r
    r.close()


@pytest.fixture(scope="session")
def _sglang_installed(lab):
    """Install the real SGLang 0.5.9 tree (PyPI wheel, cached) into lab2's checkout once."""
    try:
        lab.install_sglang("lab2")
    except Exception as exc:  # no network to PyPI and no cached wheel
        require(f"cannot get the SGLang 0.5.9 wheel: {exc}")
    return lab.host("lab2")


@pytest.fixture
def sglang_host(lab, _sglang_installed):
    """`lab2`, whose checkout (a git repo) holds the pristine real SGLang 0.5.9 tree.

    Reset with `git reset --hard && git clean -fdx` before each test, so a
    test may patch it freely.
    """
    host = _healthy(lab, "lab2")
    checkout = str(host.paths.checkout)
    for argv in (["git", "-C", checkout, "reset", "-q", "--hard"], ["git", "-C", checkout, "clean", "-qfdx"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    return host


@pytest.fixture
def sglang_remote(lab, sglang_host):
    """A connected FabricRemote to `sglang_host`."""
    r = connect(lab, sglang_host.name)
    yield r
    r.close()


@pytest.fixture(scope="session")
def base_image(lab):
    """Tag of the debootstrap bookworm+python3 image in the lab dockerd (~50 s the first time, cached)."""
    from remote_ops.hostlab import base_python_image

    return base_python_image(lab.dockerd.socket)


@pytest.fixture(scope="session")
def busybox_image(lab):
    """Tag of the ~2 MB busybox image in the lab dockerd (~0.2 s)."""
    from remote_ops.hostlab import busybox_image as make

    return make(lab.dockerd.socket)


@pytest.fixture
def faults(lab):
    """`Faults(lab)`: crash/refuse/drop/freeze/thaw/unblock/restart a host; all healed after the test."""
    require(iptables_available())
    f = Faults(lab)
    yield f
    f.heal_all()


@pytest.fixture
def lab_env(lab, tmp_path) -> dict[str, str]:
    """Environment for running the `remote-ops` CLI against the lab (inventory, private state dir)."""
    return {
        **os.environ,
        "REMOTE_OPS_INVENTORY": str(lab.inventory_dir),
        "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"),
    }


@pytest.fixture(scope="session")
def standin_base(lab, base_image):
    """The SGLang 0.5.9 stand-in base image, built locally in the lab dockerd (never pulled)."""
    from remote_ops.hostlab.images import docker
    from remote_ops.workflows import sandbox

    return sandbox.build_standin_base(
        lambda *a, timeout=600: docker(lab.dockerd.socket, *a, timeout=timeout), "0.5.9", base_image
    )


@pytest.fixture
def spec(lab, sglang_host, standin_base, tmp_path, monkeypatch):
    """lab2's inventory entry pointed at the stand-in base image (deployable); local state in tmp."""
    from remote_ops.workflows import sandbox

    monkeypatch.setenv("REMOTE_OPS_STATE_DIR", str(tmp_path / "state"))
    sandbox.write_model_config(sglang_host.paths.model_dir)
    s = lab.spec(sglang_host.name)
    return s.model_copy(
        update={
            "sglang": s.sglang.model_copy(update={"base_image": standin_base}),
            "server": s.server.model_copy(update={"launcher": sandbox.STANDIN_LAUNCHER, "healthy_timeout_s": 60}),
            "container": s.container.model_copy(
                update={"env": {"STANDIN_LOAD_SECONDS": "0.5", "STANDIN_REQUIRE_PATCH": "1"}}
            ),
        }
    )


@pytest.fixture
def deployed(sglang_remote, spec):
    """`spec` after a real deploy (stand-in server running); the container is removed afterwards."""
    from remote_ops.workflows import deploy

    deploy.deploy(sglang_remote, spec, why="test")
    yield spec
    sglang_remote.run(["docker", "rm", "-f", spec.container.name], check=False)


def pytest_collection_modifyitems(config, items):
    """Tests that use a lab fixture get the `hosts` marker (select with -m hosts / -m 'not hosts')."""
    lab_fixtures = {
        "lab",
        "host",
        "remote",
        "spare_host",
        "sglang_host",
        "sglang_remote",
        "base_image",
        "busybox_image",
        "faults",
        "dockerd",
        "lab_env",
        "standin_base",
        "spec",
        "deployed",
    }
    for item in items:
        if lab_fixtures & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.hosts)


def run_cli_process(env: dict, *args: str, timeout: float = 180, cwd=None) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m remote_ops`, this checkout's code) in a subprocess with `env`
    (in `cwd`); stdin closed, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "remote_ops", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_cli(env: dict, *args: str, timeout: float = 120) -> tuple[int, str, str]:
    """`run_cli_process` as (exit code, stdout, stderr)."""
    p = run_cli_process(env, *args, timeout=timeout)
    return p.returncode, p.stdout, p.stderr
