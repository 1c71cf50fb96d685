"""The engine's part of a one-round-trip shell probe: commands and parser, both owned here.

A no-op `deploy` and `health` must run a shell command on the host anyway
(facts, lock, file shas, GPUs, HTTP, dumps).  When that one round trip is
cheaper than opening the Engine API channel (bench/engine_calls.py), the
engine's questions ride along in it: `probe_sections` gives the shell
sections (built with `remote_ops.shell`), `parse_probe` reads their output
into the same typed records the API gives.  Either way the docker commands,
the labels and the parsing live behind the engine seam.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..core import shell
from .types import ContainerInfo, EngineVersion, ImageInfo, parse_container, parse_image, parse_version


@dataclass(frozen=True)
class Snapshot:
    """What the probe found: the daemon (or why not), the container, its image, the CLI's version."""

    version: EngineVersion | None
    error: str | None
    container: ContainerInfo | None
    image: ImageInfo | None
    client_version: str | None = None  # the host's docker CLI (decides BuildKit for builds)
    runtimes: tuple[str, ...] = ()  # only when asked for (facts)


@dataclass(frozen=True)
class SectionNames:
    """What the sections are called in the caller's probe (None: not asked)."""

    version: str | None = "engine.version"
    objects: str | None = "engine.objects"
    runtimes: str | None = "engine.runtimes"


ENGINE_SECTIONS = SectionNames()


def version_command(cli: str = "docker") -> str:
    """The engine's version, client and server, as one JSON line (the one definition)."""
    return f"{shell.quote(cli)} version --format '{{{{json .}}}}'"


def objects_command(container: str, image: str | None = None, cli: str = "docker") -> str:
    """Container + image in one inspect (each CLI call costs 0.1-0.25 s on a busy host); with
    `image` unknown, the container's own image is inspected after it."""
    if image:
        return shell.join([cli, "inspect", container, image])
    name = shell.quote(container)
    return (
        f"{cli} inspect --type container {name} && {cli} image inspect "
        f"\"$({cli} inspect --type container -f '{{{{.Config.Image}}}}' {name})\""
    )


def inspect_argv(kind: str, ref: str, cli: str = "docker") -> list[str]:
    """Inspect one object, `kind` "image" or "container" (prints a JSON array; exit 1 when absent)."""
    return [cli, kind, "inspect", ref]


def container_id_command(container: str, cli: str = "docker") -> str:
    """The container's full id, or nothing when it does not exist (stderr silenced)."""
    return f"{shell.join([cli, 'inspect', '--type', 'container', '-f', '{{.Id}}', container])} 2>/dev/null"


def exec_command(container: str, argv: list[str], cli: str = "docker") -> str:
    """Run `argv` inside the running container."""
    return shell.join([cli, "exec", container, *argv])


def probe_sections(
    container: str | None,
    image: str | None = None,
    cli: str = "docker",
    runtimes: bool = False,
    names: SectionNames = ENGINE_SECTIONS,
) -> list[tuple[str, str]]:
    """Shell sections: engine version, then container + image in one inspect (pure).

    With `container` None, no objects (facts).  With `runtimes`, also the
    daemon's runtimes (what `facts` reports).  `names` renames the sections
    to fit the caller's probe.
    """
    out = [(names.version, version_command(cli))] if names.version else []
    if container and names.objects:
        out.append((names.objects, objects_command(container, image, cli)))
    if runtimes and names.runtimes:
        out.append((names.runtimes, f"{shell.quote(cli)} info --format '{{{{json .Runtimes}}}}'"))
    return out


def parse_probe(
    sections: dict[str, tuple[int, str]], engine: str = "docker", names: SectionNames = ENGINE_SECTIONS
) -> Snapshot:
    """`shell.split_sections` output of `probe_sections` -> Snapshot (pure)."""
    status, text = sections.get(names.version or "", (1, ""))
    doc = _first_json_line(text)
    server = doc.get("Server") or {}
    version = parse_version(server, engine, "") if status == 0 and server else None
    error = None if version else ((text.strip().splitlines() or [f"{engine} not available"])[-1])
    items = _json_arrays(sections.get(names.objects or "", (1, ""))[1])
    ctr = next((i for i in items if "State" in i), None)
    img = next((i for i in items if "State" not in i), None)
    rt_status, rt_text = sections.get(names.runtimes or "", (1, ""))
    runtimes = _first_json_line(rt_text) if rt_status == 0 else {}
    return Snapshot(
        version,
        error,
        parse_container(ctr) if ctr else None,
        parse_image(img) if img else None,
        (doc.get("Client") or {}).get("Version"),
        tuple(sorted(runtimes)),
    )


def parse_version_line(text: str) -> dict[str, Any]:
    """The raw `version --format '{{json .}}'` document ({} when the output is not JSON)."""
    return _first_json_line(text)


def parse_inspect(text: str) -> tuple[ImageInfo | None, ContainerInfo | None]:
    """The objects of one `inspect CONTAINER IMAGE` output: (image, container), either may be None."""
    items = _json_arrays(text)
    ctr = next((i for i in items if "State" in i), None)
    img = next((i for i in items if "State" not in i), None)
    return (parse_image(img) if img else None), (parse_container(ctr) if ctr else None)


def _first_json_line(text: str) -> dict[str, Any]:
    line = next((x for x in text.splitlines() if x.startswith("{")), "")
    try:
        value = json.loads(line) if line else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _json_arrays(text: str) -> list[dict[str, Any]]:
    """Every object of the JSON arrays `docker inspect` prints (one array per call)."""
    docs: list[dict[str, Any]] = []
    decoder, i, text = json.JSONDecoder(), 0, text.strip()
    while i < len(text):
        if text[i] != "[":
            i += 1
            continue
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        docs += [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
    return docs
