"""Usage is checked before connecting (issue 29, item 6): path options are local unless written
`host:PATH` (`core.pathref`, one rule for every option), a missing local file is exit 2, and a
one-host command given a pattern of several hosts is exit 2; none of it opens a connection.

The CLI runs in this process (`remote_ops.cli.main.main`) on a temporary inventory whose hosts
sit on a closed loopback port (127.0.0.1:1, a real connect would be refused: exit 4), and the
connector seam (`App._open_target`, the one place a connection is opened) is replaced by a
recorder that fails the test if anything tries to connect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote_ops.cli import main as cli_main
from remote_ops.cli.app import App
from remote_ops.core import pathref
from remote_ops.core.pathref import PathRef, Seen
from remote_ops.errors import Unreachable

INVENTORY = """\
hosts:
  far1: {address: 127.0.0.1, port: 1}
  far2: {address: 127.0.0.1, port: 1}
groups:
  far:
    hosts: [far1, far2]
"""


# --------------------------------------------------------------------------- the rule (pure)


@pytest.mark.parametrize(
    ("value", "ref"),
    [
        ("data.jsonl", PathRef("data.jsonl")),
        ("/data/x.json", PathRef("/data/x.json")),  # absolute: still here, as scp reads it
        ("host:/data/x.json", PathRef("/data/x.json", on_host=True)),
        ("host:rel/x.json", PathRef("rel/x.json", on_host=True)),
        ("./host:x", PathRef("./host:x")),  # a '/' before the colon: a local name, as scp
        ("gpu-node:/x", PathRef("gpu-node:/x")),  # only the literal prefix marks the host
    ],
)
def test_a_path_is_local_unless_written_host_colon(value, ref):
    assert pathref.parse(value) == ref
    assert str(pathref.parse(value)) == value


def test_problem_names_what_is_wrong_for_each_kind_of_option():
    here, there = PathRef("x.json"), PathRef("/x.json", on_host=True)
    assert pathref.problem(here, host_ok=True, want="file", seen=Seen(True)) is None
    assert pathref.problem(there, host_ok=True, want="file") is None
    assert "does not exist here (a path on the host is written host:x.json)" in str(
        pathref.problem(here, host_ok=True, want="file", seen=Seen(False))
    )
    assert pathref.problem(here, host_ok=False, want="file", seen=Seen(False)) == "file 'x.json' does not exist here"
    assert "not accepted here" in str(pathref.problem(there, host_ok=False, want="file"))
    assert "is a directory" in str(pathref.problem(here, host_ok=False, want="file", seen=Seen(True, is_dir=True)))
    assert "not a directory" in str(pathref.problem(here, host_ok=False, want="dir", seen=Seen(True)))
    assert pathref.problem(here, host_ok=False, want="any", seen=Seen(False)) is None  # an output
    assert "needs a path" in str(pathref.problem(PathRef("", on_host=True), host_ok=True, want="file"))


# --------------------------------------------------------------------------- the CLI, no connection


class Connects:
    """The connector seam, recorded; it answers as the closed port would (Unreachable, exit 4),
    so a run that wrongly connects ends with exit 4, never 2."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, _app, _target, name: str):
        self.calls.append(name)
        raise Unreachable("connection refused (recorded connect)", host=name)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch, capsys):
    inv = tmp_path / "inventory"
    inv.mkdir()
    (inv / "hosts.yaml").write_text(INVENTORY)
    monkeypatch.delenv("REMOTE_OPS_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    connects = Connects()
    monkeypatch.setattr(App, "_open_target", lambda app, target, name: connects(app, target, name))

    def run(*args: str) -> tuple[int, dict, str]:
        code = cli_main.main([*args, "--inventory", str(inv), "--json"])
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return code, json.loads(out) if out.strip() else {}, err

    run.connects = connects  # type: ignore[attr-defined]
    return run


MISSING = [
    ("extract", "start", "--host", "far1", "--dataset", "nope.jsonl"),
    ("extract", "start", "--host", "far", "--dataset", "nope.jsonl"),
    ("train", "start", "--host", "far1", "--draft-config", "nope.json"),
    ("dataset", "regenerate", "--host", "far1", "--dataset", "nope.jsonl"),
    ("dataset", "prepare", "nope.jsonl", "--on-host", "--host", "far"),
    ("spec", "bench", "--host", "far1", "--prompts", "nope.jsonl"),
    ("facts", "--host", "far1", "--ssh-config", "nope.config"),  # facts connects early (speculate)
    ("health", "--host", "far", "--ssh-config", "nope.config"),
    ("inspect-source", "--local-file", "nope.py", "--lines", "1:2"),
    ("patch", "check", "--local-file", "nope.py"),
    ("dumps", "audit", "--host", "far1", "--draft-config", "nope.json"),
    ("dumps", "export", "--host", "far1", "--dataset", "nope.jsonl"),
]


@pytest.mark.parametrize("args", MISSING, ids=lambda a: " ".join(a[:3]))
def test_a_missing_local_file_is_a_usage_error_before_any_connection(cli, args):
    code, _doc, err = cli(*args)
    assert code == 2, err
    assert "does not exist here" in err and "nope." in err
    assert cli.connects.calls == []


def test_a_host_path_is_not_taken_where_only_a_local_file_makes_sense(cli):
    code, _doc, err = cli("dataset", "regenerate", "--host", "far1", "--dataset", "host:/data/chats.jsonl")
    assert code == 2 and "not accepted here" in err
    assert cli.connects.calls == []


def test_a_bad_local_file_is_a_config_error_before_any_connection(cli, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "input_ids": [1, "two"]}\n')
    code, doc, err = cli("extract", "start", "--host", "far1", "--dataset", str(bad))
    assert code == 3 and doc["error"] == "config" and f"{bad}:1" in err, err
    assert cli.connects.calls == []


def test_a_group_start_refuses_a_dataset_on_the_host(cli):
    code, doc, err = cli("extract", "start", "--host", "far", "--dataset", "host:/data/samples.jsonl")
    assert code == 2 and doc["error"] == "usage" and "is a file on the host" in err
    assert cli.connects.calls == []


@pytest.mark.parametrize(
    "args",
    [
        ("train", "start", "--host", "far"),
        ("spec", "bench", "--host", "far"),
        ("spec", "deploy", "--host", "far1,far2", "--draft", "/d"),
        ("dataset", "prepare", "x.jsonl", "--host", "far", "--max-length", "8"),
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_one_host_command_given_several_hosts_is_a_usage_error(cli, tmp_path, args):
    (tmp_path / "x.jsonl").write_text("")
    code, doc, err = cli(*args)
    assert code == 2, err
    assert doc["error"] == "usage" and doc["hosts"] == ["far1", "far2"]
    assert f"`{args[0]} {args[1]}` takes one host" in err
    assert cli.connects.calls == []


def test_the_host_marked_path_passes_the_parse_and_goes_on_to_connect(cli):
    """The control case: a valid command line reaches the connector (here: the recorder)."""
    code, _doc, err = cli("extract", "start", "--host", "far1", "--dataset", "host:/data/samples.jsonl")
    assert cli.connects.calls == ["far1"]
    assert code == 4 and "recorded connect" in err
