"""Inventory: one YAML file per host or group, validated at load.

An inventory is a directory of `*.yaml` files (or a single file).  Each file
holds an optional `defaults:` mapping (applied to every host of that file) and
a `hosts:` mapping of name -> host settings.  A file with several hosts is a
group; its name (the file stem) can be given to `--host` as well.

Everything here is pure data: loading turns text into `HostSpec` records and
any problem into a `ConfigError` naming the file and the field.  SSH settings
come from three layers, strongest first: the inventory, the ssh_config entry
for the host, built-in defaults (see `remote_ops.sshconfig`).
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError, NotFound


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuSpec(_Spec):
    count: int = Field(0, ge=0, description="GPUs the host must show in nvidia-smi")
    model: str | None = Field(None, description="expected GPU name, e.g. 'NVIDIA RTX PRO 6000'")
    max_temperature_c: int = Field(85, description="warn above this temperature")


class SglangSpec(_Spec):
    checkout: str = Field("/root/sglang", description="SGLang git checkout on the host")
    version: str = Field("0.5.9", description="SGLang release the checkout is at")
    base_image: str = Field("lmsysorg/sglang:v0.5.9-cu129",
                            description="image the patched image is built FROM")
    image_checkout: str = Field("/sgl-workspace/sglang",
                                description="where the base image has SGLang's checkout")
    patch: str | None = Field(None, description="patch spec (model) name, see `remote-ops patch specs`; "
                                                "unset: derived from the model's config.json architectures")

    @field_validator("patch")
    @classmethod
    def _known_patch(cls, value: str | None) -> str | None:
        from . import patchspec

        names = [m.name for m in patchspec.catalog()]
        if value is not None and value not in names:
            raise ValueError(f"unknown patch spec {value!r}; known: {', '.join(names)}")
        return value

    @property
    def target_file(self) -> str:
        """Absolute path of the patch spec's target file inside the checkout (spec named or bound)."""
        from . import patchspec

        if not self.patch:
            raise ConfigError("sglang.patch is not set and was not derived from the model's config.json yet",
                              field="sglang.patch")
        return patchspec.target_path(self.checkout, patchspec.resolve(self.patch))


class ContainerSpec(_Spec):
    name: str = "sglang-eagle3"
    image: str = "remote-ops/sglang-eagle3"
    tag: str | None = Field(None, description="image tag; default: <sglang version>-<patch hash>")
    gpus: Literal["all", "none"] | list[int] = "all"
    shm_size: str = "32g"
    ipc: str = "host"
    restart: str = "unless-stopped"
    bind_address: str = "127.0.0.1"
    env: dict[str, str] = Field(default_factory=dict)
    runtime: str | None = None
    healthcheck_start_period_s: int = Field(1800, description="model load time allowed")
    volumes: list[str] = Field(default_factory=list, description="extra -v HOST:CONTAINER[:ro]")


class ModelSpec(_Spec):
    path: str = "/models/Kimi-K2.5"
    served_name: str = "kimi-k2.5"
    num_layers: int = Field(61, gt=3)
    hidden_size: int = Field(7168, gt=0)
    trust_remote_code: bool = True


class DumpSpec(_Spec):
    dir: str = "/data/eagle3-dumps"
    layers: list[int] | None = Field(None, description="layers_to_capture; default [2, L//2, L-3]")
    all_ranks: bool = Field(False, description="every TP rank writes (validation only)")
    policy: Literal["backpressure", "drop"] = "backpressure"
    pinned_buffers: int = Field(8, gt=0)
    writer_threads: int = Field(2, gt=0)
    min_free_gb: float = Field(100.0, ge=0)


class ServerSpec(_Spec):
    port: int = Field(30000, gt=0, lt=65536)
    tp: int = Field(8, gt=0)
    disable_radix_cache: bool = True
    chunked_prefill_size: int = Field(32768, gt=0)
    mem_fraction_static: float | None = None
    extra_args: list[str] = Field(default_factory=list)
    launcher: list[str] = Field(default_factory=lambda: ["python3", "-m", "sglang.launch_server"],
                                description="argv that starts the server in the container")
    healthy_timeout_s: int = Field(2400, gt=0, description="deploy waits this long for healthy")


class LogsSpec(_Spec):
    dir: str = "/data/eagle3-logs"
    extraction: str = "/data/eagle3-logs/extraction.log"
    training: str = "/data/eagle3-logs/training.log"


class HostSpec(_Spec):
    """One host as the inventory describes it (before ssh_config is applied)."""

    name: str
    address: str | None = None
    user: str | None = None
    port: int | None = Field(None, gt=0, lt=65536)
    identity_file: str | None = None
    proxy_jump: str | None = None
    known_hosts: str | None = None
    source: str | None = Field(None, description="file this host came from")
    groups: tuple[str, ...] = ()
    gpus: GpuSpec = GpuSpec()
    sglang: SglangSpec = SglangSpec()
    container: ContainerSpec = ContainerSpec()
    model: ModelSpec = ModelSpec()
    dump: DumpSpec = DumpSpec()
    server: ServerSpec = ServerSpec()
    logs: LogsSpec = LogsSpec()
    audit_log: str = "/var/log/remote-ops/audit.jsonl"
    lock_dir: str = "/var/lock/remote-ops.lock"

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError("host names must be non-empty and contain no spaces")
        return v

    @property
    def connect_address(self) -> str:
        """What to hand to ssh: the address, else the name (an ssh_config alias)."""
        return self.address or self.name


