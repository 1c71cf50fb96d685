"""Docker on the host, over SSH: argv builders and JSON parsers (pure) + thin runners.

pyinfra-style: every docker operation is a pure function returning an argv
(or a shell string from `remote_ops.shell`), and every answer is read from
docker's JSON output (`docker inspect`, `docker version --format '{{json .}}'`),
never from human-formatted tables.  The few functions at the bottom take a
`Remote` and run them.

Why the docker CLI on the host and not the Engine API over ssh://: the CLI on
the host has BuildKit (the Python SDK builds with the legacy builder only),
and the CLI runs over our one strict SSH connection (the SDK's ssh:// mode
reads only ~/.ssh/known_hosts and ~/.ssh/config).

Safety: images we built are never pulled: `--pull=never` on run, and
`--pull=false` on build.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from . import secrets, shell
from .errors import CommandFailed, NotFound, RemoteOpsError
from .inventory import HostSpec
from .remote import LineSink, Remote

LABEL_PREFIX = "org.remote-ops."
#: Container label: hash of the `docker run` argv, so a changed setting means a restart.
RUN_CONFIG_LABEL = LABEL_PREFIX + "run-config"
#: Image label: hash of everything that went into the build context.
CONTEXT_LABEL = LABEL_PREFIX + "context-hash"
TOOL_DIR = "/opt/remote-ops"


# -- data ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageInfo:
    """What `docker image inspect` says about one image."""

    id: str
    tags: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    created: str = ""
    size: int | None = None

    def label(self, name: str) -> str | None:
        return self.labels.get(LABEL_PREFIX + name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ContainerInfo:
    """What `docker container inspect` says about one container."""

    id: str
    name: str
    image_id: str
    image_ref: str
    status: str                 # created | running | restarting | exited | paused | dead
    health: str | None          # starting | healthy | unhealthy | None (no healthcheck)
    restart_count: int = 0
    oom_killed: bool = False
    exit_code: int | None = None
    started_at: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.status == "running"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "running": self.running}


@dataclass(frozen=True)
class PatchInImage:
    """Result of the anchor verification run with the image's (or container's) python3."""

    where: str                  # "image <id>" or "container <name>"
    ok: bool
    file: str | None = None
    sha256: str | None = None
    expected_sha256: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- parsers (pure) -----------------------------------------------------------------------------
def _json_array(text: str) -> list[dict]:
    """The JSON array `docker inspect` prints ([] when the output is not JSON)."""
    start = text.find("[")
    try:
        data = json.loads(text[start:]) if start >= 0 else []
    except json.JSONDecodeError:
        return []
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def parse_image_inspect(status: int, text: str) -> ImageInfo | None:
    """`docker image inspect REF` -> ImageInfo, or None when the image does not exist."""
    items = _json_array(text) if status == 0 else []
    if not items:
        return None
    d = items[0]
    config = d.get("Config") or {}
    return ImageInfo(id=d.get("Id", ""), tags=tuple(d.get("RepoTags") or ()),
                     labels=dict(config.get("Labels") or {}), created=d.get("Created", ""),
                     size=d.get("Size"))


def parse_container_inspect(status: int, text: str) -> ContainerInfo | None:
    """`docker container inspect NAME` -> ContainerInfo, or None when there is no such container."""
    items = _json_array(text) if status == 0 else []
    if not items:
        return None
    d = items[0]
    state = d.get("State") or {}
    config = d.get("Config") or {}
    health = (state.get("Health") or {}).get("Status")
    return ContainerInfo(id=d.get("Id", ""), name=(d.get("Name") or "").lstrip("/"),
                         image_id=d.get("Image", ""), image_ref=config.get("Image", ""),
                         status=state.get("Status", "unknown"), health=health,
                         restart_count=int(d.get("RestartCount") or 0),
                         oom_killed=bool(state.get("OOMKilled")), exit_code=state.get("ExitCode"),
                         started_at=state.get("StartedAt", ""), labels=dict(config.get("Labels") or {}))


def parse_docker_version(text: str) -> dict[str, Any]:
    """`docker version --format '{{json .}}'` -> the decoded document ({} if not JSON)."""
    line = next((l for l in text.splitlines() if l.startswith("{")), "")
    try:
        return json.loads(line) if line else {}
    except json.JSONDecodeError:
        return {}


def client_major(version_doc: dict[str, Any]) -> int | None:
    """Major version of the docker CLI from a `docker version` JSON document."""
    version = ((version_doc.get("Client") or {}).get("Version") or "").split(".")[0]
    return int(version) if version.isdigit() else None


def choose_builder(buildx_status: int, version_doc: dict[str, Any]) -> str:
    """'buildkit' when the host's CLI can use it, else 'legacy'.

    Docker >= 23 needs the buildx plugin for BuildKit; 20.10-22.x CLIs have it built in.
    """
    if buildx_status == 0:
        return "buildkit"
    major = client_major(version_doc)
    return "buildkit" if major is not None and major < 23 else "legacy"


def parse_patch_verification(where: str, status: int, text: str, expected_sha256: str | None) -> PatchInImage:
    """Read verify_patch.py's one JSON line; a non-JSON answer is a failed verification."""
    line = next((l for l in reversed(text.splitlines()) if l.startswith("{")), "")
    try:
        doc = json.loads(line) if line else None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        reason = (text.strip().splitlines() or [f"exit status {status}"])[-1]
        return PatchInImage(where, False, expected_sha256=expected_sha256, reason=reason)
    return PatchInImage(where, bool(doc.get("ok")) and status == 0, file=doc.get("file"),
                        sha256=doc.get("sha256"), expected_sha256=expected_sha256,
                        detail=doc.get("verify") or {}, reason=doc.get("reason", ""))


