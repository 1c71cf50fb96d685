"""The command line: parse, call, render, and map errors to exit codes — once.

This is the single error boundary.  Expected failures are `RemoteOpsError`s:
they are rendered as one message (plus a hint) on stderr, or as a JSON error
document with `--json` (one compact line when it ends a JSON Lines stream:
`health --watch`, `logs follow`), and exit with their documented code.
Anything else is a bug: it exits 1 with the traceback.  Host text in any of
these (a message, a stderr tail, a traceback) is shown, never obeyed: control
characters in `cat -v` notation (`remote_ops.core.terminal`).

Start-up is lazy: `remote-ops --help` lists the commands from `COMMAND_HELP`
(no command module imported) and `--version` reads package metadata, so
neither loads SSH, pydantic, Jinja2 or rich.  A command's module (and what it
needs) is imported only when that command runs or its own help is asked for.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

import click

from .. import __version__
from ..errors import ExitCode, Interrupted, RemoteOpsError

#: Command modules under remote_ops.cli.commands, in help order.  One line per module.
COMMAND_MODULES = (
    "hosts",
    "inventory",
    "init",
    "facts",
    "source",
    "patch",
    "render",
    "container",
    "health",
    "deploy",
    "unlock",
    "sandbox",
    "logs",
    "dumps",
    "extract",
    "dataset",
    "spec",
    "train",
    "daemon",
    "completion",
)

#: command name -> (its module, its one-line help): what `--help` shows without importing
#: the module.  A module listed above but not here still works (imported to list it);
#: tests/test_cli_startup.py checks this table against the modules.  One line per command.
COMMAND_HELP = {
    "hosts": ("hosts", "List the hosts (and groups) of the inventory."),
    "inventory": ("inventory", "Print the inventory's JSON Schema, or check inventory files (all errors)."),
    "init": ("init", "Write a commented inventory from the shipped example (and record a host's key)."),
    "facts": ("facts", "Report OS, kernel, CPU, memory, GPUs, container runtime, dump-dir disk and SGLang."),
    "inspect-source": ("source", "Show numbered lines of the SGLang file, each with its enclosing Class.method."),
    "patch": ("patch", "Anchored patch of an SGLang model file (EAGLE-3 hidden-state dump hooks)."),
    "render": ("render", "Print the rendered Dockerfile for HOST on stdout (no SSH)."),
    "container": ("container", "Start, stop, restart or show the SGLang container (built by `deploy`)."),
    "health": ("health", "Check SSH, docker, GPUs, container, patch, SGLang endpoints and dumps."),
    "deploy": ("deploy", "Preflight, lock, check, push, patch, verify, build, start, wait, record, unlock."),
    "unlock": ("unlock", "Show who holds the host lock (who, client host, PID, when, why) and release it."),
    "sandbox": ("sandbox", "A local stand-in GPU host on loopback: real sshd + dockerd, real SGLang tree."),
    "logs": ("logs", "Pull, follow and summarise a host's logs (server container, extraction, training)."),
    "dumps": ("dumps", "Reconcile, check and pull the hidden-state dumps of a host."),
    "extract": ("extract", "Run the extraction client on a host: every sample once through /generate."),
    "dataset": ("dataset", "Regenerate a chat dataset's replies with the target; tokenize chats with a loss mask."),
    "spec": ("spec", "Speculative decoding with a trained drafter: deploy it, then measure it."),
    "train": ("train", "Train the drafter on the exported features, follow it, stop it."),
    "daemon": ("daemon", "A warm fork server: runs start without re-importing (opt-in)."),
    "completion": ("completion", "Print the shell completion script (bash, zsh or fish) for remote-ops."),
}


def _versions() -> str:
    """remote-ops and its SSH/template/engine libraries' versions, from package metadata only."""
    found = _dist_versions(("fabric", "paramiko", "jinja2", "docker"))
    return "\n".join(
        [f"remote-ops {__version__}"]
        + [
            f"{d} {found.get(d) or _metadata_version(d) or '(not installed)'}"
            for d in ("fabric", "paramiko", "jinja2", "docker")
        ]
    )


