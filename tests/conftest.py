"""Shared fixtures: real local test hosts from `remote_ops.hostlab`.

See tests/README.md for the list, what they need (root, Debian packages) and
how long they take.  Without root/sshd/dockerd the host fixtures skip with the
reason; with REMOTE_OPS_REQUIRE_HOSTS=1 (CI) they fail instead, so a broken
harness can never pass as "all skipped".
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from remote_ops.hostlab import Faults, HostLab, iptables_available, lab_unavailable
from remote_ops.remote import FabricRemote

LAB_HOSTS = 3

# CLI subprocesses of the tests run in-process, never through a warm fork server the developer
# may have running (`remote-ops daemon start`); tests/test_daemon.py turns it on for its own.
os.environ["REMOTE_OPS_DAEMON"] = "0"

#: Seconds a test waits for its turn under the `serial` lock (pytest-xdist workers) before it fails.
SERIAL_WAIT_S = 1800.0


def pytest_configure(config):
    """Each test process (the one process, or each pytest-xdist worker) gets its own local state
    dir (run records, the sandbox): a test that does not name one never shares another worker's,
    nor writes the developer's own.  The cache dir (wheels, rootfs tarballs) stays shared: its
    builds take file locks.  Under pytest-xdist the work units go out in the order that
    `pytest_collection_modifyitems` makes, not by their size, and each worker runs one BLAS
    thread."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # pytest-xdist: keep the order made below
    if hasattr(config, "workerinput"):
        # Workers outnumber the cores: one BLAS/OpenMP thread per process (torch's benches, the
        # stand-in's numpy), not threads that spin waiting for a core another worker holds.
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")
    state = tempfile.mkdtemp(prefix="ro-test-state-")
    config._remote_ops_state = state
    os.environ["REMOTE_OPS_STATE_DIR"] = state


def pytest_unconfigure(config):
    state = getattr(config, "_remote_ops_state", None)
    if state:
        shutil.rmtree(state, ignore_errors=True)


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
    """The named host, restarted and thawed if an earlier test broke it, its standard dirs there."""
    from remote_ops.hostlab.faults import heal

    host = lab.host(name)
    heal(lab, host)
    host.paths.create()  # its dump, logs, lock and model dirs (a test in another file may have removed one)
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
    """`spec` after a real deploy (stand-in server running); the container is removed afterwards.  A
    container left by a test file run earlier on this worker is reused or recreated by deploy as
    it finds it (a stale mount of a dump dir removed and made again included)."""
    from remote_ops.workflows import deploy

    deploy.deploy(sglang_remote, spec, why="test")
    yield spec
    sglang_remote.run(["docker", "rm", "-f", spec.container.name], check=False)


#: Fixtures that put a test on the lab (it gets the `hosts` marker).
LAB_FIXTURES = frozenset(
    {
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
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group markers
def pytest_collection_modifyitems(config, items):
    """Tests that use a lab fixture get the `hosts` marker (select with -m hosts / -m 'not hosts').

    Under pytest-xdist (`--dist loadgroup`, as scripts/test runs it) a test file is one unit of
    work, run by one worker in file order, as without xdist: its module fixtures are made once and
    a test may rely on an earlier one of its file.  `@pytest.mark.xdist_group("name")` puts tests
    of several files in one unit instead (they share a session-scoped deployment).  On a worker,
    files with more lab tests come first, so that the long ones do not start last; files of the real
    drafter loop (`loop`, the longest by far) before all."""
    lab_tests: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if LAB_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.hosts)
            lab_tests[path] = lab_tests.get(path, 0) + 1
        if not any(m.args or m.kwargs for m in item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(path))
    if hasattr(config, "workerinput"):
        first = {}
        for i, item in enumerate(items):
            first.setdefault(_group(item), i)
        weight = {}
        for item in items:
            g = _group(item)
            weight[g] = weight.get(g, 0) + (1000 if item.get_closest_marker("loop") else 0)
            weight[g] += 1 if item.get_closest_marker("hosts") else 0
        items.sort(key=lambda it: (-weight[_group(it)], first[_group(it)]))


def _group(item) -> str:
    return str(next(m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")))


@pytest.fixture(autouse=True)
def _serial_turn(request, tmp_path_factory):
    """Under pytest-xdist, a test marked `serial` runs alone: it waits until the tests running on
    the other workers end, and none starts until it has ended (a readers-writer lock on files
    shared by the run's workers; a waiting `serial` test goes first).  Without xdist it does
    nothing.  Session and module fixtures are set up before this one, outside the lock."""
    if not hasattr(request.config, "workerinput"):
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's own
    exclusive = request.node.get_closest_marker("serial") is not None
    with open(shared / "serial-gate.lock", "a") as gate, open(shared / "serial-run.lock", "a") as run:
        if exclusive:
            _flock(gate, fcntl.LOCK_EX, request.node)  # no test starts from now on
            _flock(run, fcntl.LOCK_EX, request.node)  # until the running ones end
        else:
            _flock(gate, fcntl.LOCK_SH, request.node)
            _flock(run, fcntl.LOCK_SH, request.node)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


def _flock(fh, op: int, item) -> None:
    deadline = time.monotonic() + SERIAL_WAIT_S
    while True:
        try:
            fcntl.flock(fh, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"{item.nodeid}: no turn under the serial lock after {SERIAL_WAIT_S:g}s", pytrace=False)
            time.sleep(0.05)


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


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Stop a process a test started, by its PID: SIGTERM, then SIGKILL after `timeout`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def clear_server_port(lab, host, timeout: float = 20) -> None:
    """Free lab host `host`'s server port for a stand-in a test starts itself: remove the lab's
    containers that publish it (another test file on this worker may have deployed one there;
    files run in any order side by side), then wait until nothing listens on it."""
    import time

    from remote_ops.hostlab._proc import can_bind

    port = host.server_port
    found = lab.dockerd.docker("ps", "-aq", "--filter", f"publish={port}", check=False, timeout=30)
    ids = (found.stdout.decode() if isinstance(found.stdout, bytes) else found.stdout or "").split()
    ids += [host.container_name]
    lab.dockerd.docker("rm", "-f", *ids, check=False, timeout=60)
    deadline = time.monotonic() + timeout
    while not can_bind("0.0.0.0", port) and time.monotonic() < deadline:
        time.sleep(0.2)
