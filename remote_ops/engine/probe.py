"""The engine's part of a one-round-trip shell probe: what it found, and the pure parsers.

A no-op `deploy` and `health` must run a shell command on the host anyway
(facts, lock, file shas, GPUs, HTTP, dumps).  When that one round trip is
cheaper than opening the Engine API channel (bench/engine_calls.py), the
engine's questions ride along in it.  The commands and their parser are the
engine kind's (`DockerCLI.probe_sections` / `DockerCLI.parse_probe` in
engine/cli.py, reached with `remote_ops.engine.cli_for(host)`); here are what
they share: the record (`Snapshot`), the section names (`SectionNames`) and
`read_snapshot`, which reads the sections' output into the same typed records
the API gives (`engine.types`).  The CLI's `inspect` prints the API's own JSON
documents, so one parser reads both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .types import ContainerInfo, EngineVersion, ImageInfo, parse_container, parse_image, parse_version


@dataclass(frozen=True)
class Snapshot:
    """What the probe found: the daemon (or why not), the container, its image, the CLI's version."""

    version: EngineVersion | None
    error: str | None
    container: ContainerInfo | None
    image: ImageInfo | None
    client_version: str | None = None  # the host's engine CLI (decides BuildKit for docker builds)
    runtimes: tuple[str, ...] = ()  # only when asked for (facts)
    engine: str = ""  # the engine kind that was asked (`DockerCLI.kind`)


@dataclass(frozen=True)
class SectionNames:
    """What the sections are called in the caller's probe (None: not asked)."""

    version: str | None = "engine.version"
    objects: str | None = "engine.objects"
    runtimes: str | None = "engine.runtimes"


ENGINE_SECTIONS = SectionNames()


def read_snapshot(sections: dict[str, tuple[int, str]], engine: str, names: SectionNames = ENGINE_SECTIONS) -> Snapshot:
    """`shell.split_sections` output of an engine kind's `probe_sections` -> Snapshot (pure; the
    kind's `parse_probe` calls it, and may adjust what it read)."""
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
        engine,
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
    """Every object of the JSON arrays an engine's `inspect` prints (one array per call)."""
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
