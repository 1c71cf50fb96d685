"""An engine kind's command lines over SSH, and the parser of their output (pure builders).

`DockerCLI` knows the docker CLI: its binary, every command line remote-ops
runs with it on a host, and how to read those commands' output back into the
records of `engine.types`.  Each engine kind's class holds one as `cli`
(`DockerEngine.cli`; `PodmanEngine.cli` is a `PodmanCLI(DockerCLI)`), and
workflows get it from the inventory's `engine` field with
`remote_ops.engine.cli_for(host)`: no API channel is opened and no SDK is
imported for it.  Workflows write no engine command line themselves.

What runs as a CLI command rather than an API call:

- the engine's part of a one-round-trip shell probe (`probe_sections` /
  `parse_probe`: version, container + image, runtimes; the container's id and
  PID; `exec`).  A no-op deploy and `health` must run a shell command on the
  host anyway; the engine's questions ride along in it.  With `api=True` they
  are asked over the engine's unix socket with curl when it can be
  (`api_socket`; ~5 ms against 25-35 ms of CPU per CLI process on the host);
- builds: BuildKit exists only in the docker CLI (the SDK drives the legacy
  builder), and the build context is assembled on the host (docs/ENGINES.md).
  Never pulls;
- throwaway containers whose stdin/stdout the caller streams (the in-image
  patch verifier, `dataset prepare --on-host`), and `exec`;
- server logs with a cursor (`logs_since_command`) and `logs follow`;
- the lifecycle's `--dry-run` text: the command lines equivalent to the
  engine calls that would be made (what an operator would type).
"""

from __future__ import annotations

from typing import Any

from ..core import shell
from . import probe
from .probe import ENGINE_SECTIONS, SectionNames, Snapshot
from .spec import RunSpec, cli_argv
from .types import ContainerInfo, ImageInfo

#: Where the image keeps remote-ops' in-image tools (verify_patch.py, patch-spec.json).
TOOL_DIR = "/opt/remote-ops"

#: Sets `sock` to the docker daemon's unix socket when its API can be asked directly with curl:
#: curl present, no docker context selected, DOCKER_HOST unset or unix://, the socket readable
#: and writable by this user.  Otherwise `sock` is empty and the section falls back to the CLI.
DOCKER_API_SOCKET = (
    'sock=; if command -v curl >/dev/null 2>&1 && [ -z "${DOCKER_CONTEXT:-}" ] && '
    'cfg="${DOCKER_CONFIG:-$HOME/.docker}/config.json" && ! { [ -f "$cfg" ] && grep -qs \'"currentContext"\' "$cfg"; }; then '
    'case "${DOCKER_HOST:-unix:///var/run/docker.sock}" in unix://*) '
    "sock=${DOCKER_HOST:-unix:///var/run/docker.sock}; sock=${sock#unix://}; "
    '[ -S "$sock" ] && [ -r "$sock" ] && [ -w "$sock" ] || sock=;; esac; fi'
)


def verify_patch_args(expected_sha256: str | None) -> list[str]:
    """The in-image verifier's argv (run with the image's or the container's python3)."""
    args = ["python3", f"{TOOL_DIR}/verify_patch.py"]
    return args + (["--expect-sha256", expected_sha256] if expected_sha256 else [])


