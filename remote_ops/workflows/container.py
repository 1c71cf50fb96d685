"""The SGLang server container on a host: lifecycle, image builds, in-image patch verification.

Everything docker-specific lives behind the engine seam (`remote_ops.engine`):
the run spec (`engine.spec.for_host`: settings, labels, run-config hash), the
records (`engine.types.ImageInfo` / `ContainerInfo`), the API calls
(`engine.container`, `remote`, `run`, `start`, `stop`, `restart`), the shell
probes (`engine.probe`) and the CLI command lines that remain
(`engine.cli`: BuildKit builds, the in-image verifier, `--dry-run` text).
This module decides (pure: `lifecycle_steps`, `choose_builder`, parsers) and
drives those over one `Remote`.

Lifecycle (start/stop/restart) is check -> act -> verify over one engine
channel: three or more API requests for one SSH round trip.  A one-shot read
(`inspect_container`, `status`) is one shell round trip instead, which costs
the same and keeps the Docker SDK out of the process (its import is the
larger cost for a short command).

Safety: images we built are never pulled: the engine creates containers
with `POST /containers/create` (a missing image is NotFound), and builds run
with `--pull=false`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core import secrets, shell
from ..core.inventory import HostSpec
from ..engine import labels, probe as engine_probe
from ..engine.cli import (
    TOOL_DIR,
    build_cmd,
    buildx_cmd,
    remove_cmd,
    restart_cmd,
    start_cmd,
    stop_cmd,
    verify_in_container_cmd,
    verify_in_image_cmd,
)
from ..engine.spec import cli_argv, dump_env, for_host, gpu_flags, server_args
from ..engine.types import ContainerInfo, ImageInfo
from ..errors import NotFound, RemoteOpsError
from ..remote import LineSink, Remote, command_deadline


@dataclass(frozen=True)
class PatchInImage:
    """Result of the anchor verification run with the image's (or container's) python3."""

    where: str  # "image <id>" or "container <name>"
    ok: bool
    file: str | None = None
    sha256: str | None = None
    expected_sha256: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- parsers (pure) -----------------------------------------------------------------------------
def parse_image_inspect(status: int, text: str) -> ImageInfo | None:
    """`docker image inspect REF` -> ImageInfo, or None when the image does not exist."""
    return engine_probe.parse_inspect(text)[0] if status == 0 else None


def parse_container_inspect(status: int, text: str) -> ContainerInfo | None:
    """`docker container inspect NAME` -> ContainerInfo, or None when there is no such container."""
    return engine_probe.parse_inspect(text)[1] if status == 0 else None


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
    line = next((x for x in reversed(text.splitlines()) if x.startswith("{")), "")
    try:
        doc = json.loads(line) if line else None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        reason = (text.strip().splitlines() or [f"exit status {status}"])[-1]
        return PatchInImage(where, False, expected_sha256=expected_sha256, reason=reason)
    return PatchInImage(
        where,
        bool(doc.get("ok")) and status == 0,
        file=doc.get("file"),
        sha256=doc.get("sha256"),
        expected_sha256=expected_sha256,
        detail=doc.get("verify") or {},
        reason=doc.get("reason", ""),
    )


# -- the host's server container (pure) ---------------------------------------------------------
def image_ref(host: HostSpec, tag: str) -> str:
    return f"{host.container.image}:{tag}"


def deploy_image(host: HostSpec, patch_hash: str) -> str:
    """The image deploy builds for `host`: `image:tag`, the tag `<sglang version>-<patch hash[:12]>`
    unless the inventory names one (the one definition: deploy builds it, health expects it)."""
    return image_ref(host, host.container.tag or f"{host.sglang.version}-{patch_hash[:12]}")


def gpu_args(host: HostSpec) -> list[str]:
    """`--gpus all`, `--gpus "device=0,1"` (docker parses the value as CSV), or nothing."""
    gpus = host.container.gpus
    return gpu_flags(gpus if isinstance(gpus, str) else tuple(gpus))


def run_argv(host: HostSpec, image: str) -> list[str]:
    """The `docker run` command line of the host's container (`engine.spec.for_host`, as flags)."""
    return cli_argv(for_host(host, image))


def expected_run_config(host: HostSpec, image: str) -> str:
    """The run-config label value the host's container gets now (`engine.spec.inventory_run_config`)."""
    return for_host(host, image).labels[labels.RUN_CONFIG]


