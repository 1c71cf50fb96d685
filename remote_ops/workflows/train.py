"""EAGLE-3 drafter training on a host: SpecForge 0.2.0 in a container, then its checkpoint as a servable drafter.

- The training image (`dockerfile`, `templates/Dockerfile.train.j2`) is built on the host FROM a
  base that has SpecForge: on a GPU host `lmsysorg/sglang:v0.5.14` plus `specforge==0.2.0`
  (`--no-deps`: that SGLang release pins the torch 2.11.0 and transformers 5.8.1 SpecForge
  pins), on a host whose containers get no GPU (`container.gpus: none`, the sandbox) the lab's
  `remote-ops/specforge-cpu:0.2.0` (remote_ops/hostlab/train.py: SpecForge on the vLLM image's
  CPU torch, with the labelled CPU SHIM for its Triton loss).  `--base-image` overrides either.
  The per-host layer adds `run.yaml`, the draft config and the entrypoint
  (docker/train/remote_ops_train.py: `specforge train|export`, with an index view of a target
  saved as one safetensors file).
- `run.yaml` (`run_yaml`) is SpecForge's own `specforge train --config` document, offline:
  `data.hidden_states_path` = the `dumps export` dir (`.ckpt` files: input_ids, loss_mask,
  post-norm hidden_state, aux_hidden_state), the draft config given explicitly, and on the CPU
  `fsdp_sharding: NO_SHARD` (DDP over gloo; FSDP refuses the CPU), `attention_backend: sdpa`,
  `dataloader_num_workers: 0`, one rank, with `SPECFORGE_DEVICE=cpu` in the container.
- The trainer container runs detached (GPUs on a GPU host), the export read-only, the checkpoint
  dir read-write; its log is followed into the host's training log.

Lifecycle as deploy's: `start` and `stop` take the one host lock (`hostlock.take`,
exit 9 while another change holds it) only for the change itself, not for the
days of training; they release it with an audit line on the host and write a local
run record (`<state>/hosts/<host>/runs/<time>-<pid>-train.json`) naming the failed
step on failure.  `run.json` next to the log says which run was started (plan and
fingerprint): `start` of the same plan while it runs is a no-op, of another plan
refused; `stop` of nothing is a no-op.  `--dry-run` reads the host only; one whose draft
config fails the contract (not forced) ends with the same refusal, exit 9 (`dry_run_refusal`).

The capture contract guards a start with a draft config (`contract` step): its
`eagle_config.eagle_aux_hidden_state_layer_ids`, under the numbering of the host's serving
release, must give the layers the dumps recorded, and its hidden size must be theirs
(`workflows.audit.check_drafter`).  Otherwise the start is refused (`ContractMismatch`,
exit 9) unless forced; a forced start's audit line on the host names what was forced past.

Status reads SpecForge's own metrics from the training log (`core.specforge_run.run_metrics`:
per-position acc_k, ploss_k, acceptance_rate_k, the eval lines' simulated_acc_len), `run.json`
(samples and epochs: the run's steps, hence the ETA from `perf/optimizer_step_time_s`), the
`<run_id>-step<N>` folders and SpecForge's `<run_id>.best_meta.json`.

`export` runs `specforge export` on the host in the training image for the chosen checkpoint
(`core.specforge_run.choose_checkpoint`: the best by eval simulated_acc_len, else the newest)
into `core.specforge_run.exported_drafter_dir`, with a `provenance.json` beside the weights.
"""

from __future__ import annotations

import difflib
import getpass
import hashlib
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from .. import __version__
from ..core import shell, specforge_run as sfr
from ..core.logparse import bounded_lines, parse_training
from ..engine import cli_for
from ..engine.spec import RunSpec
from ..errors import CommandFailed, CommandTimedOut, Refused, RemoteOpsError
from ..probes.lock import LockRead, parse_read
from ..remote.smallfile import read_small_file
from . import hostlock

SPECFORGE_VERSION = "0.2.0"
#: The GPU base: SGLang 0.5.14, whose pins (torch 2.11.0, transformers 5.8.1) are SpecForge 0.2.0's.
GPU_BASE_IMAGE = "lmsysorg/sglang:v0.5.14"
#: The CPU base: built by remote_ops/hostlab/train.py in the sandbox (SpecForge on the vLLM image).
CPU_BASE_IMAGE = f"remote-ops/specforge-cpu:{SPECFORGE_VERSION}"
# The bar's head, then its `[elapsed<remaining` after it: one regex with `.*?` between them
# re-scanned the line from every `Training Epoch` (quadratic on a hostile log line).
_BAR_HEAD = re.compile(r"Training Epoch \d{1,9}:")
_REMAINING = re.compile(r"\[(?P<elapsed>[\d:]{1,20})<(?P<remaining>[\d:]{1,20})")
# Where the training image holds its files (the draft config is copied into the build context,
# wherever it came from: the laptop, or a path on the host that the trainer does not mount).
IMAGE_DIR = "/opt/remote-ops/train"
IMAGE_DRAFT_CONFIG = f"{IMAGE_DIR}/draft_config.json"
IMAGE_RUN_YAML = f"{IMAGE_DIR}/run.yaml"
ENTRYPOINT = f"{IMAGE_DIR}/remote_ops_train.py"


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
    return TrainPaths(
        str(PurePosixPath(spec.logs.dir) / "train"),
        spec.logs.training,
        output or base + "-drafter",
        data or base + "-specforge",
    )


