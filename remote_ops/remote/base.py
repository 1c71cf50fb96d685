"""The run protocol every `Remote` shares: deadline, streaming, typed errors, one hook.

`Remote` is the interface the rest of remote-ops talks to (run / put / get /
close).  `BaseRemote` implements `run` once: it normalises the command
(`remote_ops.core.shell.cmd`), applies the deadline (the target's command timeout
unless the call names its own), counts the round trip, reports it to
`on_command`, and turns the outcome into a `RunResult` or a typed error
(`CommandTimedOut` exit 8, `CommandFailed` exit 7 with stderr/stdout tails).
Subclasses only say how to execute one command line (`_execute`) and how to
move files (`put` / `get`): `FabricRemote` over SSH, `LocalRemote` with
/bin/sh on this machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from ..core import shell
from ..errors import CommandFailed, CommandTimedOut, tail

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Called with (stream, line) for each output line while a command runs; stream is "stdout"/"stderr".
LineSink = Callable[[str, str], None]
#: Called after every command with (command line, seconds, exit status or None when it got none).
CommandHook = Callable[[str, float, "int | None"], None]
DEFAULT_COMMAND_S = 120.0


@dataclass(frozen=True)
class RunResult:
    """What a finished remote command gave back."""

    command: str
    exit_status: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


class RunOptions(TypedDict, total=False):
    """The keyword options of `Remote.run` (`BaseRemote.run` spells them out with their defaults)."""

    timeout: float | None  # seconds; None: the run's command deadline (`command_deadline`)
    check: bool  # a non-zero exit raises CommandFailed (default True)
    input: bytes | None  # sent to the command's stdin
    on_line: LineSink | None  # called with each output line while the command runs


@runtime_checkable
class Remote(Protocol):
    """A connected host.  Commands are strings built by `remote_ops.core.shell` or argv lists."""

    name: str
    target: Any

    def run(self, command: str | shell.Argv, **options: Unpack[RunOptions]) -> RunResult: ...

    def put(self, local: str | Path | bytes, remote_path: str, *, mode: int | None = None) -> None: ...

    def get(self, remote_path: str, local: str | Path) -> None: ...

    @property
    def host_key_fingerprint(self) -> str: ...

    @property
    def round_trips(self) -> int: ...

    def close(self) -> None: ...


def command_deadline(remote: Any) -> float:
    """The run's per-command deadline in seconds (`--command-timeout`, else the target's default).

    The one number every remote call and every probe is bounded by unless a
    step has its own named deadline (build, wait for healthy)."""
    timeouts = getattr(getattr(remote, "target", None), "timeouts", None)
    return float(getattr(timeouts, "command", getattr(remote, "timeout", DEFAULT_COMMAND_S)))


class BaseRemote:
    """`run` for every Remote; subclasses implement `_execute`, `put`, `get`.

    `on_command`, when set, is called after each command with (command line,
    round-trip seconds, exit status; None on a timeout or a lost connection),
    e.g. by the CLI's `-v`.  It sees the command as sent: mask secrets there.
    """

    name: str = "remote"
    target: Any = None

    def __init__(self) -> None:
        self._round_trips = 0
        self.on_command: CommandHook | None = None

    def run(
        self,
        command: str | shell.Argv,
        *,
        timeout: float | None = None,
        check: bool = True,
        input: bytes | None = None,
        on_line: LineSink | None = None,
    ) -> RunResult:
        """Run one command; raise CommandFailed / CommandTimedOut (or the transport's Unreachable)."""
        line = shell.cmd(command)
        deadline_s = command_deadline(self) if timeout is None else timeout
        start, status = time.monotonic(), None
        try:
            status, out, err = self._execute(line, input, deadline_s, on_line)
        finally:
            self._report(line, time.monotonic() - start, status)
        if status is None:
            raise CommandTimedOut(
                f"command timed out after {deadline_s:g}s", host=self.name, command=line, timeout=deadline_s
            )
        result = RunResult(
            line, status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), time.monotonic() - start
        )
        if check and status != 0:
            raise CommandFailed(
                f"command exited {status}",
                host=self.name,
                command=line,
                exit_status=status,
                stderr_tail=tail(result.stderr),
                stdout_tail=tail(result.stdout, 5),
            )
        return result

    def _execute(
        self, line: str, input: bytes | None, deadline_s: float, on_line: LineSink | None
    ) -> tuple[int | None, bytes, bytes]:
        """Run `line` within `deadline_s`: (exit status, or None at the deadline; stdout; stderr)."""
        raise NotImplementedError

    def _report(self, line: str, seconds: float, status: int | None) -> None:
        if self.on_command is not None:
            self.on_command(line, seconds, status)

    def _count(self) -> None:
        """One more command or file transfer (the cost the benchmarks report)."""
        self._round_trips += 1

    @property
    def round_trips(self) -> int:
        """Commands and file transfers issued so far."""
        return self._round_trips

    @property
    def host_key_fingerprint(self) -> str:
        return ""

    def close(self) -> None:
        pass

    def __enter__(self) -> "BaseRemote":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
