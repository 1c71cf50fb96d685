"""SGLang release wheels from PyPI, cached: the real source the tool patches.

Used by `patch drift`, the sandbox (its host holds the real 0.5.9 tree) and the
tests.  A wheel is found through the package index's JSON Simple API (PEP 691,
`/simple/sglang/`), downloaded once into the cache dir with plain urllib (no
pip: venvs made by uv have none), and its sha256 is checked against the digest
the index published before it is kept.  Afterwards everything is read from the
zip.  `REMOTE_OPS_INDEX_URL` points at a mirror speaking the same API.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from ..errors import NotFound, RemoteOpsError, VerifyFailed
from ..paths import cache_dir

DEFAULT_INDEX = "https://pypi.org/simple"


def wheel_dir() -> Path:
    return cache_dir() / "wheels"


def fetch_sglang_wheel(version: str, timeout: float = 300.0) -> Path:
    """Return the cached `sglang-<version>-*.whl`, downloading (and sha256-checking) it once."""
    found = sorted(wheel_dir().glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    name, url, sha256 = pick_wheel(release_files(version, timeout), version)
    wheel_dir().mkdir(parents=True, exist_ok=True)
    return _download(url, wheel_dir() / name, sha256, timeout)


def release_files(version: str, timeout: float) -> list[dict]:
    """The index's files for sglang==version, from the JSON Simple API (PEP 691)."""
    base = os.environ.get("REMOTE_OPS_INDEX_URL", DEFAULT_INDEX).rstrip("/")
    req = urllib.request.Request(f"{base}/sglang/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            files = json.load(r).get("files", [])
    except urllib.error.HTTPError as exc:
        raise RemoteOpsError(f"the package index answered {exc.code} for sglang") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RemoteOpsError(f"cannot read sglang's files from {base}: {exc}") from None
    mine = [f for f in files if f.get("filename", "").startswith(f"sglang-{version}-") and not f.get("yanked")]
    if not mine:
        raise NotFound(f"sglang=={version} has no wheel on {base}")
    return mine


def pick_wheel(files: list[dict], version: str) -> tuple[str, str, str]:
    """(filename, url, sha256) of the wheel to read: the pure-Python one when there is one.

    Some releases ship only platform wheels; their .py files are the same in
    each, so the first by name is as good as any (and stable)."""
    wheels = sorted((f for f in files if f["filename"].endswith(".whl")), key=lambda f: f["filename"])
    if not wheels:
        raise NotFound(f"sglang=={version} has no wheel on the package index")
    pure = [f for f in wheels if f["filename"].endswith("-none-any.whl")]
    chosen = (pure or wheels)[0]
    return chosen["filename"], chosen["url"], chosen["hashes"]["sha256"]


def _download(url: str, dest: Path, sha256: str, timeout: float) -> Path:
    """Stream `url` to a temp file, check its sha256, then rename it into place."""
    tmp = dest.with_name(dest.name + f".part.{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as out:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise VerifyFailed(f"{dest.name}: sha256 {digest.hexdigest()} is not PyPI's {sha256}")
        os.replace(tmp, dest)
        return dest
    except (urllib.error.URLError, OSError) as exc:
        raise RemoteOpsError(f"download of {dest.name} failed: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


def read_member(wheel: Path, member: str) -> bytes:
    """Bytes of one file inside a wheel (e.g. `sglang/srt/models/llama.py`)."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise NotFound(f"{member} is not in {wheel.name}") from None


def member_of(target: str) -> str:
    """A checkout path (`python/sglang/srt/models/x.py`) as a wheel member (`sglang/srt/models/x.py`)."""
    return target[len("python/") :] if target.startswith("python/") else target


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
