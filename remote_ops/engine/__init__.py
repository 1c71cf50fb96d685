"""The engine seam: the host's container engine behind one small interface.

`Engine` is what workflows (container, health, facts, deploy) need from a
container engine: version, image and container inspection, lifecycle, create
from a `RunSpec`, logs, events.  Every answer is a typed record
(`engine.types`), every failure a typed error from `remote_ops.errors`, every
call has a deadline.  `DockerEngine` (engine/docker.py) implements it with the
Docker SDK's `APIClient`, talking to the host's Engine API over the one strict
SSH connection (`docker system dial-stdio`, see engine/dialstdio.py).

Where one shell round trip is cheaper than the API channel (a no-op deploy,
health: they run a shell probe anyway), the same questions ride along in it:
`probe_sections` / `parse_probe` give the commands and read them back into the
same records.

Builds are not part of it: BuildKit exists only in the docker CLI (the SDK
builds with the legacy builder), so `docker build` stays a command over SSH.
docs/ENGINES.md says why, and how a second engine (podman) plugs in.

Usage::

    from remote_ops.engine import open_engine
    with open_engine(remote) as engine:
        ctr = engine.container("sglang-eagle3")
        img = engine.image(ctr.image_ref) if ctr else None
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .probe import Snapshot
from .spec import PortBinding, RunSpec
from .types import ContainerInfo, EngineEvent, EngineInfo, EngineVersion, ImageInfo, LogLine, Since


@runtime_checkable
class Engine(Protocol):
    """A container engine on one host.  `timeout` is each call's deadline in seconds."""

    kind: str

    def version(self, *, timeout: float | None = None) -> EngineVersion: ...

    def info(self, *, timeout: float | None = None) -> EngineInfo: ...

    def image(self, ref: str, *, timeout: float | None = None) -> ImageInfo | None: ...

    def container(self, name: str, *, timeout: float | None = None) -> ContainerInfo | None: ...

    def create(self, spec: RunSpec, *, timeout: float | None = None) -> str: ...

    def run(self, spec: RunSpec, *, timeout: float | None = None) -> ContainerInfo: ...

    def start(self, name: str, *, timeout: float | None = None) -> None: ...

    def stop(self, name: str, *, grace_s: int = 30, timeout: float | None = None) -> None: ...

    def restart(self, name: str, *, grace_s: int = 30, timeout: float | None = None) -> None: ...

    def remove(self, name: str, *, force: bool = True, timeout: float | None = None) -> bool: ...

    def logs(
        self,
        name: str,
        *,
        since: Since | None = None,
        until: Since | None = None,
        tail: int | None = None,
        timeout: float | None = None,
    ) -> list[LogLine]: ...

    def events(
        self, *, since: Since, until: Since, filters: dict[str, list[str]] | None = None, timeout: float | None = None
    ) -> list[EngineEvent]: ...

    def probe_sections(
        self, container: str, image: str | None = None, *, runtimes: bool = False
    ) -> list[tuple[str, str]]: ...

    def parse_probe(self, sections: dict[str, tuple[int, str]]) -> Snapshot: ...

    def close(self) -> None: ...


def open_engine(remote: Any, *, kind: str = "docker", timeout: float | None = None) -> Engine:
    """The engine of `remote`'s host, over `remote`'s connection (nothing is sent until first use)."""
    if kind != "docker":
        from ..errors import ConfigError

        raise ConfigError(f"unknown container engine {kind!r} (known: docker)", field="engine")
    from .docker import DockerEngine

    return DockerEngine(remote, timeout=timeout)


__all__ = [
    "Engine",
    "open_engine",
    "RunSpec",
    "PortBinding",
    "EngineVersion",
    "EngineInfo",
    "ImageInfo",
    "ContainerInfo",
    "LogLine",
    "EngineEvent",
    "Snapshot",
]
