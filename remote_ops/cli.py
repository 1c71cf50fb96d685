"""The command line: parse, call, render, and map errors to exit codes — once.

This is the single error boundary.  Expected failures are `RemoteOpsError`s:
they are rendered as one message (plus a hint) on stderr, or as a JSON error
document with `--json`, and exit with their documented code.  Anything else is
a bug: it exits 1 with the traceback.
"""
from __future__ import annotations

import importlib
import sys

import click

from . import __version__
from .errors import ExitCode, Interrupted, RemoteOpsError

#: Command modules under remote_ops.commands, in help order.
COMMAND_MODULES = ("hosts", "facts", "source", "patch", "render", "container", "health",
                   "deploy", "unlock", "sandbox", "logs", "dumps", "extract", "dataset", "spec", "train")


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"remote-ops {__version__}"]
    for dist in ("fabric", "paramiko", "jinja2", "docker"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist} (not installed)")
    return "\n".join(parts)


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_versions())
        ctx.exit(0)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="show versions of remote-ops, fabric, paramiko, jinja2 and docker")
def cli() -> None:
    """Prepare a GPU host over SSH for EAGLE-3 hidden-state extraction with SGLang.

    \b
    Typical use:
      remote-ops facts --host gpu-node
      remote-ops inspect-source --host gpu-node --lines 2830:2845
      remote-ops deploy --host 10.1.230.174 --dry-run
      remote-ops health --host gpu-node

    Exit codes are documented in the README (0 ok, 3 config, 4 unreachable,
    5 auth, 6 host key, 7 command failed, 8 timeout, 9 refused, 10 verify
    failed, 11/12 health warn/fail, 13 not found, 129/130/143 SIGHUP/SIGINT/SIGTERM).
    """


def _register() -> None:
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"remote_ops.commands.{name}")
        for command in getattr(module, "commands", []):
            cli.add_command(command)


_register()


def _json_requested(argv: list[str]) -> bool:
    return "--json" in argv


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI and turn every outcome into an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from . import signals

    previous = signals.install()
    try:
        result = cli.main(args=argv, prog_name="remote-ops", standalone_mode=False)
        return result if isinstance(result, int) else ExitCode.OK
    except RemoteOpsError as exc:
        return _render_error(exc, _json_requested(argv))
    except Interrupted as exc:
        return _render_interrupt(exc, _json_requested(argv))
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, Interrupted):  # click turns KeyboardInterrupt into Abort
            return _render_interrupt(exc.__cause__, _json_requested(argv))
        click.echo("aborted", err=True)
        return ExitCode.INTERRUPTED
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return ExitCode.USAGE
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return ExitCode.INTERRUPTED
    finally:
        signals.restore(previous)


def _render_interrupt(exc: Interrupted, as_json: bool) -> int:
    """SIGINT/SIGTERM/SIGHUP: one line, exit 128 + signal (cleanup already ran in `finally`)."""
    from .console import Console

    console = Console(json_mode=as_json)
    console.error(f"{exc}; stopped", getattr(exc, "hint", None))
    console.emit(exc.to_dict())
    return exc.exit_code


def _render_error(exc: RemoteOpsError, as_json: bool) -> int:
    from .console import Console

    console = Console(json_mode=as_json)
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
    sys.exit(main())
