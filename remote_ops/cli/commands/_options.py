"""Shared click options: host selection, connection settings, --json.

`hosts_command` adds the options every host-facing command takes: `--host
PATTERN` / `--all` / `--limit PATTERN` / `--forks N` (see `remote_ops.core.targets`)
plus the connection options, and passes the `App` and the selected hosts, so
commands read `def facts(app, hosts, ...)` and hand a per-host function to
`commands._fleet.run_on_hosts`.  `host_command` is the one-host form
(`def cmd(app, host, ...)` with `host` the `--host` text) for commands that
work on a single host only (a pattern naming several hosts: exit 2, `App.host`).
`PathOption` is the type of every path option: local unless `host:PATH`
(`remote_ops.core.pathref`), checked while parsing, before any connection.  Every command gets `-v/--verbose` (each remote
command with its round-trip time; `-vv` SSH transport events) and `-q/--quiet`,
merged with the same options given before the command (`remote-ops -v hosts`:
counts add up, `-q` with any `-v` is a usage error), and `--host` completes
inventory host and group names in the shell.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import click

from ...errors import UsageError
from ..app import App
from ..console import Console
from ..main import RunConsole


def ask_or_refuse(question: str, refusal: str, host: str | None = None) -> None:
    """Before a change the operator did not --yes: ask on a terminal (no: Abort), else refuse
    (exit 9) with `refusal`, which says to re-run with --yes."""
    import sys

    from ...errors import Refused

    if not sys.stdin.isatty():
        raise Refused(refusal, host=host)
    if not click.confirm(question, default=False, err=True):
        raise click.exceptions.Abort()


def app_options(fn):
    """--inventory, --ssh-config, --host-key-policy, timeouts, --json, --quiet -> `app`."""

    @click.option(
        "--inventory",
        "inventory",
        multiple=True,
        type=click.Path(path_type=Path),
        envvar="REMOTE_OPS_INVENTORY",
        help="inventory file or directory [env REMOTE_OPS_INVENTORY] (else ./inventory, else ~/.config/remote-ops/inventory)",
    )
    @path_option(
        "--ssh-config",
        "ssh_config",
        help="ssh_config file to use (default ~/.ssh/config if present; a missing one: exit 2)",
    )
    @choice_option(
        "--host-key-policy",
        choices=["strict", "accept-new"],
        default="strict",
        help="strict refuses unknown keys; accept-new records first-seen keys. Changed keys are always refused.",
    )
    @seconds_option("--connect-timeout", help="seconds to connect, banner and auth included (default 10)")
    @seconds_option(
        "--command-timeout",
        help="deadline of every remote command and probe, in seconds (default 120); "
        "long steps have their own (deploy --build-timeout, --healthy-timeout)",
    )
    @click.option("--json", "as_json", is_flag=True, help="print one JSON document on stdout")
    @click.option("-q", "--quiet", is_flag=True, help="no progress or notes on stderr (data and errors still print)")
    @click.option(
        "-v",
        "--verbose",
        count=True,
        help="-v: each remote command (secrets masked) and its round-trip time on stderr; "
        "-vv: whole commands and SSH transport events",
    )
    @functools.wraps(fn)
    def wrapper(
        *args,
        inventory,
        ssh_config,
        host_key_policy,
        connect_timeout,
        command_timeout,
        as_json,
        quiet,
        verbose,
        **kwargs,
    ):
        run = click.get_current_context().find_object(RunConsole)
        verbose, quiet = _verbosity(run, verbose, quiet)
        if verbose > 1:
            _ssh_events_to_stderr()
        console = Console(json_mode=as_json, quiet=quiet)
        if run is not None:  # the CLI boundary renders a final error on this console
            run.console = console
        app = App(
            console=console,
            inventory_paths=list(inventory) or None,
            ssh_config_path=str(ssh_config) if ssh_config else None,
            host_key_policy=host_key_policy,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
            verbose=verbose,
        )
        click.get_current_context().call_on_close(app.close)
        return fn(app, *args, **kwargs)

    return wrapper


def _verbosity(run: RunConsole | None, verbose: int, quiet: bool) -> tuple[int, bool]:
    """The run's `-v` count and `-q`: the root group's (`remote-ops -v CMD`) and the command's
    (`remote-ops CMD -v`) together, counts added.  `-q` with any `-v` is a usage error (exit 2)."""
    if run is not None:
        verbose, quiet = verbose + run.verbose, quiet or run.quiet
    if quiet and verbose:
        raise click.UsageError("-q/--quiet and -v/--verbose cannot be used together")
    return verbose, quiet


def _ssh_events_to_stderr() -> None:
    """-vv: paramiko's transport log (connect, kex, auth, channels) at INFO on stderr.  Its
    records quote what the server sent (its version banner), so their control characters are
    shown (`visible`), as on every other human-output path."""
    import logging

    from ...core.terminal import visible

    class _VisibleFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return visible(super().format(record))

    handler = logging.StreamHandler()
    handler.setFormatter(_VisibleFormatter("ssh: %(name)s: %(message)s"))
    log = logging.getLogger("paramiko")
    log.setLevel(logging.INFO)
    log.addHandler(handler)


def complete_hosts(ctx: click.Context, _param, incomplete: str) -> list:
    """Shell completion for --host: inventory host and group names (the last term of a pattern).

    Names come from the raw YAML (`core.rawinv.raw_names`), not the validated inventory: a TAB
    does not import pydantic or build the models."""
    from click.shell_completion import CompletionItem

    try:
        from ...core.rawinv import default_inventory_paths, raw_names

        names = raw_names(list(map(Path, ctx.params.get("inventory") or ())) or default_inventory_paths())
    except Exception:  # completion must never fail loudly: no inventory, no names
        return []
    cut = max(incomplete.rfind(","), incomplete.rfind(":"))  # terms are joined by ',' or ':'
    head, sep, last = (incomplete[:cut], incomplete[cut], incomplete[cut + 1 :]) if cut >= 0 else ("", "", incomplete)
    sign = last[:1] if last[:1] in "!&" else ""
    names = [*names, "all"]
    return [CompletionItem(f"{head}{sep}{sign}{n}") for n in names if n.startswith(last[len(sign) :])]


class PathOption(click.ParamType):
    """A path option's value under the one rule (`core.pathref`): local unless `host:PATH`.

    Checked while the command line is parsed, so before any inventory load or connection:
    a local path that must exist and does not, or a `host:` path where only a local one is
    taken, is a usage error (exit 2).  The value given to the command is a `PathRef`
    (`host_ok`) or, for local-only options, a `Path` (`~` expanded)."""

    def __init__(self, want: str = "file", *, host_ok: bool = False) -> None:
        self.want, self.host_ok = want, host_ok
        self.name = "path"

    def convert(self, value, param, ctx):
        from ...core import pathref

        if isinstance(value, (pathref.PathRef, Path)):
            return value
        ref = pathref.parse(str(value))
        seen = None
        if not ref.on_host:
            local = Path(ref.path).expanduser()
            seen = pathref.Seen(local.exists(), local.is_dir())
            ref = pathref.PathRef(str(local)) if ref.path else ref
        why = pathref.problem(ref, host_ok=self.host_ok, want=self.want, seen=seen)  # type: ignore[arg-type]
        if why:
            self.fail(why, param, ctx)
        return ref if self.host_ok else Path(ref.path)


def pattern_option(*decls: str, help: str, metavar: str = "PATTERN", required: bool = False):
    """An option whose value is a host pattern (or name), completed from the inventory."""
    return click.option(
        *decls, metavar=metavar, required=required, default=None, shell_complete=complete_hosts, help=help
    )


def server_url_option(fn):
    """`--server-url`: the engine's URL as the host's clients reach it."""
    return click.option("--server-url", default=None, help="default http://127.0.0.1:<server.port> on the host")(fn)


def wait_option(help: str, default: float | None = None, metavar: str | None = "SECONDS"):
    """`--wait SECONDS` (-> `wait_s`): how long to wait, with this command's meaning in `help`."""
    return click.option(
        "--wait",
        "wait_s",
        type=float,
        default=default,
        show_default=default is not None,
        metavar=metavar,
        help=help,
    )


