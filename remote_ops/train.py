"""EAGLE-3 drafter training on a host: SpecForge 0.2.0 in a container, or the clearly named stand-in.

- Real run: an image rendered from `templates/Dockerfile.train.j2` (FROM the SGLang
  image + `specforge==0.2.0` pinned) and a `run.yaml` for `specforge train --config`
  (offline: `data.hidden_states_path` = the export dir), started with GPUs, the
  export mounted read-only and the checkpoint dir mounted read-write. Builders
  here are pure; `train start` runs them through the `Remote` seam.
- Stand-in (`--standin`, the sandbox and tests, no GPU or registry):
  `docker/standin/specforge_standin_train.py` runs detached on the host (`setsid`,
  PID recorded, stopped by that PID) and writes SpecForge-format log lines with
  SYNTHETIC values and checkpoint folders without weights, labelled as such.

Status reads the training log (`logs.parse_training`: epoch, step, per-position
accuracy), the tqdm remaining time (ETA), and the newest `<run_id>-step<N>` folder.
tau is estimated from the per-position accuracies as `1 + sum_k prod_{j<=k} acc_j`
(the expected accepted length of a chain draft whose position-k token is right
with probability acc_k given the earlier ones were): an estimate, not a measurement.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from . import shell
from .errors import CommandTimedOut, Refused
from .logs import parse_training

STANDIN = "specforge_standin_train.py"
SPECFORGE_VERSION = "0.2.0"
_REMAINING = re.compile(r"Training Epoch \d+:.*?\[(?P<elapsed>[\d:]+)<(?P<remaining>[\d:]+)")
_STEP_DIR = re.compile(r"^(?P<run>.+)-step(?P<step>\d+)$")


@dataclass(frozen=True)
class TrainPaths:
    workdir: str
    log: str
    output: str
    data: str

    def file(self, name: str) -> str:
        return str(PurePosixPath(self.workdir) / name)


def paths_for(spec, data: str | None = None, output: str | None = None) -> TrainPaths:
    base = spec.dump.dir.rstrip("/")
    return TrainPaths(str(PurePosixPath(spec.logs.dir) / "train"), spec.logs.training,
                      output or base + "-drafter", data or base + "-specforge")


def standin_source() -> bytes:
    from .paths import repo_resource

    return repo_resource("docker", "standin", STANDIN).read_bytes()


# --------------------------------------------------------------------------- commands (pure)

def alive_check(p: TrainPaths) -> str:
    pidfile = shell.quote(p.file("train.pid"))
    return (f"pid=$(cat {pidfile} 2>/dev/null) && [ -n \"$pid\" ] && "
            f"tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -q {shell.quote(STANDIN)}")


def standin_command(p: TrainPaths, run_id: str, epochs: int, steps: int, step_s: float) -> str:
    """Start the stand-in detached in its own session; record and print its PID."""
    argv = ["python3", p.file(STANDIN), "--log", p.log, "--output", p.output, "--data", p.data,
            "--run-id", run_id, "--epochs", str(epochs), "--steps", str(steps), "--step-s", f"{step_s:g}"]
    out, pid = shell.quote(p.file("train.out")), shell.quote(p.file("train.pid"))
    return (f"cd {shell.quote(p.workdir)} || exit 1; setsid nohup {shell.join(argv)} >> {out} 2>&1 < /dev/null & "
            f"echo $! > {pid}; cat {pid}")


def run_yaml(spec, p: TrainPaths, draft_config: str, run_id: str, epochs: int, nproc: int) -> str:
    """SpecForge 0.2.0 `specforge train --config` document for offline EAGLE-3 (keys from its schema)."""
    import json

    doc = {"model": {"target_model_path": spec.model.path, "draft_model_config": draft_config,
                     "torch_dtype": "bfloat16"},
           "data": {"hidden_states_path": p.data, "max_length": 2048},
           "training": {"strategy": "eagle3", "num_epochs": epochs, "batch_size": 1, "ttt_length": 7},
           "run_id": run_id, "output_dir": p.output,
           "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": nproc}}}
    return json.dumps(doc, indent=1) + "\n"        # JSON is YAML


def dockerfile(spec, extra_packages: tuple[str, ...] = ("datasets", "yunchang", "openai-harmony")) -> str:
    from . import __version__
    from .templates import render

    return render("Dockerfile.train.j2", {"remote_ops_version": __version__, "host_name": spec.name,
                                          "sglang_version": spec.sglang.version, "base_image": spec.sglang.base_image,
                                          "specforge_version": SPECFORGE_VERSION, "extra_packages": extra_packages})


def container_name(spec) -> str:
    return f"{spec.container.name}-train"


def image_ref(spec) -> str:
    return f"{spec.container.image}-train:specforge-{SPECFORGE_VERSION}"


def real_commands(spec, p: TrainPaths) -> list[str]:
    """Build the training image (never pulls our own image) and run it detached with GPUs."""
    ctx = shell.quote(p.file("context"))
    build = f"docker build --pull=false -t {shell.quote(image_ref(spec))} {ctx}"
    run = ["docker", "run", "-d", "--pull=never", "--name", container_name(spec), "--gpus", "all",
           "--ipc", "host", "--shm-size", spec.container.shm_size,
           "-v", f"{p.data}:{p.data}:ro", "-v", f"{p.output}:{p.output}", "-v", f"{spec.model.path}:{spec.model.path}:ro",
           "--label", "io.remote-ops.managed=1", image_ref(spec)]
    logs = (f"setsid nohup docker logs -f {shell.quote(container_name(spec))} >> {shell.quote(p.log)} 2>&1 "
            f"< /dev/null & echo $! > {shell.quote(p.file('logs.pid'))}")
    return [build, shell.join(run), logs]


def status_command(p: TrainPaths, spec) -> str:
    return shell.sections([
        ("alive", alive_check(p)),
        ("container", f"docker inspect -f '{{{{.State.Running}}}}' {shell.quote(container_name(spec))}"),
        ("log", f"tail -c 200000 {shell.quote(p.log)}"),
        ("ckpt", f"ls -1 {shell.quote(p.output)}"),
    ])


# --------------------------------------------------------------------------- status (pure)

def tau_estimate(acc: dict[int, float]) -> float | None:
    """1 + sum_k prod_{j<=k} acc_j over the positions reported (an estimate of the acceptance length)."""
    if not acc:
        return None
    total, run = 1.0, 1.0
    for k in sorted(acc):
        run *= max(0.0, min(1.0, acc[k]))
        total += run
    return round(total, 3)


def parse_eta(log_text: str) -> float | None:
    """Seconds left in the current epoch from the last tqdm bar (`[elapsed<remaining, ...]`)."""
    found = list(_REMAINING.finditer(log_text))
    if not found:
        return None
    parts = [int(x) for x in found[-1]["remaining"].split(":")]
    seconds = 0
    for x in parts:
        seconds = seconds * 60 + x
    return float(seconds)


def latest_checkpoint(listing: str) -> str | None:
    steps = [(int(m["step"]), name) for name in listing.split() if (m := _STEP_DIR.match(name))]
    return max(steps)[1] if steps else None


@dataclass
class TrainStatus:
    host: str
    running: bool
    standin: bool
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    steps: int | None = None
    acc: dict[int, float] = field(default_factory=dict)
    tau_estimate: float | None = None
    eta_s: float | None = None
    latest_checkpoint: str | None = None
    state: str = "unknown"               # running | finished | stopped | not started
    output: str | None = None            # the checkpoint dir on the host

    @property
    def latest_checkpoint_path(self) -> str | None:
        return f"{self.output.rstrip('/')}/{self.latest_checkpoint}" if self.output and self.latest_checkpoint else None

    def to_dict(self) -> dict:
        return {**asdict(self), "latest_checkpoint_path": self.latest_checkpoint_path}


def parse_status(host: str, output: str) -> TrainStatus:
    parts = shell.split_sections(output)
    log_text = parts.get("log", (1, ""))[1]
    running = parts.get("alive", (1, ""))[0] == 0 or parts.get("container", (1, ""))[1].strip() == "true"
    st = TrainStatus(host, running, "SPECFORGE STAND-IN" in log_text)
    summary = parse_training(log_text)
    rec = summary.latest("train")
    if rec:
        st.epoch, st.epochs, st.acc = rec.index, rec.total, dict(rec.acc)
        st.tau_estimate = tau_estimate(rec.acc)
    if summary.steps:
        st.step, st.steps = summary.steps[-1].step, summary.steps[-1].total
        st.epoch = max(st.epoch or 0, summary.steps[-1].epoch + 1) if rec else summary.steps[-1].epoch + 1
    st.eta_s = parse_eta(log_text)
    st.latest_checkpoint = latest_checkpoint(parts.get("ckpt", (1, ""))[1])
    st.state = _state(running, log_text)
    return st


def _state(running: bool, log_text: str) -> str:
    if running:
        return "running"
    for word in ("finished", "stopped"):
        if f"SPECFORGE STAND-IN {word}" in log_text:
            return word
    return "not started" if not log_text.strip() else "exited"


# --------------------------------------------------------------------------- edges

def status(remote, spec, p: TrainPaths | None = None) -> TrainStatus:
    p = p or paths_for(spec)
    st = parse_status(spec.name, remote.run(status_command(p, spec), check=False).stdout)
    st.output = p.output
    return st


def start_standin(remote, spec, p: TrainPaths, run_id: str = "eagle3", epochs: int = 3, steps: int = 20,
                  step_s: float = 0.1, wait_s: float = 30.0) -> TrainStatus:
    """Refuse if a run is alive; upload the stand-in; launch it detached; wait for its banner."""
    remote.run(["mkdir", "-p", p.workdir, p.output, str(PurePosixPath(p.log).parent)])
    if remote.run(alive_check(p), check=False).exit_status == 0:
        raise Refused("a training run is already running on this host", host=spec.name,
                      hint=f"remote-ops train status --host {spec.name}  (or train stop)")
    remote.put(standin_source(), p.file(STANDIN), mode=0o755)
    remote.run(["rm", "-f", p.log])
    remote.run(standin_command(p, run_id, epochs, steps, step_s))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if "SPECFORGE STAND-IN" in remote.run(f"head -c 400 {shell.quote(p.log)}", check=False).stdout:
            return status(remote, spec, p)
        time.sleep(0.2)
    raise CommandTimedOut(f"training stand-in did not start within {wait_s:g}s", host=spec.name,
                          command="train start --standin", timeout=wait_s)


def start_real(remote, spec, p: TrainPaths, draft_config: str, run_id: str, epochs: int, nproc: int) -> list[str]:
    """Render the context on the host, build, run; returns the commands run."""
    remote.run(["mkdir", "-p", p.file("context"), p.output, str(PurePosixPath(p.log).parent)])
    remote.put(dockerfile(spec).encode(), p.file("context/Dockerfile"))
    remote.put(run_yaml(spec, p, draft_config, run_id, epochs, nproc).encode(), p.file("context/run.yaml"))
    cmds = real_commands(spec, p)
    for cmd in cmds:
        remote.run(cmd, timeout=3600)
    return cmds


def stop(remote, spec, p: TrainPaths | None = None, wait_s: float = 60.0) -> TrainStatus:
    """SIGTERM the stand-in by its recorded PID (KILL at the deadline), or `docker stop` the trainer."""
    p = p or paths_for(spec)
    remote.run(f"docker stop -t 30 {shell.quote(container_name(spec))} >/dev/null 2>&1 || true", check=False)
    if remote.run(alive_check(p), check=False).exit_status == 0:
        pidfile = shell.quote(p.file("train.pid"))
        remote.run(f"kill -TERM $(cat {pidfile})", check=False)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and remote.run(alive_check(p), check=False).exit_status == 0:
            time.sleep(0.2)
        remote.run(f"{alive_check(p)} && kill -KILL $(cat {pidfile})", check=False)
    return status(remote, spec, p)
