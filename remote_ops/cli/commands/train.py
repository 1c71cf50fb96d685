"""`remote-ops train start|status|stop|export`: EAGLE-3 drafter training (SpecForge 0.2.0) on a host."""

from __future__ import annotations

from pathlib import Path

import click

from ...workflows import train as train_mod
from ._fleet import run_on_hosts
from ._options import PathOption, host_command, hosts_command


@click.group("train")
def train_group() -> None:
    """Train the drafter on the exported features with SpecForge 0.2.0, follow it, stop it, export it.

    \b
    Examples:
      remote-ops train start --host gpu-node --draft-config host:/data/kimi-eagle3.json --epochs 10
      remote-ops train status --host gpu-node
      remote-ops train status --host fleet          # every host's run
      remote-ops train stop --host gpu-node
      remote-ops train export --host gpu-node       # the best checkpoint -> a drafter vLLM loads

    Data: the `dumps export` dir (default <dump.dir>-specforge); checkpoints:
    <dump.dir>-drafter/<run_id>-step<N>; the exported drafter:
    <dump.dir>-drafter/<run_id>-drafter-<hf|sglang>.  A host whose containers get no
    GPU (container.gpus: none, the sandbox) trains on the CPU, from the CPU training
    image (SpecForge with a labelled CPU shim for its Triton loss).  `start` and
    `stop` take the host lock for the change, append an audit line on the host and
    write a run record, as deploy does.  ETA: the export's sample count and
    SpecForge's perf/optimizer_step_time_s; older SpecForge tqdm bars give the time
    left in the epoch.
    """


def _per_position(values: dict[int, float], fmt: str = "{:.2f}") -> str:
    return ", ".join(f"{k}: {fmt.format(v)}" for k, v in sorted(values.items())) or "-"


def _render(console, st: train_mod.TrainStatus) -> None:
    eta = f"ETA {st.eta_s:.0f}s" if st.eta_s is not None else "ETA -"
    console.status(
        "ok" if st.running or st.state == "finished" else ("fail" if st.state == "failed" else "info"),
        f"training {st.state}"
        + (f" (exit {st.exit_code})" if st.exit_code else "")
        + f": epoch {st.epoch or '-'}/{st.epochs or '-'}, step {st.step or '-'}/{st.steps or '-'}, {eta}",
    )
    console.say(f"  acc_k (SpecForge, newest line): {_per_position(st.acc)}")
    console.say(f"  ploss_k: {_per_position(st.ploss, '{:.3f}')}")
    if st.acceptance_rate:
        console.say(f"  acceptance_rate_k (SpecForge): {_per_position(st.acceptance_rate)}")
    if st.eval:
        sal = st.eval.get("simulated_acc_len")
        console.say(
            f"  eval at step {st.eval['step']}: simulated_acc_len {sal:.3f}, per-position acc "
            f"{_per_position(st.eval.get('acc') or {})}"
            if sal is not None
            else f"  eval at step {st.eval['step']}: per-position acc {_per_position(st.eval.get('acc') or {})}"
        )
    best = f"; best: step {st.best['step']} ({st.best['score']:.3f})" if st.best else ""
    console.say(
        f"  tau (estimated from acc_k, not measured): {st.tau_estimate or '-'}; "
        f"newest checkpoint: {st.latest_checkpoint or '-'}{best}"
    )


_STEP_STATUS = {"ok": "ok", "changed": "ok", "planned": "info", "skipped": "info", "failed": "fail", "forced": "warn"}


def _step_line(console, host: str):
    def show(step: train_mod.Step) -> None:
        console.status(
            _STEP_STATUS.get(step.status, "info"),
            f"{host}: {step.name} {step.status}" + (f": {step.detail}" if step.detail else ""),
        )

    return show


def _render_result(app, r: train_mod.TrainResult, diff: bool) -> None:
    """`_show_result`, then the result as the command's document."""
    _show_result(app.console, r, diff)
    app.console.emit(r)


def _show_result(console, r: train_mod.TrainResult, diff: bool) -> None:
    """Steps (dry runs: all at once; real runs streamed them), commands, --diff, then the status."""
    if r.dry_run:
        for step in r.steps:
            _step_line(console, r.host)(step)
        for cmd in r.commands:
            console.say(f"would run: {cmd}")
    if r.noop:
        console.status(
            "ok",
            f"{r.host}: nothing to do (train {r.action}: "
            + ("this run is already running)" if r.action == "start" else "no run is running)"),
        )
    if diff:
        _render_diff(console, r)
    if r.status:
        _render(console, r.status)
    if r.record:
        console.say(f"  record {r.record}", style="dim")


