"""`remote-ops spec deploy|bench`: serve the target with an EAGLE-3 drafter, measure acceptance and speed."""

from __future__ import annotations

from pathlib import Path

import click

from ...errors import PreflightFailed
from ...workflows import specbench as sb
from ._options import PathOption, ask_or_refuse, host_command


@click.group("spec")
def spec_group() -> None:
    """Speculative decoding with a trained drafter: deploy it, then measure it.

    \b
    Typical flow (each bench stores its run; the second one prints the comparison):
      remote-ops deploy --host gpu-node --yes                       # target alone
      remote-ops spec bench --host gpu-node                         # baseline tokens/s
      remote-ops spec deploy --host gpu-node --draft /data/drafter/epoch_9 --yes
      remote-ops spec bench --host gpu-node                         # acceptance length, speed-up, PNG

    `remote-ops deploy` afterwards restores the server without the drafter.
    On vLLM the baseline is `spec deploy --target-only` (the extraction server is not one),
    and the bench counts what vLLM accepted (its spec-decode counters on /metrics).
    Against the SGLang stand-in the numbers come from its deterministic acceptance
    model and are labelled STAND-IN: they measure no drafter.
    """


# --------------------------------------------------------------------------- deploy


@spec_group.command("deploy")
@click.option(
    "--draft",
    default=None,
    metavar="DIR",
    help="drafter checkpoint dir on the host (default: inventory speculative.draft_model_path)",
)
@click.option(
    "--from-run",
    is_flag=True,
    help="serve the drafter `train export` made of the host's newest training run (not with --draft)",
)
@click.option(
    "--num-steps",
    type=int,
    default=None,
    help="--speculative-num-steps; on vLLM num_speculative_tokens (default: inventory, 3)",
)
@click.option("--eagle-topk", type=int, default=None, help="--speculative-eagle-topk (default: inventory, 1)")
@click.option(
    "--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens (default: inventory, 4)"
)
@click.option(
    "--target-only",
    is_flag=True,
    help="vLLM: serve the target alone (no drafter, no extraction): the baseline spec bench compares with",
)
@click.option("--dry-run", is_flag=True, help="print the plan and every diff; change nothing")
@click.option("--diff", "show_diff", is_flag=True, help="print the diffs (implied by --dry-run)")
@click.option("--yes", "-y", is_flag=True, help="do not ask before restarting the server")
@click.option(
    "--healthy-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="seconds to wait for healthy (default: inventory server.healthy_timeout_s)",
)
@host_command
def deploy_cmd(
    app,
    host,
    draft,
    from_run,
    num_steps,
    eagle_topk,
    num_draft_tokens,
    target_only,
    dry_run,
    show_diff,
    yes,
    healthy_timeout,
) -> None:
    """Restart the server with the EAGLE-3 drafter (through `deploy`; a re-run is a no-op).

    SGLang: --speculative-algorithm EAGLE3 and the draft path, steps, topk, draft tokens.
    vLLM: --speculative-config '{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}'
    (K = --num-steps), extraction and its KV connector off; --target-only serves the target
    alone.  The draft dir is mounted read-only.  The values come from the host's
    `speculative:` inventory section; the options override them for this run.  A drafter
    whose config.json ids, numbered the way the serving release numbers them (SGLang's per
    release, vLLM's own), do not give the layers the dumps hold (or, with no dumps, the
    inventory's layers) is refused: exit 9, contract_mismatch.  `remote-ops deploy`
    afterwards restores the inventory's server.  --from-run serves the drafter `train export`
    made of the newest training run on the host."""
    from ...errors import UsageError
    from ...workflows import deploy as deploy_mod, specdeploy
    from ._deploy_events import ConsoleEvents
    from .deploy import _confirm, _summary

    base = app.host(host)
    if from_run and (draft or target_only):
        raise UsageError("--from-run names the drafter itself: not with --draft or --target-only")
    if from_run:
        draft = specdeploy.drafter_of_run(app.remote(base), base)
    s = specdeploy.settings(base, draft, num_steps, eagle_topk, num_draft_tokens, target_only)
    spec = specdeploy.spec_host(base, s)
    remote = app.remote(spec)
    app.console.step(f"spec deploy {spec.name}: {specdeploy.describe(spec, s)}")
    if s["draft"] is not None:
        _render_fit(app, specdeploy.check_drafter(remote, spec, s["draft"]))
        flags = specdeploy.check_flags(remote, spec)
        if flags["checked"]:
            app.console.status("ok", f"the speculative flags exist in {flags['source']}")
    if not dry_run and not yes:
        preview = specdeploy.deploy(remote, spec, dry_run=True, events=deploy_mod.Events())
        if not preview.up_to_date:
            _confirm(app, spec, preview)
    result = specdeploy.deploy(
        remote, spec, dry_run=dry_run, events=ConsoleEvents(app.console, spec.name), healthy_timeout_s=healthy_timeout
    )
    if dry_run or show_diff:
        for name, text in result.diffs.items():
            app.console.step(f"{spec.name} diff: {name}")
            app.console.text_block(text)
    _summary(app, result)
    app.console.emit(result)


