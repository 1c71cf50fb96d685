"""EAGLE-3 drafter training on a host: SpecForge 0.2.0 in a container, or the clearly named stand-in.

- Real run: an image rendered from `templates/Dockerfile.train.j2` (FROM the SGLang
  image + `specforge==0.2.0` pinned) and a `run.yaml` for `specforge train --config`
  (offline: `data.hidden_states_path` = the export dir), started with GPUs, the
  export mounted read-only and the checkpoint dir mounted read-write. Builders
  here are pure; `train start` runs them through the `Remote` seam.
- Stand-in (`--standin`, the sandbox and tests, no GPU or registry):
  `docker/standin/specforge_standin_train.py` runs detached on the host (`setsid`,
  PID recorded, stopped by that PID) and writes SpecForge 0.2.0's own metrics lines
  (`step N: {'acc_0': ..}`) with SYNTHETIC values and checkpoint folders without
  weights, every one labelled STAND-IN.

Lifecycle as deploy's: `start` and `stop` take the one host lock (`hostlock.take`,
exit 9 while another change holds it) only for the change itself, not for the
days of training; they release it with an audit line on the host and write a local
run record (`<state>/hosts/<host>/runs/<time>-<pid>-train.json`) naming the failed
step on failure.  `run.json` next to the log says which run was started (plan and
fingerprint): `start` of the same plan while it runs is a no-op, of another plan
refused; `stop` of nothing is a no-op.  `--dry-run` reads the host only; one whose draft
config fails the contract (not forced) ends with the same refusal, exit 9 (`dry_run_refusal`).

The capture contract guards a start with a draft config (`contract` step): its
`eagle_config.eagle_aux_hidden_state_layer_ids`, under the numbering of the host's SGLang
release, must give the layers the dumps recorded, and its hidden size must be theirs
(`workflows.audit.check_drafter`).  Otherwise the start is refused (`ContractMismatch`,
exit 9) unless forced; a forced start's audit line on the host names what was forced past.

Status reads the training log (`logparse.parse_training`: step, per-position accuracy,
0.2.0's `perf/optimizer_step_time_s` or the older tqdm bar for the ETA), `run.json`
(epochs, steps per epoch when known) and the newest `<run_id>-step<N>` folder.
tau is estimated from the per-position accuracies as `1 + sum_k prod_{j<=k} acc_j`
(the expected accepted length of a chain draft whose position-k token is right
with probability acc_k given the earlier ones were): an estimate, not a measurement.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from .. import __version__
from ..core import shell
from ..core.logparse import bounded_lines, parse_training
from ..engine import cli_for
from ..engine.spec import RunSpec
from ..errors import CommandTimedOut, Refused, RemoteOpsError
from ..probes.lock import LockRead, parse_read
from ..remote.smallfile import read_small_file
from . import hostlock

STANDIN = "specforge_standin_train.py"
SPECFORGE_VERSION = "0.2.0"
# The bar's head, then its `[elapsed<remaining` after it: one regex with `.*?` between them
# re-scanned the line from every `Training Epoch` (quadratic on a hostile log line).
_BAR_HEAD = re.compile(r"Training Epoch \d{1,9}:")
_REMAINING = re.compile(r"\[(?P<elapsed>[\d:]{1,20})<(?P<remaining>[\d:]{1,20})")
_STEP_DIR = re.compile(r"^(?P<run>.+)-step(?P<step>\d{1,18})$")


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


def standin_source() -> bytes:
    from ..paths import repo_resource

    return repo_resource("docker", "standin", STANDIN).read_bytes()


# --------------------------------------------------------------------------- commands (pure)


def alive_check(p: TrainPaths) -> str:
    pidfile = shell.quote(p.file("train.pid"))
    return (
        f'pid=$(cat {pidfile} 2>/dev/null) && [ -n "$pid" ] && '
        f"tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -q {shell.quote(STANDIN)}"
    )


def standin_command(p: TrainPaths, run_id: str, epochs: int, steps: int, step_s: float) -> str:
    """Start the stand-in detached in its own session (a fresh log); record and print its PID."""
    argv = [
        "python3",
        p.file(STANDIN),
        "--log",
        p.log,
        "--output",
        p.output,
        "--data",
        p.data,
        "--run-id",
        run_id,
        "--epochs",
        str(epochs),
        "--steps",
        str(steps),
        "--step-s",
        f"{step_s:g}",
    ]
    out, pid = shell.quote(p.file("train.out")), shell.quote(p.file("train.pid"))
    return (
        f"cd {shell.quote(p.workdir)} || exit 1; rm -f {shell.quote(p.log)}; setsid nohup {shell.join(argv)} >> {out} 2>&1 < /dev/null & "
        f"echo $! > {pid}; cat {pid}"
    )


# Where the training image holds the draft config: it is copied into the build context, wherever
# it came from (the laptop, or a path on the host that the trainer container does not mount).
IMAGE_DRAFT_CONFIG = "/opt/remote-ops/train/draft_config.json"


def run_yaml(spec, p: TrainPaths, run_id: str, epochs: int, nproc: int) -> str:
    """SpecForge 0.2.0 `specforge train --config` document for offline EAGLE-3 (keys from its schema)."""
    import json

    doc = {
        "model": {
            "target_model_path": spec.model.path,
            "draft_model_config": IMAGE_DRAFT_CONFIG,
            "torch_dtype": "bfloat16",
        },
        "data": {"hidden_states_path": p.data, "max_length": 2048},
        "training": {"strategy": "eagle3", "num_epochs": epochs, "batch_size": 1, "ttt_length": 7},
        "run_id": run_id,
        "output_dir": p.output,
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": nproc}},
    }
    return json.dumps(doc, indent=1) + "\n"  # JSON is YAML


def dockerfile(spec, extra_packages: tuple[str, ...] = ("datasets", "yunchang", "openai-harmony")) -> str:
    from .. import __version__
    from ..core.rendering import render

    return render(
        "Dockerfile.train.j2",
        {
            "remote_ops_version": __version__,
            "host_name": spec.name,
            "sglang_version": spec.sglang.version,
            "base_image": spec.sglang.base_image,
            "specforge_version": SPECFORGE_VERSION,
            "extra_packages": extra_packages,
        },
    )


def container_name(spec) -> str:
    return f"{spec.container.name}-train"


def image_ref(spec) -> str:
    return f"{spec.container.image}-train:specforge-{SPECFORGE_VERSION}"


def trainer_spec(spec, p: TrainPaths) -> RunSpec:
    """The trainer container: all GPUs, the export read-only, the checkpoint dir read-write."""
    return RunSpec(
        name=container_name(spec),
        image=image_ref(spec),
        labels={"io.remote-ops.managed": "1"},
        init=False,
        gpus="all",
        ipc="host",
        shm_size=spec.container.shm_size,
        volumes=(f"{p.data}:{p.data}:ro", f"{p.output}:{p.output}", f"{spec.model.path}:{spec.model.path}:ro"),
    )


def real_commands(spec, p: TrainPaths) -> list[str]:
    """Build the training image (never pulls our own image) and run it detached with GPUs, with
    the host's engine CLI (`engine.cli_for`); its log is copied to the training log."""
    cli = cli_for(spec)
    build = cli.build_cmd(p.file("context"), image_ref(spec))
    leftover = cli.remove_cmd(container_name(spec))  # a finished run's
    logs = (
        f"setsid nohup {cli.logs_follow_command(container_name(spec))} >> {shell.quote(p.log)} 2>&1 "
        f"< /dev/null & echo $! > {shell.quote(p.file('logs.pid'))}"
    )
    return [build, leftover, shell.join(cli.run_argv(trainer_spec(spec, p))), logs]


