"""The engine seam: Docker SDK over `docker system dial-stdio` on the strict SSH transport.

Pure tests (run spec -> API body, log demux, times, inspect parsing) first;
then the real lab dockerd reached through a real lab sshd.
"""

from __future__ import annotations

import struct
import time
import uuid

import pytest
from conftest import connect

from remote_ops.engine import Engine, RunSpec, labels, open_engine
from remote_ops.engine.docker import DockerEngine
from remote_ops.engine.spec import PortBinding, create_request
from remote_ops.engine.types import api_time, demux, parse_container, parse_logs, unix_time
from remote_ops.errors import CommandFailed, CommandTimedOut, ExitCode, NotFound, Unreachable


# -- pure ----------------------------------------------------------------------------------------
def test_create_request_mirrors_docker_run_flags():
    spec = RunSpec(
        "c",
        "img:1",
        ("serve", "--port", "8000"),
        env={"B": "2", "A": "1"},
        gpus="all",
        shm_size="1g",
        ipc="host",
        restart="on-failure:3",
        volumes=("/m:/m:ro",),
        ports=(PortBinding("127.0.0.1", 8000, 8000),),
        runtime="nvidia",
    ).labelled()
    body = create_request(spec, "1.41")
    hc = body["HostConfig"]
    assert body["Image"] == "img:1" and body["Cmd"] == ["serve", "--port", "8000"]
    assert body["Env"] == ["A=1", "B=2"] and body["ExposedPorts"] == {"8000/tcp": {}}
    assert hc["Init"] is True and hc["ShmSize"] == 2**30 and hc["IpcMode"] == "host"
    assert hc["RestartPolicy"] == {"Name": "on-failure", "MaximumRetryCount": 3}
    assert hc["DeviceRequests"][0]["Count"] == -1 and hc["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
    assert hc["PortBindings"] == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "8000"}]}
    assert hc["Binds"] == ["/m:/m:ro"] and hc["Runtime"] == "nvidia"
    assert body["Labels"][labels.RUN_CONFIG] == spec.config_hash()


def test_run_config_hash_tracks_settings_not_its_own_label():
    spec = RunSpec("c", "img", ("a",))
    assert spec.labelled().config_hash() == spec.config_hash()
    assert RunSpec("c", "img", ("b",)).config_hash() != spec.config_hash()
    assert RunSpec("c", "img", ("a",), gpus=(0, 1)).config_hash() != spec.config_hash()


def _frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(payload)) + payload


def test_demux_and_log_lines():
    body = _frame(1, b"2026-12-01T04:00:00.000000001Z one\n2026-12-01T04:00:00.5Z two\n") + _frame(
        2, b"2026-12-01T04:00:01Z oops\n"
    )
    lines = parse_logs(body)
    assert [(x.stream, x.text) for x in lines] == [("stdout", "one"), ("stdout", "two"), ("stderr", "oops")]
    assert lines[1].unix_time - lines[0].unix_time == pytest.approx(0.5, abs=1e-5)
    assert demux(b"raw tty output\n") == [("stdout", b"raw tty output\n")]
    assert demux(b"") == []


def test_api_time_and_unix_time():
    assert api_time(1.5) == "1.500000000" and api_time(1796098045) == "1796098045.000000000"
    assert unix_time("1970-01-01T00:00:02.25Z") == 2.25 and unix_time("") == 0.0


def test_parse_container_state_health_init():
    doc = {
        "Id": "abc",
        "Name": "/ctr",
        "Image": "sha256:1",
        "RestartCount": 2,
        "HostConfig": {"Init": True},
        "Config": {"Image": "img:1", "Labels": {labels.RUN_CONFIG: "h"}},
        "State": {
            "Status": "running",
            "OOMKilled": False,
            "ExitCode": 0,
            "StartedAt": "t",
            "Health": {"Status": "unhealthy", "FailingStreak": 3, "Log": [{"Output": " 503\n"}]},
        },
    }
    c = parse_container(doc)
    assert (c.name, c.running, c.health, c.restart_count, c.init) == ("ctr", True, "unhealthy", 2, True)
    assert c.health_failing_streak == 3 and c.health_last_output == "503"
    assert c.labels[labels.RUN_CONFIG] == "h"