class DockerCLI:
    """The docker CLI's command lines and the parser of their output (pure; no state)."""

    kind = "docker"
    binary = "docker"
    #: shell that sets `$sock` to the engine's API socket when curl may ask it, else empty
    api_socket = DOCKER_API_SOCKET

    # -- the one-round-trip shell probe -------------------------------------------------------
    def probe_sections(
        self,
        container: str | None,
        image: str | None = None,
        *,
        runtimes: bool = False,
        names: SectionNames = ENGINE_SECTIONS,
        api: bool = False,
    ) -> list[tuple[str, str]]:
        """The engine's shell sections for container `container` / image `image`: version, then
        container + image in one inspect, then (with `runtimes`) the engine's runtimes.

        With `container` None, no objects (facts).  `names` renames the sections
        to fit the caller's probe (None: not asked).  With `api`, version and
        objects are asked over the engine's socket when they can be (the CLI
        otherwise): the hot probes (health, the deploy probe) use it.  Read the
        output back with `parse_probe` and the same `names`.
        """
        out = [(names.version, self.version_command(api))] if names.version else []
        if container and names.objects:
            out.append((names.objects, self.objects_command(container, image, api)))
        if runtimes and names.runtimes:
            out.append((names.runtimes, self.runtimes_command()))
        return out

    def parse_probe(self, sections: dict[str, tuple[int, str]], names: SectionNames = ENGINE_SECTIONS) -> Snapshot:
        """`shell.split_sections` output of `probe_sections` -> Snapshot (pure)."""
        return probe.read_snapshot(sections, self.kind, names)

    def version_command(self, api: bool = False) -> str:
        """The engine's version, client and server, as one JSON line.

        With `api`, asked over the socket when it can be (`api_socket`): the same line with
        the server part only (`{"Server": {...}}`: no client version, which only `facts` reports)."""
        command = f"{shell.quote(self.binary)} version --format '{{{{json .}}}}'"
        if not api:
            return command
        api_cmd = "v=$(" + _api_get("/version") + ') && printf \'{"Server":%s}\\n\' "$v"'
        return self._api_or_cli(api_cmd, command, cli_on_error=True)

    def objects_command(self, container: str, image: str | None = None, api: bool = False) -> str:
        """Container + image in one inspect (each CLI call costs 0.1-0.25 s on a busy host); with
        `image` unknown, the container's own image is inspected after it.  With `api`, the two
        documents come from the socket when they can (`api_socket`), each printed as a JSON array
        as `inspect` prints it (an absent object: an empty array)."""
        cli = shell.quote(self.binary)
        if image:
            command = shell.join([self.binary, "inspect", container, image])
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
        return self._api_or_cli(api_cmd, command)

    def runtimes_command(self) -> str:
        """The engine's OCI runtimes as one JSON object keyed by name (what `facts` reports)."""
        return f"{shell.quote(self.binary)} info --format '{{{{json .Runtimes}}}}'"

    def inspect_argv(self, what: str, ref: str) -> list[str]:
        """Inspect one object, `what` "image" or "container" (prints a JSON array; exit 1 when absent)."""
        return [self.binary, what, "inspect", ref]

    def parse_inspect(self, status: int, text: str) -> tuple[ImageInfo | None, ContainerInfo | None]:
        """The objects of one `inspect` output: (image, container), either may be None; none
        when the command failed."""
        return probe.parse_inspect(text) if status == 0 else (None, None)

    def container_id_command(self, container: str, api: bool = False) -> str:
        """The container's full id, or nothing when it does not exist (stderr silenced)."""
        command = self._format_command(container, "{{.Id}}")
        return self._api_field(container, "Id", "0-9a-f", True, command) if api else command

    def container_pid_command(self, container: str, api: bool = False) -> str:
        """The PID of the container's first process on the host (0 when stopped), or nothing."""
        command = self._format_command(container, "{{.State.Pid}}")
        return self._api_field(container, "Pid", "0-9", False, command) if api else command

    def container_image_command(self, container: str) -> str:
        """The image reference the container was created from (its `Config.Image`); when there is
        no such container, nothing on stdout and the CLI's complaint on stderr."""
        return shell.join([self.binary, "inspect", "-f", "{{.Config.Image}}", container])

    def running_command(self, container: str) -> str:
        """`true` while the container runs, `false` when stopped, nothing when it does not exist."""
        return self._format_command(container, "{{.State.Running}}")

    def exec_command(self, container: str, argv: list[str]) -> str:
        """Run `argv` inside the running container."""
        return shell.join([self.binary, "exec", container, *argv])

    def parse_version_line(self, text: str) -> dict[str, Any]:
        """The raw `version --format '{{json .}}'` document ({} when the output is not JSON)."""
        return probe.parse_version_line(text)

    # -- builds -------------------------------------------------------------------------------
    def builder_sections(self) -> list[tuple[str, str]]:
        """Shell sections that tell which builder the host's CLI has (`choose_builder` reads them)."""
        return [
            ("buildx", f"{shell.quote(self.binary)} buildx version >/dev/null 2>&1"),
            ("version", self.version_command()),
        ]

    def choose_builder(self, sections: dict[str, tuple[int, str]]) -> str:
        """'buildkit' when the host's CLI can use it, else 'legacy' (pure).

        Docker >= 23 needs the buildx plugin for BuildKit; 20.10-22.x CLIs have it built in.
        """
        if sections.get("buildx", (1, ""))[0] == 0:
            return "buildkit"
        major = client_major(self.parse_version_line(sections.get("version", (1, ""))[1]))
        return "buildkit" if major is not None and major < 23 else "legacy"

    def build_cmd(self, context_dir: str, tag: str, builder: str | None = None, iidfile: str | None = None) -> str:
        """Build `context_dir` on the host as `tag`; never pulls; the image id to `iidfile`.
        `builder` None: the CLI's own default builder."""
        argv = [self.binary, "build", "--pull=false", "-t", tag]
        argv += ["--iidfile", iidfile] if iidfile else []
        argv += ["--progress=plain"] if builder == "buildkit" else []
        command = shell.join([*argv, context_dir])
        if builder is None:
            return command
        return f"{'DOCKER_BUILDKIT=1' if builder == 'buildkit' else 'DOCKER_BUILDKIT=0'} {command}"

    def image_id(self, text: str) -> str:
        """The image id an `--iidfile` holds (`sha256:...`)."""
        return text.strip()

    # -- containers as command lines ------------------------------------------------------------
    def run_argv(self, spec: RunSpec) -> list[str]:
        """`spec` as the `run` command line (detached, never pulls): what the engine's create +
        start do, as an operator would type it (`--dry-run`, `--diff`, a training container)."""
        return [self.binary, *cli_argv(spec)[1:]]

    def throwaway_command(
        self,
        image_word: str,
        args: list[str],
        *,
        entrypoint: str,
        mounts: tuple[str, ...] = (),
        stdin: bool = False,
        name: str | None = None,
    ) -> str:
        """A throwaway container (`--rm`, no network, never pulls) of `image_word` (a shell word:
        quoted, or a `"$(...)"` the host expands) running `entrypoint` with `args`; with `stdin`
        the caller's input reaches it; with `name`, named so that it can be removed by name."""
        head = [self.binary, "run", "--rm", *(["--name", name] if name else []), *(["-i"] if stdin else [])]
        head += [
            "--pull=never",
            "--network",
            "none",
            "--entrypoint",
            entrypoint,
            *[a for m in mounts for a in ("-v", m)],
        ]
        return f"{shell.join(head)} {image_word} {shell.join(args)}".rstrip()

    def bounded_throwaway_command(
        self,
        image_word: str,
        args: list[str],
        *,
        name: str,
        seconds: float,
        entrypoint: str,
        mounts: tuple[str, ...] = (),
        stdin: bool = False,
    ) -> str:
        """`throwaway_command` named `name`, whose engine client ends on the host within `seconds`
        (coreutils `timeout`, SIGKILL 2 s later; exit 124), and whose container is removed however
        the shell ends: `rm -f` on EXIT, and HUP/INT/PIPE/TERM end the shell through it.  A laptop
        killed mid-run therefore leaves nothing behind once `seconds` have passed.  Hosts without
        `timeout` run it unbounded (the trap still removes it when the shell ends)."""
        run = self.throwaway_command(image_word, args, entrypoint=entrypoint, mounts=mounts, stdin=stdin, name=name)
        limit = max(1, int(seconds))
        traps = (
            f"trap {shell.quote(self.remove_cmd(name))} EXIT; "
            "trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 141' PIPE; trap 'exit 143' TERM"
        )
        return f"{traps}; if command -v timeout >/dev/null 2>&1; then timeout -k 2 {limit} {run}; else {run}; fi"

    def verify_in_image_cmd(self, image: str, expected_sha256: str | None) -> str:
        """Run the verifier with the image's python3 in a throwaway container (no network, no pull)."""
        return self.throwaway_command(shell.quote(image), verify_patch_args(expected_sha256)[1:], entrypoint="python3")

    def verify_in_container_cmd(self, name: str, expected_sha256: str | None) -> list[str]:
        return [self.binary, "exec", name, *verify_patch_args(expected_sha256)]

    def remove_cmd(self, name: str) -> str:
        """Remove the container if it exists (stopped first); succeeds when it is absent."""
        return f"{shell.join([self.binary, 'rm', '-f', name])} >/dev/null 2>&1 || true"

    def stop_cmd(self, name: str, grace_s: int = 30) -> list[str]:
        return [self.binary, "stop", "-t", str(grace_s), name]

    def start_cmd(self, name: str) -> list[str]:
        return [self.binary, "start", name]

    def restart_cmd(self, name: str, grace_s: int = 30) -> list[str]:
        return [self.binary, "restart", "-t", str(grace_s), name]

    # -- logs ---------------------------------------------------------------------------------
    def logs_since_command(self, container: str, since: str) -> str:
        """The container's id on the first line (exit 3 when it does not exist), then its log
        lines from `since` on, each starting with the engine's RFC 3339 timestamp."""
        c = shell.quote(container)
        cli = shell.quote(self.binary)
        return (
            f"{cli} inspect --format '{{{{.Id}}}}' {c} || exit 3; "
            f"{cli} logs --timestamps --since {shell.quote(since)} {c} 2>&1"
        )

    def logs_follow_command(self, container: str, since: str | None = None, lines: int | None = None) -> str:
        """Stream the container's log: from `since`, else its last `lines` lines, else all of it
        (the log's stderr lines on the command's stderr: the caller redirects)."""
        start = ["--since", since] if since else ["--tail", str(int(lines))] if lines is not None else []
        return shell.join([self.binary, "logs", "-f", *start, container])

    def logs_hint(self, container: str) -> str:
        """What an operator types on the host to read the container's log."""
        return shell.join([self.binary, "logs", container])

    # -- helpers ------------------------------------------------------------------------------
    def _format_command(self, container: str, template: str) -> str:
        """One field of the container's inspect document, or nothing (stderr silenced)."""
        argv = [self.binary, "inspect", "--type", "container", "-f", template, container]
        return f"{shell.join(argv)} 2>/dev/null"

    def _api_or_cli(self, api: str, cli: str, cli_on_error: bool = False) -> str:
        """`api` when the socket can be used, else `cli`; with `cli_on_error` also when `api` fails
        (it must print nothing before it succeeds): the CLI then says what is wrong."""
        if cli_on_error:
            return f'{self.api_socket}; if [ -n "$sock" ] && {api}; then :; else {cli}; fi'
        return f'{self.api_socket}; if [ -n "$sock" ]; then {api}; else {cli}; fi'

    def _api_field(self, container: str, key: str, chars: str, quoted: bool, cli_command: str) -> str:
        """The first `"key":value` of the container's compact API document (`Id` is its first key,
        `State.Pid` comes before any other "Pid"; strings inside it escape their quotes)."""
        get = _api_get(f"/containers/{container}/json")
        pick = f'v=; {_first_value("c", "v", key, chars, quoted)} [ -n "$v" ] && printf \'%s\\n\' "$v"'
        return self._api_or_cli(f"c=$({get}); {pick}; :", cli_command)


