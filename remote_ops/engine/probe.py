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

from .. import shell
from .types import ContainerInfo, EngineVersion, ImageInfo, parse_container, parse_image, parse_version


@dataclass(frozen=True)
class Snapshot:
    """What the probe found: the daemon (or why not), the container, its image, the CLI's version."""

    version: EngineVersion | None
    error: str | None
    container: ContainerInfo | None
    image: ImageInfo | None
    client_version: str | None = None     # the host's docker CLI (decides BuildKit for builds)
    runtimes: tuple[str, ...] = ()        # only when asked for (facts)


def probe_sections(container: str, image: str | None = None, cli: str = "docker",
                   runtimes: bool = False) -> list[tuple[str, str]]:
    """Shell sections: engine version, then container + image in one inspect (pure).

    With `image` unknown, the container's own image is inspected after it.
    With `runtimes`, also the daemon's runtimes (what `facts` reports).
    """
    version = f"{shell.quote(cli)} version --format '{{{{json .}}}}'"
    if image:
        objects = shell.join([cli, "inspect", container, image])
    else:
        name = shell.quote(container)
        objects = (f"{cli} inspect --type container {name} && {cli} image inspect "
                   f"\"$({cli} inspect --type container -f '{{{{.Config.Image}}}}' {name})\"")
    extra = [("engine.runtimes", f"{shell.quote(cli)} info --format '{{{{json .Runtimes}}}}'")] if runtimes else []
    return [("engine.version", version), ("engine.objects", objects), *extra]


def parse_probe(sections: dict[str, tuple[int, str]], engine: str = "docker") -> Snapshot:
    """`shell.split_sections` output of `probe_sections` -> Snapshot (pure)."""
    status, text = sections.get("engine.version", (1, ""))
    doc = _first_json_line(text)
    server = doc.get("Server") or {}
    version = parse_version(server, engine, "") if status == 0 and server else None
    error = None if version else ((text.strip().splitlines() or [f"{engine} not available"])[-1])
    items = _json_arrays(sections.get("engine.objects", (1, ""))[1])
    ctr = next((i for i in items if "State" in i), None)
    img = next((i for i in items if "RepoTags" in i), None)
    rt_status, rt_text = sections.get("engine.runtimes", (1, ""))
    runtimes = _first_json_line(rt_text) if rt_status == 0 else {}
    return Snapshot(version, error, parse_container(ctr) if ctr else None, parse_image(img) if img else None,
                    (doc.get("Client") or {}).get("Version"), tuple(sorted(runtimes)))


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