def device_for(spec) -> str:
    """`cpu` when the host's containers get no GPU (`container.gpus: none`), else `cuda`."""
    return "cpu" if spec.container.gpus == "none" else "cuda"


def entrypoint_source() -> bytes:
    """docker/train/remote_ops_train.py, copied into every training image."""
    from ..paths import repo_resource

    return repo_resource("docker", "train", "remote_ops_train.py").read_bytes()


# --------------------------------------------------------------------------- commands (pure)


@dataclass(frozen=True)
class RunPlan:
    """What `train start` runs: the same plan while it runs makes a re-run a no-op (its fingerprint)."""

    run_id: str
    epochs: int
    data: str
    output: str
    nproc: int
    draft_config: str
    device: str = "cuda"  # cuda | cpu (device_for)
    base_image: str = GPU_BASE_IMAGE
    samples: int | None = None  # .ckpt files in `data`, counted on the host at the start
    eval_data: str | None = None  # a second export for SpecForge's eval (best checkpoint by simulated_acc_len)
    log_interval: int = 10
    save_interval: int = 0  # 0: once per epoch when the samples are known, else at the end only
    learning_rate: float = 1e-4
    seed: int = 42  # SpecForge's training.seed (the drafter's init and the data order)
    batch_size: int = 1  # samples per optimizer step on each rank

    @property
    def dp(self) -> int:
        return 1 if self.device == "cpu" else self.nproc

    @property
    def steps_per_epoch(self) -> int | None:
        return sfr.total_steps(self.samples, 1, self.batch_size, self.dp)

    @property
    def total_steps(self) -> int | None:
        return sfr.total_steps(self.samples, self.epochs, self.batch_size, self.dp)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def run_json(self) -> str:
        """`run.json` on the host: the plan, its fingerprint, and who started it (pure but for the clock)."""
        return (
            json.dumps(
                {
                    **asdict(self),
                    "steps_per_epoch": self.steps_per_epoch,
                    "total_steps": self.total_steps,
                    "fingerprint": self.fingerprint,
                    "started": time.time(),
                    "tool": f"remote-ops {__version__}",
                },
                indent=1,
            )
            + "\n"
        )


def real_plan(
    spec,
    p: TrainPaths,
    draft_config: str,
    run_id: str,
    epochs: int,
    nproc: int,
    *,
    base_image: str | None = None,
    **options: Any,
) -> RunPlan:
    """The plan for this host: its device (cpu where containers get no GPU: one process, the CPU
    image), the base image; `options` are RunPlan's own fields (eval_data, log_interval,
    save_interval, learning_rate, seed, batch_size)."""
    device = device_for(spec)
    base = base_image or (CPU_BASE_IMAGE if device == "cpu" else GPU_BASE_IMAGE)
    nproc = 1 if device == "cpu" else nproc
    return RunPlan(run_id, epochs, p.data, p.output, nproc, draft_config, device=device, base_image=base, **options)


def count_command(data: str) -> str:
    """How many SpecForge feature files the export dir holds (what the offline reader walks)."""
    d = shell.quote(data)
    return f"find {d} -type f \\( -name '*.ckpt' -o -name '*.ckpt.gz' \\) 2>/dev/null | wc -l"


def with_samples(remote, plan: RunPlan) -> RunPlan:
    """`plan` with the export's sample count (read on the host): its steps, ETA and saves per epoch."""
    out = remote.run(count_command(plan.data), check=False).stdout.strip()
    return replace(plan, samples=int(out)) if out.isdigit() and int(out) > 0 else plan


def run_yaml(spec, p: TrainPaths, plan: RunPlan) -> str:
    """SpecForge 0.2.0's `specforge train --config` document for offline EAGLE-3 (keys from its schema)."""
    save = plan.save_interval or plan.steps_per_epoch or 0
    training = {
        "strategy": "eagle3",
        "num_epochs": plan.epochs,
        "batch_size": plan.batch_size,
        "ttt_length": 7,
        "seed": plan.seed,
        "learning_rate": plan.learning_rate,
        "log_interval": plan.log_interval,
        "save_interval": save,
        "eval_interval": (save or plan.log_interval) if plan.eval_data else 0,
    }
    data = {"hidden_states_path": plan.data, "max_length": 2048}
    if plan.eval_data:
        data["eval_hidden_states_path"] = plan.eval_data
    if plan.device == "cpu":
        # FSDP refuses the CPU ("FSDP needs a non-CPU accelerator device"): NO_SHARD runs DDP over gloo.
        training.update(fsdp_sharding="NO_SHARD", attention_backend="sdpa")
        data["dataloader_num_workers"] = 0
    doc = {
        "model": {
            "target_model_path": spec.model.path,
            "draft_model_config": IMAGE_DRAFT_CONFIG,
            "torch_dtype": "bfloat16",
        },
        "data": data,
        "training": training,
        "run_id": plan.run_id,
        "output_dir": plan.output,
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": plan.nproc}},
    }
    return json.dumps(doc, indent=1) + "\n"  # JSON is YAML


def dockerfile(spec, plan: RunPlan) -> str:
    from ..core.rendering import render

    return render(
        "Dockerfile.train.j2",
        {
            "remote_ops_version": __version__,
            "host_name": spec.name,
            "base_image": plan.base_image,
            "device": plan.device,
            "specforge_version": SPECFORGE_VERSION,
            "extra_packages": ("datasets", "accelerate", "yunchang", "openai-harmony"),
        },
    )