class Inventory(BaseModel):
    """All hosts by name, plus groups (file stems of multi-host files)."""

    model_config = ConfigDict(frozen=True)
    hosts: dict[str, HostSpec] = Field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    sources: tuple[str, ...] = ()

    def resolve(self, ref: str) -> list[HostSpec]:
        """Hosts for a `--host` value: a name, a group, a listed address, or ad hoc.

        An unknown value that looks like an address or ssh_config alias becomes
        an ad-hoc host with defaults, as `ssh` itself would treat it.
        """
        if ref in self.hosts:
            return [self.hosts[ref]]
        if ref in self.groups:
            return [self.hosts[n] for n in self.groups[ref]]
        by_address = [h for h in self.hosts.values() if h.address == ref]
        if by_address:
            return by_address[:1]
        return [adhoc_host(ref)]

    def one(self, ref: str) -> HostSpec:
        hosts = self.resolve(ref)
        if len(hosts) != 1:
            raise ConfigError(f"'{ref}' is a group of {len(hosts)} hosts; this command takes one",
                              hint="use --all where offered, or name one host")
        return hosts[0]


def adhoc_host(ref: str) -> HostSpec:
    """A host not in the inventory: `[user@]address[:port]` with defaults."""
    user, _, rest = ref.rpartition("@")
    address, port = rest, None
    if rest.count(":") == 1:
        address, _, port_text = rest.partition(":")
        if not port_text.isdigit():
            raise ConfigError(f"bad port in host '{ref}'", field="--host")
        port = int(port_text)
    if not address:
        raise ConfigError(f"empty host in '{ref}'", field="--host")
    return HostSpec(name=address, address=None, user=user or None, port=port,
                    source="(ad hoc)")


def default_inventory_paths() -> list[Path]:
    """`$REMOTE_OPS_INVENTORY` (os.pathsep list), else ./inventory, plus the sandbox's."""
    env = os.environ.get("REMOTE_OPS_INVENTORY")
    paths = [Path(p) for p in env.split(os.pathsep) if p] if env else [Path("inventory")]
    from .paths import sandbox_inventory_file  # local import: paths is tiny, avoids a cycle

    sandbox = sandbox_inventory_file()
    return paths + ([sandbox] if sandbox.exists() else [])


def load_inventory(paths: list[Path] | None = None) -> Inventory:
    """Load and validate every inventory file under `paths` (files or directories)."""
    files = _inventory_files(paths if paths is not None else default_inventory_paths())
    hosts: dict[str, HostSpec] = {}
    groups: dict[str, tuple[str, ...]] = {}
    for file in files:
        file_hosts = load_inventory_file(file)
        for host in file_hosts:
            if host.name in hosts:
                raise ConfigError(f"host '{host.name}' is also defined in {hosts[host.name].source}",
                                  source=str(file), field=f"hosts.{host.name}")
            hosts[host.name] = host
        if len(file_hosts) > 1:
            groups[file.stem] = tuple(h.name for h in file_hosts)
    return Inventory(hosts=hosts, groups=groups, sources=tuple(str(f) for f in files))


def _inventory_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir()
                            if p.suffix in (".yaml", ".yml") and not p.name.startswith("."))
        elif path.is_file():
            files.append(path)
        elif os.environ.get("REMOTE_OPS_INVENTORY") or path != Path("inventory"):
            raise NotFound(f"inventory path {path} does not exist")
    return files


def load_inventory_file(file: Path) -> list[HostSpec]:
    """Parse one inventory file into hosts; errors name the file and the field."""
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=str(file)) from None
    return parse_inventory_data(data, source=str(file))


def parse_inventory_data(data: Any, source: str) -> list[HostSpec]:
    """Validate a loaded inventory document (pure)."""
    if not isinstance(data, dict):
        raise ConfigError("top level must be a mapping with 'hosts:'", source=source)
    unknown = set(data) - {"defaults", "hosts"}
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)}; expected 'defaults' and 'hosts'",
                          source=source, field=sorted(unknown)[0])
    defaults = data.get("defaults") or {}
    entries = data.get("hosts") or {}
    if not isinstance(entries, dict) or not isinstance(defaults, dict):
        raise ConfigError("'hosts' and 'defaults' must be mappings", source=source, field="hosts")
    group = (Path(source).stem,) if len(entries) > 1 else ()
    return [_host(name, _merge(defaults, body or {}), source, group) for name, body in entries.items()]


def _host(name: str, body: dict, source: str, groups: tuple[str, ...]) -> HostSpec:
    try:
        return HostSpec(name=str(name), source=source, groups=groups, **body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in ("hosts", name, *err["loc"]))
        raise ConfigError(err["msg"], source=source, field=field) from None
    except TypeError as exc:
        raise ConfigError(str(exc), source=source, field=f"hosts.{name}") from None


def _merge(base: dict, over: dict) -> dict:
    """Deep-merge two mappings; `over` wins."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (used by the sandbox and the tests' safety net)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
