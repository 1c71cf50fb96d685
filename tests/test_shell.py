"""Quoting and batched probes (pure)."""

import shlex
import subprocess

from remote_ops.core import shell


def test_join_quotes_every_argument():
    argv = ["ls", "-l", "/srv/a dir; rm -rf /", "$(reboot)", "it's"]
    line = shell.join(argv)
    assert shlex.split(line) == argv


def test_sections_round_trip_through_a_real_shell():
    script = shell.sections([("a", ["echo", "x; y"]), ("b", "exit 3"), ("c", "echo after")])
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10).stdout
    sec = shell.split_sections(out)
    assert sec == {"a": (0, "x; y"), "b": (3, ""), "c": (0, "after")}


def test_redirect_and_combinators():
    assert shell.redirect(["echo", "a b"], stdout="/tmp/x y", append=True) == "echo 'a b' >> '/tmp/x y'"
    assert shell.and_then(["true"], ["echo", "ok"]) == "true && echo ok"


def test_parallel_sections_parse_like_sections_and_run_concurrently(tmp_path):
    # b and c each wait (up to 10 s) for the other's file: run one after the other, b would
    # give up and exit 9; run side by side, both see the other at once (no timing involved)
    def meet(mine: str, theirs: str, rc: int, say: str) -> str:
        wait = f"i=0; while [ ! -e {tmp_path / theirs} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done"
        return f"touch {tmp_path / mine}; {wait}; [ -e {tmp_path / theirs} ] || exit 9; {say}exit {rc}"

    probes = [
        ("a", ["echo", "x; y"]),
        ("b", meet("b", "c", 3, "")),
        ("c", meet("c", "b", 0, "echo after; ")),
        ("d", "printf 'no newline'"),
    ]
    out = subprocess.run(
        ["sh", "-c", shell.parallel_sections(probes)], capture_output=True, text=True, timeout=30
    ).stdout
    assert shell.split_sections(out) == {"a": (0, "x; y"), "b": (3, ""), "c": (0, "after"), "d": (0, "no newline")}


def test_sections_probe_without_final_newline():
    out = subprocess.run(
        ["sh", "-c", shell.sections([("d", "printf 'no newline'"), ("e", "echo ok")])],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    assert shell.split_sections(out) == {"d": (0, "no newline"), "e": (0, "ok")}
