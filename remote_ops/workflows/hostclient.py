"""The edges every on-host client shares: ship it, start it detached, ask how it stands, wait for it,
stop it.  A client is a program built on the on-host skeleton (`remote_ops/onhost/client.py`)
with its work dir in one layout (`core.extractplan.ExtractPaths`, or a subclass naming another
program); here it is a `Client` subclass that names its work dir (`paths`) and its words in
errors.  `workflows.extract` and `workflows.regenerate` are the two today.

Shipping: a client runs with the host's `python3` (3.8+, standard library only) and imports the
skeleton from its own folder, so both files go into its work dir (`ExtractPaths.shipped`), each
uploaded only when the host's copy has other bytes (sha256, one round trip).  The client is
started detached in its own session (`setsid`), its PID recorded, and stopped by that PID (after
checking the PID still runs the client); every wait here has a deadline.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from .. import onhost
from ..core import shell
from ..core.datasetcheck import Problem
from ..core.extractplan import ExtractPaths, ExtractStatus
from ..errors import CommandTimedOut, ConfigError, Refused
from ..probes import batch
from ..probes.extract import ClientLogSince, ClientOutput, DoneKeys, ExtractAlive, ExtractStatusProbes, FileSha
from ..probes.system import HostPython, python_problem

DATASET_ERROR = "dataset error: "  # how a client names a bad dataset line on stderr


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload_if_changed(remote, data: bytes, path: str, mode: int = 0o644) -> bool:
    """Upload unless the host already has the same bytes (checked by sha256, one round trip)."""
    have = remote.run(shell.quiet(shell.sha256_of(path)), check=False).stdout.strip()
    if have == sha256(data):
        return False
    remote.put(data, path, mode=mode)
    return True


def check_file(path: Path, check: Callable[[Iterable[bytes]], list[Problem]], what: str, hint: str) -> None:
    """ConfigError (exit 3) naming `FILE:LINE` and why, for the first bad line of a local dataset
    (`check`: its rules over the lines as bytes, so a non-UTF-8 line is named, not a decode
    error); nothing is sent anywhere.  The hint lists the next bad lines, if any."""
    try:
        with open(path, "rb") as fh:
            problems = check(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what}: {exc.strerror or exc}", source=str(path)) from None
    if problems:
        first, more = problems[0], problems[1:]
        rest = f"; more bad lines: {', '.join(str(p.line) for p in more)}" if more else ""
        raise ConfigError(first.reason, source=f"{path}:{first.line}", hint=hint + rest)


def refuse_without_python(host, found: tuple[tuple[int, ...] | None, str | None]) -> None:
    """Preflight: a client runs with the host's python3 (3.8+); missing or older is exit 9,
    naming what needs it (`probes.system.python_problem`)."""
    problem = python_problem(*found)
    if problem:
        raise Refused(
            f"preflight: {problem}",
            host=host.name,
            hint="install python3 (3.8 or newer) on the host, on the SSH session's PATH",
        )


class Client:
    """One on-host client: its work dir (`paths`), its files, and the words its errors use."""

    #: the client, in the errors' words ("the extraction client exited at start"), with its article
    name, a_name = "client", "a client"
    #: the command that starts it (a timeout's `command`)
    start_command = ""
    #: (the run, the command that waits for it, the command that follows it): a timeout's words
    what = ("run", "", "")
    #: the hint while a client is already running there (`{host}`: the host's name)
    busy = ""
    #: the client's work dir on a host: `paths(host) -> ExtractPaths`
    paths: Callable[[Any], ExtractPaths]

    def files(self, p: ExtractPaths) -> list[tuple[bytes, str]]:
        """(bytes, path on the host) of every file shipped: the client and the skeleton it imports."""
        return [(onhost.source(name), path) for name, path in p.shipped]

    def make_dirs(self, remote, p: ExtractPaths) -> None:
        remote.run(["mkdir", "-p", p.workdir, str(PurePosixPath(p.log).parent)])

    def upload(self, remote, p: ExtractPaths) -> None:
        for data, path in self.files(p):
            upload_if_changed(remote, data, path, 0o755)

    def probe_done(self, remote, host) -> tuple[bool, set[str]]:
        """Ship the client if changed; (is a client running, every key done on this host)."""
        running, keys, _sec = self.probe_done_with(remote, host)
        return running, keys

    def probe_done_with(self, remote, host, *more) -> tuple[bool, set[str], dict]:
        """`probe_done` with `more` probes in the same round trip: (running, done keys, the answers)."""
        p = self.paths(host)
        self.make_dirs(remote, p)
        self.upload(remote, p)
        alive, keys = ExtractAlive(p), DoneKeys(p)
        sec = batch.run(remote, [alive, keys, *more], check=True)
        return alive.read(sec), keys.read(sec), sec

    def look(self, remote, host) -> tuple[bool, set[str], bool]:
        """What `probe_done` would find, changing nothing (--dry-run): (running, done keys, every
        shipped file current)."""
        p = self.paths(host)
        alive, keys, shas = ExtractAlive(p), DoneKeys(p), self.file_shas(p)
        sec = batch.run(remote, [alive, keys, *shas])
        return alive.read(sec), keys.read(sec), self.current(p, shas, sec)

    def file_shas(self, p: ExtractPaths) -> list[FileSha]:
        return [FileSha(path, f"shipped{i}") for i, (_name, path) in enumerate(p.shipped)]

    def current(self, p: ExtractPaths, shas: list[FileSha], sec) -> bool:
        """Does the host hold every shipped file as it is here (`file_shas`, read from `sec`)?"""
        return all(probe.read(sec) == sha256(data) for probe, (data, _path) in zip(shas, self.files(p)))

    def preflight(self, remote, host, p: ExtractPaths, *more):
        """One round trip: the host's python3, is a client alive, and `more` probes; refused (exit 9)
        without a usable python3.  Returns (the answers, alive)."""
        python, alive = HostPython(), ExtractAlive(p)
        sec = batch.run(remote, [python, alive, *more])
        refuse_without_python(host, python.read(sec))
        return sec, alive.read(sec)

    def launch(
        self,
        remote,
        host,
        p: ExtractPaths,
        running: bool,
        place: Callable[[], str],
        command: Callable[[str], str],
        wait_s,
    ) -> ExtractStatus:
        """After the preflight: refuse while a client runs (exit 9), ship the client's files and its
        dataset (`place`: the dataset's path on the host), run `command(dataset)` and wait (bounded)
        for its `started` line."""
        self.make_dirs(remote, p)
        if running:
            raise Refused(
                f"{self.a_name} is already running on this host", host=host.name, hint=self.busy.format(host=host.name)
            )
        self.upload(remote, p)
        dataset = place()
        before = _log_size(remote, p)
        remote.run(command(dataset))
        self.await_started(remote, host, p, before, wait_s)
        return self.status(remote, host)

    def await_started(self, remote, host, p: ExtractPaths, log_offset: int, wait_s: float) -> None:
        """Wait (bounded) for the client's `started` line; a client that died shows its output."""
        deadline = time.monotonic() + wait_s
        log, alive, out = ClientLogSince(p, log_offset), ExtractAlive(p), ClientOutput(p)
        while time.monotonic() < deadline:
            sec = batch.run(remote, [log, alive, out])
            if " started " in log.read(sec):
                return
            if not alive.read(sec) and time.monotonic() > deadline - wait_s + 2:
                client_out = out.read(sec)
                _raise_dataset_error(host, client_out)
                raise Refused(
                    f"the {self.name} exited at start",
                    host=host.name,
                    details={"client_out": client_out},
                    hint=client_out[-300:] or None,
                )
            time.sleep(0.3)
        raise CommandTimedOut(
            f"{self.name} did not log `started` within {wait_s:g}s",
            host=host.name,
            command=self.start_command,
            timeout=wait_s,
        )

    def status(self, remote, host, wait_s: float = 0.0) -> ExtractStatus:
        """One round trip: is the client alive, the log's tail, manifest and missing counts (after
        waiting up to `wait_s` on the host for a running client to exit)."""
        asked = ExtractStatusProbes(self.paths(host), wait_s=wait_s)
        return asked.read(host.name, batch.run(remote, asked.probes, check=True))

    def status_with_keys(self, remote, host, wait_s: float = 0.0) -> tuple[ExtractStatus, set[str]]:
        """`status` plus every done key, in the same round trip."""
        asked = ExtractStatusProbes(self.paths(host), with_keys=True, wait_s=wait_s)
        sec = batch.run(remote, asked.probes, check=True)
        return asked.read(host.name, sec), asked.keys.read(sec) if asked.keys else set()

    def wait_finished(self, remote, host, timeout_s: float, on_status=None, interval_s: float = 2.0) -> ExtractStatus:
        """Poll (one round trip each) until the client has exited; CommandTimedOut at the deadline."""
        deadline = time.monotonic() + timeout_s
        wait_s = 0.0  # the first status at once; then each one waits on the host for the exit
        while True:
            st = self.status(remote, host, wait_s)
            if on_status:
                on_status(st)
            if not st.running:
                return st
            if time.monotonic() + interval_s > deadline:
                run, command, follow = self.what
                raise CommandTimedOut(
                    f"{run} still running after {timeout_s:g}s (it goes on; `{follow}` follows it)",
                    host=host.name,
                    command=command,
                    timeout=timeout_s,
                )
            wait_s = interval_s

    def stop(self, remote, host, wait_s: float = 60.0) -> ExtractStatus:
        """SIGTERM the client by its recorded PID (it finishes in-flight requests), KILL at the deadline."""
        p = self.paths(host)
        alive = ExtractAlive(p)
        if not batch.ask(remote, alive):
            return self.status(remote, host)
        pidfile = shell.quote(p.file("client.pid"))
        remote.run(f"kill -TERM $(cat {pidfile})", check=False)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not batch.ask(remote, alive):
                return self.status(remote, host)
            time.sleep(0.3)
        remote.run(f"{alive.command()} && kill -KILL $(cat {pidfile})", check=False)
        return self.status(remote, host)


def url_for(host, given: str | None) -> str:
    """The URL a client asks: `given`, else the server's published port on the host's loopback."""
    return given or f"http://127.0.0.1:{host.server.port}"


def _log_size(remote, p: ExtractPaths) -> int:
    out = remote.run(f"stat -c %s {shell.quote(p.log)} 2>/dev/null || echo 0", check=False).stdout.strip()
    return int(out) if out.isdigit() else 0


def _raise_dataset_error(host, client_out: str) -> None:
    """The client's `dataset error: FILE:LINE: reason` (a dataset on the host) as a ConfigError, exit 3."""
    said = [line for line in client_out.splitlines() if line.startswith(DATASET_ERROR)]
    if said:
        err = ConfigError(
            said[-1][len(DATASET_ERROR) :],
            hint="the dataset on the host has a bad line (rules: remote-ops extract --help)",
        )
        err.host = host.name
        raise err
