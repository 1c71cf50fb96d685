"""The SGLang server container on a host: lifecycle, image builds, in-image patch verification.

Everything engine-specific lives behind the engine seam (`remote_ops.engine`):
the run spec (`engine.spec.for_host`: settings, labels, run-config hash), the
records (`engine.types.ImageInfo` / `ContainerInfo`), the API calls
(`engine.container`, `remove`, `run`, `start`, `stop`, `restart`) and the
command lines of the host's engine kind with their parsers
(`engine.cli_for(host)`: inspect, builds, the in-image verifier, `--dry-run`
text).  This module decides (pure: `lifecycle_steps`, `lifecycle_plan`) and
drives those over one `Remote`.

Lifecycle (start/stop/restart) is check -> act -> verify over one engine
channel: three or more API requests for one SSH round trip.  A one-shot read
(`inspect_container`, `status`) is one shell round trip instead, which costs
the same and keeps the Docker SDK out of the process (its import is the
larger cost for a short command).

Safety: images we built are never pulled: the engine creates containers
with `POST /containers/create` (a missing image is NotFound), and builds and
throwaway containers never pull (`DockerCLI.build_cmd`, `throwaway_command`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core import secrets, shell
from ..core.inventory import HostSpec
from ..engine import DEFAULT_KIND, cli_for, labels
from ..engine.cli import TOOL_DIR
from ..engine.spec import dump_env, for_host, gpu_flags, server_args
from ..engine.types import ContainerInfo, ImageInfo
from ..errors import NotFound, RemoteOpsError
from ..probes.dumpdir import DumpDirState
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
def parse_image_inspect(status: int, text: str, kind: str = DEFAULT_KIND) -> ImageInfo | None:
    """An engine's `image inspect REF` -> ImageInfo, or None when the image does not exist."""
    return cli_for(kind).parse_inspect(status, text)[0]


def parse_container_inspect(status: int, text: str, kind: str = DEFAULT_KIND) -> ContainerInfo | None:
    """An engine's `container inspect NAME` -> ContainerInfo, or None when there is no such container."""
    return cli_for(kind).parse_inspect(status, text)[1]


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


def server_spec(host: HostSpec, image: str, dump_dir_id: str | None = None):
    """The host's server container: SGLang's (`engine.spec.for_host`), or its serving engine's
    (`remote_ops.serving`: vLLM's command line, no dumper variables); labelled with the dump
    dir's `device:inode` when `dump_dir_id` is known (`dump_dir_for_create`)."""
    from ..serving import serving_for

    if host.serving.engine != "sglang":
        return serving_for(host).run_spec(host, image, dump_dir_id)
    return for_host(host, image, dump_dir_id)


def run_argv(host: HostSpec, image: str, dump_dir_id: str | None = None) -> list[str]:
    """The `run` command line of the host's container in its engine's CLI (`server_spec`, as flags)."""
    return cli_for(host).run_argv(server_spec(host, image, dump_dir_id))


def expected_run_config(host: HostSpec, image: str) -> str:
    """The run-config label value the host's container gets now (`engine.spec.inventory_run_config`)."""
    return server_spec(host, image).labels[labels.RUN_CONFIG]


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
    """`lifecycle_steps` as the equivalent engine command lines (what `--dry-run` prints; pure)."""
    name, cli = host.container.name, cli_for(host)
    as_cli: dict[str, Callable[[], str | list[str]]] = {
        "remove": lambda: cli.remove_cmd(name),
        "run": lambda: run_argv(host, image or ""),
        "start": lambda: cli.start_cmd(name),
        "stop": lambda: cli.stop_cmd(name, grace_s),
        "restart": lambda: cli.restart_cmd(name, grace_s),
    }
    return [as_cli[step]() for step in lifecycle_steps(action, host, info, image)]


# -- over a Remote ------------------------------------------------------------------------------
@contextmanager
def engine_for(remote: Remote, engine: Any = None, kind: str = DEFAULT_KIND) -> Iterator[Any]:
    """`engine` if the caller has a warm one, else a new engine of `kind` on `remote`'s
    connection (closed after)."""
    if engine is not None:
        yield engine
        return
    from ..engine import open_engine

    fresh = open_engine(remote, kind)
    try:
        yield fresh
    finally:
        fresh.close()


def inspect_image(remote: Remote, ref: str, kind: str = DEFAULT_KIND) -> ImageInfo | None:
    """One shell round trip (no engine channel needed for a one-shot read)."""
    r = remote.run(cli_for(kind).inspect_argv("image", ref), check=False)
    return parse_image_inspect(r.exit_status, r.stdout, kind)


def inspect_container(remote: Remote, name: str, engine: Any = None, kind: str = DEFAULT_KIND) -> ContainerInfo | None:
    """The container's state: over `engine` when one is warm, else one shell round trip."""
    if engine is not None:
        return engine.container(name)
    r = remote.run(cli_for(kind).inspect_argv("container", name), check=False)
    return parse_container_inspect(r.exit_status, r.stdout, kind)


