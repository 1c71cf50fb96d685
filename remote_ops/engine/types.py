"""What an engine answers, as typed records, and the pure parsers that make them.

The Engine API returns the same JSON documents `docker inspect` prints, so the
parsers here read API responses, captured CLI output and the shell probes'
socket answers (`engine.probe`) alike; every caller (`workflows.container`,
health, deploy) uses these records.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from .labels import LABEL_PREFIX

#: A point in time for `since`/`until`: unix seconds or an aware datetime.
Since = float | datetime


@dataclass(frozen=True)
class EngineVersion:
    """The daemon's `/version`: what runs on the host (the CLI client is not involved)."""

    engine: str  # the engine kind (`remote_ops.engine.KINDS`)
    server: str  # e.g. "20.10.24+dfsg1"
    api: str  # the daemon's API version, e.g. "1.41"
    min_api: str = ""
    os: str = ""
    arch: str = ""
    kernel: str = ""
    negotiated_api: str = ""  # the API version this client speaks to it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EngineInfo:
    """The parts of `/info` remote-ops uses (runtimes decide GPU support; system time anchors events)."""

    runtimes: tuple[str, ...]
    default_runtime: str
    system_time: float  # the daemon's clock, unix seconds
    containers: int = 0
    images: int = 0
    storage_driver: str = ""


#: The image env variables kept (`ImageInfo.cuda_env`): what the NVIDIA container toolkit checks.
CUDA_ENV = ("CUDA_VERSION", "NVIDIA_REQUIRE_CUDA")


@dataclass(frozen=True)
class ImageInfo:
    """One image: id, tags, labels (the deploy labels live here), its CUDA env (health's
    driver check; only `CUDA_ENV`, so no other env value, a secret maybe, is kept)."""

    id: str
    tags: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    created: str = ""
    size: int | None = None
    cuda_env: dict[str, str] = field(default_factory=dict)

    def label(self, name: str) -> str | None:
        return self.labels.get(LABEL_PREFIX + name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ContainerInfo:
    """One container: identity, state, health, and the labels it was started with."""

    id: str
    name: str
    image_id: str
    image_ref: str
    status: str  # created | running | restarting | exited | paused | dead
    health: str | None  # starting | healthy | unhealthy | None (no healthcheck)
    restart_count: int = 0
    oom_killed: bool = False
    exit_code: int | None = None
    started_at: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    finished_at: str = ""
    error: str = ""
    health_failing_streak: int = 0
    health_last_output: str = ""
    init: bool = False
    cuda_env: dict[str, str] = field(default_factory=dict)  # its image's CUDA env, as it runs (`CUDA_ENV`)

    @property
    def running(self) -> bool:
        return self.status == "running"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "running": self.running}


@dataclass(frozen=True)
class LogLine:
    """One line of a container's log: which stream, the daemon's timestamp, the text."""

    stream: str  # stdout | stderr
    time: str  # RFC 3339 with nanoseconds, as the daemon wrote it
    text: str

    @property
    def unix_time(self) -> float:
        return unix_time(self.time)


@dataclass(frozen=True)
class EngineEvent:
    """One `/events` record (container start/die/health_status, image pull/tag, ...)."""

    type: str  # container | image | network | volume | ...
    action: str  # start | die | health_status: healthy | pull | ...
    id: str
    time: float  # unix seconds (from timeNano)
    attributes: dict[str, str] = field(default_factory=dict)


# -- parsers (pure) ------------------------------------------------------------------------------
def parse_version(doc: dict[str, Any], engine: str, negotiated: str = "") -> EngineVersion:
    """`/version` JSON of engine kind `engine` -> EngineVersion."""
    return EngineVersion(
        engine=engine,
        server=str(doc.get("Version", "")),
        api=str(doc.get("ApiVersion", "")),
        min_api=str(doc.get("MinAPIVersion", "")),
        os=str(doc.get("Os", "")),
        arch=str(doc.get("Arch", "")),
        kernel=str(doc.get("KernelVersion", "")),
        negotiated_api=negotiated,
    )


def parse_info(doc: dict[str, Any]) -> EngineInfo:
    """`/info` JSON -> EngineInfo."""
    return EngineInfo(
        runtimes=tuple(sorted(doc.get("Runtimes") or {})),
        default_runtime=str(doc.get("DefaultRuntime", "")),
        system_time=unix_time(str(doc.get("SystemTime", ""))),
        containers=int(doc.get("Containers") or 0),
        images=int(doc.get("Images") or 0),
        storage_driver=str(doc.get("Driver", "")),
    )