# -- against the lab dockerd, through the lab sshd -----------------------------------------------
@pytest.fixture
def engine(remote):
    e = open_engine(remote, timeout=30)
    yield e
    e.close()


@pytest.fixture
def name(dockerd):
    """A unique container name, removed after the test."""
    n = f"ro-engine-test-{uuid.uuid4().hex[:8]}"
    yield n
    dockerd.docker("rm", "-f", n, check=False)


@pytest.fixture(scope="module")
def labelled_image(dockerd, busybox_image):
    """busybox with a remote-ops label, built in the lab dockerd (no registry: --pull=false)."""
    tag = f"remote-ops/engine-test:{uuid.uuid4().hex[:8]}"
    dockerfile = f"FROM {busybox_image}\nLABEL {labels.PATCH_HASH}=abc123\n".encode()
    dockerd.docker("build", "--pull=false", "-q", "-t", tag, "-", input=dockerfile, timeout=120)
    yield tag
    dockerd.docker("rmi", "-f", tag, check=False)


def _cli(remote, *args: str) -> str:
    return remote.run(["docker", *args], timeout=30).stdout.strip()


def test_version_matches_the_daemon_the_cli_on_the_host_uses(engine, remote):
    """The dial process honours the host's DOCKER_HOST: same daemon as `docker` there."""
    assert isinstance(engine, Engine)
    v = engine.version()
    assert v.engine == "docker" and v.server == _cli(remote, "version", "--format", "{{.Server.Version}}")
    assert v.api == _cli(remote, "version", "--format", "{{.Server.APIVersion}}") == v.negotiated_api
    info = engine.info()
    assert "runc" in info.runtimes and abs(info.system_time - time.time()) < 60


def test_image_inspect_labels(engine, remote, labelled_image):
    img = engine.image(labelled_image)
    assert img is not None and labelled_image in img.tags
    assert img.id == _cli(remote, "image", "inspect", "-f", "{{.Id}}", labelled_image)
    assert img.labels[labels.PATCH_HASH] == "abc123" and img.label("patch.hash") == "abc123"
    assert engine.image("remote-ops/never-built:nope") is None


def test_create_start_stop_remove_with_init(engine, remote, busybox_image, name):
    t0 = engine.info().system_time
    spec = RunSpec(
        name, busybox_image, ("sh", "-c", "echo ready; exec sleep 600"), init=True, labels={labels.MANAGED: "1"}
    ).labelled()
    info = engine.run(spec)
    assert info.running and info.init and info.name == name and info.image_ref == busybox_image
    assert info.labels[labels.RUN_CONFIG] == spec.config_hash()
    assert _cli(remote, "exec", name, "cat", "/proc/1/comm") == "docker-init"  # --init: tini is PID 1
    engine.stop(name, grace_s=5)
    stopped = engine.container(name)
    assert stopped.status == "exited" and not stopped.running
    engine.start(name)
    engine.restart(name, grace_s=5)
    assert engine.container(name).running and _cli(remote, "inspect", "-f", "{{.State.Running}}", name) == "true"
    assert engine.remove(name) is True and engine.container(name) is None and engine.remove(name) is False
    seen = [e.action for e in engine.events(since=t0, until=engine.info().system_time, filters={"container": [name]})]
    assert {"create", "start", "die", "destroy"} <= set(seen) and seen[0] == "create"


def test_logs_since_and_tail(engine, busybox_image, name):
    script = "for i in 1 2 3 4 5 6; do echo line$i; sleep 0.3; done; echo done >&2; exec sleep 600"
    engine.run(RunSpec(name, busybox_image, ("sh", "-c", script)))
    deadline = time.monotonic() + 30
    while not any(x.text == "done" for x in engine.logs(name)):
        assert time.monotonic() < deadline, "container never logged 'done'"
        time.sleep(0.2)
    lines = engine.logs(name)
    assert [x.text for x in lines] == [f"line{i}" for i in range(1, 7)] + ["done"]
    assert lines[-1].stream == "stderr" and all(x.stream == "stdout" for x in lines[:-1])
    since = (lines[2].unix_time + lines[3].unix_time) / 2  # between line3 and line4
    assert [x.text for x in engine.logs(name, since=since)] == ["line4", "line5", "line6", "done"]
    assert [x.text for x in engine.logs(name, tail=2)] == ["line6", "done"]
    with pytest.raises(NotFound):
        engine.logs("ro-engine-no-such-container")


