"""`remote-ops dataset regenerate|prepare`: the deployed target writes a chat dataset's assistant
turns (regenerate); chat JSONL -> {"id", "input_ids", "loss_mask"} with the model's tokenizer (prepare)."""

from __future__ import annotations

from pathlib import Path

import click

from ...errors import ConfigError, ExitCode
from ...onhost import dataset as ds
from ._fleet import run_on_hosts
from ._options import PathOption, app_options, host_option, hosts_command, path_option, server_url_option, wait_option


@click.group("dataset")
def dataset_group() -> None:
    """Tokenize a chat dataset for extraction and training, with an assistant-only loss mask.

    First, `regenerate` has the deployed target write the chats' replies (SpecForge's
    regenerate_train_data.py, on the host); `prepare` then tokenizes the result.

    \b
    Examples:
      remote-ops dataset regenerate --host gpu-node --dataset chats.jsonl --wait 86400
      remote-ops dataset regenerate --host fleet --dataset chats.jsonl   # split over the group
      remote-ops dataset prepare chats.regenerated.jsonl -o prepared.jsonl --tokenizer /models/Kimi-K2.5
      remote-ops dataset prepare chats.jsonl --on-host --host gpu-node   # in the SGLang image
      remote-ops dataset prepare chats.jsonl --on-host --host fleet      # on each host of the group

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
@click.argument("source", type=PathOption("file"))
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
    """Tokenize SOURCE (a local file) with the chat template; mask = the assistant turns' tokens.

    Here by default (--host: only for its model.path, one host).  With --on-host, --host
    takes a pattern: SOURCE is uploaded to each host and tokenized there, in its own image,
    and each host keeps its output (-o and --tokenizer are then paths on the host)."""
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
    hosts = app.select(host)
    app.preconnect(hosts)

    def work(spec):
        dest, report = dataset_wf.prepare_on_host(
            app.remote(spec), spec, source, output, tokenizer, max_length, overflow, trust_remote_code
        )
        return 0, {"host": spec.name, "output": dest, **report}

    def show(console, spec, doc) -> None:
        _render(console, doc, f"{spec.name}:{doc['output']}")

    return run_on_hosts(app, hosts, work, show)


# --------------------------------------------------------------------------- regenerate


@dataset_group.command("regenerate")
@path_option(
    "--dataset",
    "source",
    required=True,
    help="local chat JSONL (OpenAI messages or ShareGPT conversations); a group splits it",
)
@click.option(
    "--out",
    default=None,
    metavar="PATH",
    help="the regenerated chats, merged here in the dataset's order (default <dataset>.regenerated.jsonl)",
)
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=64, show_default=True, help="chats in flight per host"
)
@click.option(
    "--temperature", type=click.FloatRange(min=0.0), default=0.7, show_default=True, help="sampling temperature"
)
@click.option(
    "--top-p",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="nucleus sampling (default: the server's)",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True, help="per assistant turn")
@click.option(
    "--retries", type=click.IntRange(min=0), default=5, show_default=True, help="retries per request (backoff)"
)
@click.option("--max-samples", type=click.IntRange(min=1), default=None, help="only the first N chats of the dataset")
@server_url_option
@wait_option(
    "wait until the hosts finish (at most SECONDS), then pull and merge; without it the clients "
    "run on detached and a later run with the same options collects"
)
@click.option("--dry-run", is_flag=True, help="show what is done, what would be pulled and split; change nothing")
@hosts_command
def regenerate_cmd(
    app,
    hosts,
    forks,
    source,
    out,
    concurrency,
    temperature,
    top_p,
    max_tokens,
    retries,
    max_samples,
    server_url,
    wait_s,
    dry_run,
) -> int:
    """The deployed target writes the assistant turns of the chats in --dataset.

    As SpecForge's scripts/regenerate_train_data.py (its defaults): every user turn, with the
    conversation so far (system turns kept, the replies regenerated so far), goes through the
    server's chat template (/v1/chat/completions) and the answer becomes the next assistant turn.
    Each chat is keyed by its prompt turns and the sampling options (not its id): a chat already
    regenerated with these options is never sent again, and a rerun after a kill resumes.  The
    client runs on each host (a group splits the chats by key); it writes each chat there, and
    this command pulls the ones missing here and merges them into --out, in the dataset's order,
    every chat once, each with its `source_key`: what `dataset prepare` reads next.

    The dataset is checked here first (a bad line: exit 3, FILE:LINE).  With the dump patch
    deployed, the server dumps every prefill, these prompts' too: regenerate before extraction,
    or give the dump dir room for them.
    """
    from ...core import extractplan, regenplan

    _regen_wf().check_chats(source)  # before any connection, upload or lock
    sampling = regenplan.Sampling(temperature, top_p, max_tokens)
    samples = regenplan.read_chats(source, sampling, max_samples)
    dest = Path(out).expanduser() if out else source.with_name(source.stem + ".regenerated.jsonl")
    keys = {s.key for s in samples}
    have = {k: r for k, r in regenplan.read_output(dest).items() if k in keys}
    deadline = None if wait_s is None else _now() + wait_s
    survey = _survey(app, hosts, forks, keys, have, dest, samples, dry_run)
    if survey["running"] and not dry_run and deadline is not None:
        _wait(app, [h for h in hosts if h.name in survey["running"]], forks, deadline)
        survey = _survey(app, hosts, forks, keys, have, dest, samples, dry_run)
    idle = [h.name for h in hosts if h.name not in survey["running"]]
    pending = [s for s in regenplan.one_per_key(samples) if s.key not in have and s.key not in survey["on_hosts"]]
    shards = extractplan.split_pending(pending, set(), idle) if idle and not survey["running"] else {}
    plan = {
        "dataset": str(source),
        "out": str(dest),
        "samples": len(samples),
        "keys": len(keys),
        "sampling": sampling.to_dict(),
        "written": sum(1 for s in samples if s.key in have),
        "pulled": survey["pulled"],
        "running": survey["running"],
        "shards": {n: len(v) for n, v in shards.items() if v},
    }
    _render_regen_plan(app.console, plan, dry_run)
    if dry_run or survey["running"] or not plan["shards"]:
        app.console.emit({"dry_run": dry_run, **plan})
        return 0
    started = _start_shards(app, hosts, forks, shards, sampling, concurrency, retries, server_url)
    if deadline is None:
        app.console.say("the clients run on detached: run this again (same options) to pull, or add --wait SECONDS")
        app.console.emit({**plan, "started": started})
        return 0
    runs = _wait(app, [h for h in hosts if h.name in started], forks, deadline)
    survey = _survey(app, hosts, forks, keys, have, dest, samples, False)
    plan.update(written=sum(1 for s in samples if s.key in have), pulled=plan["pulled"] + survey["pulled"])
    figures = _figures(app, [h for h in hosts if h.name in started], forks, runs)
    _render_regen_done(app.console, plan, figures)
    app.console.emit({**plan, "started": started, "hosts": figures})
    return ExitCode.OK if plan["written"] == plan["samples"] else ExitCode.COMMAND_FAILED


def _regen_wf():
    from ...workflows import regenerate

    return regenerate


def _now() -> float:
    import time

    return time.monotonic()


def _fan_out(app, hosts, forks, work) -> dict:
    """`work(spec, remote)` on every host; the first host error stops the command (its own exit
    code), with a hint to leave that host out (its pulled chats stay merged here)."""
    from ...workflows import fleet

    run = fleet.fan_out(hosts, lambda spec: (0, work(spec, app.remote(spec))), forks=forks)
    bad = [o for o in run.outcomes if o.error is not None]
    if bad:
        err = bad[0].error
        assert err is not None
        err.message = f"{', '.join(o.host for o in bad)}: {err.message}"
        err.hint = err.hint or f"leave it out (--host 'GROUP,!{bad[0].host}'): what was merged here stays"
        raise err
    return {o.host: o.result for o in run.outcomes}


def _survey(app, hosts, forks, keys, have, dest: Path, samples, dry_run: bool) -> dict:
    """Each host's client state and done keys; pull (unless dry_run) what is done there and missing
    here, merge it into `have` and write `dest` when it changed."""
    from ...core import regenplan

    wf = _regen_wf()
    seen = _fan_out(app, hosts, forks, lambda spec, r: wf.look(r, spec)[:2] if dry_run else wf.prepare(r, spec))
    missing = keys - set(have)
    on_hosts = {name: done & missing for name, (_running, done) in seen.items()}
    pulled = 0
    if not dry_run and any(on_hosts.values()):
        wanted = [h for h in hosts if on_hosts[h.name]]
        got = _fan_out(app, wanted, forks, lambda spec, r: wf.pull(r, spec, on_hosts[spec.name]))
        for records in got.values():
            fresh = {k: v for k, v in records.items() if k in missing and k not in have}
            have.update(fresh)
            pulled += len(fresh)
        _write_merged(dest, regenplan.merge(samples, have))
    elif not dry_run and have and not dest.is_file():
        _write_merged(dest, regenplan.merge(samples, have))
    return {
        "running": [h.name for h in hosts if seen[h.name][0]],
        "on_hosts": set().union(*on_hosts.values()) if dry_run and on_hosts else set(),
        "pulled": pulled,
    }


def _write_merged(dest: Path, records: list[dict]) -> None:
    """Replace `dest` atomically with these records, unless it already holds exactly them."""
    from ...core import regenplan

    data = regenplan.output_bytes(records)
    if dest.is_file() and dest.read_bytes() == data:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(dest)


def _start_shards(app, hosts, forks, shards, sampling, concurrency, retries, server_url) -> list[str]:
    from ...workflows import hostlock

    wf = _regen_wf()
    chosen = [h for h in hosts if shards.get(h.name)]

    def work(spec, remote):
        with hostlock.held(remote, spec, "dataset regenerate"):
            return wf.start_shard(
                remote,
                spec,
                shards[spec.name],
                sampling,
                concurrency=concurrency,
                retries=retries,
                server_url=server_url,
            )

    started = _fan_out(app, chosen, forks, work)
    for name, st in started.items():
        app.console.status("ok", f"{name}: client started, pid {st.pid}: {len(shards[name])} chat(s)")
    return list(started)


def _wait(app, hosts, forks, deadline: float) -> dict:
    """Wait for every host's client to exit (progress every few seconds); {host: ExtractStatus}."""
    wf = _regen_wf()

    def progress(name, st):
        s = st.summary
        rate = f", {s.rate_tokens_s:,.0f} tokens/s" if s.rate_tokens_s else ""
        app.console.say(f"{name}: {s.done}/{s.total if s.total is not None else '?'} chats, {s.tokens:,} tokens{rate}")

    return _fan_out(
        app,
        hosts,
        forks,
        lambda spec, r: wf.wait_finished(r, spec, max(deadline - _now(), 1.0), lambda st: progress(spec.name, st)),
    )