def container_name(spec) -> str:
    return f"{spec.container.name}-train"


def image_ref(spec) -> str:
    return f"{spec.container.image}-train:specforge-{SPECFORGE_VERSION}"


def trainer_spec(spec, p: TrainPaths, plan: RunPlan) -> RunSpec:
    """The trainer container: the export read-only (and the eval export), the checkpoint dir
    read-write, the model read-only; all GPUs, or on the CPU none, `SPECFORGE_DEVICE=cpu` and
    `TORCHDYNAMO_DISABLE=1`."""
    volumes = [f"{plan.data}:{plan.data}:ro", f"{plan.output}:{plan.output}", f"{spec.model.path}:{spec.model.path}:ro"]
    if plan.eval_data:
        volumes.append(f"{plan.eval_data}:{plan.eval_data}:ro")
    cpu = plan.device == "cpu"
    return RunSpec(
        name=container_name(spec),
        image=image_ref(spec),
        command=("train", "--config", IMAGE_RUN_YAML),
        # TORCHDYNAMO_DISABLE: SpecForge's @torch.compile functions run eagerly (the same math); on the CPU
        # inductor would need a C++ compiler, which the CPU image (the vLLM image's minbase) lacks.
        env={"SPECFORGE_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1"} if cpu else {},
        labels={"io.remote-ops.managed": "1"},
        init=False,
        gpus="none" if cpu else "all",
        ipc="host",
        shm_size=spec.container.shm_size,
        volumes=tuple(volumes),
    )


def real_commands(spec, p: TrainPaths, plan: RunPlan) -> list[str]:
    """Build the training image (FROM a base already on the host: never pulls our own image) and run it
    detached, with the host's engine CLI (`engine.cli_for`); its log is followed into the training log."""
    cli = cli_for(spec)
    build = cli.build_cmd(p.file("context"), image_ref(spec))
    leftover = cli.remove_cmd(container_name(spec))  # a finished run's
    logs = (
        f"rm -f {shell.quote(p.log)}; "
        f"setsid nohup {cli.logs_follow_command(container_name(spec))} >> {shell.quote(p.log)} 2>&1 "
        f"< /dev/null & echo $! > {shell.quote(p.file('logs.pid'))}"
    )
    return [build, leftover, shell.join(cli.run_argv(trainer_spec(spec, p, plan))), logs]


def status_command(p: TrainPaths, spec) -> str:
    """One read-only round trip: lock holder, trainer container, run.json, log tail, checkpoints, best meta."""
    out = shell.quote(p.output)
    best = f'for f in {out}/*.best_meta.json; do [ -f "$f" ] && head -c 1000000 "$f" | tr -d "\\n" && echo; done; :'
    return shell.sections(
        [
            ("lock", LockRead(spec.lock_dir).command()),
            ("container", shell.join(cli_for(spec).inspect_argv("container", container_name(spec))) + " 2>/dev/null"),
            ("run", shell.read_small_file(p.file("run.json"))),  # a FIFO or /dev/zero there reads as none
            ("log", f"tail -c 200000 {shell.quote(p.log)} 2>/dev/null"),
            ("ckpt", f"ls -1 {out} 2>/dev/null"),
            ("best", best),
        ]
    )


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
    """Seconds left in the current epoch from the last tqdm bar of older SpecForge scripts (`[elapsed<remaining, ...]`)."""
    found = None
    for piece in bounded_lines(log_text):
        head = _BAR_HEAD.search(piece)
        found = (_REMAINING.search(piece, head.end()) or found) if head else found
    if not found:
        return None
    parts = [int(x) for x in found["remaining"].split(":") if x]
    seconds = 0
    for x in parts:
        seconds = seconds * 60 + x
    return float(seconds)


def latest_checkpoint(listing: str, run_id: str | None = None) -> str | None:
    steps = sfr.checkpoint_steps(listing, run_id)
    return steps[max(steps)] if steps else None


@dataclass
class TrainStatus:
    host: str
    running: bool
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    steps: int | None = None
    acc: dict[int, float] = field(default_factory=dict)
    ploss: dict[int, float] = field(default_factory=dict)
    acceptance_rate: dict[int, float] = field(default_factory=dict)  # SpecForge's acceptance_rate_k
    eval: dict | None = None  # the newest eval line: step, per-position acc, simulated_acc_len
    best: dict | None = None  # SpecForge's <run_id>.best_meta.json: step, score
    tau_estimate: float | None = None
    eta_s: float | None = None
    latest_checkpoint: str | None = None
    checkpoints: list[int] = field(default_factory=list)  # saved steps of this run
    state: str = "unknown"  # running | finished | stopped | failed | exited | not started
    exit_code: int | None = None  # the trainer container's, once it stopped
    output: str | None = None  # the checkpoint dir on the host
    run_id: str | None = None  # from run.json
    fingerprint: str | None = None  # of the plan that was started (run.json)
    lock: dict | None = None  # who holds the host lock now, if anyone
    metrics: sfr.RunMetrics | None = None

    @property
    def latest_checkpoint_path(self) -> str | None:
        return f"{self.output.rstrip('/')}/{self.latest_checkpoint}" if self.output and self.latest_checkpoint else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("metrics", None)
        return {**d, "latest_checkpoint_path": self.latest_checkpoint_path}


