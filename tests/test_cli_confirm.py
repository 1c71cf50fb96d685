"""`ask_or_refuse`: the one place a change without --yes asks (a terminal) or is refused (exit 9)."""

from __future__ import annotations

import io

import click
import pytest

from remote_ops.cli.commands._options import ask_or_refuse
from remote_ops.errors import Refused


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_the_change_is_refused_with_the_hint(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(Refused) as err:
        ask_or_refuse("go?", "it would change h; re-run with --yes", host="h")
    assert err.value.exit_code == 9 and "re-run with --yes" in err.value.message


def test_on_a_terminal_no_aborts_and_yes_goes_on(monkeypatch):
    monkeypatch.setattr("sys.stdin", _Tty(""))
    answers = iter([False, True])
    monkeypatch.setattr(click, "confirm", lambda *a, **k: next(answers))
    with pytest.raises(click.exceptions.Abort):
        ask_or_refuse("go?", "refused")
    ask_or_refuse("go?", "refused")  # yes: returns