def choice_option(*decls: str, choices: list[str], default: str, help: str):
    """One of `choices`, `default` shown in --help."""
    return click.option(*decls, type=click.Choice(choices), default=default, show_default=True, help=help)


def path_option(
    *decls: str, help: str, want: str = "file", host_ok: bool = False, required: bool = False, metavar: str = "PATH"
):
    """A path under the one rule (`PathOption`: local, or `host:PATH` where `host_ok`), None when
    not given; checked while the command line is parsed."""
    return click.option(
        *decls, type=PathOption(want, host_ok=host_ok), required=required, default=None, metavar=metavar, help=help
    )


def seconds_option(*decls: str, help: str, metavar: str | None = None):
    """A positive number (seconds, or a rate), None when not given."""
    return click.option(*decls, type=click.FloatRange(min=0, min_open=True), default=None, metavar=metavar, help=help)


def host_option(required: bool = True):
    return click.option(
        "--host",
        "host",
        required=required,
        metavar="HOST",
        shell_complete=complete_hosts,
        help="inventory name, listed address, or ad-hoc address form (user@addr, addr:port, an IP; e.g. 10.1.230.174)",
    )


def host_command(fn):
    """`--host` plus `app_options`: one host, given to `fn` as the `--host` text (resolve it with
    `app.host`, which goes through `remote_ops.core.targets`).  Host commands use `hosts_command`."""
    return host_option()(app_options(fn))


