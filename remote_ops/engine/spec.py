"""The container run spec: what `docker run` flags said, as data, and the API request it becomes.

`RunSpec` is engine-neutral data; `create_request` turns it into the body of
`POST /containers/create` (pure; uses the SDK's HostConfig/ContainerConfig
builders, which check each field against the negotiated API version).  The
run-config label is the hash of the spec itself, so a changed setting means
a restart and an unchanged one means a no-op.

Never a pull: creating from the low-level API only ever uses an image that is
already on the host (a missing one is a 404, i.e. NotFound); the SDK's
high-level `containers.run` would pull it, so it is never used.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .labels import RUN_CONFIG

if TYPE_CHECKING:
    from ..inventory import HostSpec


@dataclass(frozen=True)
class PortBinding:
    """`-p HOST_IP:HOST_PORT:CONTAINER_PORT/PROTO`."""

    host_ip: str
    host_port: int
    container_port: int
    proto: str = "tcp"


@dataclass(frozen=True)
class RunSpec:
    """Everything a container is created with.  Defaults are `docker run`'s, except `init`."""

    name: str
    image: str
    command: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    init: bool = True                        # --init: tini reaps SGLang's worker processes
    restart: str = "no"                      # no | always | unless-stopped | on-failure[:N]
    gpus: str | tuple[int, ...] = "none"     # "all" | "none" | device indices
    shm_size: str | None = None              # "16g"
    ipc: str | None = None                   # "host" | "private" | ...
    ports: tuple[PortBinding, ...] = ()
    volumes: tuple[str, ...] = ()            # "SRC:DST[:MODE]", bind mounts
    runtime: str | None = None
    network: str | None = None               # "none" for throwaway containers
    auto_remove: bool = False

    def config_hash(self) -> str:
        """Hash of every setting (not the run-config label itself); 16 hex digits."""
        doc = asdict(self)
        doc["labels"] = {k: v for k, v in sorted(self.labels.items()) if k != RUN_CONFIG}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode()).hexdigest()[:16]

    def labelled(self) -> "RunSpec":
        """This spec with its run-config label set to its own hash."""
        return replace(self, labels={**self.labels, RUN_CONFIG: self.config_hash()})


def restart_policy(value: str) -> dict[str, Any]:
    """`--restart` value -> the API's RestartPolicy."""
    name, _, count = value.partition(":")
    return {"Name": name, "MaximumRetryCount": int(count)} if count else {"Name": name}


def device_requests(gpus: str | tuple[int, ...]) -> list[Any]:
    """`--gpus all` / `--gpus device=0,1` / nothing, as API DeviceRequests."""
    from docker.types import DeviceRequest

    if gpus == "none" or gpus == ():
        return []
    if gpus == "all":
        return [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return [DeviceRequest(device_ids=[str(g) for g in gpus], capabilities=[["gpu"]])]


def host_config(spec: RunSpec, api_version: str) -> dict[str, Any]:
    from docker.types import HostConfig

    hc = HostConfig(
        api_version, binds=list(spec.volumes) or None,
        port_bindings={f"{p.container_port}/{p.proto}": (p.host_ip, p.host_port) for p in spec.ports} or None,
        restart_policy=restart_policy(spec.restart), init=spec.init or None,
        shm_size=spec.shm_size, ipc_mode=spec.ipc, runtime=spec.runtime, network_mode=spec.network,
        device_requests=device_requests(spec.gpus) or None, auto_remove=spec.auto_remove or None)
    for request in hc.get("DeviceRequests") or []:
        request["DeviceIDs"] = request["DeviceIDs"] or None     # as the CLI sends `--gpus all`
    return hc


def create_request(spec: RunSpec, api_version: str) -> dict[str, Any]:
    """The JSON body of `POST /containers/create?name=NAME` for `spec` (pure)."""
    from docker.types import ContainerConfig

    return ContainerConfig(
        api_version, spec.image, list(spec.command) or None, detach=True,
        ports=[(p.container_port, p.proto) for p in spec.ports] or None,
        environment=[f"{k}={v}" for k, v in sorted(spec.env.items())] or None,
        entrypoint=list(spec.entrypoint) if spec.entrypoint is not None else None,
        labels=dict(spec.labels) or None, host_config=host_config(spec, api_version))


def for_host(host: "HostSpec", image: str) -> RunSpec:
    """The SGLang server container of an inventory host: what `container.run_argv` says as flags.

    The dumper environment and the server arguments still come from
    `remote_ops.container` (imported here, not at module level, so the seam
    does not depend on it at import time); they move here when container.py
    switches to the engine.  Tested equal to `run_argv` on a real daemon.
    """
    from .. import container as legacy
    from .labels import HOST, MANAGED

    c, port = host.container, host.server.port
    volumes = (f"{host.model.path}:{host.model.path}:ro", f"{host.dump.dir}:{host.dump.dir}",
               f"{host.logs.dir}:{host.logs.dir}", *c.volumes)
    return RunSpec(name=c.name, image=image, command=(*host.server.launcher, *legacy.server_args(host)),
                   env={**legacy.dump_env(host), "SGLANG_PORT": str(port), **c.env},
                   labels={MANAGED: "1", HOST: host.name}, init=True, restart=c.restart,
                   gpus=c.gpus if isinstance(c.gpus, str) else tuple(c.gpus), shm_size=c.shm_size, ipc=c.ipc,
                   ports=(PortBinding(c.bind_address, port, port),), volumes=volumes,
                   runtime=c.runtime).labelled()