def _dist_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Versions from the `NAME-VERSION.dist-info` folder names on sys.path (the wheel
    metadata's own naming): one directory listing per path entry, no imports."""
    import os

    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        for item in listing:
            name, _, rest = item.partition("-")
            if rest.endswith(".dist-info") and name.lower() in names and name.lower() not in found:
                found[name.lower()] = rest[: -len(".dist-info")]
    return found


def _metadata_version(dist: str) -> str | None:
    """importlib.metadata's answer, for installs without a dist-info folder name to read."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_versions())
        ctx.exit(0)


class LazyGroup(click.Group):
    """A group whose commands are imported on first use; `--help` lists `COMMAND_HELP`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMAND_HELP) | set(self.commands) | set(self._unindexed(ctx)))

    def get_command(self, ctx: click.Context, name: str):
        if name not in self.commands and name in COMMAND_HELP:
            self._load(COMMAND_HELP[name][0])
        if name not in self.commands:
            self._unindexed(ctx)
        return self.commands.get(name)

    def format_commands(self, ctx: click.Context, formatter) -> None:
        """Like click's, but from the static table (imports nothing for indexed commands)."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [
            (
                name,
                _short(COMMAND_HELP[name][1], limit)
                if name in COMMAND_HELP
                else self.commands[name].get_short_help_str(limit=limit),
            )
            for name in names
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """click's, plus two rules for options given before the command name: `-v`/`-q` before
        a command that has no such options (`completion`, `inventory schema`, `daemon ...`:
        nothing they do is traced or silenced) is refused with exit 2, as the same option after
        it is; `--json` is handed to the command that runs (`remote-ops --json hosts` is
        `remote-ops hosts --json`), and refused (exit 2) where that command has no `--json`."""
        name, cmd, rest = super().resolve_command(ctx, args)
        if (ctx.params.get("verbose") or ctx.params.get("quiet")) and not ctx.resilient_parsing:
            _refuse_root_verbosity(ctx, name, cmd, rest)
        if ctx.params.get("as_json") and not ctx.resilient_parsing:
            rest = _with_json(ctx, name, cmd, rest)
        return name, cmd, rest

    def _load(self, module_name: str) -> list[str]:
        """Import one command module (once) and add its commands; their names."""
        if module_name not in _LOADED:
            module = importlib.import_module(f"remote_ops.cli.commands.{module_name}")
            _LOADED[module_name] = [c.name for c in getattr(module, "commands", [])]
            for command in getattr(module, "commands", []):
                self.add_command(command)
        return _LOADED[module_name]

    def _unindexed(self, ctx: click.Context) -> list[str]:
        """Commands of modules in COMMAND_MODULES with no COMMAND_HELP line (imported to list them)."""
        indexed = {module for module, _ in COMMAND_HELP.values()}
        return [name for m in COMMAND_MODULES if m not in indexed for name in self._load(m)]


_LOADED: dict[str, list[str]] = {}


def _refuse_root_verbosity(ctx: click.Context, name, cmd, rest: list[str]) -> None:
    """UsageError when the command `remote-ops -v|-q CMD ...` runs takes no -v/-q of its own."""
    path = [name]
    while isinstance(cmd, click.Group):  # down to the command that runs (`daemon start`)
        sub = next((a for a in rest if not a.startswith("-")), None)
        if sub is None or cmd.get_command(ctx, sub) is None:
            return  # no subcommand: click says so (or shows the group's help)
        rest = rest[rest.index(sub) + 1 :]
        cmd, path = cmd.get_command(ctx, sub), [*path, sub]
    if cmd is None or any(p.name == "verbose" for p in cmd.params) or {"-h", "--help"} & set(rest):
        return
    flag = "-v/--verbose" if ctx.params.get("verbose") else "-q/--quiet"
    raise click.UsageError(
        f"{flag} does not apply to `{' '.join(path)}` (it prints no progress and runs no remote command)", ctx
    )


def _leaf(ctx: click.Context, name, cmd, rest: list[str]):
    """(the command that runs, its path, the index in `rest` where its own arguments begin)."""
    path, at = [name], 0
    while isinstance(cmd, click.Group):  # down to the command that runs (`dumps audit`)
        sub = next((a for a in rest[at:] if not a.startswith("-")), None)
        if sub is None or cmd.get_command(ctx, sub) is None:
            return None, path, at  # no subcommand: click says so (or shows the group's help)
        at = rest.index(sub, at) + 1
        cmd, path = cmd.get_command(ctx, sub), [*path, sub]
    return cmd, path, at


def _with_json(ctx: click.Context, name, cmd, rest: list[str]) -> list[str]:
    """`rest` with `--json` given to the command that runs (root `--json`); a UsageError when it
    takes none."""
    leaf, path, at = _leaf(ctx, name, cmd, rest)
    if leaf is None or {"-h", "--help"} & set(rest):
        return rest
    if not any(p.name == "as_json" for p in leaf.params):
        raise click.UsageError(f"--json does not apply to `{' '.join(path)}` (it prints no JSON document)", ctx)
    return rest if "--json" in rest[at:] else [*rest[:at], "--json", *rest[at:]]


def _short(text: str, limit: int) -> str:
    """`text` cut at a word to fit `limit` columns, with "..." (as click shortens help)."""
    if len(text) <= limit:
        return text
    return text[: max(1, limit - 3)].rsplit(" ", 1)[0].rstrip(",;:") + "..."


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="show versions of remote-ops, fabric, paramiko, jinja2 and docker",
)
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="as a command's -v (before or after the command; the counts add up): "
    "-v each remote command, -vv SSH transport events",
)
@click.option("-q", "--quiet", is_flag=True, help="as a command's -q (before or after the command); not with -v")
@click.option("--json", "as_json", is_flag=True, help="as a command's --json (before or after the command)")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool, as_json: bool) -> None:
    """Prepare a GPU host over SSH for EAGLE-3 hidden-state extraction with SGLang.

    \b
    Typical use:
      remote-ops facts --host gpu-node
      remote-ops inspect-source --host gpu-node --lines 2830:2845
      remote-ops deploy --host 10.1.230.174 --dry-run
      remote-ops health --host fleet --forks 8
      remote-ops deploy --all --limit 'gpu-0*' --serial 2
      remote-ops patch specs | grep KimiK25

    \b
    Data (tables, diffs, listings, logs, verdicts) goes to stdout, progress
    and warnings to stderr; piped, a table is one tab-separated line per row
    (header first, values whole); --json prints one document (JSON Lines
    for --watch and `logs follow`); -v shows each remote command, -vv SSH
    events, -q silences progress (before or after the command; -q with -v
    is a usage error).

    Exit codes are documented in docs/exit-codes.md (0 ok, 3 config, 4 unreachable,
    5 auth, 6 host key, 7 command failed, 8 timeout, 9 refused, 10 verify
    failed, 11/12 health warn/fail, 13 not found, 14 no space, 15 package
    index unreachable, 129/130/143 SIGHUP/SIGINT/SIGTERM).
    """
    run = ctx.ensure_object(RunConsole)
    run.verbose, run.quiet = verbose, quiet


class RunConsole:
    """Where a run's command leaves its Console for this boundary (click's context `obj`, set
    by `commands._options.app_options`): the error that ends the run is rendered on it
    (`Console.for_errors`), so an error after a JSON Lines stream knows it ends a stream.
    It also carries the root group's `-v` count and `-q` (given before the command), which
    `app_options` merges with the command's own."""

    def __init__(self) -> None:
        self.console = None  # a remote_ops.cli.console.Console, once the command made one
        self.verbose = 0  # `remote-ops -v ... CMD`: added to the command's own -v count
        self.quiet = False  # `remote-ops -q CMD`