@dataclass(frozen=True)
class RunPlan:
    """What `train start` runs: the same plan while it runs makes a re-run a no-op (its fingerprint)."""

    run_id: str
    standin: bool
    epochs: int
    data: str
    output: str
    steps_per_epoch: int | None = None  # stand-in: --steps; real: SpecForge derives it from the data
    step_s: float | None = None  # stand-in only
    nproc: int | None = None  # real only
    draft_config: str | None = None  # real only

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def run_json(self) -> str:
        """`run.json` on the host: the plan, its fingerprint, and who started it (pure but for the clock)."""
        return (
            json.dumps(
                {
                    **asdict(self),
                    "fingerprint": self.fingerprint,
                    "started": time.time(),
                    "tool": f"remote-ops {__version__}",
                    "STAND-IN": "synthetic: nothing is trained" if self.standin else None,
                },
                indent=1,
            )
            + "\n"
        )


def standin_plan(p: TrainPaths, run_id: str, epochs: int, steps: int, step_s: float) -> RunPlan:
    return RunPlan(run_id, True, epochs, p.data, p.output, steps_per_epoch=steps, step_s=step_s)


def real_plan(p: TrainPaths, draft_config: str, run_id: str, epochs: int, nproc: int) -> RunPlan:
    return RunPlan(run_id, False, epochs, p.data, p.output, nproc=nproc, draft_config=draft_config)


