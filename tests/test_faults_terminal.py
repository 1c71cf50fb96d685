"""Issue 33, findings 2, 6 and 7: host text is data, never terminal control; fleet summaries give
each host's own verdict; Ctrl-C ends a JSON Lines stream with one compact line.

Host scenarios run the real CLI against the real lab hosts: hostile names and log lines are made
on the host through the SSH seam or the lab dockerd, an unreachable host is a real refused port.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
from conftest import run_cli

from remote_ops.cli.console import Console
from remote_ops.core.terminal import caret, visible
from remote_ops.errors import ExitCode, Unreachable
from remote_ops.workflows import fleet
from remote_ops.workflows.health import Check, HostHealth

ESC, BEL = "\x1b", "\x07"
#: the probe's dump file name: moves up a line, erases it, prints a green "ALL GOOD"
HOSTILE = f"{ESC}[1A {ESC}[2K {ESC}[32mALL GOOD.safetensors"
HOSTILE_SHOWN = "^[[1A ^[[2K ^[[32mALL GOOD.safetensors"
CLEAR = f"{ESC}[2J"
CLIPBOARD = f"{ESC}]52;c;QUxMIEdPT0Q={BEL}"  # OSC 52: set the clipboard to base64("ALL GOOD")


# ---------------------------------------------------------------- the render function (pure)
@pytest.mark.parametrize(
    "text, shown",
    [
        (f"a{ESC}b", "a^[b"),  # ESC
        (f"{ESC}[1A{ESC}[2K{ESC}[32mok{ESC}[0m", "^[[1A^[[2K^[[32mok^[[0m"),  # CSI
        (CLIPBOARD, "^[]52;c;QUxMIEdPT0Q=^G"),  # OSC ended by BEL
        (f"{ESC}]0;title{ESC}\\", "^[]0;title^[\\"),  # OSC ended by ST
        ("x\x9b2Jy", "xM-^[2Jy"),  # C1 CSI (one character)
        ("\x85\x90\x9d\x9f", "M-^EM-^PM-^]M-^_"),  # other C1 controls
        ("done 50%\roverwritten", "done 50%^Moverwritten"),  # a lone CR would overwrite the line
        ("del\x7f", "del^?"),
        ("nul\x00", "nul^@"),
        ("bs\x08\x08", "bs^H^H"),
        ("col\tumn\nnext line", "col\tumn\nnext line"),  # tab and newline kept
        ("crlf\r\nline", "crlf\r\nline"),  # a CR ending a line overwrites nothing
        ("plain ünïcode → ok", "plain ünïcode → ok"),
    ],
)
def test_visible_shows_control_characters_in_caret_notation(text, shown):
    assert visible(text) == shown


def test_one_line_shows_newlines_and_crs_too():
    assert visible("name\n[ ok ] forged\r\n", one_line=True) == "name^J[ ok ] forged^M^J"
    assert visible("a\tb", one_line=True) == "a\tb"


def test_caret_covers_every_c0_and_c1_control():
    assert [caret(chr(c)) for c in (0, 7, 0x1B, 0x1F, 0x7F, 0x80, 0x9B, 0x9F)] == [
        "^@",
        "^G",
        "^[",
        "^_",
        "^?",
        "M-^@",
        "M-^[",
        "M-^_",
    ]
    hidden = "".join(chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if chr(c) not in "\t\n")
    assert not any(0x00 <= ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in visible(hidden))


def test_visible_is_linear_on_long_host_lines():
    """A tripwire, not a benchmark: a 1 MB line of escapes and a 16 MB clean one, well in time."""
    t0 = time.monotonic()
    assert visible(ESC * (1 << 20), one_line=True) == "^[" * (1 << 20)
    assert len(visible("x" * (16 << 20))) == 16 << 20
    assert time.monotonic() - t0 < 10.0  # ~0.3 s idle; a quadratic pass over 16 MB takes hours


# ---------------------------------------------------------------- the console (the only printer)
def _console(**kw) -> tuple[Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(stdout=out, stderr=err, **kw), out, err


def test_every_human_output_path_shows_host_text():
    c, out, err = _console()
    c.say(HOSTILE)
    c.step(HOSTILE)
    c.status("warn", HOSTILE)
    c.status("ok", HOSTILE, data=True)
    c.warn(HOSTILE)
    c.error(HOSTILE, hint=HOSTILE)
    c.host_line(f"lab{ESC}[2J", "stdout", CLEAR + CLIPBOARD, data=True)
    c.host_line("lab", "stderr", CLEAR)
    c.table(["name", "size"], [[HOSTILE, 1]])
    c.text_block(f"--- a\n+{CLEAR}\tkept\n")
    c.text_block(CLIPBOARD, data=False)
    c.trace(HOSTILE)
    c.out(CLIPBOARD)
    with c.progress(HOSTILE) as advance:
        advance(1, description=CLIPBOARD)
    everything = out.getvalue() + err.getvalue()
    assert ESC not in everything and BEL not in everything and "\x9b" not in everything
    assert HOSTILE_SHOWN in err.getvalue() and "^[[2J" in out.getvalue() and "^[]52;c;" in out.getvalue()
    assert "+^[[2J\tkept\n" in out.getvalue()  # a block keeps its tabs and lines


def test_a_newline_in_a_one_line_path_cannot_forge_a_line():
    c, out, err = _console()
    c.say("    rank0/x.safetensors\n[ ok ] all files verified")
    c.status("warn", "files missing from the manifest: 1\n[ ok ] nothing missing", data=True)
    assert err.getvalue().count("\n") == 1 and out.getvalue().count("\n") == 1
    assert "^J[ ok ] all files verified" in err.getvalue()


def test_json_keeps_exact_strings_and_raw_line_writes_the_bytes():
    c, out, err = _console(json_mode=True)
    c.emit({"file": HOSTILE})
    assert json.loads(out.getvalue()) == {"file": HOSTILE}
    c, out, err = _console(json_mode=True)
    c.emit_line({"line": CLEAR + CLIPBOARD})
    assert json.loads(out.getvalue()) == {"line": CLEAR + CLIPBOARD}
    c, out, err = _console()
    c.raw_line("lab1", "[server] " + CLEAR + CLIPBOARD)
    assert out.getvalue() == f"lab1 | [server] {CLEAR}{CLIPBOARD}\n"


def test_a_document_after_a_stream_is_one_compact_line():
    c, out, _ = _console(json_mode=True)
    c.emit_line({"round": 1})
    boundary = c.for_errors()
    boundary.emit({"error": "interrupted", "exit_code": 130})
    assert out.getvalue().splitlines() == ['{"round":1}', '{"error":"interrupted","exit_code":130}']
    c, out, _ = _console(json_mode=True, streaming=True)  # streaming before its first line
    c.for_errors().emit({"error": "interrupted"})
    assert out.getvalue() == '{"error":"interrupted"}\n'
    c, out, _ = _console(json_mode=True)  # not a stream: one pretty document, as before
    c.emit({"a": 1})
    assert out.getvalue() == '{\n  "a": 1\n}\n'


def test_a_traceback_and_ssh_events_show_host_text(capsys):
    """Text that leaves without the console: a bug's traceback (`cli.run`) and -vv's paramiko
    records (the server's banner is quoted there)."""
    import logging

    from remote_ops.cli import main as cli
    from remote_ops.cli.commands import _options

    try:
        raise RuntimeError(HOSTILE)
    except RuntimeError:
        cli._print_bug()
    err = capsys.readouterr().err
    assert "RuntimeError" in err and HOSTILE_SHOWN in err and ESC not in err
    log = logging.getLogger("paramiko")
    before = (list(log.handlers), log.level)
    _options._ssh_events_to_stderr()
    try:
        logging.getLogger("paramiko.transport").info("Connected (version 2.0, client %s)", f"evil{CLEAR}")
    finally:
        log.handlers[:], log.level = before
    err = capsys.readouterr().err
    assert "client evil^[[2J" in err and ESC not in err


# ---------------------------------------------------------------- each host's own verdict (pure)
def _health(name: str, *checks: Check, error_exit: int | None = None) -> HostHealth:
    return HostHealth(name, list(checks), error_exit=error_exit)


def test_each_host_keeps_its_own_exit_code_and_verdict():
    ok = _health("a", Check("ssh", "connect", "ok", "fine"))
    warn = _health("b", Check("ssh", "connect", "ok", "fine"), Check("dumps", "growth", "warn", "not growing"))
    down = _health("c", Check("ssh", "connect", "fail", "connection refused"), error_exit=ExitCode.UNREACHABLE)
    assert [h.to_dict()["exit_code"] for h in (ok, warn, down)] == [0, 11, 4]
    assert ok.verdict == "ok" and warn.verdict == "warn: dumps/growth: not growing"
    assert down.verdict == "fail: ssh/connect: connection refused"
    outcomes = [
        fleet.HostOutcome("a", 0, ok),
        fleet.HostOutcome("c", 4, down),
        fleet.HostOutcome("d", 10, {"files": 3}),
        fleet.HostOutcome("e", 4, error=Unreachable("connection to e refused")),
        fleet.HostOutcome("f", 9, skipped=True),
    ]
    assert [o.verdict for o in outcomes] == [
        "ok",
        "fail: ssh/connect: connection refused",
        "verify failed (exit 10)",
        "connection to e refused",
        "skipped after a failed batch",
    ]


# ---------------------------------------------------------------- over real lab hosts
def test_dumps_status_and_verify_show_a_hostile_file_name(lab, lab_env, remote, host):
    """The probe's name erased the `[warn] files missing from the manifest` line above it and
    printed a green ALL GOOD; now the name is shown (`^[`), every warn line stays whole, and
    --json keeps the exact name (listed as an unsafe host name, `core.hostpaths`)."""
    rank = host.paths.dump_dir / "rank0"
    remote.run(["rm", "-rf", str(host.paths.dump_dir)])
    remote.run(["mkdir", "-p", str(rank)])
    for name in ("plain.safetensors", HOSTILE):  # one ordinary unlisted file, one hostile name
        remote.run(["sh", "-c", 'head -c 64 /dev/zero > "$1"', "sh", str(rank / name)])
    try:
        for command in ("status", "verify"):
            rc, out, err = run_cli(lab_env, "dumps", command, "--host", host.name)
            assert ESC not in out + err, out + err
            lines = err.splitlines()
            assert "[warn] files missing from the manifest: 1" in lines, err
            assert lines[lines.index("[warn] files missing from the manifest: 1") + 1] == "    rank0/plain.safetensors"
            shown = [i for i, line in enumerate(lines) if line.startswith(f"    rank0/{HOSTILE_SHOWN}")]
            assert len(shown) == 1 and lines[shown[0] - 1].startswith("[warn] "), err  # its label: whole
        rc, out, err = run_cli(lab_env, "dumps", "status", "--host", host.name, "--json")
        recon = json.loads(out)["reconciliation"]
        assert any(entry.startswith(f"rank0/{HOSTILE}") for entry in recon["unsafe"]), recon
    finally:
        remote.run(["rm", "-rf", str(host.paths.dump_dir)])


@pytest.fixture
def noisy_server(lab, host, dockerd, busybox_image):
    """The host's server container (lab busybox) printing a clear-screen and an OSC 52 line."""
    name = lab.spec(host.name).container.name
    dockerd.docker("rm", "-f", name, check=False)
    script = r"printf 'before\n\033[2Jcleared\n\033]52;c;QUxMIEdPT0Q=\007after\n'; sleep 60"
    dockerd.docker("run", "-d", "--pull=never", "--name", name, busybox_image, "sh", "-c", script)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and b"after" not in dockerd.docker("logs", name).stdout:
        time.sleep(0.1)
    yield host
    dockerd.docker("rm", "-f", name, check=False)


def test_logs_follow_shows_escapes_unless_raw(lab_env, noisy_server):
    follow = ("logs", "follow", "--host", noisy_server.name, "--what", "server", "--duration", "2")
    rc, out, err = run_cli(lab_env, *follow)
    assert rc == 0, err
    assert ESC not in out + err and BEL not in out + err
    assert f"{noisy_server.name} | [server] ^[[2Jcleared" in out
    assert f"{noisy_server.name} | [server] ^[]52;c;QUxMIEdPT0Q=^Gafter" in out
    rc, out, err = run_cli(lab_env, *follow, "--raw")
    assert rc == 0, err
    assert f"{noisy_server.name} | [server] {CLEAR}cleared\n" in out
    assert f"{noisy_server.name} | [server] {CLIPBOARD}after\n" in out
    rc, out, err = run_cli(lab_env, *follow, "--json")
    assert [json.loads(line)["line"] for line in out.splitlines()] == ["before", f"{CLEAR}cleared", f"{CLIPBOARD}after"]


def _table_rows(err: str, names: list[str]) -> dict[str, list[str]]:
    """The summary table's rows (`host │ exit │ time │ result`) by host."""
    rows = {}
    for line in err.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 4 and cells[0] in names:
            rows[cells[0]] = cells
    return rows


def test_a_fleet_summary_gives_each_host_its_own_verdict(lab, lab_env, spare_host, faults):
    """One of three hosts refused: the run exits 4, but every row and every host of the JSON
    document (each --watch round too) carries that host's own exit code and verdict."""
    faults.refuse(spare_host)
    names = ["lab1", "lab2", "lab3"]
    select_hosts = ("--all", "--limit", "lab*", "--connect-timeout", "3")
    rc, out, err = run_cli(lab_env, "health", *select_hosts, "--json")
    assert rc == 4, err
    doc = json.loads(out)
    own = {h["host"]: h["exit_code"] for h in doc["hosts"]}
    assert sorted(own) == names and all(isinstance(c, int) for c in own.values()), own
    assert own[spare_host.name] == 4 and all(c in (0, 11, 12) for n, c in own.items() if n != spare_host.name)
    rows = _table_rows(err, names)
    assert sorted(rows) == names, err
    for name, (_, code, _, verdict) in rows.items():
        assert int(code) == own[name], err
        assert (verdict == "ok") == (own[name] == 0), err
    assert rows[spare_host.name][3].startswith("fail: ssh/connect: connection to") and "refused" in err
    # long enough for two rounds when each takes ~2.5 s on a loaded machine
    rc, out, err = run_cli(lab_env, "health", *select_hosts, "--watch", "0.2", "--watch-for", "6", "--json")
    rounds = [json.loads(line) for line in out.splitlines()]
    assert len(rounds) >= 2 and rc == 4, out + err
    for r in rounds:
        assert r["exit_code"] == 4 and sorted(h["host"] for h in r["hosts"]) == names
        assert all(isinstance(h["exit_code"], int) for h in r["hosts"]), r
        assert {h["host"]: h["exit_code"] for h in r["hosts"]}[spare_host.name] == 4


def _interrupt_after_first_line(env: dict, *args: str, deadline_s: float = 60) -> tuple[int, list[str], str]:
    """Start the CLI, wait (with a deadline) for its first stdout line, send SIGINT, collect."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_ops", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        first = b""
        deadline = time.monotonic() + deadline_s
        while not first.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 1)
                if not chunk:
                    break
                first += chunk
        assert first.endswith(b"\n"), f"no first line within {deadline_s}s"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=deadline_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode, (first + rest).decode().splitlines(), err.decode()


def _assert_stream_ends_compact(rc: int, lines: list[str], err: str) -> None:
    assert rc == 130, err
    docs = [json.loads(line) for line in lines]  # every line is one JSON document
    assert docs[-1]["error"] == "interrupted" and docs[-1]["exit_code"] == 130, lines
    assert lines[-1] == json.dumps(docs[-1], separators=(",", ":")), lines[-1]


def test_ctrl_c_ends_a_health_watch_stream_with_one_compact_line(lab, lab_env, host):
    args = ("health", "--host", host.name, "--watch", "0.2", "--watch-for", "120", "--json")
    _assert_stream_ends_compact(*_interrupt_after_first_line(lab_env, *args))


def test_ctrl_c_ends_a_logs_follow_stream_with_one_compact_line(lab, lab_env, host):
    log = host.paths.logs_dir / "extraction.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("one\ntwo\n")
    args = ("logs", "follow", "--host", host.name, "--what", "extraction", "--duration", "120", "--json")
    _assert_stream_ends_compact(*_interrupt_after_first_line(lab_env, *args))


def test_ctrl_c_ends_a_many_host_follow_at_once(lab, lab_env):
    """Two hosts followed for 120 s: SIGINT ends the run within seconds (the hosts' threads are
    not waited for), and the stream still ends with the compact interrupted line."""
    for name in ("lab1", "lab2"):
        log = lab.host(name).paths.logs_dir / "extraction.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("one\ntwo\n")
    args = ("logs", "follow", "--host", "lab1,lab2", "--what", "extraction", "--duration", "120", "--json")
    t0 = time.monotonic()
    rc, lines, err = _interrupt_after_first_line(lab_env, *args, deadline_s=30)
    assert time.monotonic() - t0 < 30 and "Traceback" not in err, err
    _assert_stream_ends_compact(rc, lines, err)
