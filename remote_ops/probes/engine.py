"""The container engine's questions as probe units; the engine seam builds and reads them.

The commands and their parsing live behind the engine seam: the host's engine
kind's `cli` (`remote_ops.engine.cli_for(host)`: its socket with curl when it
can be used, its CLI otherwise) gives each unit exactly one section
(`probe_sections` with this unit's name) and reads that section back
(`parse_probe`) into the engine's typed records (`engine.probe.Snapshot`).
Beside them, the verdicts on what they found: the engine answers
(`check_engine`), the server container runs, and runs the image deploy built
(`check_container`, `check_image`).
"""

from __future__ import annotations

from dataclasses import replace

from ..core.inventory import HostSpec
from ..engine import cli_for, labels
from ..engine.probe import SectionNames, Snapshot
from ..engine.types import ContainerInfo, ImageInfo
from .base import Check, Probe

_NONE = SectionNames(version=None, objects=None, runtimes=None)


class _EngineSection(Probe[Snapshot]):
    """One section of the engine's probe, asked of and read by the host's engine kind."""

    section: str  # which of the engine's sections this unit is: version | objects | runtimes

    def __init__(self, host: HostSpec) -> None:
        self.cli = cli_for(host)

    def names(self) -> SectionNames:
        """The engine's section names with only this unit's asked."""
        return replace(_NONE, **{self.section: self.name})

    def parse(self, status: int, text: str) -> Snapshot:
        return self.cli.parse_probe({self.name: (status, text)}, self.names())


class EngineVersion(_EngineSection):
    """The engine's version (client and server; with `api`, the server's only, over its socket)."""

    name = "docker"
    section = "version"

    def __init__(self, host: HostSpec, api: bool = False) -> None:
        super().__init__(host)
        self.api = api

    def command(self) -> str:
        return self.cli.probe_sections(None, names=self.names(), api=self.api)[0][1]


class EngineObjects(_EngineSection):
    """The server container and its image in one inspect (`image` None: the container's own)."""

    name = "container"
    section = "objects"

    def __init__(self, host: HostSpec, image: str | None = None, api: bool = False) -> None:
        super().__init__(host)
        self.container, self.image, self.api = host.container.name, image, api

    def command(self) -> str:
        return self.cli.probe_sections(self.container, self.image, names=self.names(), api=self.api)[0][1]


class EngineRuntimes(_EngineSection):
    """The engine's OCI runtimes (`nvidia` when the NVIDIA container runtime is registered)."""

    name = "runtimes"
    section = "runtimes"

    def command(self) -> str:
        return self.cli.probe_sections(None, runtimes=True, names=self.names())[0][1]


class NvidiaToolkit(Probe[bool]):
    """The NVIDIA container toolkit's programs on the host's PATH (all three)."""

    name = "nvidia_ctk"

    def command(self) -> str:
        return "command -v nvidia-container-runtime nvidia-container-runtime-hook nvidia-ctk"

    def parse(self, status: int, text: str) -> bool:
        return status == 0 and bool(text.strip())


def engine_summary(snap: Snapshot) -> dict[str, str | None]:
    """The engine part of facts: {"client", "server", "api"} (+ "error" when the daemon did not answer)."""
    out = {
        "client": snap.client_version,
        "server": snap.version.server if snap.version else None,
        "api": snap.version.api if snap.version else None,
    }
    if snap.version is None:
        out["error"] = snap.error or f"{snap.engine} not available"
    return out


def check_engine(snap: Snapshot) -> Check:
    """The engine's daemon answered (named by its kind: `engine/docker`)."""
    if snap.version is not None:
        return Check(
            "engine", snap.engine, "ok", f"{snap.engine} engine {snap.version.server} (API {snap.version.api})"
        )
    return Check("engine", snap.engine, "fail", f"{snap.engine} engine not reachable: {snap.error}")


def check_container(
    host: HostSpec, c: ContainerInfo | None, image: ImageInfo | None, expected_image: str | None
) -> list[Check]:
    """The server container exists, runs, is healthy, was not restarted or OOM-killed, runs our image."""
    name = host.container.name
    if c is None:
        return [Check("container", "state", "fail", f"container {name} does not exist")]
    if not c.running:
        run = Check("container", "state", "fail", f"container {name} is {c.status} (exit code {c.exit_code})")
    elif c.health == "unhealthy":
        run = Check("container", "state", "fail", f"container {name} is running but unhealthy")
    elif c.health == "starting":
        run = Check("container", "state", "warn", f"container {name} is running, health check still starting")
    else:
        run = Check("container", "state", "ok", f"container {name} running" + (f", {c.health}" if c.health else ""))
    return [
        run,
        Check("container", "restarts", "warn" if c.restart_count else "ok", f"restart count {c.restart_count}"),
        Check("container", "oom", "fail" if c.oom_killed else "ok", "OOM-killed" if c.oom_killed else "not OOM-killed"),
        check_image(c, image, expected_image),
    ]


def check_image(c: ContainerInfo, image: ImageInfo | None, expected_image: str | None) -> Check:
    """The container runs the image deploy built: same ref, and that ref still points at it."""
    ref = c.image_ref
    if expected_image and ref != expected_image:
        return Check("container", "image", "fail", f"container runs {ref}, deployed image is {expected_image}")
    if image is None:
        return Check("container", "image", "warn", f"image {ref} is no longer present")
    if image.id != c.image_id:
        return Check("container", "image", "warn", f"{ref} was rebuilt since the container started; restart to use it")
    serving = image.labels.get(labels.LABEL_PREFIX + "serving")
    if serving and serving != "sglang" and labels.CONTEXT_HASH in image.labels:  # a vLLM image: no patch
        return Check("container", "image", "ok", f"running {ref} ({c.image_id[:19]}, a {serving} image)")
    if labels.PATCH_HASH not in image.labels:
        return Check("container", "image", "fail", f"image {ref} was not built by remote-ops (no patch labels)")
    return Check("container", "image", "ok", f"running {ref} ({c.image_id[:19]})")
