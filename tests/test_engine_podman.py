"""The second engine kind: podman (remote_ops/engine/podman.py) on Debian 12's podman 4.3.1.

Pure tests first (what podman's CLI prints, read as the API's records; the
spec podman takes; its build and run command lines).  Then a real podman on
a lab host (`HostLab(engine="podman")`: its own storage, config, network and
API service, no registry) reached over the lab sshd: the engine API through
the relay (version, image, run, logs, remove, one channel), the dial starting
the API service when its socket is absent, a build with the podman CLI from a
local rootfs, the shell probe read back as the API answers, and a full
`deploy` (patch, build, start, wait, health) then a no-op re-deploy.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from conftest import connect, require

from remote_ops.core import shell
from remote_ops.core.inventory import HostSpec
from remote_ops.engine import RunSpec, cli_for, engine_class, open_engine
from remote_ops.engine.podman import PodmanCLI, PodmanEngine, podman_spec
from remote_ops.engine.probe import SectionNames
from remote_ops.errors import CommandFailed, ExitCode
from remote_ops.hostlab import lab_unavailable
from remote_ops.hostlab.images import BUSYBOX_TAG, busybox_rootfs_tar
from remote_ops.hostlab.podman import podman_unavailable

HEX = "9f42cf6f3bc2e144f14dce5543d1d727d178461145cfb50baafe1639306e5eaa"


# -- pure ----------------------------------------------------------------------------------------
def test_the_registry_and_the_inventory_pick_podman():
    host = HostSpec(name="h", engine="podman")
    assert engine_class("podman") is PodmanEngine and isinstance(cli_for(host), PodmanCLI)
    assert cli_for(host).binary == "podman" and cli_for(HostSpec(name="h")).binary == "docker"


def test_a_local_podman_version_without_a_server_is_the_engine():
    """A local podman CLI has no daemon: its `version` has a client part only."""
    local = json.dumps({"Client": {"APIVersion": "4.3.1", "Version": "4.3.1", "Os": "linux"}})
    names = SectionNames(version="v", objects=None, runtimes=None)
    snap = PodmanCLI().parse_probe({"v": (0, local)}, names)
    assert snap.version is not None and snap.version.server == "4.3.1" and snap.version.api == "4.3.1"
    assert snap.engine == "podman" and snap.client_version == "4.3.1" and snap.error is None
    down = PodmanCLI().parse_probe({"v": (125, "Error: unable to connect to Podman socket")}, names)
    assert down.version is None and "unable to connect" in (down.error or "")


def test_libpod_inspect_documents_read_as_the_apis():
    """`podman inspect` prints ids without `sha256:` and short names as `localhost/NAME`."""
    ctr = {
        "Id": "c" * 64,
        "Name": "srv",
        "Image": HEX,
        "State": {"Status": "running", "Running": True, "Health": {"Status": "", "FailingStreak": 0, "Log": None}},
        "Config": {"Image": "localhost/remote-ops/sglang:t", "Labels": {"a": "b"}},
    }
    img = {"Id": HEX, "RepoTags": ["localhost/remote-ops/sglang:t"], "Config": {"Labels": {"a": "b"}}}
    image, container = PodmanCLI().parse_inspect(0, json.dumps([ctr]) + "\n" + json.dumps([img]))
    assert image.id == container.image_id == f"sha256:{HEX}" and image.tags == ("remote-ops/sglang:t",)
    assert container.image_ref == "remote-ops/sglang:t" and container.health is None and container.running


def test_the_spec_podman_takes():
    spec = RunSpec("c", "img", gpus=(0, 1), ipc="host", shm_size="16g", env={"A": "1"})
    taken = podman_spec(spec)
    assert taken.gpus == "none" and taken.env == {"A": "1", "NVIDIA_VISIBLE_DEVICES": "0,1"}
    assert taken.shm_size is None, "podman refuses --shm-size with the host's IPC namespace"
    assert podman_spec(RunSpec("c", "img", ipc="private", shm_size="1g")).shm_size == "1g"
    argv = PodmanCLI().run_argv(RunSpec("c", "img", gpus="all"))
    assert argv[:4] == ["podman", "run", "-d", "--pull=never"] and "--gpus" not in argv
    assert "NVIDIA_VISIBLE_DEVICES=all" in argv


def test_podman_builds_never_pull_and_carry_no_healthcheck():
    cmd = PodmanCLI().build_cmd("/ctx", "img:t", "buildah", "/ctx/.iid")
    assert cmd == "podman build --pull=never --format oci -t img:t --iidfile /ctx/.iid /ctx"
    assert PodmanCLI().builder_sections() == [] and PodmanCLI().choose_builder({}) == "buildah"


# -- a real podman on a lab host ---------------------------------------------------------------
@pytest.fixture(scope="module")
def podman_lab():
    """One lab host (`engine: podman`) served by a lab podman, and busybox imported there."""
    from remote_ops.hostlab import HostLab

    require(lab_unavailable() or podman_unavailable())
    with HostLab(hosts=1, docker=False, engine="podman") as lab:
        lab.podman.import_tar(busybox_rootfs_tar(), BUSYBOX_TAG)
        yield lab


@pytest.fixture
def pod_remote(podman_lab):
    r = connect(podman_lab, "lab1")
    yield r
    r.close()


@pytest.fixture
def name(podman_lab):
    n = f"ro-podman-test-{uuid.uuid4().hex[:8]}"
    yield n
    podman_lab.podman.podman("rm", "-f", "-t", "0", n, check=False)


@pytest.mark.hosts
def test_engine_api_through_the_relay(podman_lab, pod_remote, name):
    """version, image, run (with --init), logs, remove: the podman API over the one SSH channel."""
    local = json.loads(podman_lab.podman.podman("version", "--format", "{{json .}}").stdout)
    with open_engine(pod_remote, "podman", timeout=30) as engine:
        v = engine.version()
        assert (v.engine, v.server) == ("podman", local["Client"]["Version"])
        image = engine.image(BUSYBOX_TAG)
        assert image is not None and image.id.startswith("sha256:") and BUSYBOX_TAG in image.tags
        assert engine.image("remote-ops/never-built:nope") is None
        ctr = engine.run(RunSpec(name, BUSYBOX_TAG, ("sh", "-c", "echo out; echo err >&2; exec sleep 600")))
        assert ctr.running and ctr.init and ctr.image_id == image.id and ctr.image_ref == BUSYBOX_TAG
        deadline = time.monotonic() + 20
        while len(lines := engine.logs(name)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted((x.stream, x.text) for x in lines) == [("stderr", "err"), ("stdout", "out")]
        assert engine.logs(name, tail=1)[-1].text in ("out", "err")
        engine.stop(name, grace_s=1)
        assert not engine.container(name).running
        assert engine.remove(name) and engine.container(name) is None and not engine.remove(name)
        assert engine.adapter.channels_opened == 1, "every request on one relay channel"


@pytest.mark.hosts
def test_the_dial_starts_the_api_service_when_its_socket_is_absent(podman_lab, pod_remote):
    """With no service on the socket, the relay starts `podman system service` (then serves)."""
    lab_podman = podman_lab.podman
    lab_podman.stop_service()
    try:
        assert not lab_podman.socket.exists() and not lab_podman.service_pids()
        with open_engine(pod_remote, "podman", timeout=30) as engine:
            assert engine.version().engine == "podman" and engine.image(BUSYBOX_TAG) is not None
        started = lab_podman.service_pids()
        assert started, "the relay started an API service"
        cmdline = open(f"/proc/{started[0]}/cmdline", "rb").read().split(b"\0")
        assert b"--time=600" in cmdline, "it exits after its idle time"
    finally:
        lab_podman.stop_service()
        lab_podman.start_service()


@pytest.mark.hosts
def test_a_relay_that_cannot_reach_podman_is_a_typed_error(pod_remote):
    class Elsewhere(PodmanEngine):
        dial = (
            "sh",
            "-c",
            "CONTAINER_HOST=ssh://nowhere/run/podman.sock; export CONTAINER_HOST; " + PodmanEngine.dial[2],
        )

    with Elsewhere(pod_remote, timeout=20) as engine, pytest.raises(CommandFailed) as err:
        engine.version()
    assert err.value.exit_code == ExitCode.COMMAND_FAILED and "not unix://" in err.value.stderr_tail
    assert "podman" in err.value.hint


@pytest.mark.hosts
def test_build_with_the_podman_cli_from_a_local_rootfs(podman_lab, pod_remote):
    """`podman build` of a tiny image FROM the imported busybox rootfs: never pulls, labels kept."""
    from remote_ops.workflows import container

    tag = f"remote-ops/podman-build-test:{uuid.uuid4().hex[:6]}"
    ctx = f"{podman_lab.dir}/build-{uuid.uuid4().hex[:6]}"
    pod_remote.run(["mkdir", "-p", ctx])
    pod_remote.put(
        f"FROM {BUSYBOX_TAG}\nLABEL org.remote-ops.test=yes\nRUN echo built > /built\n".encode(), f"{ctx}/Dockerfile"
    )
    lines: list[str] = []
    try:
        builder = container.detect_builder(pod_remote, "podman")
        image_id = container.build(
            pod_remote, ctx, tag, builder, on_line=lambda _s, line: lines.append(line), timeout=300, kind="podman"
        )
        assert builder == "buildah" and image_id.startswith("sha256:") and lines, "output is streamed"
        with open_engine(pod_remote, "podman", timeout=30) as engine:
            image = engine.image(tag)
            assert image is not None and image.id == image_id and image.labels["org.remote-ops.test"] == "yes"
        ran = pod_remote.run(cli_for("podman").throwaway_command(shell.quote(image_id), ["/built"], entrypoint="cat"))
        assert ran.stdout.strip() == "built"
        assert container.inspect_image(pod_remote, tag, "podman").id == image_id
    finally:
        podman_lab.podman.podman("rmi", "-f", tag, check=False)


@pytest.mark.hosts
def test_the_shell_probe_reads_the_same_records_as_the_api(podman_lab, pod_remote, name):
    """Over the socket with curl, and with the local CLI (libpod's documents): the records a
    deploy plan compares (ids, image, state, health, labels) are the API's."""
    cli = cli_for("podman")
    with open_engine(pod_remote, "podman", timeout=30) as engine:
        engine.run(RunSpec(name, BUSYBOX_TAG, ("sleep", "600"), labels={"org.remote-ops.run-config": "r1"}))
        want_c, want_i = engine.container(name), engine.image(BUSYBOX_TAG)
    local = "env -u CONTAINER_HOST "  # the podman CLI on the lab's storage, not the service
    for image in (BUSYBOX_TAG, None):
        for prefix, api in (("", True), (local, False)):
            sections = [
                (n, c.replace("podman ", prefix + "podman ")) for n, c in cli.probe_sections(name, image, api=api)
            ]
            snap = cli.parse_probe(shell.split_sections(pod_remote.run(shell.sections(sections), check=False).stdout))
            c, i = snap.container, snap.image
            assert snap.version is not None and snap.version.engine == "podman", (prefix, snap.error)
            assert (c.id, c.image_id, c.image_ref, c.status, c.health) == (
                want_c.id,
                want_c.image_id,
                want_c.image_ref,
                want_c.status,
                want_c.health,
            ), prefix
            assert c.labels["org.remote-ops.run-config"] == "r1" and (i.id, i.tags) == (want_i.id, want_i.tags)
    cid = pod_remote.run(cli.container_id_command(name, api=True)).stdout.strip()
    assert cid == want_c.id


@pytest.mark.hosts
@pytest.mark.slow
def test_deploy_to_podman_then_noop_then_health(podman_lab, pod_remote, tmp_path, monkeypatch):
    """The whole deploy on podman: patch, verify, buildah build, start through the API, wait on
    the cheap endpoints (no HEALTHCHECK under podman); then a no-op re-deploy (one round trip)
    and a health check that is all ok."""
    from remote_ops.hostlab import images
    from remote_ops.workflows import deploy, health, sandbox

    monkeypatch.setenv("REMOTE_OPS_STATE_DIR", str(tmp_path / "state"))
    lab_podman = podman_lab.podman
    lab_podman.podman("import", str(images.base_python_tarball()), images.BASE_PYTHON_TAG, timeout=600)
    never_pull = lambda *a, timeout=600: lab_podman.podman(  # noqa: E731
        *["--pull=never" if x == "--pull=false" else x for x in a], timeout=timeout
    )
    standin = sandbox.build_standin_base(never_pull, "0.5.9", images.BASE_PYTHON_TAG)
    try:
        podman_lab.install_sglang("lab1")
    except Exception as exc:  # no network to PyPI and no cached wheel
        require(f"cannot get the SGLang 0.5.9 wheel: {exc}")
    sandbox.write_model_config(podman_lab.host("lab1").paths.model_dir)
    s = podman_lab.spec("lab1")
    spec = s.model_copy(
        update={
            "sglang": s.sglang.model_copy(update={"base_image": standin}),
            "server": s.server.model_copy(update={"launcher": sandbox.STANDIN_LAUNCHER, "healthy_timeout_s": 90}),
            "container": s.container.model_copy(
                update={"env": {"STANDIN_LOAD_SECONDS": "0.5", "STANDIN_REQUIRE_PATCH": "1"}}
            ),
        }
    )
    assert spec.engine == "podman"
    first = deploy.deploy(pod_remote, spec, why="podman test")
    steps = {x.name: x.status for x in first.steps}
    assert steps["build"] == "changed" and steps["start"] == "changed" and steps["wait"] == "ok", first.steps
    again = deploy.deploy(pod_remote, spec, why="podman test")
    assert again.up_to_date and again.round_trips == 1
    result = health.check_host(lambda _h: pod_remote, spec, expected_image=first.image)
    assert result.worst == "ok", [c for c in result.checks if c.status != "ok"]
    engine_check = next(c for c in result.checks if c.tier == "engine")
    assert engine_check.name == "podman" and "podman engine" in engine_check.reason
    dry = deploy.deploy(pod_remote, spec, dry_run=True)
    assert dry.up_to_date and not dry.diffs
