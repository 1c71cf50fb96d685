"""Base images without a registry: rootfs tarballs imported into the lab dockerd.

- `busybox_image`: a ~2 MB image from Debian's busybox-static (sh, httpd, wget…),
  built in about a second.
- `base_python_image`: a Debian bookworm minbase rootfs with `PACKAGES`
  (python3, ca-certificates, python3-numpy and a BLAS, libblis4-serial, for the
  SGLang stand-in's network) made by debootstrap (~55-100 s on 2 cores, 250 MB),
  built once and cached as a tarball under `cache_dir()/rootfs/` named by the
  package list (`packages_key`), then `docker import`ed as
  `remote-ops/base-python:bookworm` with the list in the label
  `org.remote-ops.base-packages`: an image imported from another list is
  imported again, so a changed list never runs on a stale image.  It stands in
  for the SGLang base image's userland (python3, a shell, coreutils) in tests
  and the sandbox.
- `import_tar`: import any rootfs tarball as an image.

Nothing here pulls from a registry.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ..paths import cache_dir
from ._proc import LabError, run

BUSYBOX_TAG = "remote-ops/busybox:lab"
BASE_PYTHON_TAG = "remote-ops/base-python:bookworm"
SUITE = "bookworm"
# python3-numpy: the SGLang stand-in computes a tiny network; libblis4-serial: its matrix products
# ~5x faster than Debian's reference BLAS (a 3,000-token prefill ~0.1 s instead of ~0.5 s)
PACKAGES = ("python3", "ca-certificates", "python3-numpy", "libblis4-serial")
PACKAGES_LABEL = "org.remote-ops.base-packages"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def rootfs_cache() -> Path:
    """Where built rootfs tarballs are kept between runs."""
    return cache_dir() / "rootfs"


def docker_client() -> str:
    """The docker CLI the lab uses locally: Debian's 20.10 (matches dockerd, BuildKit works)."""
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise LabError("no docker client found (apt-get install docker.io)")


def docker(
    socket_path: str | Path, *args: str, timeout: float = 120.0, input: bytes | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run the docker CLI against the lab daemon at `socket_path`."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "DOCKER_HOST": f"unix://{socket_path}",
    }
    return run([docker_client(), *args], timeout=timeout, input=input, check=check, env=env)


def import_tar(socket_path: str | Path, tarball: str | Path | bytes, tag: str, timeout: float = 300.0) -> str:
    """`docker import` a rootfs tarball (path or bytes) as `tag`; return the image id."""
    if isinstance(tarball, bytes):
        out = docker(socket_path, "import", "-", tag, input=tarball, timeout=timeout)
    else:
        out = docker(socket_path, "import", str(tarball), tag, timeout=timeout)
    return out.stdout.decode().strip()


def image_exists(socket_path: str | Path, tag: str) -> bool:
    return docker(socket_path, "image", "inspect", tag, check=False, timeout=30).returncode == 0


# -- busybox ---------------------------------------------------------------
def busybox_binary() -> Path:
    """A static busybox: the installed busybox-static's, else one fetched with apt-get download."""
    installed = Path("/bin/busybox")
    if installed.exists() and _is_static(installed):
        return installed
    cached = rootfs_cache() / "busybox"
    if not cached.exists():
        _download_busybox(cached)
    return cached


def _is_static(path: Path) -> bool:
    proc = run(["file", "-L", str(path)], check=False, timeout=10) if shutil.which("file") else None
    return proc is None or b"statically linked" in proc.stdout


