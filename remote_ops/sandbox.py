"""The sandbox: one real local host to try the whole flow without a GPU box.

`up` starts a `HostLab` with one host named `sandbox` (its own sshd on a
random 127.x address with its own host key, its own dockerd with no registry
access), kept running after the command exits and recorded under
`paths.sandbox_dir()`.  It then:

- imports the python3 base image (debootstrap, cached) and builds on top of it
  a STAND-IN for `lmsysorg/sglang:v<version>-*`: the real SGLang python tree
  from the PyPI wheel at `/sgl-workspace/sglang/python` plus the SGLang
  stand-in server (`docker/standin/`, no model, no GPU, says `"standin": true`);
- puts the real SGLang tree (a git checkout layout) at the host's checkout path
  and a tiny model config (hidden size 64) at its model path;
- writes the inventory entry `sandbox` to `paths.sandbox_inventory_file()`,
  which the inventory loader picks up automatically.

`remote-ops deploy --host sandbox`, `health`, `inspect-source` and `logs pull`
then run the real code path end to end.  `down` stops the daemons by PID and
removes the inventory entry.  Nothing here reaches a registry.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from . import templates
from .errors import RemoteOpsError
from .paths import repo_resource, sandbox_dir, sandbox_inventory_file

NAME = "sandbox"
STANDIN_DIR = "/opt/sglang-standin"
STANDIN_LAUNCHER = ["python3", f"{STANDIN_DIR}/sglang_standin_server.py"]
MODEL_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
                "num_hidden_layers": 8, "standin": True}


def standin_tag(version: str) -> str:
    return f"remote-ops/sglang-standin:v{version}"


def lab_dir() -> Path:
    return sandbox_dir() / "lab"


# -- the stand-in base image (built locally, never pulled) ---------------------------------------
def standin_context(dest: Path, version: str, base_image: str) -> Path:
    """Assemble the stand-in base image's build context in `dest` (pure file work + the cached wheel)."""
    from .wheels import fetch_sglang_wheel, unpack_python_tree

    tree = unpack_python_tree(fetch_sglang_wheel(version), dest / "unpacked")
    shutil.move(str(tree), dest / "sglang")
    shutil.rmtree(dest / "unpacked")
    shutil.copytree(repo_resource("docker", "standin"), dest / "standin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "Dockerfile").write_text(templates.render("standin-base.Dockerfile.j2", {
        "base_image": base_image, "sglang_version": version, "standin_dir": STANDIN_DIR,
        "stands_in_for": f"lmsysorg/sglang:v{version}-cu129"}))
    return dest


def build_standin_base(docker: Callable[..., Any], version: str, base_image: str) -> str:
    """Build the stand-in base image with `docker(*args)` (a local CLI runner); return its tag."""
    tag = standin_tag(version)
    with tempfile.TemporaryDirectory(prefix="ro-standin-") as tmp:
        ctx = standin_context(Path(tmp), version, base_image)
        docker("build", "--pull=false", "-q", "-t", tag, str(ctx), timeout=600)
    return tag


def write_model_config(model_dir: Path, architectures: list[str] | None = None) -> Path:
    """A model directory the stand-in reads: config.json only (hidden size 64, 8 layers)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.json"
    doc = dict(MODEL_CONFIG, **({"architectures": architectures} if architectures else {}))
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def standin_overrides(entry: dict, base_tag: str) -> dict:
    """A lab inventory entry, pointed at the stand-in base image and launcher (pure)."""
    out = json.loads(json.dumps(entry))
    out.setdefault("sglang", {})["base_image"] = base_tag
    out.setdefault("server", {})["launcher"] = list(STANDIN_LAUNCHER)
    out["server"].setdefault("tp", 1)
    out.setdefault("container", {})["env"] = {"STANDIN_LOAD_SECONDS": "1", "STANDIN_REQUIRE_PATCH": "1"}
    return out


# -- up / down / status ------------------------------------------------------------------------
@dataclass
class SandboxStatus:
    running: bool
    dir: str
    inventory: str | None
    host: dict = field(default_factory=dict)
    base_image: str | None = None
    startup_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def status() -> SandboxStatus:
    """Is the sandbox's sshd/dockerd alive, and where is its inventory entry."""
    from .hostlab import HostLab

    d = lab_dir()
    recorded = HostLab.attach(d)
    state = recorded.state if (d / "lab.json").exists() else {"hosts": []}
    inv = sandbox_inventory_file()
    meta = _read_meta()
    return SandboxStatus(running=bool(state.get("hosts")) and recorded.running() and not state.get("stopped"),
                         dir=str(sandbox_dir()), inventory=str(inv) if inv.exists() else None,
                         host=(state.get("hosts") or [{}])[0], base_image=meta.get("base_image"),
                         startup_s=meta.get("startup_s"))