def parse_image(d: dict[str, Any]) -> ImageInfo:
    """One image inspect document -> ImageInfo."""
    config = d.get("Config") or {}
    return ImageInfo(
        id=d.get("Id", ""),
        tags=tuple(d.get("RepoTags") or ()),
        labels=dict(config.get("Labels") or {}),
        created=d.get("Created", ""),
        size=d.get("Size"),
        cuda_env=_cuda_env(config),
    )


def _cuda_env(config: dict[str, Any]) -> dict[str, str]:
    """The `CUDA_ENV` variables of an inspect document's `Config.Env` (no other value is kept)."""
    return {k: v for k, _, v in (e.partition("=") for e in config.get("Env") or ()) if k in CUDA_ENV}


def parse_container(d: dict[str, Any]) -> ContainerInfo:
    """One container inspect document -> ContainerInfo."""
    state, config = d.get("State") or {}, d.get("Config") or {}
    health = state.get("Health") or {}
    log = health.get("Log") or []
    return ContainerInfo(
        id=d.get("Id", ""),
        name=(d.get("Name") or "").lstrip("/"),
        image_id=d.get("Image", ""),
        image_ref=config.get("Image", ""),
        status=state.get("Status", "unknown"),
        health=health.get("Status") or None,  # podman: "" when the image has no health check
        restart_count=int(d.get("RestartCount") or 0),
        oom_killed=bool(state.get("OOMKilled")),
        exit_code=state.get("ExitCode"),
        started_at=state.get("StartedAt", ""),
        labels=dict(config.get("Labels") or {}),
        finished_at=state.get("FinishedAt", ""),
        error=state.get("Error", ""),
        health_failing_streak=int(health.get("FailingStreak") or 0),
        health_last_output=(log[-1].get("Output", "") if log else "").strip(),
        init=bool((d.get("HostConfig") or {}).get("Init")),
        cuda_env=_cuda_env(config),
    )


def parse_event(d: dict[str, Any]) -> EngineEvent:
    actor = d.get("Actor") or {}
    nanos = d.get("timeNano") or int(d.get("time") or 0) * 1_000_000_000
    return EngineEvent(
        type=d.get("Type", ""),
        action=d.get("Action", ""),
        id=actor.get("ID", d.get("id", "")),
        time=nanos / 1e9,
        attributes=dict(actor.get("Attributes") or {}),
    )


def parse_events(body: bytes) -> list[EngineEvent]:
    """The `/events` stream (concatenated JSON objects) -> events, in order."""
    text, decoder, i, out = body.decode("utf-8", "replace"), json.JSONDecoder(), 0, []
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        out.append(parse_event(doc))
    return out


STREAMS = {0: "stdin", 1: "stdout", 2: "stderr"}


def demux(body: bytes) -> list[tuple[str, bytes]]:
    """Split a multiplexed log/attach stream into (stream, payload) frames.

    Each frame is an 8-byte header (stream id, 3 zero bytes, big-endian length)
    then the payload.  A body that does not start with such a header is a TTY
    container's raw output: one stdout frame.
    """
    if len(body) < 8 or body[0] not in STREAMS or body[1:4] != b"\0\0\0":
        return [("stdout", body)] if body else []
    frames, i = [], 0
    while i + 8 <= len(body):
        kind, size = struct.unpack_from(">BxxxL", body, i)
        frames.append((STREAMS.get(kind, "stdout"), body[i + 8 : i + 8 + size]))
        i += 8 + size
    return frames


def parse_logs(body: bytes) -> list[LogLine]:
    """A `/logs?timestamps=1` body -> lines (each line starts with the daemon's timestamp)."""
    lines: list[LogLine] = []
    for stream, payload in demux(body):
        for raw in payload.decode("utf-8", "replace").splitlines():
            stamp, _, text = raw.partition(" ")
            lines.append(LogLine(stream, stamp, text))
    return lines


def unix_time(rfc3339: str) -> float:
    """'2026-12-01T04:10:00.123456789Z' -> unix seconds (0.0 when empty or unparsable)."""
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def api_time(value: float | datetime) -> str:
    """Unix seconds or an aware datetime -> the API's `since`/`until` form, `SECONDS.NANOS`."""
    seconds = value.astimezone(timezone.utc).timestamp() if isinstance(value, datetime) else float(value)
    whole = int(seconds // 1)
    return f"{whole}.{min(999_999_999, int(round((seconds - whole) * 1e9))):09d}"