def client_major(version_doc: dict[str, Any]) -> int | None:
    """Major version of the CLI from a `version --format '{{json .}}'` document."""
    version = ((version_doc.get("Client") or {}).get("Version") or "").split(".")[0]
    return int(version) if version.isdigit() else None


def _api_get(path: str, quoted: bool = True) -> str:
    """curl GET of an Engine API path on `$sock`; exit 22 (and no output) on an HTTP error.
    `quoted=False`: `path` is one shell word already (it expands a variable: `"/images/$img/json"`)."""
    url = shell.quote("http://engine" + path) if quoted else f"http://engine{path}"
    return f"curl -sf --noproxy '*' -m 30 --unix-socket \"$sock\" {url}"


def _first_value(doc: str, var: str, key: str, chars: str, quoted: bool, head: str = "") -> str:
    """Shell that sets `$var` to the first `"key":value` of the JSON text in `$doc`: `value` is
    `head` then characters of the set `chars` (e.g. `0-9a-f`), in quotes when `quoted`, which
    are dropped.  Parameter expansion only: no grep/head/cut processes on the host."""
    prefix = shell.quote(f'"{key}":' + ('"' if quoted else "") + head)
    return (
        f"case ${doc} in *{prefix}*) {var}=${{{doc}#*{prefix}}}; "
        f"{var}={shell.quote(head)}${{{var}%%[!{chars}]*}};; esac;"
    )
