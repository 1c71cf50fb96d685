"""SGLang release sources, offline first: a local checkout, the cached wheel, then the index.

Used by `render`, `patch drift`, the sandbox (its host holds the real 0.5.9 tree)
and the tests.  A released file is read from, in this order (`locate`):

1. a local SGLang checkout (`render --sglang-checkout DIR`,
   `$REMOTE_OPS_SGLANG_CHECKOUT`) whose `python/sglang/version.py` (or
   `_version.py`) names the wanted release; another release's checkout is passed
   over (its files would give other shas);
2. the cached wheel, `<cache>/wheels/sglang-<version>-*.whl`;
3. the package index: found through its JSON Simple API (PEP 691,
   `/simple/sglang/`), downloaded once into the cache with plain urllib (no pip:
   venvs made by uv have none), its sha256 checked against the digest the index
   published before it is kept.  `REMOTE_OPS_INDEX_URL` points at a mirror
   speaking the same API.  An index that cannot be read (refused, DNS, timeout,
   a 5xx) is `IndexUnreachable` (exit 15), naming the URL and that variable.

A download reports its bytes through `on_progress(done, total)` (the CLI draws
a bar on a terminal: `Console.progress`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ConfigError, IndexUnreachable, NoSpace, NotFound, VerifyFailed
from .paths import cache_dir

DEFAULT_INDEX = "https://pypi.org/simple"
#: the environment variable naming the package index (a PEP 691 mirror)
INDEX_ENV = "REMOTE_OPS_INDEX_URL"
#: the environment variable naming a local SGLang checkout (`render --sglang-checkout`)
CHECKOUT_ENV = "REMOTE_OPS_SGLANG_CHECKOUT"

Progress = Callable[[int, "int | None"], None]


def wheel_dir() -> Path:
    return cache_dir() / "wheels"


def index_url() -> str:
    return os.environ.get(INDEX_ENV, DEFAULT_INDEX).rstrip("/")


@dataclass(frozen=True)
class Located:
    """Where a release's files will be read: `kind` "checkout", "cached wheel" or "index"
    (`path`: the checkout, the wheel, or None until downloaded)."""

    kind: str
    path: Path | None
    version: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": str(self.path) if self.path else index_url(), "version": self.version}


def checkout_version(checkout: Path) -> str | None:
    """The release of a local checkout's `python/sglang/` (`version.py`, then `_version.py`)."""
    from .probes.sglang import parse_sglang_version

    for name in ("version.py", "_version.py"):
        try:
            found = parse_sglang_version((checkout / "python" / "sglang" / name).read_text("utf-8", "replace"))
        except OSError:
            continue
        if found:
            return found
    return None


def cached_wheel(version: str) -> Path | None:
    found = sorted(wheel_dir().glob(f"sglang-{version}-*.whl"))
    return found[0] if found else None


def locate(version: str, checkout: Path | None = None) -> Located:
    """Where `version`'s files come from: the checkout when it is that release, else the cached
    wheel, else the index (nothing is downloaded here)."""
    if checkout is not None and checkout_version(checkout) == version:
        return Located("checkout", checkout, version)
    wheel = cached_wheel(version)
    if wheel is not None:
        return Located("cached wheel", wheel, version)
    return Located("index", None, version)


def fetch_sglang_wheel(version: str, timeout: float = 300.0, on_progress: Progress | None = None) -> Path:
    """Return the cached `sglang-<version>-*.whl`, downloading (and sha256-checking) it once."""
    found = cached_wheel(version)
    if found:
        return found
    name, url, sha256 = pick_wheel(release_files(version, timeout), version)
    wheel_dir().mkdir(parents=True, exist_ok=True)
    return _download(url, wheel_dir() / name, sha256, timeout, on_progress)


def _unreachable(what: str, why: object, version: str) -> IndexUnreachable:
    base = index_url()
    err = IndexUnreachable(
        f"cannot reach the package index for sglang {version}: {what}: {why}",
        hint=f"set {INDEX_ENV} to a reachable PEP 691 mirror (now {base}), put the wheel in "
        f"{wheel_dir()}/, or give a local SGLang {version} checkout ({CHECKOUT_ENV} or render --sglang-checkout)",
    )
    err.details.update(index_url=base, env=INDEX_ENV, version=version)
    return err


def release_files(version: str, timeout: float) -> list[dict]:
    """The index's files for sglang==version, from the JSON Simple API (PEP 691)."""
    base = index_url()
    req = urllib.request.Request(f"{base}/sglang/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            files = json.load(r).get("files", [])
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise NotFound(f"the package index {base} has no project sglang") from None
        raise _unreachable(f"{base}/sglang/ answered", f"HTTP {exc.code}", version) from None
    except (urllib.error.URLError, OSError) as exc:
        raise _unreachable(f"{base}/sglang/", getattr(exc, "reason", None) or exc, version) from None
    except ValueError as exc:
        raise _unreachable(f"{base}/sglang/ is not a JSON Simple API (PEP 691)", exc, version) from None
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


def _download(url: str, dest: Path, sha256: str, timeout: float, on_progress: Progress | None = None) -> Path:
    """Stream `url` to a temp file, check its sha256, then rename it into place.  `on_progress`
    gets (bytes so far, Content-Length or None) after each chunk."""
    tmp = dest.with_name(dest.name + f".part.{os.getpid()}")
    digest = hashlib.sha256()
    version = dest.name.split("-")[1] if dest.name.count("-") else "?"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as out:
            length = r.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            for chunk in iter(lambda: r.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
                done += len(chunk)
                if on_progress:
                    on_progress(done, total)
        if digest.hexdigest() != sha256:
            raise VerifyFailed(f"{dest.name}: sha256 {digest.hexdigest()} is not PyPI's {sha256}")
        os.replace(tmp, dest)
        return dest
    except urllib.error.HTTPError as exc:
        raise _unreachable(f"download of {dest.name}", f"HTTP {exc.code}", version) from None
    except urllib.error.URLError as exc:
        raise _unreachable(f"download of {dest.name}", exc.reason, version) from None
    except (TimeoutError, ConnectionError) as exc:  # the transfer stalled or was cut
        raise _unreachable(f"download of {dest.name}", exc, version) from None
    except OSError as exc:  # writing here: the cache dir
        if exc.errno == errno.ENOSPC:
            raise NoSpace(f"no space left for {dest.name} in {dest.parent}", details={"path": str(dest)}) from None
        raise ConfigError(
            f"cannot write {dest.name}: {exc.strerror or exc}", source=str(dest.parent), hint="set REMOTE_OPS_CACHE_DIR"
        ) from None
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


def sglang_source(
    version: str, target: str, checkout: Path | None = None, on_progress: Progress | None = None
) -> bytes:
    """The released file `target` (a spec's checkout-relative path) of SGLang `version`, from
    where `locate` says: a checkout of that release, the cached wheel, or the index."""
    where = locate(version, checkout)
    if where.kind == "checkout":
        assert where.path is not None
        try:
            return (where.path / target).read_bytes()
        except OSError as exc:
            raise NotFound(f"{target} is not in the checkout {where.path}: {exc.strerror}") from None
    return read_member(fetch_sglang_wheel(version, on_progress=on_progress), member_of(target))


def unpack_python_tree(wheel: Path, dest: Path) -> Path:
    """Unpack the wheel's `sglang/` package to `dest/python/sglang` (a checkout's layout)."""
    target = dest / "python"
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("sglang/")]
        zf.extractall(target, members)
    return target / "sglang"