def status_command(p: TrainPaths, spec) -> str:
    """One read-only round trip: lock holder, stand-in PID, trainer container, run.json, log tail, checkpoints."""
    return shell.sections(
        [
            ("lock", LockRead(spec.lock_dir).command()),
            ("alive", alive_check(p)),
            ("container", cli_for(spec).running_command(container_name(spec))),
            ("run", shell.read_small_file(p.file("run.json"))),  # a FIFO or /dev/zero there reads as none
            ("log", f"tail -c 200000 {shell.quote(p.log)} 2>/dev/null"),
            ("ckpt", f"ls -1 {shell.quote(p.output)} 2>/dev/null"),
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
    """Seconds left in the current epoch from the last tqdm bar (`[elapsed<remaining, ...]`)."""
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
    state: str = "unknown"  # running | finished | stopped | exited | not started
    output: str | None = None  # the checkpoint dir on the host
    run_id: str | None = None  # from run.json
    fingerprint: str | None = None  # of the plan that was started (run.json)
    lock: dict | None = None  # who holds the host lock now, if anyone

    @property
    def latest_checkpoint_path(self) -> str | None:
        return f"{self.output.rstrip('/')}/{self.latest_checkpoint}" if self.output and self.latest_checkpoint else None

    def to_dict(self) -> dict:
        return {**asdict(self), "latest_checkpoint_path": self.latest_checkpoint_path}


def _run_doc(text: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def parse_status(host: str, output: str) -> TrainStatus:
    parts = shell.split_sections(output)
    log_text = parts.get("log", (1, ""))[1]
    run = _run_doc(parts.get("run", (1, ""))[1]) if parts.get("run", (1, ""))[0] == 0 else {}
    running = parts.get("alive", (1, ""))[0] == 0 or parts.get("container", (1, ""))[1].strip() == "true"
    st = TrainStatus(
        host,
        running,
        "SPECFORGE STAND-IN" in log_text or bool(run.get("standin")),
        run_id=run.get("run_id"),
        fingerprint=run.get("fingerprint"),
    )
    holder = parse_read(*parts.get("lock", (1, "")))
    st.lock = holder.to_dict() if holder else None
    summary = parse_training(log_text)
    _from_records(st, summary, run)
    _from_tqdm(st, summary)
    st.eta_s = parse_eta(log_text) if st.eta_s is None else st.eta_s
    st.latest_checkpoint = latest_checkpoint(parts.get("ckpt", (1, ""))[1])
    st.state = _state(running, log_text)
    if st.state == "finished":
        st.eta_s = 0.0
    return st


def _from_records(st: TrainStatus, summary, run: dict) -> None:
    """Accuracy from the newest train record; for 0.2.0 step records, epoch and ETA from run.json's plan."""
    rec = summary.latest("train")
    if not rec:
        return
    st.acc, st.tau_estimate = dict(rec.acc), tau_estimate(rec.acc)
    if rec.unit == "epoch":
        st.epoch, st.epochs = rec.index, rec.total
        return
    st.step, st.epochs = rec.index, run.get("epochs")
    per_epoch = run.get("steps_per_epoch")
    if per_epoch and st.epochs:
        st.steps = per_epoch * st.epochs
        st.epoch = min(st.epochs, (rec.index - 1) // per_epoch + 1)
        step_s = rec.metrics.get("perf/optimizer_step_time_s")
        st.eta_s = round(step_s * max(0, st.steps - rec.index), 1) if step_s is not None else None


def _from_tqdm(st: TrainStatus, summary) -> None:
    """The older `train_eagle3.py` bar: step within the epoch and the epoch number."""
    if summary.steps:
        last = summary.steps[-1]
        st.step, st.steps = last.step, last.total
        st.epoch = max(st.epoch or 0, last.epoch + 1)


def _state(running: bool, log_text: str) -> str:
    if running:
        return "running"
    for word in ("finished", "stopped"):
        if f"SPECFORGE STAND-IN {word}" in log_text:
            return word
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
    action: str  # start | stop
    dry_run: bool
    standin: bool
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

    def __init__(self, remote, spec, p: TrainPaths, action: str, standin: bool, events=None) -> None:
        self.remote, self.spec, self.p, self.action = remote, spec, p, action
        self.result = TrainResult(spec.name, action, False, standin)
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
        "standin": record["standin"],
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
    if plan.standin:
        assert plan.steps_per_epoch is not None and plan.step_s is not None, "a stand-in plan sets them"
        return [standin_command(p, plan.run_id, plan.epochs, plan.steps_per_epoch, plan.step_s)]
    return real_commands(spec, p)


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
    if dry_run:
        return _start_dry_run(remote, spec, p, plan, guard)
    life = _Lifecycle(remote, spec, p, "start", plan.standin, events)
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
        plan.standin,
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
    remote.run(["mkdir", "-p", p.workdir, p.output, str(PurePosixPath(p.log).parent)])
    if plan.standin:
        remote.put(standin_source(), p.file(STANDIN), mode=0o755)
    else:
        remote.run(["mkdir", "-p", p.file("context")])
        remote.put(dockerfile(spec).encode(), p.file("context/Dockerfile"))
        assert plan.draft_config is not None and plan.nproc is not None, "a real plan sets them"
        place_draft_config(remote, guard, p.file("context/draft_config.json"))
        remote.put(run_yaml(spec, p, plan.run_id, plan.epochs, plan.nproc).encode(), p.file("context/run.yaml"))
    remote.put(plan.run_json().encode(), p.file("run.json"))
    life.step("upload", "changed", p.workdir, t)
    _launch(life, plan, wait_s)


def _launch(life: _Lifecycle, plan: RunPlan, wait_s: float) -> None:
    remote, spec, p = life.remote, life.spec, life.p
    t = life.at("launch")
    life.result.commands = plan_commands(spec, p, plan)
    for cmd in life.result.commands:
        remote.run(cmd, timeout=30 if plan.standin else 3600)
    life.step(
        "launch",
        "changed",
        "stand-in started (STAND-IN: nothing is trained)"
        if plan.standin
        else f"{container_name(spec)} from {image_ref(spec)}",
        t,
    )
    t = life.at("wait")
    life.result.status = _wait_started(remote, spec, p, plan, wait_s)
    life.step("wait", "ok", life.result.status.state, t)


def _wait_started(remote, spec, p: TrainPaths, plan: RunPlan, wait_s: float) -> TrainStatus:
    """Until the stand-in's banner is in the log, or the trainer container runs (deadline: `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        st = status(remote, spec, p)
        if (plan.standin and st.standin and st.state != "not started") or (not plan.standin and st.running):
            return st
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
    """SIGTERM the stand-in by its recorded PID (KILL at the deadline), or stop the trainer container.
    Nothing running: a no-op (the lock is still taken, so a start cannot race it)."""
    p = p or paths_for(spec)
    if dry_run:
        st = status(remote, spec, p)
        r = TrainResult(
            spec.name,
            "stop",
            True,
            st.standin,
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
    life = _Lifecycle(remote, spec, p, "stop", False, events)
    return life.run(lambda lf: _stop_act(lf, wait_s))


def stop_commands(spec, p: TrainPaths) -> list[str]:
    pidfile = shell.quote(p.file("train.pid"))
    return [
        f"{shell.join(cli_for(spec).stop_cmd(container_name(spec), 30))} >/dev/null 2>&1 || true",
        f"{alive_check(p)} && kill -TERM $(cat {pidfile})",
    ]


def _stop_act(life: _Lifecycle, wait_s: float) -> None:
    remote, spec, p = life.remote, life.spec, life.p
    t = life.at("check")
    st = life.result.before = status(remote, spec, p)
    life.result.standin = st.standin
    life.step("check", "ok", st.state + ("" if st.running else ": nothing to stop"), t)
    if not st.running:
        life.result.noop, life.result.status = True, st
        return
    t = life.at("stop")
    life.result.commands = stop_commands(spec, p)
    for cmd in life.result.commands:
        remote.run(cmd, check=False, timeout=60)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and remote.run(alive_check(p), check=False).exit_status == 0:
        time.sleep(0.2)
    remote.run(f"{alive_check(p)} && kill -KILL $(cat {shell.quote(p.file('train.pid'))})", check=False)
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
