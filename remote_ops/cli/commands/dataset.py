"""`remote-ops dataset prepare`: chat JSONL -> {"id", "input_ids", "loss_mask"} with the model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import click

from ...errors import ConfigError
from ...onhost import dataset as ds
from ._options import app_options, host_option


@click.group("dataset")
def dataset_group() -> None:
    """Tokenize a chat dataset for extraction and training, with an assistant-only loss mask.

    \b
    Examples:
      remote-ops dataset prepare chats.jsonl -o prepared.jsonl --tokenizer /models/Kimi-K2.5
      remote-ops dataset prepare chats.jsonl --on-host --host gpu-node   # in the SGLang image

    Input: ShareGPT (`conversations`: from/value) or OpenAI (`messages`: role/content) JSONL.
    Output: {"id", "input_ids", "loss_mask"} JSONL; the mask is 1 on the assistant turns'
    tokens (reply + end-of-turn marker), found through the tokenizer's offset mapping.
    """


def _render(console, report: ds.PrepareReport | dict, dest: str) -> None:
    r = report if isinstance(report, dict) else report.to_dict()
    share = r["assistant_tokens"] / r["tokens"] if r["tokens"] else 0
    console.status(
        "ok" if r["written"] else "warn",
        f"{r['written']}/{r['samples']} samples -> {dest}: {r['tokens']:,} tokens, "
        f"{r['assistant_tokens']:,} in the loss mask ({share:.0%})",
    )
    over = f"--max-length {r['max_length']}" if r["max_length"] else "no --max-length"
    console.say(
        f"  {over}: {r['truncated']} truncated, {r['dropped_too_long']} dropped as too long "
        f"(overflow={r['overflow']}), {r['dropped_no_assistant']} dropped with no assistant token left"
    )
    if r["template_fallback"]:
        console.status(
            "warn",
            f"{r['template_fallback']} sample(s): template not prefix-stable, "
            "mask found from the reply text (end-of-turn marker not masked)",
        )
    for bad in r["bad_records"][:10]:
        console.status("warn", f"skipped: {bad}")


@dataset_group.command("prepare")
@click.argument("source", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "-o",
    "--output",
    "output",
    default=None,
    metavar="PATH",
    help="output JSONL (default <source>.prepared.jsonl; with --on-host, a path on the host)",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="DIR",
    help="model dir with the tokenizer and chat template (default: model.path of --host)",
)
@click.option("--max-length", type=int, default=None, help="token limit per sample")
@click.option(
    "--overflow",
    type=click.Choice(ds.OVERFLOW),
    default="truncate",
    show_default=True,
    help="what to do with a sample over --max-length",
)
@click.option("--trust-remote-code", is_flag=True, help="let transformers run the model's tokenizer code")
@click.option(
    "--on-host", is_flag=True, help="run in a throwaway container of the host's SGLang image (transformers + the model)"
)
@host_option(required=False)
@app_options
def prepare_cmd(app, source, output, tokenizer, max_length, overflow, trust_remote_code, on_host, host) -> int:
    """Tokenize SOURCE with the chat template; mask = the assistant turns' tokens."""
    if on_host:
        return _prepare_on_host(app, source, output, tokenizer, max_length, overflow, trust_remote_code, host)
    if not (tokenizer or host):
        raise ConfigError("--tokenizer DIR is needed (or --host, to use its model.path)", field="--tokenizer")
    tok_dir = tokenizer or app.host(host).model.path
    dest = output or str(source.with_suffix("")) + ".prepared.jsonl"
    try:
        tok = ds.load_tokenizer(tok_dir, trust_remote_code)
        report = ds.prepare_file(tok, str(source), dest, max_length, overflow)
    except (ds.DatasetError, OSError) as exc:
        raise ConfigError(str(exc), source=str(source)) from None
    _render(app.console, report, dest)
    app.console.emit({"output": dest, **report.to_dict()})
    return 0


# --------------------------------------------------------------------------- on the host


def _prepare_on_host(app, source, output, tokenizer, max_length, overflow, trust_remote_code, host) -> int:
    from ...workflows import dataset as dataset_wf

    if not host:
        raise ConfigError("--on-host needs --host", field="--host")
    spec = app.host(host)
    dest, report = dataset_wf.prepare_on_host(
        app.remote(spec), spec, source, output, tokenizer, max_length, overflow, trust_remote_code
    )
    _render(app.console, report, f"{spec.name}:{dest}")
    app.console.emit({"host": spec.name, "output": dest, **report})
    return 0


commands = [dataset_group]