def test_missing_image_is_not_found_and_never_pulled(engine, name):
    t0 = engine.info().system_time
    with pytest.raises(NotFound) as err:
        engine.create(RunSpec(name, "remote-ops/never-built:nope"))
    assert err.value.exit_code == ExitCode.NOT_FOUND and "never pulled" in err.value.hint
    assert not [p for p in engine.adapter.paths if "/images/create" in p or "pull" in p]
    assert engine.container(name) is None
    pulls = [
        e
        for e in engine.events(since=t0, until=engine.info().system_time, filters={"type": ["image"]})
        if e.action == "pull"
    ]
    assert pulls == []


@pytest.mark.serial  # counts `docker system dial-stdio` machine-wide: another worker's engine test adds one
def test_many_calls_share_one_channel(engine, remote, busybox_image):
    before = remote.round_trips
    for _ in range(40):
        assert engine.image(busybox_image) is not None
        assert engine.container("ro-engine-no-such-container") is None
    assert engine.adapter.channels_opened == 1
    assert engine.adapter.requests == 81  # /version once, then 80
    assert remote.round_trips - before == 1  # one SSH exec for all of them
    assert _dial_processes(remote) == 1
    engine.close()  # the dial process exits with its channel
    deadline = time.monotonic() + 20
    while _dial_processes(remote):
        assert time.monotonic() < deadline, "docker system dial-stdio outlived its channel"
        time.sleep(0.2)


def _dial_processes(remote) -> int:
    out = remote.run("pgrep -fc '[d]ocker system dial-stdio'", check=False, timeout=30).stdout.strip()
    return int(out or 0)


def test_dial_failure_is_a_typed_error_with_the_daemons_complaint(remote):
    class NoDaemon(DockerEngine):
        dial = ("sh", "-c", "DOCKER_HOST=unix:///nonexistent/docker.sock exec docker system dial-stdio")

    e = NoDaemon(remote, timeout=20)
    with pytest.raises(CommandFailed) as err:
        e.version()
    assert err.value.exit_code == ExitCode.COMMAND_FAILED and "nonexistent" in err.value.stderr_tail
    e.close()


def test_frozen_host_times_out_then_a_new_channel_serves(lab, faults, spare_host):
    r = connect(lab, spare_host.name)
    e = DockerEngine(r, timeout=2)
    e.version()
    faults.freeze(spare_host)
    t = time.monotonic()
    with pytest.raises(CommandTimedOut) as err:
        e.container("ro-engine-no-such-container")
    took = time.monotonic() - t
    assert err.value.exit_code == ExitCode.TIMEOUT and 1.5 <= took < 30
    faults.thaw(spare_host)
    assert e.container("ro-engine-no-such-container", timeout=20) is None
    assert e.adapter.channels_opened == 2  # the timed-out one was dropped
    e.close()
    r.close()


def test_run_spec_for_host_creates_what_run_argv_creates(engine, remote, lab, host, busybox_image, dockerd):
    """`spec.for_host` and today's `container.run_argv` give the daemon the same container."""
    from remote_ops.engine.spec import for_host
    from remote_ops.workflows import container

    spec = lab.spec(host.name)
    cli_name, api_name = f"ro-engine-cli-{uuid.uuid4().hex[:6]}", f"ro-engine-api-{uuid.uuid4().hex[:6]}"
    argv = container.run_argv(
        spec.model_copy(update={"container": spec.container.model_copy(update={"name": cli_name})}), busybox_image
    )
    assert argv[:3] == ["docker", "run", "-d"]
    try:
        remote.run(["docker", "create", *argv[3:]], timeout=60)
        run_spec = for_host(spec, busybox_image)
        engine.create(RunSpec(**{**run_spec.__dict__, "name": api_name}))
        cli, api = (_created(remote, n) for n in (cli_name, api_name))
        assert {k: v for k, v in cli["host"].items() if v != api["host"][k]} == {}
        assert cli == api
    finally:
        dockerd.docker("rm", "-f", cli_name, api_name, check=False)


