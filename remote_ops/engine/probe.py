"""The engine's part of a one-round-trip shell probe: commands and parser, both owned here.

A no-op `deploy` and `health` must run a shell command on the host anyway
(facts, lock, file shas, GPUs, HTTP, dumps).  When that one round trip is
cheaper than opening the Engine API channel (bench/engine_calls.py), the
engine's questions ride along in it: `probe_sections` gives the shell
sections (built with `remote_ops.core.shell`), `parse_probe` reads their output
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


#: Sets `sock` to the engine's unix socket when its API can be asked directly with curl (~5 ms,
#: against 25-35 ms of CPU per docker CLI process on the host): curl present, no docker context
#: selected, DOCKER_HOST unset or unix://, the socket readable and writable by this user.
#: Otherwise `sock` is empty and the section falls back to the docker CLI.
API_SOCKET = (
    'sock=; if command -v curl >/dev/null 2>&1 && [ -z "${DOCKER_CONTEXT:-}" ] && '
    'cfg="${DOCKER_CONFIG:-$HOME/.docker}/config.json" && ! { [ -f "$cfg" ] && grep -qs \'"currentContext"\' "$cfg"; }; then '
    'case "${DOCKER_HOST:-unix:///var/run/docker.sock}" in unix://*) '
    "sock=${DOCKER_HOST:-unix:///var/run/docker.sock}; sock=${sock#unix://}; "
    '[ -S "$sock" ] && [ -r "$sock" ] && [ -w "$sock" ] || sock=;; esac; fi'
)


def _api_get(path: str, quoted: bool = True) -> str:
    """curl GET of an Engine API path on `$sock`; exit 22 (and no output) on an HTTP error.
    `quoted=False`: `path` is one shell word already (it expands a variable: `"/images/$img/json"`)."""
    url = shell.quote("http://docker" + path) if quoted else f"http://docker{path}"
    return f"curl -sf --noproxy '*' -m 30 --unix-socket \"$sock\" {url}"


def _api_or_cli(api: str, cli: str, cli_on_error: bool = False) -> str:
    """`api` when the socket can be used, else `cli`; with `cli_on_error` also when `api` fails
    (it must print nothing before it succeeds): the CLI then says what is wrong."""
    if cli_on_error:
        return f'{API_SOCKET}; if [ -n "$sock" ] && {api}; then :; else {cli}; fi'
    return f'{API_SOCKET}; if [ -n "$sock" ]; then {api}; else {cli}; fi'


def version_command(cli: str = "docker", api: bool = False) -> str:
    """The engine's version, client and server, as one JSON line (the one definition).

    With `api`, asked over the socket when it can be (`API_SOCKET`): the same line with the
    server part only (`{"Server": {...}}`: no client version, which only `facts` reports)."""
    command = f"{shell.quote(cli)} version --format '{{{{json .}}}}'"
    if not api:
        return command
    api_cmd = "v=$(" + _api_get("/version") + ') && printf \'{"Server":%s}\\n\' "$v"'
    return _api_or_cli(api_cmd, command, cli_on_error=True)


def objects_command(container: str, image: str | None = None, cli: str = "docker", api: bool = False) -> str:
    """Container + image in one inspect (each CLI call costs 0.1-0.25 s on a busy host); with
    `image` unknown, the container's own image is inspected after it.  With `api`, the two
    documents come from the socket when they can (`API_SOCKET`), each printed as a JSON array
    as `inspect` prints it (an absent object: an empty array)."""
    if image:
        command = shell.join([cli, "inspect", container, image])
    else:
        name = shell.quote(container)
        command = (
            f"{cli} inspect --type container {name} && {cli} image inspect "
            f"\"$({cli} inspect --type container -f '{{{{.Config.Image}}}}' {name})\""
        )
    if not api:
        return command
    get_ctr = _api_get(f"/containers/{container}/json")
    if image:
        get_img = _api_get(f"/images/{image}/json")
        find_img = ""
    else:  # by the container's image id: the first "Image":"sha256:..." of its document
        get_img = _api_get('"/images/$img/json"', quoted=False)
        find_img = f"img=; {_first_value('c', 'img', 'Image', '0-9a-f', quoted=True, head='sha256:')} "
    api_cmd = (
        f"c=$({get_ctr}); printf '[%s]\\n' \"$c\"; {find_img}"
        f'i=$({get_img}); printf \'[%s]\\n\' "$i"; [ -n "$c" ] && [ -n "$i" ]'
    )
    return _api_or_cli(api_cmd, command)


def inspect_argv(kind: str, ref: str, cli: str = "docker") -> list[str]:
    """Inspect one object, `kind` "image" or "container" (prints a JSON array; exit 1 when absent)."""
    return [cli, kind, "inspect", ref]


def container_id_command(container: str, cli: str = "docker", api: bool = False) -> str:
    """The container's full id, or nothing when it does not exist (stderr silenced)."""
    command = f"{shell.join([cli, 'inspect', '--type', 'container', '-f', '{{.Id}}', container])} 2>/dev/null"
    return _api_field(container, "Id", "0-9a-f", True, command) if api else command


def container_pid_command(container: str, cli: str = "docker", api: bool = False) -> str:
    """The PID of the container's first process on the host (0 when stopped), or nothing."""
    command = f"{shell.join([cli, 'inspect', '--type', 'container', '-f', '{{.State.Pid}}', container])} 2>/dev/null"
    return _api_field(container, "Pid", "0-9", False, command) if api else command


def _api_field(container: str, key: str, chars: str, quoted: bool, cli_command: str) -> str:
    """The first `"key":value` of the container's compact API document (`Id` is its first key,
    `State.Pid` comes before any other "Pid"; strings inside it escape their quotes)."""
    get = _api_get(f"/containers/{container}/json")
    pick = f'v=; {_first_value("c", "v", key, chars, quoted)} [ -n "$v" ] && printf \'%s\\n\' "$v"'
    return _api_or_cli(f"c=$({get}); {pick}; :", cli_command)


def _first_value(doc: str, var: str, key: str, chars: str, quoted: bool, head: str = "") -> str:
    """Shell that sets `$var` to the first `"key":value` of the JSON text in `$doc`: `value` is
    `head` then characters of the set `chars` (e.g. `0-9a-f`), in quotes when `quoted`, which
    are dropped.  Parameter expansion only: no grep/head/cut processes on the host."""
    prefix = shell.quote(f'"{key}":' + ('"' if quoted else "") + head)
    return (
        f"case ${doc} in *{prefix}*) {var}=${{{doc}#*{prefix}}}; "
        f"{var}={shell.quote(head)}${{{var}%%[!{chars}]*}};; esac;"
    )


def exec_command(container: str, argv: list[str], cli: str = "docker") -> str:
    """Run `argv` inside the running container."""
    return shell.join([cli, "exec", container, *argv])


def probe_sections(
    container: str | None,
    image: str | None = None,
    cli: str = "docker",
    runtimes: bool = False,
    names: SectionNames = ENGINE_SECTIONS,
    api: bool = False,
) -> list[tuple[str, str]]:
    """Shell sections: engine version, then container + image in one inspect (pure).

    With `container` None, no objects (facts).  With `runtimes`, also the
    daemon's runtimes (what `facts` reports).  `names` renames the sections
    to fit the caller's probe.  With `api`, version and objects are asked over
    the engine's socket when they can be (`API_SOCKET`; the CLI otherwise):
    the hot probes (health, the deploy probe) use it.
    """
    out = [(names.version, version_command(cli, api))] if names.version else []
    if container and names.objects:
        out.append((names.objects, objects_command(container, image, cli, api)))
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
