"""The container run spec: what `docker run` flags said, as data, and the API request it becomes.

`RunSpec` is engine-neutral data; `create_request` turns it into the body of
`POST /containers/create` (pure; uses the SDK's HostConfig/ContainerConfig
builders, which check each field against the negotiated API version);
`cli_argv` renders the same spec as the `docker run` command line (what
`--dry-run`/`--diff` show).  The run-config label is a hash of the settings,
so a changed setting means a restart and an unchanged one means a no-op.
Labels that are host state, not settings (`labels.NOT_SETTINGS`: the dump
dir's `device:inode` at create time), are left out of that hash.

For an inventory host's server container (`for_host`) that hash is the one
remote-ops has always set (`inventory_run_config`: sha256 of the `docker run`
flags, image, launcher and server arguments).  Containers running on hosts
today carry it; a new formula would read as "run settings changed" and
restart them, reloading the model (for a 1T-parameter model, many minutes).

Never a pull: creating from the low-level API only ever uses an image that is
already on the host (a missing one is a 404, i.e. NotFound); the SDK's
high-level `containers.run` would pull it, so it is never used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .labels import NOT_SETTINGS, RUN_CONFIG

if TYPE_CHECKING:
    from ..core.inventory import HostSpec


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
    init: bool = True  # --init: tini reaps SGLang's worker processes
    restart: str = "no"  # no | always | unless-stopped | on-failure[:N]
    gpus: str | tuple[int, ...] = "none"  # "all" | "none" | device indices
    shm_size: str | None = None  # "16g"
    ipc: str | None = None  # "host" | "private" | ...
    ports: tuple[PortBinding, ...] = ()
    volumes: tuple[str, ...] = ()  # "SRC:DST[:MODE]", bind mounts
    runtime: str | None = None
    network: str | None = None  # "none" for throwaway containers
    auto_remove: bool = False

    def config_hash(self) -> str:
        """Hash of every setting (not the labels that are no setting: `labels.NOT_SETTINGS`); 16 hex digits."""
        doc = asdict(self)
        doc["labels"] = {k: v for k, v in sorted(self.labels.items()) if k not in NOT_SETTINGS}
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
        api_version,
        binds=list(spec.volumes) or None,
        port_bindings={f"{p.container_port}/{p.proto}": (p.host_ip, p.host_port) for p in spec.ports} or None,
        restart_policy=restart_policy(spec.restart),
        init=spec.init or None,
        shm_size=spec.shm_size,
        ipc_mode=spec.ipc,
        runtime=spec.runtime,
        network_mode=spec.network,
        device_requests=device_requests(spec.gpus) or None,
        auto_remove=spec.auto_remove or None,
    )
    for request in hc.get("DeviceRequests") or []:
        request["DeviceIDs"] = request["DeviceIDs"] or None  # as the CLI sends `--gpus all`
    return hc


def create_request(spec: RunSpec, api_version: str) -> dict[str, Any]:
    """The JSON body of `POST /containers/create?name=NAME` for `spec` (pure)."""
    from docker.types import ContainerConfig

    return ContainerConfig(
        api_version,
        spec.image,
        list(spec.command) or None,
        detach=True,
        ports=[(p.container_port, p.proto) for p in spec.ports] or None,
        environment=[f"{k}={v}" for k, v in sorted(spec.env.items())] or None,
        entrypoint=list(spec.entrypoint) if spec.entrypoint is not None else None,
        labels=dict(spec.labels) or None,
        host_config=host_config(spec, api_version),
    )


def cli_argv(spec: RunSpec) -> list[str]:
    """`spec` as the `docker run` command line (pure; never pulls).  Flag order is fixed:
    the run-config hash of inventory hosts is taken over this form."""
    argv = [
        "docker",
        "run",
        "-d",
        "--pull=never",
        *(["--init"] if spec.init else []),
        "--name",
        spec.name,
        "--restart",
        spec.restart,
        *gpu_flags(spec.gpus),
    ]
    argv += ["--shm-size", spec.shm_size] if spec.shm_size else []
    argv += ["--ipc", spec.ipc] if spec.ipc else []
    for p in spec.ports:
        argv += ["-p", f"{p.host_ip}:{p.host_port}:{p.container_port}" + ("" if p.proto == "tcp" else f"/{p.proto}")]
    argv += [a for v in spec.volumes for a in ("-v", v)]
    argv += ["--runtime", spec.runtime] if spec.runtime else []
    argv += ["--network", spec.network] if spec.network else []
    argv += ["--rm"] if spec.auto_remove else []
    argv += [a for k, v in sorted(spec.env.items()) for a in ("-e", f"{k}={v}")]
    argv += [a for k, v in spec.labels.items() if k != RUN_CONFIG for a in ("--label", f"{k}={v}")]
    argv += ["--label", f"{RUN_CONFIG}={spec.labels[RUN_CONFIG]}"] if RUN_CONFIG in spec.labels else []
    argv += ["--entrypoint", " ".join(spec.entrypoint)] if spec.entrypoint else []
    return argv + [spec.image, *spec.command]


def gpu_flags(gpus: str | tuple[int, ...]) -> list[str]:
    """`--gpus all`, `--gpus "device=0,1"` (docker parses the value as CSV), or nothing."""
    if gpus == "none" or gpus == ():
        return []
    if gpus == "all":
        return ["--gpus", "all"]
    return ["--gpus", '"device=' + ",".join(str(g) for g in gpus) + '"']


def inventory_run_config(spec: RunSpec, launcher_len: int) -> str:
    """The run-config hash of an inventory host's server container (16 hex digits).

    sha256 of JSON [docker run flags up to the run-config label, image, launcher,
    server arguments]: unchanged since the first release, so a container that
    is running on a host keeps its label's value (tests/test_run_config_compat.py
    pins it).  The labels that are no setting (`labels.NOT_SETTINGS`) are not hashed.
    """
    argv = cli_argv(replace(spec, labels={k: v for k, v in spec.labels.items() if k not in NOT_SETTINGS}))
    flags = argv[: len(argv) - 1 - len(spec.command)]
    doc = json.dumps([flags, spec.image, list(spec.command[:launcher_len]), list(spec.command[launcher_len:])])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def dump_env(host: "HostSpec") -> dict[str, str]:
    """The dumper's SGLANG_HS_DUMP_* settings from the inventory (dump contract)."""
    d = host.dump
    env = {
        "SGLANG_HS_DUMP_DIR": d.dir,
        "SGLANG_HS_DUMP_POLICY": d.policy,
        "SGLANG_HS_DUMP_BUFFERS": str(d.pinned_buffers),
        "SGLANG_HS_DUMP_WRITERS": str(d.writer_threads),
    }
    if d.layers:
        env["SGLANG_HS_DUMP_LAYERS"] = ",".join(str(i) for i in d.layers)
    if d.all_ranks:
        env["SGLANG_HS_DUMP_ALL_RANKS"] = "1"
    if d.storage != "bf16":  # absent in the default: a running container's run config stays what it was
        env["SGLANG_HS_DUMP_DTYPE"] = d.storage
    return env


