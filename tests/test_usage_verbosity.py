"""The root `-v`/`-q` on a command that has no such options (issue 29, loose end of item 1): refused
with exit 2 whether written before or after the command, never accepted and ignored.  The commands
built without the shared options are listed from the CLI itself, so a new one is covered too."""

from __future__ import annotations

import click
import pytest

from remote_ops.cli import main as cli_main


def _leaves(cmd: click.Command, path: tuple[str, ...], ctx: click.Context):
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            yield from _leaves(cmd.get_command(ctx, name), (*path, name), ctx)
    else:
        yield path, cmd


def _without_verbosity() -> list[tuple[str, ...]]:
    ctx = click.Context(cli_main.cli)
    return [p for p, c in _leaves(cli_main.cli, (), ctx) if not any(x.name == "verbose" for x in c.params)]


#: a valid argument list for each such command (what follows its name)
ARGS = {("completion",): ["bash"], ("inventory", "schema"): [], ("daemon", "status"): ["--json"]}


def test_the_commands_without_verbosity_are_the_known_ones():
    assert set(_without_verbosity()) <= {*ARGS, ("daemon", "start"), ("daemon", "stop")}
    assert ("completion",) in _without_verbosity()


@pytest.mark.parametrize("path", sorted(ARGS), ids=" ".join)
@pytest.mark.parametrize("flag", ["-v", "-vv", "-q"])
def test_root_verbosity_on_a_command_without_it_is_refused_as_after_it(path, flag, capsys):
    argv = [*path, *ARGS[path]]
    assert cli_main.main([flag, *argv]) == 2
    before = capsys.readouterr().err
    assert f"does not apply to `{' '.join(path)}`" in before and "Traceback" not in before
    assert cli_main.main([*argv, flag]) == 2  # click's own: "No such option"
    assert "No such option" in capsys.readouterr().err


def test_help_and_a_command_with_verbosity_still_work(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main.main(["-v", "completion", "--help"]) == 0
    assert "completion" in capsys.readouterr().out
    assert cli_main.main(["completion", "bash"]) == 0  # without -v: the script
    assert "_REMOTE_OPS_COMPLETE" in capsys.readouterr().out
