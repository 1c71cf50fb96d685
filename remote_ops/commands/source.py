"""`remote-ops inspect-source`: numbered, scope-annotated lines of the host's patch target file."""
from __future__ import annotations

from pathlib import Path

import click

from .. import patching
from .. import source as srcview
from ..errors import UsageError
from ._options import app_options, host_option


def where(app, host: str | None, path: str | None, local_file: Path | None, model_class: str | None = None,
          strict: bool = True):
    """(remote, PatchTarget) for `--host H [--file PATH]` or `--local-file PATH` (exactly one).

    A local file's spec comes from its one capture class (`--model-class` picks
    among several); a host's from its inventory (`sglang.patch`) or, unset,
    from its model's config.json (one more round trip; the derivation goes to stderr)."""
    if bool(host) == bool(local_file):
        raise UsageError("give exactly one of --host HOST or --local-file PATH")
    if local_file is not None:
        if path:
            raise UsageError("--file goes with --host; use --local-file PATH alone")
        target = patching.PatchTarget.local(local_file, model_class, strict)
        how = "--model-class" if model_class else "the one class resetting capture_aux_hidden_states in __init__"
        if target.spec_name:
            app.console.say(f"patch spec: {target.spec_name} (class {target.model_class}: {how})")
        return patching.LocalRemote(), target
    spec = app.host(host)
    remote = app.remote(spec)
    patch, derivation = patching.host_spec(remote, spec)
    if derivation.how != "inventory":           # named in the inventory: nothing to explain
        app.console.say(f"patch spec: {derivation} -> {patch.model_class} in {patch.target}")
    return remote, patching.PatchTarget.for_host(spec, path, patch)


def target_options(fn):
    """--host / --file / --local-file, shared by inspect-source and patch."""
    fn = click.option("--local-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
                      help="work on a file on this machine instead (no SSH)")(fn)
    fn = click.option("--model-class", default=None, metavar="NAME",
                      help="with --local-file: the model class to patch when the file has several")(fn)
    fn = click.option("--file", "path", default=None, metavar="PATH",
                      help="file on the host (default: the host's patch spec target in its sglang checkout)")(fn)
    return host_option(required=False)(fn)


def check_request(lines: str | None, grep: str | None, symbol: str | None) -> None:
    """Reject bad --lines / --grep / --symbol here, before any connection (exit 2, not 4).

    Only what can be judged without the file: the range's form and order (its
    end against the file's length is checked once the file is read)."""
    import re

    if sum(x is not None for x in (lines, grep, symbol)) != 1:
        raise UsageError("give exactly one of --lines A:B, --grep PATTERN, --symbol Class.method")
    if lines is not None:
        srcview.parse_range(lines, 2**31)
    if grep is not None:
        try:
            re.compile(grep)
        except re.error as exc:
            raise UsageError(f"bad pattern {grep!r}: {exc}") from None
    if symbol is not None and not any(p for p in symbol.split(".")):
        raise UsageError(f"bad symbol {symbol!r}: expected Class.method, Class or function")


@click.command("inspect-source")
@target_options
@click.option("--lines", default=None, metavar="A:B", help="show lines A..B, like sed -n 'A,Bp' (e.g. 2830:2845)")
@click.option("--grep", default=None, metavar="PATTERN", help="lines matching a Python regex, like grep -n")
@click.option("--symbol", default=None, metavar="Class.method", help="the whole definition, decorators included")
@app_options
def inspect_source(app, host, path, local_file, model_class, lines, grep, symbol) -> None:
    """Show numbered lines of the SGLang file, each with its enclosing Class.method.

    \b
    Examples:
      remote-ops inspect-source --host gpu-node --lines 2830:2845
      remote-ops inspect-source --host gpu-node --grep capture_aux_hidden_states
      remote-ops inspect-source --local-file deepseek_v2.py --symbol DeepseekV2ForCausalLM.forward

    Read-only: one SSH round trip, nothing is changed.  Bad ranges exit 2,
    a missing file 13.
    """
    check_request(lines, grep, symbol)
    remote, target = where(app, host, path, local_file, model_class, strict=False)
    tf = patching.read_target(remote, target)
    view = srcview.inspect(tf.data, path=tf.path, host=tf.host, sha256=tf.sha256, version=tf.version,
                           version_source=tf.version_source, lines=lines, grep=grep, symbol=symbol)
    if app.console.json_mode:
        app.console.emit(view)
    else:
        app.console.out(view.render())  # the listing is the command's data: stdout, like sed -n


commands = [inspect_source]