def server_args(host: "HostSpec") -> list[str]:
    """SGLang launch arguments from the inventory (extraction: radix cache off, big chunks)."""
    s, m = host.server, host.model
    args = [
        "--model-path",
        m.path,
        "--served-model-name",
        m.served_name,
        "--tp",
        str(s.tp),
        "--chunked-prefill-size",
        str(s.chunked_prefill_size),
        "--port",
        str(s.port),
        "--host",
        "0.0.0.0",
    ]
    args += ["--disable-radix-cache"] if s.disable_radix_cache else []
    args += ["--trust-remote-code"] if m.trust_remote_code else []
    args += ["--mem-fraction-static", str(s.mem_fraction_static)] if s.mem_fraction_static else []
    return args + list(s.extra_args)


def for_host(host: "HostSpec", image: str, dump_dir_id: str | None = None) -> RunSpec:
    """The SGLang server container of an inventory host, labelled with its run-config hash, and
    with `dump_dir_id` (the host's dump dir as `device:inode`, read right before the create) when
    known: `probes.dumpdir.mount_of` compares it with the dir as it is later."""
    from .labels import DUMP_DIR_ID, HOST, MANAGED

    c, port = host.container, host.server.port
    volumes = (
        f"{host.model.path}:{host.model.path}:ro",
        f"{host.dump.dir}:{host.dump.dir}",
        f"{host.logs.dir}:{host.logs.dir}",
        *c.volumes,
    )
    spec = RunSpec(
        name=c.name,
        image=image,
        command=(*host.server.launcher, *server_args(host)),
        env={**dump_env(host), "SGLANG_PORT": str(port), **c.env},
        labels={MANAGED: "1", HOST: host.name, **({DUMP_DIR_ID: dump_dir_id} if dump_dir_id else {})},
        init=True,
        restart=c.restart,
        gpus=c.gpus if isinstance(c.gpus, str) else tuple(c.gpus),
        shm_size=c.shm_size,
        ipc=c.ipc,
        ports=(PortBinding(c.bind_address, port, port),),
        volumes=volumes,
        runtime=c.runtime,
    )
    run_config = inventory_run_config(spec, len(host.server.launcher))
    return replace(spec, labels={**spec.labels, RUN_CONFIG: run_config})