# -- command builders (pure) --------------------------------------------------------------------
def image_ref(host: HostSpec, tag: str) -> str:
    return f"{host.container.image}:{tag}"


def image_inspect_cmd(ref: str) -> list[str]:
    return ["docker", "image", "inspect", ref]


def container_inspect_cmd(name: str) -> list[str]:
    return ["docker", "container", "inspect", name]


def version_cmd() -> str:
    return "docker version --format '{{json .}}'"


def buildx_cmd() -> str:
    return "docker buildx version >/dev/null 2>&1"


def build_cmd(context_dir: str, tag: str, builder: str, iidfile: str) -> str:
    """`docker build` of `context_dir` on the host; never pulls; writes the image id to `iidfile`."""
    argv = ["docker", "build", "--pull=false", "-t", tag, "--iidfile", iidfile]
    if builder == "buildkit":
        argv += ["--progress=plain"]
    env = "DOCKER_BUILDKIT=1" if builder == "buildkit" else "DOCKER_BUILDKIT=0"
    return f"{env} {shell.join(argv + [context_dir])}"


def dump_env(host: HostSpec) -> dict[str, str]:
    """The dumper's SGLANG_HS_DUMP_* settings from the inventory (dump contract)."""
    d = host.dump
    env = {"SGLANG_HS_DUMP_DIR": d.dir, "SGLANG_HS_DUMP_POLICY": d.policy,
           "SGLANG_HS_DUMP_BUFFERS": str(d.pinned_buffers), "SGLANG_HS_DUMP_WRITERS": str(d.writer_threads)}
    if d.layers:
        env["SGLANG_HS_DUMP_LAYERS"] = ",".join(str(i) for i in d.layers)
    if d.all_ranks:
        env["SGLANG_HS_DUMP_ALL_RANKS"] = "1"
    return env


def server_args(host: HostSpec) -> list[str]:
    """SGLang launch arguments from the inventory (extraction: radix cache off, big chunks)."""
    s, m = host.server, host.model
    args = ["--model-path", m.path, "--served-model-name", m.served_name, "--tp", str(s.tp),
            "--chunked-prefill-size", str(s.chunked_prefill_size), "--port", str(s.port),
            "--host", "0.0.0.0"]
    args += ["--disable-radix-cache"] if s.disable_radix_cache else []
    args += ["--trust-remote-code"] if m.trust_remote_code else []
    args += ["--mem-fraction-static", str(s.mem_fraction_static)] if s.mem_fraction_static else []
    return args + list(s.extra_args)


def gpu_args(host: HostSpec) -> list[str]:
    """`--gpus all`, `--gpus "device=0,1"` (docker parses the value as CSV), or nothing."""
    gpus = host.container.gpus
    if gpus == "none":
        return []
    if gpus == "all":
        return ["--gpus", "all"]
    return ["--gpus", '"device=' + ",".join(str(g) for g in gpus) + '"']


def volume_args(host: HostSpec) -> list[str]:
    """Model (read-only), dump dir and logs dir at the same paths inside, plus extras."""
    pairs = [f"{host.model.path}:{host.model.path}:ro", f"{host.dump.dir}:{host.dump.dir}",
             f"{host.logs.dir}:{host.logs.dir}", *host.container.volumes]
    return [a for v in pairs for a in ("-v", v)]