def detect_builder(remote: Remote, kind: str = DEFAULT_KIND) -> str:
    """The builder the host's engine CLI has (docker: one round trip, 'buildkit' | 'legacy')."""
    cli = cli_for(kind)
    asked = cli.builder_sections()
    out = remote.run(shell.sections(asked), check=False).stdout if asked else ""
    return cli.choose_builder(shell.split_sections(out))


def build(
    remote: Remote,
    context_dir: str,
    tag: str,
    builder: str,
    *,
    on_line: LineSink | None = None,
    timeout: float = 3600.0,
    kind: str = DEFAULT_KIND,
) -> str:
    """Build on the host with its engine's CLI, streaming output; return the new image id."""
    cli, iidfile = cli_for(kind), f"{context_dir}/.image-id"
    remote.run(cli.build_cmd(context_dir, tag, builder, iidfile), timeout=timeout, on_line=on_line)
    return cli.image_id(remote.run(["cat", iidfile]).stdout)


def dump_dir_for_create(remote: Remote, host: HostSpec, required: tuple[str, ...] = ()) -> str | None:
    """The host's dump dir as `device:inode` right before its container is created (one round
    trip; None: unknown), the value of the container's `labels.DUMP_DIR_ID`.

    A missing dump dir is made first (`mkdir -p`, as the SSH user), so that the label names the
    dir the container mounts; where the SSH user may not make it, the engine makes it at the
    start as before, and the container has no label.  `required` dirs are made first and must
    be made (`CommandFailed` otherwise)."""
    d = host.dump.dir
    make = shell.and_then(["mkdir", "-p", "--", *required]) + " && " if required else ""
    state = DumpDirState(d)
    r = remote.run(f"{make}{{ mkdir -p -- {shell.quote(d)} 2>/dev/null; {state.command()}; }}")
    return state.parse(r.exit_status, r.stdout).identity


def run(remote: Remote, host: HostSpec, image: str, *, engine: Any = None, dump_dir_id: str | None = None) -> str:
    """Replace the container with a fresh one from `image` (labelled with `dump_dir_id` when
    known); return the new container id."""
    with engine_for(remote, engine, host.engine) as e:
        return _act(e, host, "run", image, 30, command_deadline(remote), dump_dir_id) or ""


def _act(
    engine: Any,
    host: HostSpec,
    step: str,
    image: str | None,
    grace_s: int,
    timeout: float,
    dump_dir_id: str | None = None,
) -> str | None:
    """One lifecycle step as engine calls; secrets in an error are masked."""
    name = host.container.name
    try:
        if step in ("remove", "run"):
            engine.remove(name, timeout=timeout)
        if step == "run":
            return engine.run(server_spec(host, image or "", dump_dir_id), timeout=timeout).id
        if step in ("start", "stop", "restart"):
            call = getattr(engine, step)
            call(name, timeout=timeout) if step == "start" else call(name, grace_s=grace_s, timeout=timeout)
    except RemoteOpsError as exc:
        raise secrets.mask_error(exc) from None  # the cause carries unmasked secrets
    return None


def _run_masked(remote: Remote, command: str | list[str], timeout: float):
    """Run a command that may carry secret values (`run -e HF_TOKEN=…`); an error
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
    (the equivalent engine commands, state before, state after)."""
    with engine_for(remote, engine, host.engine) as e:
        before = e.container(host.container.name)
        plan = lifecycle_plan(action, host, before, image, grace_s)
        shown = [secrets.mask_text(c) if isinstance(c, str) else shell.join(secrets.mask_argv(c)) for c in plan]
        if dry_run:
            return shown, before, before
        steps = lifecycle_steps(action, host, before, image)
        dump_dir_id = dump_dir_for_create(remote, host) if "run" in steps else None
        for step in steps:
            _act(e, host, step, image, grace_s, command_deadline(remote), dump_dir_id)
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
    return inspect_container(remote, host.container.name, kind=host.engine)


def verify_patch(
    remote: Remote,
    *,
    image: str | None = None,
    container_name: str | None = None,
    expected_sha256: str | None = None,
    kind: str = DEFAULT_KIND,
) -> PatchInImage:
    """Run the anchor verification with the image's / container's own python3."""
    cli = cli_for(kind)
    argv: str | list[str]
    if image:
        where, argv = f"image {image}", cli.verify_in_image_cmd(image, expected_sha256)
    else:
        where, argv = f"container {container_name}", cli.verify_in_container_cmd(container_name or "", expected_sha256)
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
    "dump_env",
    "server_args",
    "lifecycle",
    "lifecycle_plan",
    "lifecycle_steps",
    "run",
    "run_argv",
    "expected_run_config",
]