def _render_fit(app, fit: dict) -> None:
    srv = fit["serving"]
    app.console.status(
        "ok",
        f"drafter fits {fit['from']}: layers {fit['contract'].get('layers_to_capture')} under "
        f"{srv.get('engine', 'SGLang')} {srv['version']} ({srv['rule']})",
    )


# --------------------------------------------------------------------------- bench


def _render_run(console, s: sb.BenchSummary) -> None:
    tag = "STAND-IN " if s.standin else ""
    if s.mode == "spec" and s.engine == "vllm":
        console.status(
            "ok" if s.drafts else "warn",
            f"spec run (vLLM's counters): mean acceptance length {s.acceptance_length} over {s.drafts} drafts, "
            f"per position {s.per_position}, accept rate {s.accept_rate}, "
            f"{s.tokens_per_s} tokens/s over {s.requests} prompts",
        )
    elif s.mode == "spec":
        console.status(
            "warn" if s.standin else "ok",
            f"{tag}spec run: acceptance length {s.acceptance_length} "
            f"(mean per request {s.acceptance_length_mean}), accept rate {s.accept_rate}, "
            f"{s.tokens_per_s} tokens/s over {s.requests} prompts",
        )
    else:
        console.status(
            "warn" if s.standin else "ok",
            f"{tag}baseline run (no speculation): {s.tokens_per_s} tokens/s over {s.requests} prompts",
        )
    if s.standin:
        console.say(f"  {sb.label(True)}: these numbers measure no drafter", style="dim")


@spec_group.command("bench")
@click.option(
    "--prompts",
    "prompts_file",
    type=PathOption("file"),
    default=None,
    help='JSONL of {"text"} or {"input_ids"}, held out from the drafter\'s training data '
    "(default: the built-in set of 8 prompts)",
)
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="where runs, table and PNG go (default <state>/hosts/<host>/specbench)",
)
@host_command
def bench_cmd(app, host, prompts_file, max_new_tokens, warmup, out_dir) -> int:
    """Measure what is served now (spec or baseline); compare when both runs exist.

    On vLLM the acceptance is vLLM's own count (its spec-decode counters on /metrics, read
    before and after the prompt set); the baseline is `spec deploy --target-only`."""
    spec = app.host(host)
    data = prompts_file.read_bytes() if prompts_file else sb.prompts_jsonl(sb.DEFAULT_PROMPTS)
    doc = sb.run(app.remote(spec), spec, data, max_new_tokens, warmup)
    summary = sb.summarise(doc, sb.prompt_set_id(data, max_new_tokens), max_new_tokens)
    folder = out_dir or sb.result_dir(spec.name)
    saved = sb.save(summary, folder)
    _render_run(app.console, summary)
    result = {
        "host": spec.name,
        "run": summary.to_dict(),
        "saved": str(saved),
        "label": sb.label(summary.standin, summary.engine),
    }
    other = sb.load(folder, "baseline" if summary.mode == "spec" else "spec")
    pair = (other, summary) if summary.mode == "spec" else (summary, other)
    comparison = sb.compare(*pair) if other else None
    if comparison:
        result.update(_render_comparison(app.console, comparison, folder))
    elif other:
        app.console.status("warn", "the other run used a different prompt set or length: no comparison")
    app.console.emit(result)
    return 0


def _render_comparison(console, c: sb.Comparison, folder: Path) -> dict:
    title = f"speculative decoding - {sb.label(c.standin, c.spec.engine)}"
    console.table(["", "baseline", "spec (EAGLE3)", "speed-up"], sb.table_rows(c), title=title)
    table = folder / "comparison.md"
    table.write_text(
        f"# {title}\n\n| | baseline | spec (EAGLE3) | speed-up |\n|---|---|---|---|\n"
        + "".join(f"| {' | '.join(r)} |\n" for r in sb.table_rows(c))
    )
    png = sb.plot(c, folder / "comparison.png")
    console.say(f"  table {table}, plot {png}", style="dim")
    return {"comparison": c.to_dict(), "table": str(table), "png": str(png)}


# --------------------------------------------------------------------------- preflight