def _run_doc(text: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _container(text: str) -> tuple[bool, int | None, bool]:
    """(running, exit code once stopped, exists) from `inspect` of the trainer container."""
    try:
        doc = json.loads(text)
    except ValueError:
        return False, None, False
    state = (doc[0] if isinstance(doc, list) and doc and isinstance(doc[0], dict) else {}).get("State") or {}
    if not isinstance(state, dict) or not state:
        return False, None, False
    running = state.get("Running") is True
    code = state.get("ExitCode")
    return running, (code if isinstance(code, int) and not running else None), True


def parse_status(host: str, output: str) -> TrainStatus:
    parts = shell.split_sections(output)
    log_text = parts.get("log", (1, ""))[1]
    run = _run_doc(parts.get("run", (1, ""))[1]) if parts.get("run", (1, ""))[0] == 0 else {}
    running, exit_code, exists = _container(parts.get("container", (1, ""))[1])
    st = TrainStatus(host, running, run_id=run.get("run_id"), fingerprint=run.get("fingerprint"), exit_code=exit_code)
    holder = parse_read(*parts.get("lock", (1, "")))
    st.lock = holder.to_dict() if holder else None
    summary = parse_training(log_text)
    total = run.get("total_steps") if isinstance(run.get("total_steps"), int) else None
    m = st.metrics = sfr.run_metrics(log_text, total, summary)
    st.acc, st.ploss, st.acceptance_rate, st.tau_estimate = m.acc, m.ploss, m.acceptance_rate, tau_estimate(m.acc)
    st.step, st.steps, st.eta_s, st.epochs = m.step, total, m.eta_s, run.get("epochs")
    per_epoch = run.get("steps_per_epoch")
    if m.step and isinstance(per_epoch, int) and per_epoch and st.epochs:
        st.epoch = min(st.epochs, (m.step - 1) // per_epoch + 1)
    if m.eval_step is not None:
        st.eval = {"step": m.eval_step, "acc": m.eval_acc, "simulated_acc_len": m.eval_simulated_acc_len}
    _from_epoch_records(st, summary)
    st.eta_s = parse_eta(log_text) if st.eta_s is None else st.eta_s
    listing = parts.get("ckpt", (1, ""))[1]
    steps = sfr.checkpoint_steps(listing, st.run_id)
    st.checkpoints = sorted(steps)
    st.latest_checkpoint = steps[max(steps)] if steps else latest_checkpoint(listing)
    best = sfr.best_meta(parts.get("best", (1, ""))[1], st.run_id)
    st.best = {"step": best["step"], "score": best["score"], "metric": best.get("metric")} if best else None
    st.state = _state(running, exists, exit_code, log_text)
    if st.state == "finished":
        st.eta_s = 0.0
    return st


def _from_epoch_records(st: TrainStatus, summary) -> None:
    """Older SpecForge scripts: `Train Epoch [e/E], position i, Acc:` lines and the tqdm bar."""
    rec = summary.latest("train")
    if rec and rec.unit == "epoch":
        st.acc, st.tau_estimate = dict(rec.acc), tau_estimate(rec.acc)
        st.epoch, st.epochs = rec.index, rec.total
    if summary.steps:
        last = summary.steps[-1]
        st.step, st.steps = last.step, last.total
        st.epoch = max(st.epoch or 0, last.epoch + 1)


def _state(running: bool, exists: bool, exit_code: int | None, log_text: str) -> str:
    if running:
        return "running"
    if exists and exit_code is not None:
        # 143/137: SIGTERM/SIGKILL (`train stop`, docker stop's grace); 130: SIGINT
        return "finished" if exit_code == 0 else ("stopped" if exit_code in (130, 137, 143) else "failed")
    return "not started" if not log_text.strip() else "exited"


# --------------------------------------------------------------------------- lifecycle decisions (pure)


def start_decision(st: TrainStatus, plan: RunPlan) -> str:
    """`start` (nothing runs), `noop` (this plan runs already) or `refuse` (another run is running)."""
    if not st.running:
        return "start"
    return "noop" if st.fingerprint == plan.fingerprint else "refuse"


def run_json_diff(current: str, plan_json: str) -> str:
    """Unified diff of the host's run.json and the planned one (the `started` time left out)."""

    def lines(text: str) -> list[str]:
        doc = _run_doc(text)
        doc.pop("started", None)
        return json.dumps(doc, indent=1, sort_keys=True).splitlines(keepends=True) if doc else []

    return "".join(difflib.unified_diff(lines(current), lines(plan_json), "run.json (host)", "run.json (planned)"))


# --------------------------------------------------------------------------- the run (edges)


@dataclass
class Step:
    name: str
    status: str  # ok | changed | skipped | planned | failed | forced (a refusal --force passed)
    detail: str = ""
    seconds: float = 0.0


@dataclass
class TrainResult:
    """One `train start|stop`: steps, the status after, the record written (like a deploy's result)."""

    host: str
    action: str  # start | stop | export
    dry_run: bool
    noop: bool = False
    steps: list[Step] = field(default_factory=list)
    status: TrainStatus | None = None  # after the change (dry run: now)
    before: TrainStatus | None = None  # at the check, before the change
    plan: dict | None = None
    commands: list[str] = field(default_factory=list)
    diff: str = ""
    record: str | None = None
    contract: dict | None = None  # the draft config against the dumps (problems, forced), when checked

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.to_dict() if self.status else None
        d["before"] = self.before.to_dict() if self.before else None
        return d


class _Lifecycle:
    """One locked change (start or stop): lock -> check -> act -> verify; always unlock + audit + record."""

    def __init__(self, remote, spec, p: TrainPaths, action: str, events=None) -> None:
        self.remote, self.spec, self.p, self.action = remote, spec, p, action
        self.result = TrainResult(spec.name, action, False)
        self.current, self.t0 = "lock", time.monotonic()
        self.token: str | None = None
        self.events = events

    def step(self, name: str, status: str, detail: str = "", since: float | None = None) -> None:
        s = Step(name, status, detail, round(time.monotonic() - since, 3) if since else 0.0)
        self.result.steps.append(s)
        if self.events:
            self.events(s)

    def run(self, act) -> TrainResult:
        from .. import signals

        failure = None
        try:
            t = time.monotonic()
            run_id = (self.result.plan or {}).get("run_id")
            self.token = hostlock.take(
                self.remote, self.spec, f"train {self.action}" + (f": {run_id}" if run_id else "")
            )
            self.step("lock", "ok", self.spec.lock_dir, t)
            act(self)
        except BaseException as exc:
            failure = exc
            self._failed(exc)
            raise
        finally:
            with signals.deferred():
                self._finish(failure)
        return self.result

    def at(self, name: str) -> float:
        self.current = name
        return time.monotonic()

    def _failed(self, exc: BaseException) -> None:
        text = exc.message if isinstance(exc, RemoteOpsError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, RemoteOpsError) and not exc.message.startswith(f"{self.current}:"):
            exc.message = f"{self.current}: {exc.message}"
            exc.args = (exc.message,)
            exc.details.setdefault("step", self.current)
        self.step(self.current, "failed", text)

    def _finish(self, failure: BaseException | None) -> None:
        """Release our lock with the audit line (one round trip), then the local record.  A release that
        fails (connection lost) is said in the record and the error, with how to recover (as deploy)."""
        doc = self._record_doc(failure)
        unlock_error = self._release(doc, failure)
        if unlock_error is not None and failure is None:
            doc.update(ok=False, failed_step="unlock", error=unlock_error.to_dict())
        self.result.record = str(write_record(self.spec.name, doc))
        if unlock_error is not None and failure is None:
            raise unlock_error

    def _release(self, doc: dict, failure: BaseException | None) -> RemoteOpsError | None:
        if not self.token:
            doc["lock"] = "not taken"
            return None
        try:
            hostlock.release(self.remote, self.spec, self.token, audit_line(doc))
        except RemoteOpsError as exc:
            doc["lock"], doc["lock_hint"] = "maybe held", hostlock.recovery_hint(self.spec)
            target = failure if isinstance(failure, RemoteOpsError) else exc
            target.hint = "; ".join(x for x in (target.hint, doc["lock_hint"]) if x)
            if target is exc and not exc.message.startswith("unlock:"):
                exc.message = f"unlock: {exc.message}"
                exc.args = (exc.message,)
            return exc
        doc["lock"] = "released"
        return None

    def _record_doc(self, failure: BaseException | None) -> dict:
        from ..core.jsonable import to_jsonable

        error = None
        if failure is not None:
            error = (
                failure.to_dict()
                if hasattr(failure, "to_dict")
                else {"error": "internal", "exit_code": 1, "message": f"{type(failure).__name__}: {failure}"}
            )
        failed = next((s.name for s in self.result.steps if s.status == "failed"), None)
        return to_jsonable(
            {
                **self.result.to_dict(),
                "kind": "train",
                "time": time.time(),
                "ok": failure is None,
                "error": error,
                "failed_step": failed,
                "wall_s": round(time.monotonic() - self.t0, 3),
            }
        )


def audit_line(record: dict) -> dict:
    """The line appended to the host's audit log for a `train start|stop`."""
    return {
        "time": record["time"],
        "tool": f"remote-ops {__version__}",
        "action": f"train {record['action']}",
        "host": record["host"],
        "user": getpass.getuser(),
        "client": socket.gethostname(),
        "ok": record["ok"],
        "noop": record["noop"],
        "run": (record.get("plan") or {}).get("run_id"),
        "fingerprint": (record.get("plan") or {}).get("fingerprint"),
        "steps": {s["name"]: s["status"] for s in record["steps"]},
        "error": (record.get("error") or {}).get("message"),
        "failed_step": record.get("failed_step"),
        "contract": (record.get("contract") or {}).get("problems"),
        "forced": bool((record.get("contract") or {}).get("forced")),
    }


def write_record(host_name: str, doc: dict) -> Path:
    """runs/<UTC time>-<pid>-train.json under the host's state dir (atomic rename), beside deploy's records."""
    from ..paths import host_dir

    runs = host_dir(host_name) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-train.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def status(remote, spec, p: TrainPaths | None = None) -> TrainStatus:
    p = p or paths_for(spec)
    st = parse_status(spec.name, remote.run(status_command(p, spec), check=False).stdout)
    st.output = p.output
    return st


def read_run_json(remote, p: TrainPaths) -> str:
    """The host's run.json ("" when there is none), bounded (`remote.smallfile`)."""
    return read_small_file(remote, p.file("run.json"), missing_ok=True) or ""


def plan_commands(spec, p: TrainPaths, plan: RunPlan) -> list[str]:
    return real_commands(spec, p, plan)


def start(
    remote,
    spec,
    p: TrainPaths,
    plan: RunPlan,
    *,
    dry_run: bool = False,
    wait_s: float = 30.0,
    events=None,
    draft_config: str | None = None,
    force: bool = False,
    draft_on_host: bool = False,
) -> TrainResult:
    """Start `plan` (a no-op when it runs already; refused while another run runs), as deploy does.

    With `draft_config` (a local file, or a path on the host with `draft_on_host`) the drafter is
    checked against the dumps first: a mismatch is refused (ContractMismatch, exit 9) unless
    `force`.  A real run copies it into the training image."""
    guard = Guard(draft_config, force, draft_on_host)
    plan = with_samples(remote, plan)
    if dry_run:
        return _start_dry_run(remote, spec, p, plan, guard)
    life = _Lifecycle(remote, spec, p, "start", events)
    life.result.plan = {**asdict(plan), "fingerprint": plan.fingerprint}
    return life.run(lambda lf: _start_act(lf, plan, wait_s, guard))


@dataclass(frozen=True)
class Guard:
    """The contract check of a start: the draft config to check (None: none), and `--force`."""

    draft_config: str | None = None
    force: bool = False
    on_host: bool = False  # the draft config is a path on the host (`host:PATH`), not a local file

    def check(self, remote, spec) -> dict | None:
        """The draft config against the dumps ({problems, ...}), or None when there is none."""
        if not self.draft_config:
            return None
        from . import audit

        draft = audit.read_draft_config(remote, self.draft_config, on_host=self.on_host)
        found = audit.check_drafter(remote, spec, draft)
        return {**found, "draft_config": self.draft_config, "forced": bool(found["problems"]) and self.force}


def place_draft_config(remote, guard: Guard, dest: str) -> None:
    """The draft config into the build context: uploaded from the laptop, or copied on the host
    (`host:PATH`); the image COPYs it to IMAGE_DRAFT_CONFIG, which run.yaml names."""
    assert guard.draft_config, "a real plan has a draft config"
    if guard.on_host:
        remote.run(["cp", guard.draft_config, dest])
    else:
        remote.put(Path(guard.draft_config).expanduser().read_bytes(), dest)


def _contract_step(life: _Lifecycle, guard: Guard) -> None:
    """Refuse a draft config that does not fit the dumps, unless forced (said in the step and the
    audit line)."""
    if not guard.draft_config:
        return
    t = life.at("contract")
    found = life.result.contract = guard.check(life.remote, life.spec)
    assert found is not None
    if not found["problems"]:
        life.step("contract", "ok", f"{guard.draft_config} fits {found['from']}", t)
        return
    if not guard.force:
        from . import audit

        raise audit.refusal(
            life.spec,
            f"the draft config {guard.draft_config}",
            found,
            "fix the draft config, or --force (recorded in the host's audit log)",
        )
    life.step("contract", "forced", "--force past: " + "; ".join(found["problems"]), t)


def _start_dry_run(remote, spec, p: TrainPaths, plan: RunPlan, guard: Guard | None = None) -> TrainResult:
    st = status(remote, spec, p)
    r = TrainResult(
        spec.name,
        "start",
        True,
        status=st,
        before=st,
        plan={**asdict(plan), "fingerprint": plan.fingerprint},
    )
    decision = start_decision(st, plan)
    r.noop = decision == "noop"
    r.steps.append(Step("lock", "skipped", "dry run" + (f"; HELD by {st.lock}" if st.lock else "")))
    r.steps.append(Step("check", "ok" if decision != "refuse" else "failed", _decision_text(st, plan, decision)))
    found = r.contract = guard.check(remote, spec) if guard and decision == "start" else None
    if found is not None:
        problems = found["problems"]
        verdict = "ok" if not problems else ("forced" if found["forced"] else "failed")
        r.steps.append(Step("contract", verdict, "; ".join(problems) or f"fits {found['from']}"))
    r.commands = [] if decision != "start" else plan_commands(spec, p, plan)
    for name in ("upload", "launch", "wait"):
        r.steps.append(Step(name, "planned" if decision == "start" else "skipped"))
    r.diff = run_json_diff(read_run_json(remote, p), plan.run_json()) if decision == "start" else ""
    return r


def dry_run_refusal(spec, r: TrainResult) -> RemoteOpsError | None:
    """The error a dry run ends with when its draft config fails the contract and `--force` was not
    given: the refusal the real start would raise (ContractMismatch, exit 9), its steps in the
    details.  None when the contract held, was forced or was not checked."""
    found = r.contract
    if not r.dry_run or not found or not found["problems"] or found["forced"]:
        return None
    from . import audit

    err = audit.refusal(
        spec,
        f"the draft config {found.get('draft_config')}",
        found,
        "fix the draft config, or --force (recorded in the host's audit log)",
    )
    err.details.update(dry_run=True, steps=[asdict(step) for step in r.steps])
    return err


def _decision_text(st: TrainStatus, plan: RunPlan, decision: str) -> str:
    if decision == "noop":
        return f"run {plan.run_id} ({plan.fingerprint}) is already running: nothing to do"
    if decision == "refuse":
        return f"another run is running: {st.run_id or 'unknown'} ({st.fingerprint or 'no run.json'})"
    return f"no run is running ({st.state}): start {plan.run_id} ({plan.fingerprint})"


def _start_act(life: _Lifecycle, plan: RunPlan, wait_s: float, guard: Guard) -> None:
    remote, spec, p = life.remote, life.spec, life.p
    t = life.at("check")
    st = life.result.before = status(remote, spec, p)
    decision = start_decision(st, plan)
    if decision == "refuse":
        raise Refused(
            f"another training run is running on {spec.name}: {st.run_id or 'unknown'} "
            f"(plan {st.fingerprint or '-'}; this one is {plan.fingerprint})",
            host=spec.name,
            hint=f"remote-ops train stop --host {spec.name}, then start again",
            details={"reason": "train_running", "running": st.run_id},
        )
    life.step("check", "ok", _decision_text(st, plan, decision), t)
    if decision == "noop":
        life.result.noop, life.result.status = True, st
        return
    _contract_step(life, guard)
    t = life.at("upload")
    remote.run(["mkdir", "-p", p.workdir, p.output, p.file("context"), str(PurePosixPath(p.log).parent)])
    remote.put(dockerfile(spec, plan).encode(), p.file("context/Dockerfile"))
    remote.put(entrypoint_source(), p.file("context/remote_ops_train.py"))
    place_draft_config(remote, guard, p.file("context/draft_config.json"))
    remote.put(run_yaml(spec, p, plan).encode(), p.file("context/run.yaml"))
    remote.put(plan.run_json().encode(), p.file("run.json"))
    life.step("upload", "changed", p.workdir, t)
    _launch(life, plan, wait_s)


def _launch(life: _Lifecycle, plan: RunPlan, wait_s: float) -> None:
    remote, spec, p = life.remote, life.spec, life.p
    t = life.at("launch")
    life.result.commands = plan_commands(spec, p, plan)
    for cmd in life.result.commands:
        remote.run(cmd, timeout=3600)
    life.step("launch", "changed", f"{container_name(spec)} from {image_ref(spec)} ({plan.device})", t)
    t = life.at("wait")
    life.result.status = _wait_started(remote, spec, p, plan, wait_s)
    life.step("wait", "ok", life.result.status.state, t)


def _wait_started(remote, spec, p: TrainPaths, plan: RunPlan, wait_s: float) -> TrainStatus:
    """Until the trainer container runs (or already finished well); one that failed is an error
    with its log's tail (deadline: `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        st = status(remote, spec, p)
        if st.running or st.state == "finished":
            return st
        if st.state == "failed":
            tail = remote.run(f"tail -c 4000 {shell.quote(p.log)} 2>/dev/null", check=False).stdout
            raise CommandFailed(
                f"the trainer exited {st.exit_code} right after its start",
                host=spec.name,
                command=f"train start {plan.run_id}",
                exit_status=st.exit_code or 1,
                stderr_tail=tail,
                hint=f"the training log on the host: {p.log}",
            )
        if time.monotonic() >= deadline:
            raise CommandTimedOut(
                f"the training run did not start within {wait_s:g}s (state {st.state})",
                host=spec.name,
                command=f"train start {plan.run_id}",
                timeout=wait_s,
            )
        time.sleep(0.2)


def stop(
    remote, spec, p: TrainPaths | None = None, *, dry_run: bool = False, wait_s: float = 60.0, events=None
) -> TrainResult:
    """Stop the trainer container (SIGTERM, SIGKILL after 30 s: SpecForge unwinds its workers on SIGTERM).
    Nothing running: a no-op (the lock is still taken, so a start cannot race it)."""
    p = p or paths_for(spec)
    if dry_run:
        st = status(remote, spec, p)
        r = TrainResult(
            spec.name,
            "stop",
            True,
            noop=not st.running,
            status=st,
            before=st,
            commands=stop_commands(spec, p) if st.running else [],
        )
        r.steps += [
            Step("lock", "skipped", "dry run" + (f"; HELD by {st.lock}" if st.lock else "")),
            Step("check", "ok", f"{st.state}" + ("" if st.running else ": nothing to stop")),
            Step("stop", "planned" if st.running else "skipped"),
        ]
        return r
    life = _Lifecycle(remote, spec, p, "stop", events)
    return life.run(lambda lf: _stop_act(lf, wait_s))


def stop_commands(spec, p: TrainPaths) -> list[str]:
    return [f"{shell.join(cli_for(spec).stop_cmd(container_name(spec), 30))} >/dev/null 2>&1 || true"]


def _stop_act(life: _Lifecycle, wait_s: float) -> None:
    remote, spec, p = life.remote, life.spec, life.p
    t = life.at("check")
    st = life.result.before = status(remote, spec, p)
    life.step("check", "ok", st.state + ("" if st.running else ": nothing to stop"), t)
    if not st.running:
        life.result.noop, life.result.status = True, st
        return
    t = life.at("stop")
    life.result.commands = stop_commands(spec, p)
    for cmd in life.result.commands:
        remote.run(cmd, check=False, timeout=max(60.0, wait_s))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and status(remote, spec, p).running:
        time.sleep(0.5)
    life.step("stop", "changed", f"run {st.run_id or '-'}", t)
    t = life.at("verify")
    life.result.status = status(remote, spec, p)
    if life.result.status.running:
        raise CommandTimedOut(
            f"the training run still runs {wait_s:g}s after SIGTERM and SIGKILL",
            host=spec.name,
            command="train stop",
            timeout=wait_s,
        )
    life.step("verify", "ok", life.result.status.state, t)


# --------------------------------------------------------------------------- export: checkpoint -> drafter


@dataclass
class ExportResult:
    """One `train export`: which checkpoint, why, where the drafter went, and its provenance."""

    host: str
    run_id: str
    to: str  # hf (vLLM) | sglang
    dry_run: bool
    step: int
    checkpoint: str  # the <run_id>-step<N> dir on the host
    reason: str
    out: str  # the drafter dir on the host (core.specforge_run.exported_drafter_dir)
    command: str = ""
    files: list[str] = field(default_factory=list)
    vocab_mapping_dropped: bool = False
    provenance: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def export_command(spec, p: TrainPaths, checkpoint: str, out: str, to: str, timeout_s: float) -> str:
    """`specforge export` in a throwaway container of the training image (no network, never pulls),
    into `<out>.tmp`, then renamed to `out` (the old export replaced only by a whole new one)."""
    cli = cli_for(spec)
    tmp = out + ".tmp"
    args = [ENTRYPOINT, "export", "--to", to, "--checkpoint", checkpoint, "--draft-config", IMAGE_DRAFT_CONFIG]
    args += ["--output-dir", tmp, "--embedding-source", spec.model.path, "--drop-vocab-mapping-if-full"]
    run = cli.bounded_throwaway_command(
        shell.quote(image_ref(spec)),
        args,
        name=f"{container_name(spec)}-export",
        seconds=timeout_s,
        entrypoint="python3",
        mounts=(f"{p.output}:{p.output}", f"{spec.model.path}:{spec.model.path}:ro"),
    )
    t, o = shell.quote(tmp), shell.quote(out)
    # SpecForge prints to stdout too: its output goes to stderr, so that stdout lists the files only
    return f"rm -rf {t} && ( {run} ) >&2 && rm -rf {o} && mv {t} {o} && ls -1 {o}"


def export(
    remote,
    spec,
    p: TrainPaths | None = None,
    *,
    to: str = "hf",
    step: int | None = None,
    dry_run: bool = False,
    timeout_s: float = 1800.0,
) -> ExportResult:
    """Export the run's chosen checkpoint (`step`, else `choose_checkpoint`) as a servable drafter."""
    p = p or paths_for(spec)
    t0 = time.monotonic()
    raw = remote.run(status_command(p, spec), check=False).stdout
    st = parse_status(spec.name, raw)
    run = _run_doc(shell.split_sections(raw).get("run", (1, ""))[1])
    if not st.run_id:
        raise Refused(
            f"no training run on {spec.name} ({p.file('run.json')} missing)",
            host=spec.name,
            hint=f"remote-ops train start --host {spec.name} first",
            details={"reason": "no_run"},
        )
    steps = sfr.checkpoint_steps(shell.split_sections(raw).get("ckpt", (1, ""))[1], st.run_id)
    best = sfr.best_meta(shell.split_sections(raw).get("best", (1, ""))[1], st.run_id)
    assert st.metrics is not None
    if step is not None:
        choice = (
            sfr.Choice(step, steps[step], f"step {step} (asked for)", {"train": {"acc": st.acc}})
            if step in steps
            else None
        )
    else:
        choice = sfr.choose_checkpoint(steps, best, st.metrics)
    if choice is None:
        raise Refused(
            f"run {st.run_id} on {spec.name} has no checkpoint"
            + (f" of step {step} (saved: {sorted(steps) or 'none'})" if step is not None else f" in {p.output}"),
            host=spec.name,
            hint="wait for the run's first save (training.save_interval), or name a saved --step",
            details={"reason": "no_checkpoint", "saved": sorted(steps)},
        )
    out = sfr.exported_drafter_dir(p.output, st.run_id, to)
    checkpoint = f"{p.output.rstrip('/')}/{choice.name}"
    r = ExportResult(spec.name, st.run_id, to, dry_run, choice.step, checkpoint, choice.reason, out)
    r.command = export_command(spec, p, checkpoint, out, to, timeout_s)
    if dry_run:
        return r
    res = remote.run(r.command, check=False, timeout=timeout_s + 60)
    if res.exit_status != 0:
        raise CommandFailed(
            f"specforge export of {choice.name} failed (exit {res.exit_status})",
            host=spec.name,
            command=r.command,
            exit_status=res.exit_status,
            stderr_tail=(res.stderr or res.stdout)[-4000:],
            hint=f"the training image {image_ref(spec)} is built by `train start`",
        )
    r.files = [f for f in res.stdout.split() if f]
    r.vocab_mapping_dropped = "d2t/t2d removed" in (res.stderr or "")
    r.provenance = {
        "made_by": f"remote-ops {__version__} train export",
        "time": time.time(),
        "host": spec.name,
        "run_id": st.run_id,
        "plan_fingerprint": st.fingerprint,
        "checkpoint": checkpoint,
        "step": choice.step,
        "chosen": choice.reason,
        "metrics": choice.metrics,
        "to": to,
        "specforge": SPECFORGE_VERSION,
        "image": image_ref(spec),
        "base_image": run.get("base_image"),
        "data": run.get("data"),
        "eval_data": run.get("eval_data"),
        "vocab_mapping_dropped": r.vocab_mapping_dropped,
    }
    remote.put((json.dumps(r.provenance, indent=1) + "\n").encode(), f"{out}/provenance.json")
    r.files = sorted({*r.files, "provenance.json"})
    r.seconds = round(time.monotonic() - t0, 3)
    return r
