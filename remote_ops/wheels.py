"""SGLang release wheels from PyPI, cached: the real source the tool patches.

Used by `patch drift`, the sandbox (its host holds the real 0.5.9 tree) and the
tests.  Download goes through `pip download --no-deps sglang==V` once per
version into the cache dir; afterwards everything is read from the zip.
"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from .errors import NotFound, RemoteOpsError
from .paths import cache_dir



def wheel_dir() -> Path:
    return cache_dir() / "wheels"


def fetch_sglang_wheel(version: str, timeout: float = 300.0) -> Path:
    """Return the cached `sglang-<version>-py3-none-any.whl`, downloading it once."""
    found = sorted(wheel_dir().glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    wheel_dir().mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"sglang=={version}", "-d", str(wheel_dir())]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RemoteOpsError(f"pip download sglang=={version} timed out after {timeout:g}s") from None
    found = sorted(wheel_dir().glob(f"sglang-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        raise NotFound(f"could not download sglang=={version} from PyPI: "
                       f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return found[0]


def read_member(wheel: Path, member: str) -> bytes:
    """Bytes of one file inside a wheel (e.g. `sglang/srt/models/llama.py`)."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise NotFound(f"{member} is not in {wheel.name}") from None


def member_of(target: str) -> str:
    """A checkout path (`python/sglang/srt/models/x.py`) as a wheel member (`sglang/srt/models/x.py`)."""
    return target[len("python/"):] if target.startswith("python/") else target


def sglang_source(version: str, target: str) -> bytes:
    """The released file `target` (a spec's checkout-relative path) of SGLang `version`."""
    return read_member(fetch_sglang_wheel(version), member_of(target))


def unpack_python_tree(wheel: Path, dest: Path) -> Path:
    """Unpack the wheel's `sglang/` package to `dest/python/sglang` (a checkout's layout)."""
    target = dest / "python"
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("sglang/")]
        zf.extractall(target, members)
    return target / "sglang"