def _figures(app, hosts, forks, runs: dict) -> dict:
    """Per host: the client's own tokens/s and the server's generation throughput (its log lines)."""
    wf = _regen_wf()

    def work(spec, remote):
        s = runs[spec.name].summary
        server = wf.server_figure(remote, spec, s.last_time)
        return {
            "chats_done": s.done,
            "chats_failed": s.failed,
            "completion_tokens": s.tokens,
            "client_tokens_s": s.rate_tokens_s,
            "server": server.to_dict() if server is not None else None,
        }

    return _fan_out(app, hosts, forks, work)


def _render_regen_plan(console, plan: dict, dry_run: bool) -> None:
    console.say(
        f"{plan['samples']} chats ({plan['keys']} distinct prompts; "
        f"{', '.join(f'{k} {v:g}' for k, v in plan['sampling'].items())}): "
        f"{plan['written']} in {plan['out']}" + (f", {plan['pulled']} just pulled" if plan["pulled"] else "")
    )
    if plan["running"]:
        console.status(
            "info",
            f"a client is running on {', '.join(plan['running'])}: nothing new is started; "
            "--wait SECONDS waits for it, then pulls and goes on",
        )
    elif plan["shards"]:
        console.table(
            ["host", "chats"],
            [[h, n] for h, n in plan["shards"].items()],
            title=("would split" if dry_run else "split") + " of the chats not yet regenerated",
        )
    elif plan["written"] == plan["samples"]:
        console.status("ok", "every chat is regenerated: nothing to do")


def _render_regen_done(console, plan: dict, figures: dict) -> None:
    rows = []
    for name, f in figures.items():
        server = f["server"] or {}
        label = " STAND-IN" if server.get("standin") else ""
        mean = server.get("mean_tokens_s")
        rows.append(
            [
                name,
                f["chats_done"],
                f"{f['completion_tokens']:,}",
                "-" if f["client_tokens_s"] is None else f"{f['client_tokens_s']:,.1f}",
                "- (no decode line in the server's log)"
                if mean is None
                else f"{mean:,.1f}{label} (mean of {server.get('lines')} decode lines)",
            ]
        )
    console.table(
        ["host", "chats", "tokens", "client tokens/s", "server gen throughput tokens/s"],
        rows,
        title="tokens generated: the client's count (usage) over its run, and the server's own decode lines",
    )
    missing = plan["samples"] - plan["written"]
    console.status(
        "ok" if not missing else "fail",
        f"{plan['written']}/{plan['samples']} chats in {plan['out']}"
        + (f"; {missing} not regenerated (failed: the client log says why; a rerun retries them)" if missing else ""),
    )


commands = [dataset_group]
