"""`PodmanEngine`: podman as an engine kind (the inventory's `engine: podman`), in this one file.

Podman serves a Docker-compatible Engine API, so the Docker SDK's `APIClient`
of `DockerEngine` talks to it unchanged; what differs is how its API is
reached, its CLI, and a few answers (docs/ENGINES.md, "A second engine"):

- The API: podman 4.3 (Debian 12) has no `system dial-stdio`.  Its API is
  `podman system service --time=N unix://SOCKET`; the dial (`RELAY`) runs on
  an exec channel of the SSH connection, starts that service when the socket
  is not there (idle for `SERVICE_IDLE_S`, it exits), and relays the channel's
  stdin/stdout to the socket with socat, or with a few lines of the host's
  python3.  The socket: `CONTAINER_HOST` when it is `unix://...` (podman's own
  variable), else `/run/podman/podman.sock` for root, else
  `$XDG_RUNTIME_DIR/podman/podman.sock`.
- The CLI: `podman` for the shell probes, builds, logs and throwaway
  containers.  Builds use buildah (`podman build`, no BuildKit), never pull
  (`--pull=never`), and write OCI images: those carry no HEALTHCHECK, because
  podman runs health checks only through systemd timers, and a host without
  systemd (containers, minimal servers) would report `starting` forever.
  Without an engine health check, "healthy" is what `health` and deploy's wait
  decide anyway: the container runs and the cheap endpoints answer.
- Answers: `podman inspect` prints libpod's documents (image ids without
  `sha256:`, short names qualified as `localhost/NAME`, a local CLI's
  `version` with no server part); `parse_probe` / `parse_inspect` read them
  as the API's (`sha256:` ids, names as created), so a deploy's plan compares
  like with like whichever path answered.
- GPUs: podman 4.3's compat API drops `DeviceRequests` and does not resolve
  CDI names, so a spec's GPUs become `NVIDIA_VISIBLE_DEVICES` in the
  container's environment, which the NVIDIA container toolkit's OCI hook
  (`oci-nvidia-hook`) reads.  Untested on a GPU host.  With the host's IPC
  namespace (the default) `shm_size` is dropped: podman refuses the pair.
- `--init` (every server container) needs podman's `catatonit` on the host.
"""

from __future__ import annotations

import json
from dataclasses import replace

from ..core import shell
from .cli import DockerCLI
from .docker import DockerEngine
from .probe import ENGINE_SECTIONS, SectionNames, Snapshot
from .spec import RunSpec
from .types import ContainerInfo, ImageInfo

#: Seconds the API service started by the dial stays up with no client (then it exits).
SERVICE_IDLE_S = 600

#: Shell that sets `s` to the podman API socket's path (see the module doc).
SOCKET_PATH = (
    's=; case "${CONTAINER_HOST:-}" in unix://*) s=${CONTAINER_HOST#unix://};; '
    '"") if [ "$(id -u)" = 0 ]; then s=/run/podman/podman.sock; '
    "else s=${XDG_RUNTIME_DIR:-/run/user/$(id -u)}/podman/podman.sock; fi;; esac"
)

#: The API socket for a shell probe: `sock` set when curl may ask it, else empty.
API_SOCKET = (
    f"sock=; if command -v curl >/dev/null 2>&1; then {SOCKET_PATH}; sock=$s; "
    '[ -n "$sock" ] && [ -S "$sock" ] && [ -r "$sock" ] && [ -w "$sock" ] || sock=; fi'
)

#: Relay stdin/stdout to the unix socket argv[1] (when socat is not installed).
PY_RELAY = r"""
import os, socket, sys, threading, time
s = socket.socket(socket.AF_UNIX)
for i in range(100):
    try:
        s.connect(sys.argv[1])
        break
    except OSError as e:
        if i == 99:
            sys.exit("cannot connect to the podman API at %s: %s" % (sys.argv[1], e))
        time.sleep(0.1)
def up():
    while True:
        b = os.read(0, 65536)
        if not b:
            break
        s.sendall(b)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while True:
    b = s.recv(65536)
    if not b:
        break
    while b:
        b = b[os.write(1, b):]
"""

#: The dial: find the socket, start the API service when it is not there (waiting up to 10 s
#: for its socket), then relay this channel's stdin/stdout to it.
RELAY = (
    f"{SOCKET_PATH}; "
    'if [ -z "$s" ]; then echo "CONTAINER_HOST is not unix://: $CONTAINER_HOST" >&2; exit 2; fi; '
    "command -v podman >/dev/null 2>&1 || { echo 'podman: command not found' >&2; exit 127; }; "
    'if [ ! -S "$s" ]; then mkdir -p "$(dirname "$s")"; '
    "if command -v setsid >/dev/null 2>&1; then ss=setsid; else ss=; fi; "
    f'env -u CONTAINER_HOST $ss podman system service --time={SERVICE_IDLE_S} "unix://$s" '
    "</dev/null >/dev/null 2>&1 & p=$!; i=0; "
    'while [ ! -S "$s" ] && [ $i -lt 100 ] && kill -0 $p 2>/dev/null; do sleep 0.1; i=$((i+1)); done; fi; '
    'if command -v socat >/dev/null 2>&1; then exec socat - "UNIX-CONNECT:$s"; fi; '
    f'exec python3 -c {shell.quote(PY_RELAY)} "$s"'
)