def _render_diff(console, r: train_mod.TrainResult) -> None:
    before = r.before
    was = f"{before.state} (run {before.run_id or '-'}, plan {before.fingerprint or '-'})" if before else "unknown"
    if r.action == "start":
        plan = r.plan or {}
        after = "unchanged" if r.noop else f"running (run {plan.get('run_id')}, plan {plan.get('fingerprint')})"
    else:
        after = "unchanged" if r.noop else "stopped"
    console.say(
        f"--- training on {r.host}: {was}\n+++ after train {r.action}: {after}" + (" (not run)" if r.dry_run else "")
    )
    if r.diff:
        console.text_block(r.diff)


@train_group.command("start")
@click.option(
    "--data", default=None, metavar="DIR", help="exported features on the host (default <dump.dir>-specforge)"
)
@click.option("--output", default=None, metavar="DIR", help="checkpoint dir on the host (default <dump.dir>-drafter)")
@click.option(
    "--draft-config",
    default=None,
    metavar="PATH",
    type=PathOption("file", host_ok=True),
    help="EAGLE-3 draft model config: a local file (checked before connecting), or host:PATH for a file "
    "on the host; checked against the dumps' layer ids and hidden size, then copied into the training "
    "image (a start needs it; a dry run without it shows a placeholder)",
)
@click.option("--run-id", default="eagle3", show_default=True)
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--nproc", type=int, default=8, show_default=True, help="GPUs for the trainer (1 on the CPU)")
@click.option(
    "--base-image",
    default=None,
    metavar="IMAGE",
    help=f"image the training image is built FROM (default: {train_mod.GPU_BASE_IMAGE} on a GPU host, "
    f"{train_mod.CPU_BASE_IMAGE} where containers get no GPU)",
)
@click.option(
    "--eval-data",
    default=None,
    metavar="DIR",
    help="a second `dumps export` dir on the host for SpecForge's eval (eval/simulated_acc_len picks the "
    "checkpoint `train export` exports)",
)
@click.option(
    "--log-interval", type=click.IntRange(1), default=10, show_default=True, help="steps between metrics lines"
)
@click.option(
    "--save-interval", type=click.IntRange(0), default=0, help="steps between checkpoints (default: once per epoch)"
)
@click.option("--learning-rate", type=float, default=1e-4, show_default=True)
@click.option(
    "--seed", type=int, default=42, show_default=True, help="SpecForge's training.seed: the drafter's init, data order"
)
@click.option(
    "--batch-size", type=click.IntRange(1), default=1, show_default=True, help="samples per optimizer step on each rank"
)
@click.option(
    "--force",
    is_flag=True,
    help="start although the draft config does not fit the dumps (recorded in the host's audit log)",
)
@click.option("--dry-run", is_flag=True, help="show the plan, Dockerfile, run.yaml and commands; change nothing")
@click.option("--diff", is_flag=True, help="show the training state before/after and the run.json change")
@host_command
def start_cmd(
    app,
    host,
    data,
    output,
    draft_config,
    run_id,
    epochs,
    nproc,
    base_image,
    eval_data,
    log_interval,
    save_interval,
    learning_rate,
    seed,
    batch_size,
    force,
    dry_run,
    diff,
) -> int:
    """Start a training run: a no-op while this same run runs, refused (exit 9) while another does.

    Holds the host lock for the start only (not for the training), appends an
    audit line on the host and writes a run record, like deploy.  A draft config
    whose eagle_config.eagle_aux_hidden_state_layer_ids (under the numbering of the
    host's SGLang release) or hidden size do not fit what the dumps record is
    refused (exit 9, contract_mismatch) unless --force, which the audit line records;
    --dry-run shows the plan and exits 9 the same way.  A draft config that is not JSON,
    nests too deep or has a hidden size that is not a positive integer: exit 3."""
    if draft_config and not draft_config.on_host:
        from ...workflows import audit as audit_mod

        audit_mod.load_draft_config(Path(draft_config.path))  # a bad local file: exit 3 before connecting
    spec = app.host(host)
    draft_on_host = bool(draft_config and draft_config.on_host)
    draft_config = draft_config.path if draft_config else None
    p = train_mod.paths_for(spec, data, output)
    if not draft_config and not dry_run:
        raise click.UsageError("train start needs --draft-config (the drafter SpecForge trains)")
    plan = train_mod.real_plan(
        spec,
        p,
        draft_config or "<--draft-config>",
        run_id,
        epochs,
        nproc,
        base_image=base_image,
        eval_data=eval_data,
        log_interval=log_interval,
        save_interval=save_interval,
        learning_rate=learning_rate,
        seed=seed,
        batch_size=batch_size,
    )
    if dry_run:
        app.console.text_block(train_mod.dockerfile(spec, plan))
        app.console.text_block(train_mod.run_yaml(spec, p, plan))
    result = train_mod.start(
        app.remote(spec),
        spec,
        p,
        plan,
        dry_run=dry_run,
        events=None if dry_run else _step_line(app.console, spec.name),
        draft_config=draft_config,
        force=force,
        draft_on_host=draft_on_host,
    )
    refusal = train_mod.dry_run_refusal(spec, result)
    if refusal is not None:  # the plan is shown, then the start it plans is refused: exit 9
        _show_result(app.console, result, diff)
        raise refusal
    _render_result(app, result, diff)
    return 0


