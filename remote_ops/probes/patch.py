"""The patched file inside the running container: its sha256 and its patch blocks.

Read through the container's root on the host (`/proc/PID/root`, no process
started) when this user may (root; ~5 ms), at the path deploy copied it to
(`image_checkout`/target: the build's verify_patch.py proved that is the file
`sglang` imports); otherwise an exec in the container (the engine's
`exec_command`, `engine.cli_for`) finds the file the way Python would (~0.1 s: a process in the
container plus a python3 start).  `check_patch` compares it with the image's
label: the verified patched file of that image.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import patchspec, shell
from ..core.inventory import HostSpec
from ..engine import cli_for, labels
from ..engine.types import ContainerInfo, ImageInfo
from ..errors import RemoteOpsError
from .base import Check, Output, Probe, last_line

#: Counts the patch blocks in `$f` (each starts with this marker).
MARKER_COUNT = "grep -c '>>> remote-ops' \"$f\""


@dataclass(frozen=True)
class PatchFile:
    """What the probe found: the file's sha256 and its count of patch blocks, or why not."""

    sha256: str | None
    markers: str | None
    error: str | None = None


class PatchInContainer(Probe[PatchFile]):
    """sha256 + marker count of the patched file the container's Python imports."""

    name = "patch"

    def __init__(self, host: HostSpec) -> None:
        self.host = host

    def command(self) -> str:
        sha = shell.sha256_of_word('"$f"')
        try:
            in_image = patchspec.target_path(self.host.sglang.image_checkout, patchspec.for_host(self.host))
        except RemoteOpsError:  # no local spec for this host's patch: ask inside the container only
            return exec_patch_probe(self.host, sha, MARKER_COUNT)
        pid = cli_for(self.host).container_pid_command(self.host.container.name, api=True)
        fast = (
            f"pid=$({pid}); f=/proc/$pid/root{shell.quote(in_image)}; "
            f'if [ "${{pid:-0}}" -gt 0 ] 2>/dev/null && [ -r "$f" ]; then {sha} && {MARKER_COUNT}; else '
        )
        return fast + exec_patch_probe(self.host, sha, MARKER_COUNT) + "; fi"

    def parse(self, status: int, text: str) -> PatchFile:
        return parse_patch(status, text)


def parse_patch(status: int, text: str) -> PatchFile:
    """`SHA` on the first line, the marker count on the last; else the last line says why."""
    lines = text.strip().splitlines()
    if status != 0 or len(lines) < 2:
        return PatchFile(None, None, last_line(text))
    return PatchFile(lines[0].split()[0], lines[-1].strip())


def exec_patch_probe(host: HostSpec, sha: str, count: str) -> str:
    """The patch probe inside the container: the target named by the patch spec shipped in the
    image ($REMOTE_OPS_TOOL_DIR/patch-spec.json), located with the image's own python3."""
    locate = (
        "import importlib.util,json,os; s=importlib.util.find_spec('sglang'); "
        "t=json.load(open(os.environ['REMOTE_OPS_TOOL_DIR'] + '/patch-spec.json'))['target']; "
        "print(s.submodule_search_locations[0] + '/' + t.split('sglang/', 1)[1])"
    )
    inner = f"f=$(python3 -c {shell.quote(locate)}) && {sha} && {count}"
    return cli_for(host).exec_command(host.container.name, ["sh", "-c", inner])


def check_patch(probe: Output, c: ContainerInfo | None, image: ImageInfo | None) -> Check:
    """The container's importable patch target is the verified patched file of its image."""
    if c is None or not c.running:
        return Check("patch", "in_container", "skip", "container not running")
    found = parse_patch(*probe)
    if found.sha256 is None:
        return Check("patch", "in_container", "fail", f"patch markers not found in the container ({found.error})")
    sha, markers = found.sha256, found.markers
    want = image.labels.get(labels.SHA_AFTER) if image else None
    if want and sha != want:
        return Check("patch", "in_container", "fail", f"patched file sha {sha[:12]} != image label {want[:12]}")
    return Check("patch", "in_container", "ok", f"{markers} patch blocks present, sha {sha[:12]}", {"sha256": sha})