def lifecycle_steps(action: str, host: HostSpec, info: ContainerInfo | None, image: str | None) -> list[str]:
    """What `start`/`stop`/`restart` must do from the container's current state (pure):
    a list of "remove" | "run" | "start" | "stop" | "restart".

    An empty list is a no-op (start of a running container, stop of a stopped
    one), so re-runs change nothing.
    """
    name = host.container.name
    if action == "start" and info is None:
        if not image:
            raise NotFound(
                f"no container {name} and no image to run", host=host.name, hint="run `remote-ops deploy` first"
            )
        return ["remove", "run"]
    if info is None:
        raise NotFound(f"container {name} does not exist", host=host.name, hint="run `remote-ops deploy` first")
    if action == "start":
        return [] if info.running else ["start"]
    if action == "stop":
        return ["stop"] if info.running else []
    return ["restart"]


def lifecycle_plan(
    action: str, host: HostSpec, info: ContainerInfo | None, image: str | None, grace_s: int = 30
) -> list[str | list[str]]:
    """`lifecycle_steps` as the equivalent docker command lines (what `--dry-run` prints; pure)."""
    name = host.container.name
    as_cli: dict[str, Callable[[], str | list[str]]] = {
        "remove": lambda: remove_cmd(name),
        "run": lambda: run_argv(host, image or ""),
        "start": lambda: start_cmd(name),
        "stop": lambda: stop_cmd(name, grace_s),
        "restart": lambda: restart_cmd(name, grace_s),
    }
    return [as_cli[step]() for step in lifecycle_steps(action, host, info, image)]


# -- over a Remote ------------------------------------------------------------------------------
@contextmanager
def engine_for(remote: Remote, engine: Any = None) -> Iterator[Any]:
    """`engine` if the caller has a warm one, else a new engine on `remote`'s connection (closed after)."""
    if engine is not None:
        yield engine
        return
    from ..engine import open_engine

    fresh = open_engine(remote)
    try:
        yield fresh
    finally:
        fresh.close()


def inspect_image(remote: Remote, ref: str) -> ImageInfo | None:
    """One shell round trip (no engine channel needed for a one-shot read)."""
    r = remote.run(engine_probe.inspect_argv("image", ref), check=False)
    return parse_image_inspect(r.exit_status, r.stdout)


def inspect_container(remote: Remote, name: str, engine: Any = None) -> ContainerInfo | None:
    """The container's state: over `engine` when one is warm, else one shell round trip."""
    if engine is not None:
        return engine.container(name)
    r = remote.run(engine_probe.inspect_argv("container", name), check=False)
    return parse_container_inspect(r.exit_status, r.stdout)


def detect_builder(remote: Remote) -> str:
    """One round trip: buildx presence + CLI version -> 'buildkit' | 'legacy'."""
    out = remote.run(
        shell.sections([("buildx", buildx_cmd()), ("version", engine_probe.version_command())]), check=False
    ).stdout
    sec = shell.split_sections(out)
    return choose_builder(
        sec.get("buildx", (1, ""))[0], engine_probe.parse_version_line(sec.get("version", (1, ""))[1])
    )


def build(
    remote: Remote,
    context_dir: str,
    tag: str,
    builder: str,
    *,
    on_line: LineSink | None = None,
    timeout: float = 3600.0,
) -> str:
    """Build on the host, streaming output; return the new image id."""
    iidfile = f"{context_dir}/.image-id"
    remote.run(build_cmd(context_dir, tag, builder, iidfile), timeout=timeout, on_line=on_line)
    return remote.run(["cat", iidfile]).stdout.strip()


def run(remote: Remote, host: HostSpec, image: str, *, engine: Any = None) -> str:
    """Replace the container with a fresh one from `image`; return the new container id."""
    with engine_for(remote, engine) as e:
        return _act(e, host, "run", image, 30, command_deadline(remote)) or ""


def _act(engine: Any, host: HostSpec, step: str, image: str | None, grace_s: int, timeout: float) -> str | None:
    """One lifecycle step as engine calls; secrets in an error are masked."""
    name = host.container.name
    try:
        if step in ("remove", "run"):
            engine.remove(name, timeout=timeout)
        if step == "run":
            return engine.run(for_host(host, image or ""), timeout=timeout).id
        if step in ("start", "stop", "restart"):
            call = getattr(engine, step)
            call(name, timeout=timeout) if step == "start" else call(name, grace_s=grace_s, timeout=timeout)
    except RemoteOpsError as exc:
        raise secrets.mask_error(exc) from None  # the cause carries unmasked secrets
    return None


