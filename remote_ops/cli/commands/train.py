"""`remote-ops train start|status|stop`: EAGLE-3 drafter training (SpecForge 0.2.0) on a host."""

from __future__ import annotations

from pathlib import Path

import click

from ...workflows import train as train_mod
from ._fleet import run_on_hosts
from ._options import PathOption, host_command, hosts_command


@click.group("train")
def train_group() -> None:
    """Train the drafter on the exported features, follow it, stop it.

    \b
    Examples:
      remote-ops train start --host gpu-node --draft-config host:/data/kimi-eagle3.json --epochs 10
      remote-ops train start --host sandbox --standin      # no GPU: the labelled stand-in
      remote-ops train status --host gpu-node
      remote-ops train status --host fleet          # every host's run
      remote-ops train stop --host gpu-node

    Data: the `dumps export` dir (default <dump.dir>-specforge); checkpoints:
    <dump.dir>-drafter/<run_id>-step<N>.  With --standin nothing is trained: the
    STAND-IN writes SpecForge 0.2.0's metrics lines with SYNTHETIC values and
    weightless checkpoint folders, all labelled STAND-IN, so the commands can be
    exercised without a GPU.  `start` and `stop` take the host lock for the change,
    append an audit line on the host and write a run record, as deploy does.
    ETA: 0.2.0 runs with a known number of steps (the stand-in) give the time left
    in the run; older SpecForge tqdm bars give the time left in the epoch.
    """


def _render(console, st: train_mod.TrainStatus) -> None:
    tag = "STAND-IN " if st.standin else ""
    acc = ", ".join(f"{k}: {v:.2f}" for k, v in sorted(st.acc.items())) or "-"
    eta = f"ETA {st.eta_s:.0f}s" if st.eta_s is not None else "ETA -"
    console.status(
        "ok" if st.running else "info",
        f"{tag}training {st.state}: epoch {st.epoch or '-'}/{st.epochs or '-'}, step {st.step or '-'}/"
        f"{st.steps or '-'}, {eta}",
    )
    console.say(f"  per-position accuracy (latest): {acc}")
    console.say(
        f"  tau (estimated from accuracies, not measured): {st.tau_estimate or '-'}; "
        f"latest checkpoint: {st.latest_checkpoint or '-'}"
    )
    if st.standin:
        console.say("  STAND-IN: synthetic numbers, no drafter is being trained", style="dim")


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
    "image (real runs need it; with --standin it is only checked)",
)
@click.option("--run-id", default="eagle3", show_default=True)
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--nproc", type=int, default=8, show_default=True, help="GPUs for the trainer (real runs)")
@click.option("--standin", is_flag=True, help="run the labelled training STAND-IN (no GPU, nothing trained)")
@click.option("--steps", type=int, default=20, show_default=True, help="stand-in: steps per epoch")
@click.option("--step-s", type=float, default=0.1, show_default=True, help="stand-in: seconds per step")
@click.option(
    "--force",
    is_flag=True,
    help="start although the draft config does not fit the dumps (recorded in the host's audit log)",
)
@click.option("--dry-run", is_flag=True, help="show the plan, Dockerfile, run.yaml and commands; change nothing")
@click.option("--diff", is_flag=True, help="show the training state before/after and the run.json change")
@host_command
def start_cmd(
    app, host, data, output, draft_config, run_id, epochs, nproc, standin, steps, step_s, force, dry_run, diff
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
    if standin:
        plan = train_mod.standin_plan(p, run_id, epochs, steps, step_s)
    elif draft_config:
        plan = train_mod.real_plan(p, draft_config, run_id, epochs, nproc)
    elif dry_run:
        plan = train_mod.real_plan(p, "<--draft-config>", run_id, epochs, nproc)
    else:
        raise click.UsageError("a real run needs --draft-config (or use --standin without a GPU)")
    if dry_run and not plan.standin:
        app.console.text_block(train_mod.dockerfile(spec))
        app.console.text_block(train_mod.run_yaml(spec, p, run_id, epochs, nproc))
    if plan.standin:
        app.console.say(
            "STAND-IN: synthetic SpecForge 0.2.0-format metrics lines and weightless checkpoints; "
            "no drafter is trained",
            style="yellow",
        )
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
    """Epoch, step, per-position accuracy, tau estimate, ETA, latest checkpoint. One round trip a host.

    A pattern shows each host's run (read only), then the per-host table."""

    def work(spec):
        return 0, train_mod.status(app.remote(spec), spec, train_mod.paths_for(spec, output=output))

    return run_on_hosts(app, hosts, work, lambda console, _spec, st: _render(console, st), forks=forks)


@train_group.command("stop")
@click.option("--dry-run", is_flag=True, help="show what would be stopped; change nothing")
@click.option("--diff", is_flag=True, help="show the training state before/after")
@hosts_command
def stop_cmd(app, hosts, forks, dry_run, diff) -> int:
    """Stop the run by its recorded PID (stand-in) or `docker stop` (container); nothing running: no-op.

    Holds the host lock while it stops, appends an audit line and writes a run record, on each
    host of a pattern (a host's failure does not stop the others; the exit is the worst host's)."""

    def work(spec):
        events = None if dry_run else _step_line(app.console, spec.name)
        return 0, train_mod.stop(app.remote(spec), spec, dry_run=dry_run, events=events)

    return run_on_hosts(app, hosts, work, lambda console, _spec, r: _show_result(console, r, diff), forks=forks)


commands = [train_group]