#: A `--host` that is one name (no list, glob, address form or set operator): what `speculate` takes.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def hosts_command(fn=None, *, local_ok: bool = False, speculate: bool = False):
    """`--host PATTERN`/`--all`/`--limit`/`--forks` plus `app_options` -> fn(app, hosts, forks=, ...).

    With `local_ok` the command also takes `--local-file` (its own option): then no host is
    selected and `hosts` is empty (inspect-source, patch).  With `speculate` (commands that
    always connect: health, deploy, facts) a `--host` naming one inventory host starts its
    handshake from the raw inventory before it is validated (`App.speculate`)."""
    if fn is None:
        return functools.partial(hosts_command, local_ok=local_ok, speculate=speculate)

    @pattern_option(
        "--host",
        "pattern",
        help="host, group, glob, or a list joined by ',' or ':' with &/! (Ansible patterns: 'fleet:&rack-2:!gpu-03'); "
        "an address form (user@addr, addr:port, an IP) is an ad-hoc host, e.g. 10.1.230.174",
    )
    @click.option("--all", "all_hosts", is_flag=True, help="every inventory host")
    @pattern_option("--limit", help="narrow the selection (as ansible --limit)")
    @click.option("--forks", type=click.IntRange(min=1), default=16, show_default=True, help="hosts worked on at once")
    @app_options
    @functools.wraps(fn)
    def wrapper(app, *args, pattern, all_hosts, limit, **kwargs):
        if local_ok and kwargs.get("local_file") is not None:
            if pattern or all_hosts:
                flag = next(p.opts[0] for p in click.get_current_context().command.params if p.name == "local_file")
                raise UsageError(f"give exactly one of --host/--all or {flag} PATH")
            return fn(app, [], *args, **kwargs)
        if speculate and pattern and not all_hosts and not limit and _PLAIN_NAME.fullmatch(pattern):
            app.speculate(pattern)
        return fn(app, app.select(pattern, all_hosts=all_hosts, limit=limit), *args, **kwargs)

    return wrapper