def run_argv(host: HostSpec, image: str) -> list[str]:
    """The full `docker run` argv; its hash becomes the run-config label."""
    c = host.container
    argv = ["docker", "run", "-d", "--pull=never", "--init", "--name", c.name, "--restart", c.restart,
            *gpu_args(host), "--shm-size", c.shm_size, "--ipc", c.ipc,
            "-p", f"{c.bind_address}:{host.server.port}:{host.server.port}", *volume_args(host)]
    argv += ["--runtime", c.runtime] if c.runtime else []
    env = {**dump_env(host), "SGLANG_PORT": str(host.server.port), **c.env}
    argv += [a for k, v in sorted(env.items()) for a in ("-e", f"{k}={v}")]
    argv += ["--label", f"{LABEL_PREFIX}managed=1", "--label", f"{LABEL_PREFIX}host={host.name}"]
    config = run_config_hash(argv, image, host)
    return argv + ["--label", f"{RUN_CONFIG_LABEL}={config}", image, *host.server.launcher, *server_args(host)]


def run_config_hash(argv: list[str], image: str, host: HostSpec) -> str:
    """Hash of the run settings (not the image id: that is compared separately)."""
    doc = json.dumps([argv, image, host.server.launcher, server_args(host)])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def expected_run_config(host: HostSpec, image: str) -> str:
    """The run-config label value `run_argv` would set now."""
    argv = run_argv(host, image)
    label = next(a for a in argv if a.startswith(RUN_CONFIG_LABEL + "="))
    return label.split("=", 1)[1]


def remove_cmd(name: str) -> str:
    """Remove the container if it exists (stopped first); succeeds when it is absent."""
    return f"{shell.join(['docker', 'rm', '-f', name])} >/dev/null 2>&1 || true"


def stop_cmd(name: str, grace_s: int = 30) -> list[str]:
    return ["docker", "stop", "-t", str(grace_s), name]


def start_cmd(name: str) -> list[str]:
    return ["docker", "start", name]


def verify_patch_args(expected_sha256: str | None) -> list[str]:
    args = ["python3", f"{TOOL_DIR}/verify_patch.py"]
    return args + (["--expect-sha256", expected_sha256] if expected_sha256 else [])


def verify_in_image_cmd(image: str, expected_sha256: str | None) -> list[str]:
    """Run the verifier with the image's python3 in a throwaway container (no network, no pull)."""
    return ["docker", "run", "--rm", "--pull=never", "--network", "none", "--entrypoint", "python3",
            image, *verify_patch_args(expected_sha256)[1:]]


def verify_in_container_cmd(name: str, expected_sha256: str | None) -> list[str]:
    return ["docker", "exec", name, *verify_patch_args(expected_sha256)]


# -- runners (over a Remote) --------------------------------------------------------------------
def inspect_image(remote: Remote, ref: str) -> ImageInfo | None:
    r = remote.run(image_inspect_cmd(ref), check=False, timeout=30)
    return parse_image_inspect(r.exit_status, r.stdout)


def inspect_container(remote: Remote, name: str) -> ContainerInfo | None:
    r = remote.run(container_inspect_cmd(name), check=False, timeout=30)
    return parse_container_inspect(r.exit_status, r.stdout)


def detect_builder(remote: Remote) -> str:
    """One round trip: buildx presence + CLI version -> 'buildkit' | 'legacy'."""
    out = remote.run(shell.sections([("buildx", buildx_cmd()), ("version", version_cmd())]),
                     check=False, timeout=30).stdout
    sec = shell.split_sections(out)
    return choose_builder(sec.get("buildx", (1, ""))[0], parse_docker_version(sec.get("version", (1, ""))[1]))


def build(remote: Remote, context_dir: str, tag: str, builder: str, *, on_line: LineSink | None = None,
          timeout: float = 3600) -> str:
    """Build on the host, streaming output; return the new image id."""
    iidfile = f"{context_dir}/.image-id"
    remote.run(build_cmd(context_dir, tag, builder, iidfile), timeout=timeout, on_line=on_line)
    return remote.run(["cat", iidfile], timeout=30).stdout.strip()


def run(remote: Remote, host: HostSpec, image: str) -> str:
    """Replace the container with a fresh one from `image`; return the new container id."""
    remote.run(remove_cmd(host.container.name), timeout=120)
    return _run_masked(remote, run_argv(host, image), timeout=120).stdout.strip()