class PodmanCLI(DockerCLI):
    """The podman CLI's command lines, and its answers read as the API's (pure)."""

    kind = "podman"
    binary = "podman"
    api_socket = API_SOCKET

    def runtimes_command(self) -> str:
        """podman has one OCI runtime per host: `{"NAME": {}}`, the form `parse_probe` reads."""
        name = f"$({shell.quote(self.binary)} info --format '{{{{.Host.OCIRuntime.Name}}}}')"
        return f'printf \'{{"%s":{{}}}}\\n\' "{name}"'

    def parse_probe(self, sections: dict[str, tuple[int, str]], names: SectionNames = ENGINE_SECTIONS) -> Snapshot:
        """Libpod's answers read as the API's: a local CLI's version is the engine's (there is no
        daemon), ids carry `sha256:`, short names lose podman's `localhost/`."""
        version = names.version or ""
        if version in sections:
            status, text = sections[version]
            sections = {**sections, version: (status, _server_version(text))}
        snap = super().parse_probe(sections, names)
        return replace(snap, container=_container(snap.container), image=_image(snap.image))

    def parse_inspect(self, status: int, text: str) -> tuple[ImageInfo | None, ContainerInfo | None]:
        image, ctr = super().parse_inspect(status, text)
        return _image(image), _container(ctr)

    def builder_sections(self) -> list[tuple[str, str]]:
        """Nothing to ask: podman builds with buildah."""
        return []

    def choose_builder(self, sections: dict[str, tuple[int, str]]) -> str:
        return "buildah"

    def build_cmd(self, context_dir: str, tag: str, builder: str | None = None, iidfile: str | None = None) -> str:
        """`podman build` of `context_dir` as an OCI image (no HEALTHCHECK: module doc); never pulls."""
        argv = [self.binary, "build", "--pull=never", "--format", "oci", "-t", tag]
        argv += ["--iidfile", iidfile] if iidfile else []
        return shell.join([*argv, context_dir])

    def run_argv(self, spec: RunSpec) -> list[str]:
        return super().run_argv(podman_spec(spec))


class PodmanEngine(DockerEngine):
    """The host's podman, through its Docker-compatible API over `remote`'s SSH connection."""

    kind = "podman"
    cli = PodmanCLI()
    dial = ("sh", "-c", RELAY)
    dial_label = "the podman API relay (podman system service + socat/python3)"
    dial_hint = "is podman installed on the host (and catatonit, for --init), and python3 or socat?"

    def create(self, spec: RunSpec, *, timeout: float | None = None) -> str:
        """Create from `spec` as podman takes it (`podman_spec`: GPUs, shm size)."""
        return super().create(podman_spec(spec), timeout=timeout)

    def container(self, name: str, *, timeout: float | None = None) -> ContainerInfo | None:
        """As `DockerEngine.container`, its image named as it was created (no `localhost/`)."""
        return _container(super().container(name, timeout=timeout))

    def image(self, ref: str, *, timeout: float | None = None) -> ImageInfo | None:
        return _image(super().image(ref, timeout=timeout))


def podman_spec(spec: RunSpec) -> RunSpec:
    """`spec` as podman takes it (pure): its GPUs as `NVIDIA_VISIBLE_DEVICES` for the NVIDIA OCI
    hook, and no `shm_size` with the host's IPC namespace (docker ignores it there, podman
    refuses the container; the host's /dev/shm is what the container gets either way)."""
    if spec.ipc == "host" and spec.shm_size:
        spec = replace(spec, shm_size=None)
    if spec.gpus == "none" or spec.gpus == ():
        return spec
    visible = "all" if spec.gpus == "all" else ",".join(str(g) for g in spec.gpus)
    return replace(spec, gpus="none", env={**spec.env, "NVIDIA_VISIBLE_DEVICES": visible})


def _server_version(text: str) -> str:
    """A `podman version` document as the API's `{"Server": ...}`: a local CLI (no server part) is
    the engine itself; a remote one's server says `APIVersion`."""
    line = next((x for x in text.splitlines() if x.startswith("{")), "")
    try:
        doc = json.loads(line) if line else None
    except json.JSONDecodeError:
        return text
    if not isinstance(doc, dict) or not (doc.get("Server") or doc.get("Client")):
        return text
    server = dict(doc.get("Server") or doc["Client"])
    server.setdefault("ApiVersion", server.get("APIVersion", ""))
    return json.dumps({**doc, "Server": server})


def _image_id(value: str) -> str:
    """Libpod prints a bare 64-hex id where the API says `sha256:...`."""
    return f"sha256:{value}" if len(value) == 64 and ":" not in value else value


def _short(ref: str) -> str:
    """`localhost/NAME[:TAG]` (podman's qualified short name) -> `NAME[:TAG]`."""
    return ref.removeprefix("localhost/")


def _image(image: ImageInfo | None) -> ImageInfo | None:
    if image is None:
        return None
    return replace(image, id=_image_id(image.id), tags=tuple(_short(t) for t in image.tags))


def _container(ctr: ContainerInfo | None) -> ContainerInfo | None:
    if ctr is None:
        return None
    return replace(ctr, image_id=_image_id(ctr.image_id), image_ref=_short(ctr.image_ref))