def up(version: str = "0.5.9", progress: Callable[[str], None] = lambda s: None,
       patch: str = "deepseek-v2") -> SandboxStatus:
    """Start the sandbox (idempotent: a running sandbox is left as it is).

    `patch` is the patch spec its inventory names; its model config.json carries
    that spec's first architecture (the checkout holds the whole real tree)."""
    from . import patchspec

    patchspec.model(patch)                  # an unknown spec fails before anything starts
    current = status()
    if current.running and current.inventory:
        progress("sandbox already running")
        return current
    down(quiet=True)
    t0 = time.monotonic()
    lab = _start_lab(version, progress, patch)
    try:
        base = _prepare_images(lab, version, progress)
        _prepare_host(lab, version, progress, patch)
        _write_inventory(lab, base)
    except BaseException:
        lab.stop()
        raise
    _write_meta({"base_image": base, "startup_s": round(time.monotonic() - t0, 1), "version": version})
    return status()


def _start_lab(version: str, progress, patch: str = "deepseek-v2"):
    from .hostlab import HostLab, lab_unavailable

    reason = lab_unavailable()
    if reason:
        raise RemoteOpsError(f"sandbox: cannot run here: {reason}", hint="run scripts/setup first (as root)")
    progress("starting sshd + dockerd on loopback")
    lab_dir().mkdir(parents=True, exist_ok=True)
    return HostLab(lab_dir(), names=[NAME], keep=True, sglang_version=version, patch=patch).start()


def _prepare_images(lab, version: str, progress) -> str:
    from .hostlab import base_python_image
    from .hostlab.images import docker

    progress("python3 base image (debootstrap, cached after the first time)")
    base = base_python_image(lab.dockerd.socket)
    progress(f"building the SGLang {version} stand-in base image")
    return build_standin_base(lambda *a, timeout=600: docker(lab.dockerd.socket, *a, timeout=timeout), version, base)


def _prepare_host(lab, version: str, progress, patch: str = "deepseek-v2") -> None:
    from . import patchspec

    progress(f"real SGLang {version} tree at the host's checkout")
    lab.install_sglang(NAME, version)
    write_model_config(lab.host(NAME).paths.model_dir, list(patchspec.model(patch).architectures[:1]))


def _write_inventory(lab, base_tag: str) -> Path:
    """inventory entry `sandbox` (the lab's entry + stand-in base image and launcher)."""
    entry = lab.host(NAME).inventory_entry(lab, base_tag)
    doc = {"hosts": {NAME: standin_overrides(entry, base_tag)}}
    path = sandbox_inventory_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by `remote-ops sandbox up`: a local host on loopback with an SGLang STAND-IN\n"
                    + yaml.safe_dump(doc, sort_keys=False))
    return path


def down(quiet: bool = False) -> SandboxStatus:
    """Stop the sandbox's daemons by recorded PID and remove its inventory entry."""
    from .hostlab import HostLab

    if (lab_dir() / "lab.json").exists():
        HostLab.attach(lab_dir()).stop()
    sandbox_inventory_file().unlink(missing_ok=True)
    return status()


def _meta_file() -> Path:
    return sandbox_dir() / "sandbox.json"


def _read_meta() -> dict:
    try:
        return json.loads(_meta_file().read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_meta(doc: dict) -> None:
    _meta_file().parent.mkdir(parents=True, exist_ok=True)
    _meta_file().write_text(json.dumps(doc, indent=2) + "\n")