def _created(remote, name: str) -> dict:
    """The settings of a created container that both paths must agree on."""
    import json

    doc = json.loads(remote.run(["docker", "inspect", name], timeout=30).stdout)[0]
    hc, cfg = doc["HostConfig"], doc["Config"]
    keys = (
        "Binds",
        "PortBindings",
        "RestartPolicy",
        "Init",
        "ShmSize",
        "IpcMode",
        "DeviceRequests",
        "Runtime",
        "NetworkMode",
    )
    host = {k: hc.get(k) for k in keys}
    host["Binds"] = sorted(host["Binds"] or [])  # the CLI collects -v in a map: any order
    return {
        "host": host,
        "env": sorted(cfg["Env"]),
        "cmd": cfg["Cmd"],
        "image": cfg["Image"],
        "entrypoint": cfg["Entrypoint"],
        "labels": {k: v for k, v in cfg["Labels"].items() if k != labels.RUN_CONFIG},
    }


def test_shell_probe_sections_read_back_as_the_api_answers(engine, remote, busybox_image, name):
    """The one-round-trip form (sections in a caller's shell probe) gives the API's records."""
    from remote_ops.core import shell

    engine.run(RunSpec(name, busybox_image, ("sh", "-c", "exec sleep 600")))
    for image in (busybox_image, None):  # known ref, or the container's own
        sections = engine.cli.probe_sections(name, image, runtimes=True)
        out = remote.run(shell.parallel_sections(sections), check=False, timeout=30).stdout
        snap = engine.cli.parse_probe(shell.split_sections(out))
        assert snap.error is None and snap.client_version and snap.runtimes == engine.info().runtimes
        assert snap.version.server == engine.version().server and snap.version.api == engine.version().api
        assert snap.container == engine.container(name) and snap.image == engine.image(busybox_image)
    out = remote.run(
        shell.sections(engine.cli.probe_sections("ro-engine-none", "remote-ops/none:x")), check=False, timeout=30
    ).stdout
    snap = engine.cli.parse_probe(shell.split_sections(out))
    assert snap.container is None and snap.image is None and snap.version is not None


def test_host_killed_is_unreachable(lab, faults, spare_host):
    r = connect(lab, spare_host.name)
    e = DockerEngine(r, timeout=20)
    e.version()
    faults.crash(spare_host)
    t = time.monotonic()
    with pytest.raises(Unreachable) as err:
        e.container("ro-engine-no-such-container")
    assert err.value.exit_code == ExitCode.UNREACHABLE and time.monotonic() - t < 30
    e.close()
    r.close()


def test_probe_over_the_engine_socket_reads_the_same_records_as_the_cli(engine, remote, busybox_image, name):
    """The hot probes ask the Engine API over its socket with curl (`api=True`); with a docker
    context selected (or no curl, no unix socket) the same sections fall back to the CLI.
    Both read back as the same records, absent objects included; the id/pid one-liners agree."""
    from remote_ops.core import shell
    from remote_ops.engine import cli_for

    probe = cli_for("docker")
    engine.run(RunSpec(name, busybox_image, ("sh", "-c", "exec sleep 600")))
    want = engine.container(name)
    for image in (busybox_image, None):
        snaps = []
        for prefix in ("", "DOCKER_CONTEXT=default; export DOCKER_CONTEXT; "):
            sections = [(n, prefix + c) for n, c in probe.probe_sections(name, image, api=True)]
            out = remote.run(shell.parallel_sections(sections), check=False, timeout=30).stdout
            snaps.append(probe.parse_probe(shell.split_sections(out)))
        api, cli = snaps
        assert api.container == cli.container == want and api.image == cli.image == engine.image(busybox_image)
        assert api.version.server == cli.version.server == engine.version().server and api.error is None
        assert api.client_version is None and cli.client_version, "the socket form has no client version"
    for api in (True, False):
        cid = remote.run(probe.container_id_command(name, api=api), timeout=30).stdout.strip()
        pid = remote.run(probe.container_pid_command(name, api=api), timeout=30).stdout.strip()
        assert cid == want.id and int(pid) > 0, (api, cid, pid)
    absent = probe.probe_sections("ro-engine-none", "remote-ops/none:x", api=True)
    snap = probe.parse_probe(shell.split_sections(remote.run(shell.sections(absent), check=False, timeout=30).stdout))
    assert snap.container is None and snap.image is None and snap.version is not None
    gone = remote.run(probe.container_pid_command("ro-engine-none", api=True), check=False, timeout=30).stdout
    assert gone.strip() == ""