def _run_masked(remote: Remote, command: str | list[str], timeout: float):
    """Run a command that may carry secret values (`docker run -e HF_TOKEN=…`); an error
    raised by it shows the command with those values masked (`remote_ops.secrets`)."""
    try:
        return remote.run(command, timeout=timeout)
    except RemoteOpsError as exc:
        if isinstance(command, list) and getattr(exc, "command", None):
            exc.command = shell.join(secrets.mask_argv(command))
        raise secrets.mask_error(exc)


def lifecycle_plan(action: str, host: HostSpec, info: ContainerInfo | None, image: str | None,
                   grace_s: int = 30) -> list[str | list[str]]:
    """The commands `start`/`stop`/`restart` need from the container's current state (pure).

    An empty plan is a no-op (start of a running container, stop of a stopped
    one), so re-runs change nothing; `--dry-run` prints the plan instead.
    """
    name = host.container.name
    if action == "start" and info is None:
        if not image:
            raise NotFound(f"no container {name} and no image to run", host=host.name,
                           hint="run `remote-ops deploy` first")
        return [remove_cmd(name), run_argv(host, image)]
    if info is None:
        raise NotFound(f"container {name} does not exist", host=host.name, hint="run `remote-ops deploy` first")
    if action == "start":
        return [] if info.running else [start_cmd(name)]
    if action == "stop":
        return [stop_cmd(name, grace_s)] if info.running else []
    return [["docker", "restart", "-t", str(grace_s), name]]


def lifecycle(remote: Remote, host: HostSpec, action: str, *, image: str | None = None, grace_s: int = 30,
              dry_run: bool = False) -> tuple[list[str], ContainerInfo | None, ContainerInfo | None]:
    """Check -> act -> verify for start/stop/restart: (commands, state before, state after)."""
    before = inspect_container(remote, host.container.name)
    plan = lifecycle_plan(action, host, before, image, grace_s)
    shown = [secrets.mask_text(c) if isinstance(c, str) else shell.join(secrets.mask_argv(c)) for c in plan]
    if dry_run:
        return shown, before, before
    for command in plan:
        _run_masked(remote, command, timeout=grace_s + 120)
    return shown, before, _must_inspect(remote, host)


def start(remote: Remote, host: HostSpec, image: str | None) -> ContainerInfo:
    """Start the existing container, or run a new one from `image` when there is none."""
    return lifecycle(remote, host, "start", image=image)[2]


def stop(remote: Remote, host: HostSpec, grace_s: int = 30) -> ContainerInfo:
    """Stop the container (it keeps its configuration; `start` resumes it)."""
    return lifecycle(remote, host, "stop", grace_s=grace_s)[2]


def restart(remote: Remote, host: HostSpec, grace_s: int = 30) -> ContainerInfo:
    return lifecycle(remote, host, "restart", grace_s=grace_s)[2]


def status(remote: Remote, host: HostSpec) -> ContainerInfo | None:
    return inspect_container(remote, host.container.name)


def _must_inspect(remote: Remote, host: HostSpec) -> ContainerInfo:
    info = inspect_container(remote, host.container.name)
    if info is None:
        raise NotFound(f"container {host.container.name} does not exist", host=host.name,
                       hint="run `remote-ops deploy` first")
    return info


def verify_patch(remote: Remote, *, image: str | None = None, container_name: str | None = None,
                 expected_sha256: str | None = None) -> PatchInImage:
    """Run the anchor verification with the image's / container's own python3."""
    if image:
        where, argv = f"image {image}", verify_in_image_cmd(image, expected_sha256)
    else:
        where, argv = f"container {container_name}", verify_in_container_cmd(container_name, expected_sha256)
    r = remote.run(argv, check=False, timeout=120)
    return parse_patch_verification(where, r.exit_status, r.stdout + "\n" + r.stderr, expected_sha256)


def require_ok(result: PatchInImage, host: str) -> PatchInImage:
    """Raise VerifyFailed unless the in-image verification passed."""
    from .errors import VerifyFailed

    if not result.ok:
        raise VerifyFailed(f"verify: patch check failed in {result.where}: "
                           f"{result.reason or 'anchor verification failed'}", host=host,
                           details={"verification": result.to_dict()})
    return result


__all__ = ["ImageInfo", "ContainerInfo", "PatchInImage", "CommandFailed"]