def _run_masked(remote: Remote, command: str | list[str], timeout: float):
    """Run a command that may carry secret values (`docker run -e HF_TOKEN=…`); an error
    raised by it shows the command with those values masked (`remote_ops.core.secrets`)."""
    try:
        return remote.run(command, timeout=timeout)
    except RemoteOpsError as exc:
        if isinstance(command, list) and getattr(exc, "command", None):
            setattr(exc, "command", shell.join(secrets.mask_argv(command)))  # noqa: B010  (not every error has it)
        raise secrets.mask_error(exc) from None  # the cause carries unmasked secrets


def lifecycle(
    remote: Remote,
    host: HostSpec,
    action: str,
    *,
    image: str | None = None,
    grace_s: int = 30,
    dry_run: bool = False,
    engine: Any = None,
) -> tuple[list[str], ContainerInfo | None, ContainerInfo | None]:
    """Check -> act -> verify for start/stop/restart over one engine channel:
    (the equivalent docker commands, state before, state after)."""
    with engine_for(remote, engine) as e:
        before = e.container(host.container.name)
        plan = lifecycle_plan(action, host, before, image, grace_s)
        shown = [secrets.mask_text(c) if isinstance(c, str) else shell.join(secrets.mask_argv(c)) for c in plan]
        if dry_run:
            return shown, before, before
        for step in lifecycle_steps(action, host, before, image):
            _act(e, host, step, image, grace_s, command_deadline(remote))
        after = e.container(host.container.name)
    if after is None:
        raise NotFound(
            f"container {host.container.name} does not exist", host=host.name, hint="run `remote-ops deploy` first"
        )
    return shown, before, after


def _after(result: tuple[list[str], ContainerInfo | None, ContainerInfo | None]) -> ContainerInfo:
    """The state after a lifecycle that was not a dry run (it raised `NotFound` rather than give None)."""
    after = result[2]
    assert after is not None, "lifecycle raises NotFound when the container is gone"
    return after


def start(remote: Remote, host: HostSpec, image: str | None) -> ContainerInfo:
    """Start the existing container, or run a new one from `image` when there is none."""
    return _after(lifecycle(remote, host, "start", image=image))


def stop(remote: Remote, host: HostSpec, grace_s: int = 30) -> ContainerInfo:
    """Stop the container (it keeps its configuration; `start` resumes it)."""
    return _after(lifecycle(remote, host, "stop", grace_s=grace_s))


def restart(remote: Remote, host: HostSpec, grace_s: int = 30) -> ContainerInfo:
    return _after(lifecycle(remote, host, "restart", grace_s=grace_s))


def status(remote: Remote, host: HostSpec) -> ContainerInfo | None:
    return inspect_container(remote, host.container.name)


def verify_patch(
    remote: Remote, *, image: str | None = None, container_name: str | None = None, expected_sha256: str | None = None
) -> PatchInImage:
    """Run the anchor verification with the image's / container's own python3."""
    if image:
        where, argv = f"image {image}", verify_in_image_cmd(image, expected_sha256)
    else:
        where, argv = f"container {container_name}", verify_in_container_cmd(container_name or "", expected_sha256)
    r = remote.run(argv, check=False)
    return parse_patch_verification(where, r.exit_status, r.stdout + "\n" + r.stderr, expected_sha256)


def require_ok(result: PatchInImage, host: str) -> PatchInImage:
    """Raise VerifyFailed unless the in-image verification passed."""
    from ..errors import VerifyFailed

    if not result.ok:
        raise VerifyFailed(
            f"verify: patch check failed in {result.where}: {result.reason or 'anchor verification failed'}",
            host=host,
            details={"verification": result.to_dict()},
        )
    return result


__all__ = [
    "ImageInfo",
    "ContainerInfo",
    "PatchInImage",
    "TOOL_DIR",
    "build_cmd",
    "dump_env",
    "server_args",
    "lifecycle",
    "lifecycle_plan",
    "lifecycle_steps",
    "run",
    "run_argv",
    "expected_run_config",
]
