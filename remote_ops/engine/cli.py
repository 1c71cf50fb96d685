"""What still runs as the docker CLI over SSH, and the CLI form of engine calls (pure builders).

- Builds: BuildKit exists only in the docker CLI (the SDK drives the legacy
  builder), and the build context is assembled on the host, so `docker build`
  runs there (docs/ENGINES.md, "Builds stay on the CLI").  Never pulls.
- The in-image patch verification: a throwaway `docker run --rm` with no
  network, or `docker exec` in the running container; its output is the
  verifier's one JSON line, streamed back through the same shell round trip.
- The lifecycle's `--dry-run` text: the `docker` command lines equivalent to
  the engine calls that would be made (what an operator would type).
"""

from __future__ import annotations

from ..core import shell

TOOL_DIR = "/opt/remote-ops"


def buildx_cmd() -> str:
    return "docker buildx version >/dev/null 2>&1"


def build_cmd(context_dir: str, tag: str, builder: str, iidfile: str) -> str:
    """`docker build` of `context_dir` on the host; never pulls; writes the image id to `iidfile`."""
    argv = ["docker", "build", "--pull=false", "-t", tag, "--iidfile", iidfile]
    if builder == "buildkit":
        argv += ["--progress=plain"]
    env = "DOCKER_BUILDKIT=1" if builder == "buildkit" else "DOCKER_BUILDKIT=0"
    return f"{env} {shell.join(argv + [context_dir])}"


def verify_patch_args(expected_sha256: str | None) -> list[str]:
    args = ["python3", f"{TOOL_DIR}/verify_patch.py"]
    return args + (["--expect-sha256", expected_sha256] if expected_sha256 else [])


def verify_in_image_cmd(image: str, expected_sha256: str | None) -> list[str]:
    """Run the verifier with the image's python3 in a throwaway container (no network, no pull)."""
    return [
        "docker",
        "run",
        "--rm",
        "--pull=never",
        "--network",
        "none",
        "--entrypoint",
        "python3",
        image,
        *verify_patch_args(expected_sha256)[1:],
    ]


def verify_in_container_cmd(name: str, expected_sha256: str | None) -> list[str]:
    return ["docker", "exec", name, *verify_patch_args(expected_sha256)]


def remove_cmd(name: str) -> str:
    """Remove the container if it exists (stopped first); succeeds when it is absent."""
    return f"{shell.join(['docker', 'rm', '-f', name])} >/dev/null 2>&1 || true"


def stop_cmd(name: str, grace_s: int = 30) -> list[str]:
    return ["docker", "stop", "-t", str(grace_s), name]


def start_cmd(name: str) -> list[str]:
    return ["docker", "start", name]


def restart_cmd(name: str, grace_s: int = 30) -> list[str]:
    return ["docker", "restart", "-t", str(grace_s), name]
