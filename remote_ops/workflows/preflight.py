"""`spec preflight`: the whole job on a handful of samples, judged by what the engine accepts.

The chain is the existing workflows', run with the pre-flight's host spec
(`core.preflight.preflight_host`: every file under `<dump.dir>-preflight/`, never the
operator's own dumps, export, work dirs or drafter):

  check     no extraction client and no training run of the host's own is running (exit 9):
            the pre-flight restarts the server and the trainer container is the host's one
  clean     `<dump.dir>-preflight/` removed and made again (a pre-flight starts fresh)
  deploy    `workflows.deploy` of the extraction server, its dumps into the pre-flight's dir
  extract   `workflows.extract.start` of the samples (`core.preflight.pick_samples`), waited for
  export    `workflows.export` (the final-norm decision, then the stdlib exporter)
  train     `workflows.train.start` of SpecForge on that export (one rank, a checkpoint at the
            end), polled until it ends
  train export  `workflows.train.export` of that checkpoint (`--to hf` on vLLM, `--to sglang`)
  spec deploy   `workflows.specdeploy` with the drafter (its contract checked unless forced)
  spec bench    `workflows.specbench.run` on the samples' own prompts
  verdict   `core.preflight.judge`
  restore   `workflows.deploy` of the host's own spec: always once the server was touched, also
            after a failure (not after Ctrl-C: the error says to run `deploy`)

Each step reports through `progress(status, text)`; the deploys also through `deploy_events`.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ..core import preflight as pf, shell
from ..core.inventory import HostSpec
from ..errors import (
    CommandFailed,
    CommandTimedOut,
    ContractMismatch,
    PreflightFailed,
    Refused,
    RemoteOpsError,
    VerifyFailed,
)

Progress = Callable[[str, str], None]


@dataclass(frozen=True)
class Options:
    """One pre-flight's settings (the command's options)."""

    dataset: str  # a local prepared JSONL (input_ids, loss_mask)
    draft_config: str  # a local file, or a path on the host with draft_on_host
    draft_on_host: bool = False
    samples: int = pf.DEFAULT_SAMPLES
    num_steps: int = pf.DEFAULT_NUM_STEPS
    epochs: int = pf.DEFAULT_EPOCHS
    learning_rate: float = pf.DEFAULT_LEARNING_RATE
    threshold: float | None = None  # None: core.preflight.default_threshold(num_steps)
    max_new_tokens: int = pf.DEFAULT_MAX_NEW_TOKENS
    force: bool = False  # past a draft config that does not fit the capture (train and spec deploy)
    healthy_timeout_s: float | None = None
    extract_timeout_s: float = 1800.0
    train_timeout_s: float = 4 * 3600.0

    @property
    def gate(self) -> float:
        return pf.default_threshold(self.num_steps) if self.threshold is None else self.threshold


@dataclass
class Result:
    host: str
    root: str
    verdict: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    drafter: str | None = None
    train: dict[str, Any] = field(default_factory=dict)  # SpecForge's last acc_k, steps, state
    bench: dict[str, Any] = field(default_factory=dict)  # the bench summary (per request, counters)
    forced: list[str] = field(default_factory=list)
    restored: bool | None = None  # None: the server was not touched
    engine_note: str | None = None
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_samples(path: Path, n: int) -> tuple[list[pf.Sample], int]:
    """The first `n` usable samples of a local dataset (a UsageError, exit 2, when there is none)."""
    from ..errors import UsageError

    with path.expanduser().open(errors="replace") as fh:
        samples, skipped = pf.pick_samples(fh, n)
    if not samples:
        raise UsageError(
            f"{path}: no sample with a prompt and a reply in its first {pf.MAX_LINES_READ} lines "
            '(each line {"id", "input_ids", "loss_mask"}, the loss mask 0 over the prompt, 1 over the reply: '
            "`dataset prepare` writes them)"
        )
    return samples, skipped


def engine_note(spec: HostSpec) -> str | None:
    """What the pre-flight says of an SGLang host: the path has not run against a real SGLang."""
    if spec.serving.engine == "vllm":
        return None
    return (
        "SGLang host: the chain serves the drafter with SGLang's --speculative-* flags and judges "
        "SGLang's per-request spec_accept_length; this path has not run against a real SGLang server "
        "(none runs in the project's lab: only its stand-in, whose verdict is inconclusive)"
    )


def plan(spec: HostSpec, o: Options, samples: list[pf.Sample]) -> list[dict[str, str]]:
    return pf.plan_steps(
        spec,
        {
            "samples": len(samples),
            "dataset": o.dataset,
            "num_steps": o.num_steps,
            "epochs": o.epochs,
            "learning_rate": o.learning_rate,
            "threshold": o.gate,
            "max_new_tokens": pf.max_new_tokens(samples, o.max_new_tokens),
            "draft_config": ("host:" if o.draft_on_host else "") + o.draft_config,
        },
    )


class _Run:
    def __init__(self, remote, spec: HostSpec, o: Options, progress: Progress, deploy_events) -> None:
        self.remote, self.spec, self.o = remote, spec, o
        self.pf = pf.preflight_host(spec)
        self.progress, self.deploy_events = progress, deploy_events
        self.result = Result(spec.name, pf.root_of(spec), engine_note=engine_note(spec))
        self.t0 = time.monotonic()

    def step(self, name: str, status: str, detail: str, since: float) -> None:
        s = {"step": name, "status": status, "detail": detail, "seconds": round(time.monotonic() - since, 1)}
        self.result.steps.append(s)
        self.progress("ok" if status in ("ok", "changed") else "warn", f"preflight {name}: {detail} ({s['seconds']}s)")

    def deploy(self, spec: HostSpec, why: str):
        from . import deploy as deploy_mod

        return deploy_mod.deploy(
            self.remote,
            spec,
            events=self.deploy_events or deploy_mod.Events(),
            why=why,
            healthy_timeout_s=self.o.healthy_timeout_s,
        )

    # ----------------------------------------------------------------- steps

    def check(self) -> None:
        from . import extract, train

        t = time.monotonic()
        ex = extract.status(self.remote, self.spec)
        if ex.running:
            raise Refused(
                f"preflight: the host's extraction client is running (pid {ex.pid}): the pre-flight restarts the server",
                host=self.spec.name,
                hint=f"wait for it, or `remote-ops extract stop --host {self.spec.name}`",
                details={"reason": "extraction_running"},
            )
        st = train.status(self.remote, self.spec)
        if st.running:
            raise Refused(
                f"preflight: a training run is running ({st.run_id or 'unknown'}): the pre-flight needs the trainer",
                host=self.spec.name,
                hint=f"wait for it, or `remote-ops train stop --host {self.spec.name}`",
                details={"reason": "train_running"},
            )
        self.step("check", "ok", "no extraction client, no training run", t)

    def clean(self) -> None:
        t = time.monotonic()
        self.remote.run(pf.clean_command(self.spec), timeout=600)
        self.step("clean", "changed", pf.root_of(self.spec), t)

    def extract(self, samples: list[pf.Sample]) -> None:
        from . import extract

        t = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="remote-ops-preflight-") as tmp:
            local = Path(tmp) / "samples.jsonl"
            local.write_bytes(pf.samples_jsonl(samples))
            extract.start(self.remote, self.pf, str(local), concurrency=min(4, len(samples)), local_dataset=True)
        st = extract.wait_finished(self.remote, self.pf, self.o.extract_timeout_s)
        code, why = st.outcome()
        if code:
            raise CommandFailed(
                f"preflight extract: {why}",
                host=self.spec.name,
                command="extract start",
                exit_status=code,
                stderr_tail=st.client_out[-4000:],
            )
        self.step("extract", "changed", f"{st.manifest_ok} of {st.dataset_total} samples -> {self.pf.dump.dir}", t)

    def export(self) -> None:
        from . import export

        t = time.monotonic()
        norm = export.final_norm_decision(self.remote, self.pf)
        out = export.default_out(self.pf)
        cmd = export.export_command(
            self.pf.dump.dir,
            export.default_dataset(self.pf),
            out,
            jobs=2,
            probe_mb=0,
            convert_prenorm=self.pf.model.path if norm["action"] == "convert" else None,
        )
        report = export.run_export(self.remote, cmd).final
        if report.get("failed"):
            raise VerifyFailed(
                f"preflight export: {len(report['failed'])} sample(s) failed to export",
                host=self.spec.name,
                details={"export": report},
            )
        self.step("export", "changed", f"{out}; final states: {norm['said']}", t)

    def train(self) -> None:
        from . import train

        t = time.monotonic()
        p = train.paths_for(self.pf)
        plan = train.real_plan(
            self.pf, p, self.o.draft_config, pf.RUN_ID, self.o.epochs, 1, learning_rate=self.o.learning_rate
        )
        plan = train.with_samples(self.remote, plan)
        total = plan.total_steps or 0
        # one checkpoint, at the end (a drafter of a real model is GBs a save); a line every few steps
        plan = replace(plan, save_interval=total, log_interval=max(1, min(10, total // 10 or 1)))
        started = train.start(
            self.remote,
            self.pf,
            p,
            plan,
            draft_config=self.o.draft_config,
            draft_on_host=self.o.draft_on_host,
            force=self.o.force,
        )
        if started.contract and started.contract.get("forced"):
            self.result.forced.append("train: " + "; ".join(started.contract["problems"]))
        deadline = time.monotonic() + self.o.train_timeout_s
        st = started.status
        last = 0.0
        while st is None or st.state == "running":
            if time.monotonic() > deadline:
                train.stop(self.remote, self.pf, p)
                raise CommandTimedOut(
                    f"preflight train: still running after {self.o.train_timeout_s:g}s (stopped)",
                    host=self.spec.name,
                    command="train start",
                    timeout=self.o.train_timeout_s,
                )
            time.sleep(5)
            st = train.status(self.remote, self.pf, p)
            if st.step and time.monotonic() - last > 30:
                last = time.monotonic()
                self.progress("info", f"preflight train: step {st.step}/{st.steps or '?'}, acc_0 {st.acc.get(0)}")
        self.result.train = {
            "state": st.state,
            "steps": st.steps,
            "step": st.step,
            "acc": st.acc,
            "ploss": st.ploss,
            "samples": plan.samples,
            "epochs": plan.epochs,
            "learning_rate": plan.learning_rate,
        }
        if st.state != "finished":
            tail = self.remote.run(f"tail -c 4000 {shell.quote(p.log)} 2>/dev/null", check=False).stdout
            raise CommandFailed(
                f"preflight train: the run ended {st.state} (exit {st.exit_code})",
                host=self.spec.name,
                command="train start",
                exit_status=st.exit_code or 1,
                stderr_tail=tail,
                hint=f"the training log on the host: {p.log}",
            )
        acc = ", ".join(f"{st.acc[k]:.2f}" for k in sorted(st.acc)[:3])
        self.step("train", "changed", f"{st.step} steps ({plan.samples} samples x {plan.epochs}), acc_0..2 {acc}", t)

    def train_export(self) -> str:
        from . import train

        t = time.monotonic()
        r = train.export(self.remote, self.pf, to="hf" if self.spec.serving.engine == "vllm" else "sglang")
        self.result.drafter = r.out
        self.step("train export", "changed", f"step {r.step} -> {r.out}", t)
        return r.out

    def spec_deploy(self, draft: str) -> HostSpec:
        from . import specdeploy

        t = time.monotonic()
        k = self.o.num_steps
        s = specdeploy.settings(self.pf, draft, k, 1, None if self.spec.serving.engine == "vllm" else k + 1)
        served = specdeploy.spec_host(self.pf, s)
        try:
            specdeploy.check_drafter(self.remote, served, draft)
        except ContractMismatch as exc:
            if not self.o.force:
                raise
            self.result.forced.append("spec deploy: " + exc.message)
            self.progress("warn", f"preflight spec deploy: --force past: {exc.message}")
        specdeploy.check_flags(self.remote, served)
        specdeploy.deploy(
            self.remote,
            served,
            events=self.deploy_events,
            healthy_timeout_s=self.o.healthy_timeout_s,
            why="spec preflight",
        )
        self.step("spec deploy", "changed", specdeploy.describe(self.pf, s), t)
        return served

    def bench(self, served: HostSpec, samples: list[pf.Sample]) -> pf.Verdict:
        from . import specbench as sb

        t = time.monotonic()
        new = pf.max_new_tokens(samples, self.o.max_new_tokens)
        data = sb.prompts_jsonl(pf.bench_prompts(samples))
        doc = sb.run(self.remote, served, data, new, warmup=1)
        summary = sb.summarise(doc, sb.prompt_set_id(data, new), new).to_dict()
        summary.pop("metrics", None)
        self.result.bench = summary
        verdict = pf.judge(summary, samples, self.o.gate, self.o.num_steps, new, self.result.train.get("acc"))
        self.result.verdict = verdict.to_dict()
        self.step("spec bench", "ok", pf.figures_line(verdict), t)
        return verdict

    def restore(self) -> None:
        t = time.monotonic()
        try:
            self.deploy(self.spec, "spec preflight: restore")
        except RemoteOpsError as exc:
            self.result.restored = False
            self.step("restore", "failed", exc.message, t)
            raise
        self.result.restored = True
        self.step("restore", "changed", "the host's own server again", t)


def run(
    remote, spec: HostSpec, o: Options, samples: list[pf.Sample], *, progress: Progress, deploy_events=None
) -> Result:
    """The pre-flight on one host; PreflightFailed (exit 10) when the verdict is not a pass, with
    the result in its details.  Once the server was touched it is restored, also after an error."""
    r = _Run(remote, spec, o, progress, deploy_events)
    r.result.samples = [s.id for s in samples]
    if r.result.engine_note:
        progress("warn", r.result.engine_note)
    touched = False
    failure: BaseException | None = None
    verdict = None
    try:
        r.check()
        r.clean()
        touched = True
        t = time.monotonic()
        r.deploy(r.pf, "spec preflight: extraction into its own dump dir")
        r.step("deploy", "changed", f"extraction server, dumps into {r.pf.dump.dir}", t)
        r.extract(samples)
        r.export()
        r.train()
        draft = r.train_export()
        served = r.spec_deploy(draft)
        verdict = r.bench(served, samples)
    except Exception as exc:
        failure = exc
        raise
    except BaseException:  # Ctrl-C, SIGTERM: no restart of minutes now; say how to restore
        touched = False
        raise
    finally:
        r.result.wall_s = round(time.monotonic() - r.t0, 1)
        if touched:
            try:
                r.restore()
            except RemoteOpsError as exc:
                if failure is None:
                    raise
                if isinstance(failure, RemoteOpsError):
                    failure.details["restore_error"] = exc.to_dict()
                    failure.hint = "; ".join(
                        x for x in (failure.hint, f"then restore: remote-ops deploy --host {spec.name} --yes") if x
                    )
        if isinstance(failure, RemoteOpsError):
            failure.details.setdefault("preflight", r.result.to_dict())
    r.result.wall_s = round(time.monotonic() - r.t0, 1)
    assert verdict is not None
    if not verdict.passed:
        raise PreflightFailed(
            f"preflight {verdict.state}: {verdict.reason}",
            host=spec.name,
            hint="docs/drafter.md#pre-flight says what a low acceptance on overfit samples points to",
            details={"reason": "preflight_" + verdict.state, "preflight": r.result.to_dict()},
        )
    return r.result
