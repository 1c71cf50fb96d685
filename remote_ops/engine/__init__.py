"""The engine seam: the host's container engine behind one small interface.

`Engine` is what workflows (container, health, facts, deploy) need from a
container engine: version, image and container inspection, lifecycle, create
from a `RunSpec`, logs, events.  Every answer is a typed record
(`engine.types`), every failure a typed error from `remote_ops.errors`, every
call has a deadline.

An engine kind is a class (pyinfra's `PodmanConnector(DockerConnector)`
pattern): `DockerEngine` (engine/docker.py) knows its CLI's command lines and
their parser (`cli`, a `DockerCLI` from engine/cli.py), the host command that
reaches its API (`dial`), and as an instance speaks that API with the Docker
SDK's `APIClient` over the one strict SSH connection (engine/dialstdio.py).
`PodmanEngine(DockerEngine)` (engine/podman.py) is the second kind.  `KINDS`
below is the one table from the inventory's `engine` value to its class.

Workflows never name an engine binary.  For a command line (a shell probe,
a build, logs, a throwaway container) they ask `cli_for(host)`: pure, no
channel opened, no SDK imported.  For API calls they ask
`open_engine(remote, host.engine)`.

Usage::

    from remote_ops.engine import cli_for, open_engine
    sections = cli_for(host).probe_sections(host.container.name, api=True)
    with open_engine(remote, host.engine) as engine:
        ctr = engine.container("sglang-eagle3")
        img = engine.image(ctr.image_ref) if ctr else None
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .cli import DockerCLI
from .probe import Snapshot
from .spec import PortBinding, RunSpec
from .types import ContainerInfo, EngineEvent, EngineInfo, EngineVersion, ImageInfo, LogLine, Since


@runtime_checkable
class Engine(Protocol):
    """A container engine on one host.  `timeout` is each call's deadline in seconds."""

    kind: str
    cli: DockerCLI  # its command lines and their parser (also on the class: `cli_for`)

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

    def close(self) -> None: ...


#: Engine kinds: the inventory's `engine` value -> (module under remote_ops.engine, class name).
#: A module is imported only when its kind is asked for.
KINDS: dict[str, tuple[str, str]] = {
    "docker": ("docker", "DockerEngine"),
    "podman": ("podman", "PodmanEngine"),
}
#: The kind of a host whose inventory names none.
DEFAULT_KIND = "docker"

if TYPE_CHECKING:
    from .docker import DockerEngine


def engine_class(kind: str) -> type[DockerEngine]:
    """The class of engine kind `kind` (ConfigError for a kind not in `KINDS`)."""
    if kind not in KINDS:
        from ..errors import ConfigError

        raise ConfigError(f"unknown container engine {kind!r} (known: {', '.join(KINDS)})", field="engine")
    module, name = KINDS[kind]
    cls: type[DockerEngine] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return cls


def cli_for(host_or_kind: Any) -> DockerCLI:
    """The command lines of a host's engine (a HostSpec, or a kind name): pure, no channel."""
    kind = host_or_kind if isinstance(host_or_kind, str) else getattr(host_or_kind, "engine", DEFAULT_KIND)
    return engine_class(kind).cli


def open_engine(remote: Any, kind: str = DEFAULT_KIND, *, timeout: float | None = None) -> Engine:
    """The engine of `remote`'s host, over `remote`'s connection (nothing is sent until first use)."""
    return engine_class(kind)(remote, timeout=timeout)


__all__ = [
    "Engine",
    "KINDS",
    "DEFAULT_KIND",
    "DockerCLI",
    "engine_class",
    "cli_for",
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