@spec_group.command("preflight")
@click.option(
    "--dataset",
    "dataset",
    type=PathOption("file"),
    required=True,
    help='prepared JSONL ({"id", "input_ids", "loss_mask"}: the target\'s own greedy replies); '
    "the first --samples lines with a prompt and a reply are used",
)
@click.option(
    "--draft-config",
    required=True,
    metavar="PATH",
    type=PathOption("file", host_ok=True),
    help="the EAGLE-3 draft config to try (as `train start` takes it): a local file, or host:PATH",
)
@click.option("--samples", type=click.IntRange(1, 64), default=2, show_default=True, help="samples to overfit")
@click.option("--num-steps", type=click.IntRange(1, 32), default=3, show_default=True, help="draft tokens per step (K)")
@click.option(
    "--epochs", type=click.IntRange(1), default=150, show_default=True, help="passes over the samples (overfit)"
)
@click.option("--learning-rate", type=float, default=1e-3, show_default=True)
@click.option(
    "--threshold",
    type=click.FloatRange(min=1.0),
    default=None,
    help="mean acceptance length a pass needs (default 1 + 2/3 K: 3.0 at K = 3; docs/drafter.md#pre-flight)",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1),
    default=32,
    show_default=True,
    help="tokens generated per prompt (at most the shortest reply)",
)
@click.option(
    "--force",
    is_flag=True,
    help="go on although the draft config does not fit the capture (train start and spec deploy; recorded)",
)
@click.option(
    "--healthy-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="seconds each server restart may take to be healthy (default: inventory server.healthy_timeout_s)",
)
@click.option(
    "--train-timeout", type=click.FloatRange(min=1), default=14400, show_default=True, help="seconds for the training"
)
@click.option("--dry-run", is_flag=True, help="print the plan; contact nothing")
@click.option("--yes", "-y", is_flag=True, help="do not ask before restarting the server (three times)")
@host_command
def preflight_cmd(
    app,
    host,
    dataset,
    draft_config,
    samples,
    num_steps,
    epochs,
    learning_rate,
    threshold,
    max_new_tokens,
    force,
    healthy_timeout,
    train_timeout,
    dry_run,
    yes,
) -> int:
    """Before days of extraction: overfit a drafter on a few samples and check the engine accepts it.

    \b
    The chain, in the pre-flight's own dirs (<dump.dir>-preflight/ on the host):
      deploy (extraction, its own dump dir) -> extract the samples -> dumps export
      -> train start (SpecForge, until it overfits) -> train export
      -> spec deploy (the drafter, K draft tokens) -> spec bench (the samples' own prompts)
      -> verdict -> deploy (the host's own server again, also after a failure)

    It passes when the engine's mean acceptance length on those prompts reaches the threshold:
    a drafter that learned its samples by heart has nearly all its drafts accepted on them,
    unless the capture is not what the engine serves it with (layer ids one off, pre-norm
    finals), which no file check sees.  A fail is exit 10 (preflight_failed) with the figures.
    The samples should be the target's own greedy replies (`dataset regenerate --temperature 0`).
    On an SGLang host the same chain uses SGLang's --speculative-* flags; that path has not
    run against a real SGLang server, and the SGLang stand-in's verdict is inconclusive."""

    from ...workflows import preflight as wf
    from ._deploy_events import ConsoleEvents

    if not draft_config.on_host:  # a bad local file: exit 3 before connecting (as `train start`)
        from ...workflows import audit as audit_mod

        audit_mod.load_draft_config(Path(draft_config.path))
    spec = app.host(host)
    picked, skipped = wf.read_samples(dataset, samples)
    opts = wf.Options(
        str(dataset),
        draft_config.path,
        draft_on_host=draft_config.on_host,
        samples=samples,
        num_steps=num_steps,
        epochs=epochs,
        learning_rate=learning_rate,
        threshold=threshold,
        max_new_tokens=max_new_tokens,
        force=force,
        healthy_timeout_s=healthy_timeout,
        train_timeout_s=train_timeout,
    )
    steps = wf.plan(spec, opts, picked)
    note = wf.engine_note(spec)
    if skipped:
        app.console.status("warn", f"{dataset}: {skipped} line(s) without a prompt and a reply skipped")
    if len(picked) < samples:
        app.console.status("warn", f"{dataset}: only {len(picked)} usable sample(s) of {samples} asked")
    if dry_run:
        app.console.step(f"spec preflight {spec.name}: the plan (nothing contacted)")
        if note:
            app.console.status("warn", note)
        app.console.table(["step", "does"], [[s["step"], s["does"]] for s in steps])
        app.console.emit(
            {
                "host": spec.name,
                "dry_run": True,
                "steps": steps,
                "engine_note": note,
                "samples": [s.id for s in picked],
                "threshold": opts.gate,
            }
        )
        return 0
    if not yes:
        ask_or_refuse(
            f"{spec.name}: restart the server three times for the pre-flight?",
            f"spec preflight restarts the server of {spec.name} three times; re-run with --yes "
            "(or --dry-run to see the plan)",
            host=spec.name,
        )
    app.console.step(f"spec preflight {spec.name}: {len(picked)} samples, K = {num_steps}, threshold {opts.gate:g}")
    events = ConsoleEvents(app.console, spec.name)
    try:
        result = wf.run(app.remote(spec), spec, opts, picked, progress=app.console.status, deploy_events=events)
    except PreflightFailed as exc:
        verdict = (exc.details.get("preflight") or {}).get("verdict")
        if verdict:
            _render_verdict(app.console, verdict)
        raise
    _render_verdict(app.console, result.verdict or {})
    app.console.emit(result.to_dict())
    return 0


def _render_verdict(console, v: dict) -> None:
    from ...core import preflight as pf

    verdict = pf.Verdict(**v)
    console.status("ok" if verdict.passed else "fail", f"preflight {verdict.state}: {verdict.reason}", data=True)
    console.status("info", pf.figures_line(verdict), data=True)


commands = [spec_group]