@train_group.command("status")
@click.option("--output", default=None, metavar="DIR", help="checkpoint dir on the host (default <dump.dir>-drafter)")
@hosts_command
def status_cmd(app, hosts, forks, output) -> int:
    """SpecForge's own metrics (acc_k, ploss_k, eval simulated_acc_len), ETA, checkpoints. One round trip a host.

    A pattern shows each host's run (read only), then the per-host table."""

    def work(spec):
        return 0, train_mod.status(app.remote(spec), spec, train_mod.paths_for(spec, output=output))

    return run_on_hosts(app, hosts, work, lambda console, _spec, st: _render(console, st), forks=forks)


@train_group.command("stop")
@click.option("--dry-run", is_flag=True, help="show what would be stopped; change nothing")
@click.option("--diff", is_flag=True, help="show the training state before/after")
@hosts_command
def stop_cmd(app, hosts, forks, dry_run, diff) -> int:
    """Stop the trainer container (`docker stop`: SIGTERM, SIGKILL after 30 s); nothing running: no-op.

    Holds the host lock while it stops, appends an audit line and writes a run record, on each
    host of a pattern (a host's failure does not stop the others; the exit is the worst host's)."""

    def work(spec):
        events = None if dry_run else _step_line(app.console, spec.name)
        return 0, train_mod.stop(app.remote(spec), spec, dry_run=dry_run, events=events)

    return run_on_hosts(app, hosts, work, lambda console, _spec, r: _show_result(console, r, diff), forks=forks)


@train_group.command("export")
@click.option(
    "--to",
    "to",
    type=click.Choice(["hf", "sglang"]),
    default="hf",
    show_default=True,
    help="hf: what vLLM loads; sglang: what SGLang loads",
)
@click.option("--step", type=click.IntRange(1), default=None, help="this saved step, not the chosen one")
@click.option("--output", default=None, metavar="DIR", help="checkpoint dir on the host (default <dump.dir>-drafter)")
@click.option("--timeout", "timeout_s", type=float, default=1800.0, show_default=True, help="seconds for the export")
@click.option("--dry-run", is_flag=True, help="show the checkpoint chosen and the command; change nothing")
@host_command
def export_cmd(app, host, to, step, output, timeout_s, dry_run) -> int:
    """Export a checkpoint of the run as a drafter an engine serves (`specforge export` on the host).

    The checkpoint: the best by eval simulated_acc_len when the run had eval data (SpecForge's
    <run_id>.best_meta.json), else the newest.  Written to <output>/<run_id>-drafter-<to>
    (config.json, model.safetensors) with provenance.json naming the checkpoint, its step and
    metrics and the run.  When the draft vocabulary is the target's, the d2t/t2d tensors
    SpecForge still writes (which vLLM refuses) are dropped."""
    spec = app.host(host)
    p = train_mod.paths_for(spec, output=output)
    r = train_mod.export(app.remote(spec), spec, p, to=to, step=step, dry_run=dry_run, timeout_s=timeout_s)
    app.console.status(
        "info" if dry_run else "ok",
        f"{r.host}: {'would export' if dry_run else 'exported'} {r.checkpoint} -> {r.out} ({r.reason})",
    )
    if dry_run:
        app.console.say(f"would run: {r.command}")
    else:
        app.console.say(f"  files: {', '.join(r.files)}" + ("; d2t/t2d dropped" if r.vocab_mapping_dropped else ""))
    app.console.emit(r)
    return 0


commands = [train_group]
