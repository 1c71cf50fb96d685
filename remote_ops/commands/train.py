"""`remote-ops train start|status|stop`: EAGLE-3 drafter training (SpecForge 0.2.0) on a host."""
from __future__ import annotations

import click

from .. import train as train_mod
from ._options import host_command


@click.group("train")
def train_group() -> None:
    """Train the drafter on the exported features, follow it, stop it.

    \b
    Examples:
      remote-ops train start --host gpu-node --draft-config /data/kimi-eagle3.json --epochs 10
      remote-ops train start --host sandbox --standin      # no GPU: the labelled stand-in
      remote-ops train status --host gpu-node
      remote-ops train stop --host gpu-node

    Data: the `dumps export` dir (default <dump.dir>-specforge); checkpoints:
    <dump.dir>-drafter/<run_id>-step<N>.  With --standin nothing is trained: the
    stand-in writes SpecForge-format logs with SYNTHETIC values and weightless
    checkpoint folders, so the commands can be exercised without a GPU.
    """


def _render(console, st: train_mod.TrainStatus) -> None:
    tag = "STAND-IN " if st.standin else ""
    acc = ", ".join(f"{k}: {v:.2f}" for k, v in sorted(st.acc.items())) or "-"
    eta = f"{st.eta_s:.0f}s left in the epoch" if st.eta_s is not None else "ETA -"
    console.status("ok" if st.running else "info",
                   f"{tag}training {st.state}: epoch {st.epoch or '-'}/{st.epochs or '-'}, step {st.step or '-'}/"
                   f"{st.steps or '-'}, {eta}")
    console.say(f"  per-position accuracy (last epoch): {acc}")
    console.say(f"  tau (estimated from accuracies, not measured): {st.tau_estimate or '-'}; "
                f"latest checkpoint: {st.latest_checkpoint or '-'}")
    if st.standin:
        console.say("  STAND-IN: synthetic numbers, no drafter is being trained", style="dim")


@train_group.command("start")
@click.option("--data", default=None, metavar="DIR", help="exported features on the host (default <dump.dir>-specforge)")
@click.option("--output", default=None, metavar="DIR", help="checkpoint dir on the host (default <dump.dir>-drafter)")
@click.option("--draft-config", default=None, metavar="PATH", help="EAGLE-3 draft model config (real runs)")
@click.option("--run-id", default="eagle3", show_default=True)
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--nproc", type=int, default=8, show_default=True, help="GPUs for the trainer (real runs)")
@click.option("--standin", is_flag=True, help="run the labelled training stand-in (no GPU, nothing trained)")
@click.option("--steps", type=int, default=20, show_default=True, help="stand-in: steps per epoch")
@click.option("--step-s", type=float, default=0.1, show_default=True, help="stand-in: seconds per step")
@click.option("--dry-run", is_flag=True, help="print the Dockerfile, run.yaml and commands; change nothing")
@host_command
def start_cmd(app, host, data, output, draft_config, run_id, epochs, nproc, standin, steps, step_s, dry_run) -> int:
    """Start a training run (refused while one is running)."""
    spec = app.host(host)
    p = train_mod.paths_for(spec, data, output)
    if dry_run:
        return _dry_run(app, spec, p, draft_config, run_id, epochs, nproc, standin, steps, step_s)
    remote = app.remote(spec)
    if standin:
        st = train_mod.start_standin(remote, spec, p, run_id, epochs, steps, step_s)
    else:
        if not draft_config:
            raise click.UsageError("a real run needs --draft-config (or use --standin without a GPU)")
        train_mod.start_real(remote, spec, p, draft_config, run_id, epochs, nproc)
        st = train_mod.status(remote, spec, p)
    _render(app.console, st)
    app.console.emit(st)
    return 0


def _dry_run(app, spec, p, draft_config, run_id, epochs, nproc, standin, steps, step_s) -> int:
    if standin:
        plan = {"standin": True, "command": train_mod.standin_command(p, run_id, epochs, steps, step_s)}
        app.console.say(f"would run (stand-in): {plan['command']}")
    else:
        plan = {"standin": False, "dockerfile": train_mod.dockerfile(spec),
                "run_yaml": train_mod.run_yaml(spec, p, draft_config or "<--draft-config>", run_id, epochs, nproc),
                "commands": train_mod.real_commands(spec, p)}
        app.console.text_block(plan["dockerfile"])
        app.console.text_block(plan["run_yaml"])
        for cmd in plan["commands"]:
            app.console.say(f"would run: {cmd}")
    app.console.emit({"host": spec.name, "dry_run": True, **plan})
    return 0


@train_group.command("status")
@click.option("--output", default=None, metavar="DIR", help="checkpoint dir on the host (default <dump.dir>-drafter)")
@host_command
def status_cmd(app, host, output) -> int:
    """Epoch, step, per-position accuracy, tau estimate, ETA, latest checkpoint. One round trip."""
    spec = app.host(host)
    st = train_mod.status(app.remote(spec), spec, train_mod.paths_for(spec, output=output))
    _render(app.console, st)
    app.console.emit(st)
    return 0


@train_group.command("stop")
@host_command
def stop_cmd(app, host) -> int:
    """Stop the run by its recorded PID (stand-in) or `docker stop` (container)."""
    spec = app.host(host)
    st = train_mod.stop(app.remote(spec), spec)
    _render(app.console, st)
    app.console.emit(st)
    return 0


commands = [train_group]
