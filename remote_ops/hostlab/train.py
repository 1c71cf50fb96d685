"""The sandbox's CPU training image: SpecForge 0.2.0 on the sandbox vLLM image, built with no registry.

- `wheels_dir()`: what `scripts/setup --vllm` downloaded for it (scripts/setup-specforge-wheels:
  specforge 0.2.0, yunchang, openai-harmony, accelerate, datasets and the dependencies the vLLM
  image lacks).
- `train_image(socket)`: `TRAIN_TAG` in a lab dockerd, built FROM `vllm.VLLM_TAG` (its torch
  2.13.0+cpu and transformers) with docker/train/Dockerfile: the wheels installed by `pip install
  --no-index` (SpecForge without its torch/transformers/sglang pins), the CPU SHIM for
  `specforge/core/loss.py` and the entrypoint `remote_ops_train.py`.  Kept as a `docker save`
  tarball under `cache_dir()/images/`, as the vLLM image is.  Its key names the vLLM image's key,
  the files of docker/train/ and the wheel names: a new vLLM image (another model, other wheels)
  builds this one anew.

`train start` on a host whose containers get no GPU (`container.gpus: none`) builds its
per-host training image FROM this tag (workflows/train.py).  Nothing here pulls from a registry.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..paths import cache_dir
from . import vllm
from ._proc import LabError
from .images import classic_build, keyed_image

SPECFORGE_VERSION = "0.2.0"
TRAIN_TAG = f"remote-ops/specforge-cpu:{SPECFORGE_VERSION}"
KEY_LABEL = "org.remote-ops.train-key"
FILES = ("Dockerfile", "specforge_cpu_loss.py", "specforge_cpu_hook.py", "remote_ops_train.py")


def docker_assets() -> Path:
    """docker/train/: the checkout's, else the wheel's copy."""
    here = vllm.REPO / "docker" / "train"
    if here.is_dir():
        return here
    from importlib.resources import files

    return Path(str(files("remote_ops._resources.docker").joinpath("train")))


def wheels_dir() -> Path:
    """Where scripts/setup-specforge-wheels keeps them ($REMOTE_OPS_SPECFORGE_WHEELS overrides)."""
    env = os.environ.get("REMOTE_OPS_SPECFORGE_WHEELS")
    return Path(env) if env else cache_dir() / "specforge-wheels"


def wheels_ready() -> bool:
    return (wheels_dir() / f".complete-specforge-{SPECFORGE_VERSION}").exists()


def image_key() -> str:
    """The vLLM image's key, docker/train/'s files and the wheel names."""
    assets = docker_assets()
    wheels = sorted(p.name for p in wheels_dir().glob("*.whl"))
    parts = [vllm.image_key().encode(), *((assets / f).read_bytes() for f in FILES), "\n".join(wheels).encode()]
    return vllm._digest(*parts)


def image_tarball() -> Path:
    return cache_dir() / "images" / f"specforge-cpu-{SPECFORGE_VERSION}-{image_key()}.tar"


def image_built() -> str | None:
    """None when both saved images exist (tests can run), else why not and what builds them."""
    reason = vllm.image_built()
    if reason:
        return reason
    if not wheels_ready():
        return f"no SpecForge wheels in {wheels_dir()}: run `bash scripts/setup --vllm`"
    if not image_tarball().exists():
        return f"the sandbox training image is not built ({image_tarball()} missing): run `bash scripts/test-vllm`"
    return None


def train_image(socket_path: str | Path, timeout: float = 1500.0) -> str:
    """`TRAIN_TAG` in the dockerd at `socket_path`: there already, loaded from the saved tarball, or
    built (FROM the vLLM image, made or loaded first) and saved; return the tag."""
    vllm.vllm_image(socket_path, timeout)  # the base first: its key is part of this image's
    key = (KEY_LABEL, image_key())
    return keyed_image(socket_path, TRAIN_TAG, key, image_tarball(), build_image, ".train-build.lock", timeout)


def build_image(socket_path: str | Path, key: str, timeout: float) -> None:
    """`docker build --network none` (classic builder) FROM the vLLM image."""
    if not wheels_ready():
        raise LabError(f"no SpecForge wheels in {wheels_dir()}: run scripts/setup --vllm first")
    base = vllm.vllm_image(socket_path, timeout)
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".train-context-") as ctx:
        vllm._link_tree(wheels_dir(), Path(ctx) / "wheels", suffixes=(".whl",))
        for f in FILES:
            shutil.copy2(docker_assets() / f, Path(ctx) / f)
        classic_build(socket_path, ctx, base=base, tag=TRAIN_TAG, label=f"{KEY_LABEL}={key}", timeout=timeout)