def _download_busybox(dest: Path) -> None:
    """`apt-get download busybox-static` + `dpkg -x`, keeping only the binary."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["apt-get", "download", "busybox-static"],
            cwd=tmp,
            check=True,
            capture_output=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        deb = next(Path(tmp).glob("busybox-static_*.deb"))
        run(["dpkg", "-x", str(deb), f"{tmp}/x"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f"{tmp}/x/bin/busybox", dest)


def busybox_rootfs_tar() -> bytes:
    """A tarball: /bin/busybox plus a symlink per applet, /tmp, /etc/passwd."""
    binary = busybox_binary()
    applets = run([str(binary), "--list-full"]).stdout.decode().split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in (
            "bin",
            "sbin",
            "usr",
            "usr/bin",
            "usr/sbin",
            "etc",
            "tmp",
            "root",
            "proc",
            "sys",
            "dev",
            "var",
            "var/www",
        ):
            _tar_dir(tar, d, 0o1777 if d == "tmp" else 0o755)
        tar.add(str(binary), "bin/busybox")
        for applet in applets:
            if applet != "bin/busybox":
                _tar_link(tar, applet, "/bin/busybox")
        _tar_file(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        _tar_file(tar, "etc/group", b"root:x:0:\n")
    return buf.getvalue()


def _tar_dir(tar: tarfile.TarFile, name: str, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def _tar_link(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    tar.addfile(info)


def _tar_file(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def busybox_image(socket_path: str | Path, tag: str = BUSYBOX_TAG) -> str:
    """Import the busybox rootfs as `tag` (once per daemon); return the tag."""
    if not image_exists(socket_path, tag):
        import_tar(socket_path, busybox_rootfs_tar(), tag)
    return tag


# -- debootstrap python ----------------------------------------------------
def packages_key() -> str:
    """Names the rootfs of `PACKAGES` (12 hex of their sha256): another list is another tarball."""
    return hashlib.sha256(",".join(PACKAGES).encode()).hexdigest()[:12]


def base_python_tarball(mirror: str | None = None, timeout: float = 900.0) -> Path:
    """The cached bookworm+python3 rootfs tarball (of `PACKAGES`), built with debootstrap on first use.

    A file lock makes concurrent runs build it once; the tarball is written
    under a temporary name and renamed, so a half-built file is never used.
    """
    tarball = rootfs_cache() / f"{SUITE}-minbase-{packages_key()}.tar"
    if tarball.exists():
        return tarball
    rootfs_cache().mkdir(parents=True, exist_ok=True)
    with _file_lock(rootfs_cache() / ".build.lock", timeout):
        if not tarball.exists():
            _build_python_rootfs(tarball, mirror or apt_mirror(), timeout)
    return tarball


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if not path.is_file() or path.suffix not in ("", ".list", ".sources"):
            continue
        for line in path.read_text(errors="replace").splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(w for w in words[1:] if "://" in w)
    return DEFAULT_MIRROR


def _build_python_rootfs(tarball: Path, mirror: str, timeout: float) -> None:
    """debootstrap into a temp dir next to the cache, trim apt caches, tar it."""
    if not shutil.which("debootstrap"):
        raise LabError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix=".build-") as tmp:
        root = Path(tmp) / "root"
        run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(root), mirror],
            timeout=timeout,
        )
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (root / junk).glob("*"):
                if f.is_file():
                    f.unlink()
        partial = tarball.with_suffix(".tar.partial")
        run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], timeout=timeout)
        os.replace(partial, tarball)


@contextmanager
def _file_lock(path: Path, timeout: float):
    """An exclusive flock with a deadline (another run may be building)."""
    with open(path, "a") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LabError(f"{path} is held by another build for over {timeout:g}s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def has_label(socket_path: str | Path, tag: str, label_name: str, value: str) -> bool:
    """Whether image `tag` exists and its label `label_name` reads `value`."""
    label = "{{ index .Config.Labels %s }}" % json.dumps(label_name)
    out = docker(socket_path, "image", "inspect", "-f", label, tag, check=False, timeout=30)
    return out.returncode == 0 and out.stdout.decode().strip() == value


def keyed_image(
    socket_path: str | Path,
    tag: str,
    key: tuple[str, str],
    tarball: Path,
    build: Callable[[str | Path, str, float], None],
    lock_name: str,
    timeout: float,
) -> str:
    """`tag` in the dockerd at `socket_path` with `key` (label name, value) on it: already there,
    loaded from the saved `tarball`, or built by `build(socket_path, value, timeout)` (under the
    lock `lock_name` next to the tarball) and saved; return the tag."""
    if has_label(socket_path, tag, *key):
        return tag
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(tarball.parent / lock_name, timeout):
        if not tarball.exists():
            build(socket_path, key[1], timeout)
            partial = tarball.with_suffix(".tar.partial")
            docker(socket_path, "save", "-o", str(partial), tag, timeout=timeout)
            os.replace(partial, tarball)
    if not has_label(socket_path, tag, *key):
        docker(socket_path, "load", "-q", "-i", str(tarball), timeout=timeout)
    return tag


def classic_build(socket_path: str | Path, ctx: str, *, base: str, tag: str, label: str, timeout: float) -> None:
    """`docker build --network none` (classic builder, nothing pulled) of the context `ctx`, FROM
    `base` (its BASE build arg), tagged `tag` and labelled `label` (NAME=VALUE)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "DOCKER_HOST": f"unix://{socket_path}",
        "DOCKER_BUILDKIT": "0",
    }
    argv = [docker_client(), "build", "--network", "none", "--pull=false", "-q"]
    argv += ["--build-arg", f"BASE={base}", "--label", label, "-t", tag, ctx]
    run(argv, timeout=timeout, env=env)


def base_python_image(socket_path: str | Path, tag: str = BASE_PYTHON_TAG) -> str:
    """Import the bookworm+python3 rootfs as `tag` (building the tarball if needed), unless `tag`
    already holds the rootfs of this package list (its `PACKAGES_LABEL`)."""
    want = ",".join(PACKAGES)
    label = "{{ index .Config.Labels %s }}" % json.dumps(PACKAGES_LABEL)
    have = docker(socket_path, "image", "inspect", "-f", label, tag, check=False, timeout=30)
    if have.returncode != 0 or have.stdout.decode().strip() != want:
        change = f"LABEL {PACKAGES_LABEL}={want}"
        docker(socket_path, "import", "--change", change, str(base_python_tarball()), tag, timeout=300)
    return tag