def _json_requested(argv: list[str]) -> bool:
    return "--json" in argv


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI and turn every outcome into an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .. import signals

    previous = signals.install()
    run = RunConsole()  # the command's console, once it has one (`_options.app_options`)
    try:
        result = cli.main(args=argv, prog_name="remote-ops", standalone_mode=False, obj=run)
        return result if isinstance(result, int) else ExitCode.OK
    except RemoteOpsError as exc:
        return _render_error(exc, _boundary_console(run, argv))
    except Interrupted as exc:
        return _render_interrupt(exc, _boundary_console(run, argv))
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, Interrupted):  # click turns KeyboardInterrupt into Abort
            return _render_interrupt(exc.__cause__, _boundary_console(run, argv))
        click.echo("aborted", err=True)
        return ExitCode.INTERRUPTED
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        if _json_requested(argv):  # with --json every error is one document, a usage error too
            from ..errors import UsageError

            _boundary_console(run, argv).emit(UsageError(exc.format_message()).to_dict())
        return ExitCode.USAGE
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return ExitCode.INTERRUPTED
    finally:
        signals.restore(previous)


def _boundary_console(run, argv: list[str]):
    """The console the error is rendered on: the command's own (`Console.for_errors`: with
    --json during a stream, the error document is the stream's last compact line), or, when
    the run failed before a command made one, a plain one (`--json` read from argv)."""
    from .console import Console

    if run.console is not None:
        return run.console.for_errors()
    return Console(json_mode=_json_requested(argv))


