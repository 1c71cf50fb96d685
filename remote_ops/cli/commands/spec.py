"""`remote-ops spec deploy|bench`: serve the target with an EAGLE-3 drafter, measure acceptance and speed."""

from __future__ import annotations

from pathlib import Path

import click

from ...workflows import specbench as sb
from ._options import PathOption, host_command


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


commands = [spec_group]
