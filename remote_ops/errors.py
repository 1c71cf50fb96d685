"""Typed errors, each carrying its data and a stable exit code.

Every expected failure in remote-ops is one of these.  They are raised deep
inside (the SSH seam, the anchor finder, the inventory loader) and rendered
exactly once, at the CLI boundary (`remote_ops.cli.main`), which maps them to the
exit codes documented in docs/exit-codes.md.  Unexpected exceptions are bugs and exit
with code 1 and a traceback.

The exit codes are API: scripts and CI jobs branch on them.  Never renumber.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


class ExitCode:
    """The documented exit codes (docs/exit-codes.md)."""

    OK = 0
    INTERNAL = 1  # a bug in remote-ops: traceback printed
    USAGE = 2  # bad option or argument (click's own code)
    CONFIG = 3  # inventory / ssh_config / template variables invalid
    UNREACHABLE = 4  # DNS, refused, no route, connect timeout, host down
    AUTH = 5  # authentication failed
    HOST_KEY = 6  # host key unknown or changed
    COMMAND_FAILED = 7  # a remote command exited non-zero
    TIMEOUT = 8  # a command or wait ran past its deadline
    REFUSED = 9  # a pre-check refused to act (anchor, version gate, lock held)
    VERIFY_FAILED = 10  # post-check failed (patch misplaced, image mismatch, corrupt dump)
    HEALTH_WARN = 11  # health: worst result was "warn"
    HEALTH_FAIL = 12  # health: worst result was "fail"
    NOT_FOUND = 13  # a file, container, image or run that should exist does not
    NO_SPACE = 14  # local disk too small or full: free space (or --dest elsewhere), re-run resumes
    INDEX_UNREACHABLE = 15  # the package index (REMOTE_OPS_INDEX_URL) cannot be read, nothing cached
    HANGUP = 129  # SIGHUP (terminal closed)
    INTERRUPTED = 130  # SIGINT (Ctrl-C)
    TERMINATED = 143  # SIGTERM (`timeout`, CI cancel, `kill`)


def tail(text: str | bytes | None, lines: int = 20) -> str:
    """Return the last `lines` lines of `text` (decoded leniently)."""
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


@dataclass(eq=False)
class RemoteOpsError(Exception):
    """Base of every expected failure.  `message` is one human sentence."""

    message: str
    host: str | None = None
    hint: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    exit_code: ClassVar[int] = ExitCode.INTERNAL
    kind: ClassVar[str] = "error"

    def __init_subclass__(cls, *, exit_code: int | None = None, kind: str | None = None, **kwargs: Any) -> None:
        """`class NoSpace(RemoteOpsError, exit_code=ExitCode.NO_SPACE, kind="no_space")`: a subclass
        names its exit code and kind in its header (else it keeps its base's)."""
        super().__init_subclass__(**kwargs)
        if exit_code is not None:
            cls.exit_code = exit_code
        if kind is not None:
            cls.kind = kind

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        prefix = f"{self.host}: " if self.host else ""
        return prefix + self.message

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view for `--json` output."""
        return {
            "error": self.kind,
            "exit_code": self.exit_code,
            "message": self.message,
            "host": self.host,
            "hint": self.hint,
            **self.details,
        }


class ConfigError(RemoteOpsError, exit_code=ExitCode.CONFIG, kind="config"):
    """Inventory, ssh_config, patch spec or template input is invalid.

    `source` names the file and `field` the offending key, so the message can
    say exactly where to look."""

    def __init__(
        self, message: str, *, source: str | None = None, field: str | None = None, hint: str | None = None
    ) -> None:
        where = ":".join(x for x in (source, field) if x)
        super().__init__(
            f"{where}: {message}" if where else message, hint=hint, details={"source": source, "field": field}
        )


class UsageError(RemoteOpsError, exit_code=ExitCode.USAGE, kind="usage"):
    """Bad input given on the command line (range, pattern, option combination)."""


class ConnectError(RemoteOpsError):
    """Base of the errors raised while opening the SSH connection."""


class Unreachable(ConnectError, exit_code=ExitCode.UNREACHABLE, kind="unreachable"):
    """The host could not be reached: DNS, refused, no route, connect timeout."""


class AuthFailed(ConnectError, exit_code=ExitCode.AUTH, kind="auth_failed"):
    pass


class HostKeyError(ConnectError, exit_code=ExitCode.HOST_KEY):
    """Base for host-key refusals; `fingerprint` is the key the server offered."""


class HostKeyUnknown(HostKeyError, kind="host_key_unknown"):
    pass


class HostKeyChanged(HostKeyError, kind="host_key_changed"):
    pass


@dataclass(eq=False)
class CommandFailed(RemoteOpsError, exit_code=ExitCode.COMMAND_FAILED, kind="command_failed"):
    """A remote command exited non-zero.  Carries the command, code and stderr tail."""

    command: str = ""
    exit_status: int | None = None
    stderr_tail: str = ""
    stdout_tail: str = ""

    @classmethod
    def of(cls, message: str, result: Any, host: str | None) -> CommandFailed:
        """The error for a finished command's `result` (a `RunResult`): its command line, exit
        status and the last 2,000 characters of its stderr."""
        return cls(
            message,
            host=host,
            command=result.command,
            exit_status=result.exit_status,
            stderr_tail=result.stderr[-2000:],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "command": self.command,
            "exit_status": self.exit_status,
            "stderr_tail": self.stderr_tail,
        }


@dataclass(eq=False)
class CommandTimedOut(RemoteOpsError, exit_code=ExitCode.TIMEOUT, kind="timeout"):
    """A command (or a wait loop) ran past its deadline."""

    command: str = ""
    timeout: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "command": self.command, "timeout": self.timeout}


class Refused(RemoteOpsError, exit_code=ExitCode.REFUSED, kind="refused"):
    """A pre-check refused to act; nothing was changed.  `reason` is a short code."""


class ContractMismatch(Refused, kind="contract_mismatch"):
    """A drafter or an export does not fit the dumps' capture contract (layer ids under the serving
    SGLang release's numbering, hidden size, pre-norm finals); nothing was changed.  Exit 9."""


class UnsafeHostFile(Refused, kind="unsafe_host_file"):
    """A small host file the tool reads (a config, a manifest, a record) is not a regular file
    (a FIFO, a device, a symlink to one) or is larger than its cap; nothing was read past the
    check.  `reason` is `not_regular` or `too_large`; `path` and `cap` name them.  Exit 9."""


class StaleMount(Refused, kind="stale_mount"):
    """The host's server container still mounts a dump dir that was removed and made again since it
    started (`probes.dumpdir.mount_of`): what it dumps goes into the deleted directory and never
    reaches the host, so a client is not started against it.  `details`: `reason`
    (`dump_dir_replaced`), `dump_dir`, `container`, `recorded` (the `device:inode` in its
    `dump-dir.id` label; None: not recorded) and `now` (the dir's).  Exit 9; `remote-ops deploy`
    recreates the container."""


class VerifyFailed(RemoteOpsError, exit_code=ExitCode.VERIFY_FAILED, kind="verify_failed"):
    """A post-check found the result wrong (patch misplaced, image mismatch, bad dump)."""


class PreflightFailed(VerifyFailed, kind="preflight_failed"):
    """`spec preflight`: the engine accepted too little of the overfit drafter's drafts on its own
    samples, or could not judge them (the SGLang stand-in).  Exit 10; the verdict in `details`."""


class NotFound(RemoteOpsError, exit_code=ExitCode.NOT_FOUND, kind="not_found"):
    pass


class NoSpace(RemoteOpsError, exit_code=ExitCode.NO_SPACE, kind="no_space"):
    """A local filesystem has (or had) too little free space; details carry needed/free bytes and the path."""


class IndexUnreachable(RemoteOpsError, exit_code=ExitCode.INDEX_UNREACHABLE, kind="index_unreachable"):
    """The package index (PyPI, or `$REMOTE_OPS_INDEX_URL`) could not be read or downloaded
    from, and nothing local could stand in (no matching checkout, no cached wheel).  Details
    carry the index URL and the environment variable that moves it."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived (see `remote_ops.signals`); exit 128 + signal number.

    A BaseException like KeyboardInterrupt, so no `except RemoteOpsError` swallows
    it; `finally` blocks (lock release, run record) still run."""

    def __init__(self, signum: int = 2) -> None:
        import signal

        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def to_dict(self) -> dict[str, Any]:
        return {"error": "interrupted", "exit_code": self.exit_code, "signal": self.signal_name, "message": str(self)}