def _render_interrupt(exc: Interrupted, console) -> int:
    """SIGINT/SIGTERM/SIGHUP: one line, exit 128 + signal (cleanup already ran in `finally`);
    with --json the `{"error": "interrupted"}` document (one line when it ends a stream)."""
    console.error(f"{exc}; stopped", getattr(exc, "hint", None))
    console.emit(exc.to_dict())
    return exc.exit_code


def _render_error(exc: RemoteOpsError, console) -> int:
    """The error's message, hint, command and stderr tail on stderr (host text shown, never obeyed:
    `Console` makes control characters visible); with --json its document on stdout."""
    console.error(str(exc), exc.hint)
    stderr_tail = getattr(exc, "stderr_tail", "")
    command = getattr(exc, "command", "")
    if command:
        console.say(f"  command: {command}", style="dim")
    if stderr_tail:
        console.say("  stderr (last lines):", style="dim")
        for line in stderr_tail.splitlines():
            console.say(f"    {line}", style="dim")
    console.emit(exc.to_dict())
    return exc.exit_code


def run() -> None:
    """A whole run in this process: what `launch.run` (the console script, `python -m remote_ops`)
    calls when no fork server takes the run, and what a server's worker calls (`daemon._run_cli`)."""
    _defer_gc()
    # pydantic looks for plugins among every installed distribution's entry points on its first
    # model (5-10 ms here); the CLI's models are private, so a plugin has nothing to observe.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    try:
        code = main()
    except Exception:  # a bug: exit 1 with the traceback, as Python would, but shown (see _print_bug)
        _print_bug()
        code = ExitCode.INTERNAL
    # Interpreter shutdown runs one last full collection over every object of the run (60-80 ms
    # of `health` on the lab VM); frozen objects are skipped, and nothing here needs collecting.
    gc.freeze()
    sys.exit(code)


def _print_bug() -> None:
    """The traceback of an unexpected exception on stderr, its control characters shown
    (`core.terminal.visible`): its messages may quote host text, which must not drive the
    terminal there either."""
    import traceback

    from ..core.terminal import visible

    sys.stderr.write(visible(traceback.format_exc()))
    sys.stderr.flush()


#: seconds a run goes without the cyclic garbage collector (see `_defer_gc`)
GC_GRACE_S = 1.0


def _defer_gc() -> None:
    """No cyclic GC for the run's first second, then freeze what exists and collect as usual.

    Start-up allocates the objects of a few hundred imported modules, none of it
    garbage, and CPython's generational GC walks them again and again: ~90 ms of a
    ~0.9 s `health` on the 2-core lab VM (counted with `gc.callbacks`).  A short
    command now runs without it; a long one (`--watch`, `logs follow`, a pull)
    gets it back after GC_GRACE_S, with the start-up objects frozen out of every
    later pass (`gc.freeze`).  Only the CLI process does this, never an importer."""
    import threading

    gc.disable()

    def resume() -> None:
        gc.freeze()
        gc.enable()

    timer = threading.Timer(GC_GRACE_S, resume)
    timer.daemon = True
    timer.start()
