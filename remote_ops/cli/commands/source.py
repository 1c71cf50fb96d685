"""`remote-ops inspect-source`: numbered, scope-annotated lines of the host's patch target file."""

from __future__ import annotations

from pathlib import Path

import click

from ...core import source as srcview
from ...errors import UsageError
from ...workflows import patching
from ._fleet import run_on_hosts
from ._options import PathOption, hosts_command


def local_target(app, path: str | None, local_file: Path, model_class: str | None, strict: bool):
    """A file here: its spec comes from its one capture class (`--model-class` picks among several)."""
    if path:
        raise UsageError("--file goes with --host; use --local-file PATH alone")
    target = patching.PatchTarget.local(local_file, model_class, strict)
    how = "--model-class" if model_class else "the one class resetting capture_aux_hidden_states in __init__"
    if target.spec_name:
        app.console.say(f"patch spec: {target.spec_name} (class {target.model_class}: {how})")
    return target


def host_target(app, spec, path: str | None):
    """(remote, PatchTarget) of a host: its spec from the inventory (`sglang.patch`) or, unset, from
    its model's config.json (one more round trip; the derivation goes to stderr)."""
    remote = app.remote(spec)
    patch, derivation = patching.host_spec(remote, spec)
    if derivation.how != "inventory":  # named in the inventory: nothing to explain
        app.console.say(f"patch spec: {spec.name}: {derivation} -> {patch.model_class} in {patch.target}")
    return remote, patching.PatchTarget.for_host(spec, path, patch)


def target_options(fn):
    """--file / --local-file / --model-class, shared by inspect-source and patch (with `hosts_command(local_ok=True)`)."""
    fn = click.option(
        "--local-file",
        type=PathOption("file"),
        default=None,
        metavar="PATH",
        help="work on a file on this machine instead (no SSH; instead of --host; missing: exit 2)",
    )(fn)
    fn = click.option(
        "--model-class",
        default=None,
        metavar="NAME",
        help="with --local-file: the model class to patch when the file has several",
    )(fn)
    return click.option(
        "--file",
        "path",
        default=None,
        metavar="PATH",
        help="file on the host (default: the host's patch spec target in its sglang checkout)",
    )(fn)


def on_targets(
    app,
    hosts,
    forks: int,
    path: str | None,
    local_file: Path | None,
    work,
    render=None,
    model_class: str | None = None,
    strict: bool = True,
) -> int:
    """`work(remote, PatchTarget) -> (exit code, result)` on the local file (one document, as
    before) or on every selected host (`run_on_hosts`: one host as before, many in parallel)."""
    render = render or (lambda *_: None)
    if local_file is not None:
        code, result = work(patching.LocalRemote(), local_target(app, path, local_file, model_class, strict))
        render(app.console, None, result)
        app.console.emit(result)
        return code
    return run_on_hosts(app, hosts, lambda spec: work(*host_target(app, spec, path)), render, forks=forks)


def check_request(lines: str | None, grep: str | None, symbol: str | None) -> None:
    """Reject bad --lines / --grep / --symbol here, before any connection (exit 2, not 4).

    Only what can be judged without the file: the range's form and order (its
    end against the file's length is checked once the file is read, and the
    message gives that length), the pattern's ERE syntax."""
    if sum(x is not None for x in (lines, grep, symbol)) != 1:
        raise UsageError("give exactly one of --lines A:B, --grep PATTERN, --symbol Class.method")
    if lines is not None:
        srcview.parse_range(lines, None)
    if grep is not None:
        srcview.check_pattern(grep)
    if symbol is not None and not any(p for p in symbol.split(".")):
        raise UsageError(f"bad symbol {symbol!r}: expected Class.method, Class or function")


@click.command("inspect-source")
@target_options
@click.option("--lines", default=None, metavar="A:B", help="show lines A..B, like sed -n 'A,Bp' (e.g. 2830:2845)")
@click.option(
    "--grep",
    default=None,
    metavar="PATTERN",
    help="lines matching an extended regular expression, like grep -nE (run by grep on the host)",
)
@click.option("--symbol", default=None, metavar="Class.method", help="the whole definition, decorators included")
@hosts_command(local_ok=True)
def inspect_source(app, hosts, forks, path, local_file, model_class, lines, grep, symbol) -> int:
    """Show numbered lines of the SGLang file, each with its enclosing Class.method.

    \b
    Examples:
      remote-ops inspect-source --host gpu-node --lines 2830:2845
      remote-ops inspect-source --host gpu-node --grep capture_aux_hidden_states
      remote-ops inspect-source --local-file deepseek_v2.py --symbol DeepseekV2ForCausalLM.forward

    --grep takes a POSIX extended regular expression, as grep -E (with GNU's
    \\w \\s \\b \\< \\>), matched by grep on the host in the same round trip, so
    no pattern can hang the tool.  Python-only syntax (\\d, (?i), backreferences)
    is refused before connecting.

    Read-only: one SSH round trip, nothing is changed.  Bad ranges and
    patterns exit 2, a missing file 13.
    """
    check_request(lines, grep, symbol)

    def work(remote, target):
        tf = patching.read_target(remote, target, grep=grep)
        return 0, srcview.inspect(
            tf.data,
            path=tf.path,
            host=tf.host,
            sha256=tf.sha256,
            version=tf.version,
            version_source=tf.version_source,
            lines=lines,
            grep=grep,
            symbol=symbol,
            grep_hits=srcview.parse_grep(tf.grep_output or "", grep) if grep is not None else None,
        )

    return on_targets(app, hosts, forks, path, local_file, work, _show, model_class=model_class, strict=False)


def _show(console, _spec, view) -> None:
    """The listing is the command's data: stdout, like sed -n (the JSON document with --json)."""
    if not console.json_mode:
        console.out(view.render())


commands = [inspect_source]
