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
    Against the SGLang stand-in the numbers come from its deterministic acceptance
    model and are labelled STAND-IN: they measure no drafter.
    """


# --------------------------------------------------------------------------- deploy

SPEC_FLAGS = (
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
)


def speculative_args(draft: str, steps: int, topk: int, draft_tokens: int) -> list[str]:
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]


def without_spec_flags(args: list[str]) -> list[str]:
    """Drop earlier speculative flags (and their values) from the inventory's extra_args."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in SPEC_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in SPEC_FLAGS)):
            out.append(a)
    return out


def spec_host(spec, draft: str, steps: int, topk: int, draft_tokens: int):
    """The host spec with the drafter: server extra args + the draft dir mounted read-only (pure)."""
    extra = without_spec_flags(list(spec.server.extra_args)) + speculative_args(draft, steps, topk, draft_tokens)
    server = spec.server.model_copy(update={"extra_args": extra})
    mount = f"{draft}:{draft}:ro"
    volumes = list(spec.container.volumes) + ([mount] if mount not in spec.container.volumes else [])
    return spec.model_copy(
        update={"server": server, "container": spec.container.model_copy(update={"volumes": volumes})}
    )


def speculative_settings(
    spec, draft: str | None, num_steps: int | None, eagle_topk: int | None, num_draft_tokens: int | None
) -> dict:
    """The inventory's `speculative:` section with the CLI's overrides (pure; refused as a usage
    error when no draft dir is known or the combination is one SGLang would rewrite)."""
    from ...core.inventory import check_speculative
    from ...errors import UsageError

    inv = spec.speculative
    steps = inv.num_steps if num_steps is None else num_steps
    topk = inv.eagle_topk if eagle_topk is None else eagle_topk
    tokens = inv.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    out = {"draft": draft or inv.draft_model_path, "num_steps": steps, "eagle_topk": topk, "num_draft_tokens": tokens}
    if not out["draft"]:
        raise UsageError(
            f"{spec.name}: no drafter: pass --draft DIR or set speculative.draft_model_path "
            f"in the inventory ({spec.source or 'inventory'})"
        )
    try:
        check_speculative(steps, topk, tokens)
    except ValueError as exc:
        raise UsageError(f"{spec.name}: speculative settings: {exc}") from None
    return out


@spec_group.command("deploy")
@click.option(
    "--draft",
    default=None,
    metavar="DIR",
    help="drafter checkpoint dir on the host (default: inventory speculative.draft_model_path)",
)
@click.option("--num-steps", type=int, default=None, help="--speculative-num-steps (default: inventory, 3)")
@click.option("--eagle-topk", type=int, default=None, help="--speculative-eagle-topk (default: inventory, 1)")
@click.option(
    "--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens (default: inventory, 4)"
)
@click.option("--dry-run", is_flag=True, help="print the plan; change nothing")
@click.option("--yes", "-y", is_flag=True, help="do not ask before restarting the server")
@host_command
def deploy_cmd(app, host, draft, num_steps, eagle_topk, num_draft_tokens, dry_run, yes) -> None:
    """Restart the server with --speculative-algorithm EAGLE3 and the drafter (through `deploy`).

    The draft dir and the --speculative-* values come from the host's `speculative:`
    inventory section; the options override them for this run.  A drafter whose
    config.json ids (eagle_config.eagle_aux_hidden_state_layer_ids), numbered the way
    the host's SGLang release numbers them, do not give the layers the dumps hold (or,
    with no dumps, the inventory's layers) is refused: exit 9, contract_mismatch."""
    from ...workflows import deploy as deploy_mod
    from ._deploy_events import ConsoleEvents
    from .deploy import _confirm, _summary

    base = app.host(host)
    s = speculative_settings(base, draft, num_steps, eagle_topk, num_draft_tokens)
    spec = spec_host(base, s["draft"], s["num_steps"], s["eagle_topk"], s["num_draft_tokens"])
    remote = app.remote(spec)
    app.console.step(
        f"spec deploy {spec.name}: EAGLE3 draft {s['draft']}, steps {s['num_steps']}, "
        f"topk {s['eagle_topk']}, draft tokens {s['num_draft_tokens']}"
    )
    _check_drafter(app, remote, spec, s["draft"])
    if not dry_run and not yes:
        preview = deploy_mod.deploy(remote, spec, dry_run=True, events=deploy_mod.Events())
        if not preview.up_to_date:
            _confirm(app, spec, preview)
    result = deploy_mod.deploy(
        remote, spec, dry_run=dry_run, events=ConsoleEvents(app.console, spec.name), why="spec deploy"
    )
    _summary(app, result)
    app.console.emit(result)


def _check_drafter(app, remote, spec, draft: str) -> None:
    """The drafter's layer ids against the dumps under the host's SGLang release (refused: exit 9)."""
    from ...workflows import audit as audit_mod

    fit = audit_mod.drafter_guard(remote, spec, draft)
    srv = fit["serving"]
    app.console.status(
        "ok",
        f"drafter fits {fit['from']}: layers {fit['contract'].get('layers_to_capture')} under SGLang "
        f"{srv['version']} ({srv['rule']})",
    )


# --------------------------------------------------------------------------- bench


def _render_run(console, s: sb.BenchSummary) -> None:
    tag = "STAND-IN " if s.standin else ""
    if s.mode == "spec":
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
    help='JSONL of {"text"} or {"input_ids"} (default: the built-in set of 8 prompts)',
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
    """Measure what is served now (spec or baseline); compare when both runs exist."""
    spec = app.host(host)
    data = prompts_file.read_bytes() if prompts_file else sb.prompts_jsonl(sb.DEFAULT_PROMPTS)
    doc = sb.run(app.remote(spec), spec, data, max_new_tokens, warmup)
    summary = sb.summarise(doc, sb.prompt_set_id(data, max_new_tokens), max_new_tokens)
    folder = out_dir or sb.result_dir(spec.name)
    saved = sb.save(summary, folder)
    _render_run(app.console, summary)
    result = {"host": spec.name, "run": summary.to_dict(), "saved": str(saved), "label": sb.label(summary.standin)}
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
    title = f"speculative decoding - {sb.label(c.standin)}"
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
