"""Log pulls: fetch the new bytes of a host's logs into its local run directory.

The pure half is `remote_ops.core.logparse` (log parsing, cursors) and the
file fetch probe `remote_ops.probes.logs` (command and parser); here are the server log's and the follow's command
lines (the host's engine gives its `logs` part: `engine.cli_for`), the local
copies, the saved cursors (`PullState`) and the round trips (`pull_logs`,
`follow`).

No local name comes from the host: a pulled log is `<local dir>/<kind>.log`
(kinds are `logparse.KINDS`), whatever the host's file is called, and rotated
copies add the saved generation number (`<kind>.log.<n>`).  The name still goes
through `remote_ops.core.hostpaths.local_path`, like every local path a pull
writes, so a future kind cannot escape the local dir either.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core import hostpaths, shell
from ..core.logparse import (
    FileCursor,
    ServerCursor,
    log_sources,
    new_server_lines,
    reset_needed,
    split_server_fetch,
)
from ..engine import DEFAULT_KIND, cli_for
from ..errors import CommandTimedOut
from ..probes import batch
from ..probes.logs import HEAD_BYTES, FileChunk, FileFetch

# --------------------------------------------------------------------------- command lines (pure)


def server_fetch_command(container: str, cursor: ServerCursor, since: str | None, kind: str = DEFAULT_KIND) -> str:
    """Container id, then its log lines with the engine's timestamps from the last timestamp we
    hold (or `since`): `new_server_lines` reads them."""
    return cli_for(kind).logs_since_command(container, since or cursor.last_ts or "0")


def follow_command(host, kinds: tuple[str, ...], since: str | None, lines: int = 20, duration: float = 3600.0) -> str:
    """One remote command streaming every chosen log, each line tagged `<kind>|`.

    The whole thing runs under `timeout` on the host too: when the local
    deadline closes the channel, nothing (no `tail -F`, no engine `logs -f`)
    is left running there.
    """
    parts = []
    for kind, source in log_sources(host, kinds).items():
        if kind == "server":
            src = f"{cli_for(host).logs_follow_command(source, since, lines)} 2>&1"
        else:
            src = f"tail -n {int(lines)} -F {shell.quote(source)} 2>/dev/null"
        parts.append(f"{src} | sed -u 's/^/{kind}|/'")
    script = " & ".join(parts) + " & wait"
    return shell.join(["timeout", "-k", "2", f"{max(duration, 1):g}", "sh", "-c", script])


# --------------------------------------------------------------------------- incremental pull: plan


@dataclass
class PullState:
    """Per-host pull cursors, saved as JSON beside the pulled logs."""

    files: dict[str, FileCursor] = field(default_factory=dict)
    server: ServerCursor = field(default_factory=ServerCursor)

    @classmethod
    def load(cls, path: Path) -> "PullState":
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
        except ValueError:
            return cls()  # a torn state file: start over (re-fetch, never skip)
        return cls(
            files={k: FileCursor(**v) for k, v in data.get("files", {}).items()},
            server=ServerCursor(**data.get("server", {})),
        )

    def save(self, path: Path) -> None:
        """Write atomically: the state never claims bytes the local file does not hold."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)


def apply_chunk(local: Path, cursor: FileCursor, chunk: FileChunk) -> tuple[FileCursor, str | None]:
    """Append a fetched chunk to the local copy; on rotation keep the old copy as `<name>.<gen>`.

    Returns the new cursor and the reset reason (None when the pull simply continued).
    The cursor is only advanced after the bytes are on disk (caller saves it last),
    so an interrupted pull re-fetches at most one chunk and never skips bytes.
    """
    reason = (
        (reset_needed(cursor, chunk.inode, chunk.size) or "rewritten") if chunk.start == 0 and cursor.offset else None
    )
    gen = cursor.generation
    if reason:
        gen += 1
        if local.exists():
            local.replace(local.with_name(f"{local.name}.{gen}"))
    local.parent.mkdir(parents=True, exist_ok=True)
    with open(local, "r+b" if local.exists() else "wb") as fh:
        fh.truncate(chunk.start)  # drop bytes a crash wrote after the last saved cursor
        fh.seek(chunk.start)
        fh.write(chunk.data)
    offset = chunk.start + len(chunk.data)
    return FileCursor(chunk.inode, offset, gen, _head_digest(local, offset)), reason


def _head_digest(local: Path, offset: int) -> str:
    """sha256 of the first min(offset, HEAD_BYTES) bytes of our copy (what the host compares)."""
    import hashlib

    with open(local, "rb") as fh:
        return hashlib.sha256(fh.read(min(offset, HEAD_BYTES))).hexdigest()


# --------------------------------------------------------------------------- pull (edge)


@dataclass
class PulledLog:
    """What one pull did for one log."""

    kind: str
    remote: str
    local: str
    new_bytes: int = 0
    total_bytes: int = 0
    reset: str | None = None
    missing: bool = False


def local_copy(local_dir: Path, kind: str) -> Path:
    """The local copy of a log: `<local dir>/<kind>.log`, never a name the host chose."""
    return hostpaths.local_path(local_dir, f"{kind}.log")


def local_log_dir(host_name: str) -> Path:
    from ..paths import host_dir

    return host_dir(host_name) / "logs"


def pull_file(
    remote, kind: str, path: str, local_dir: Path, state: PullState, state_path: Path, max_bytes: int = 64 << 20
) -> PulledLog:
    """Fetch the new bytes of one remote log file, chunk by chunk, saving the cursor after each."""
    local = local_copy(local_dir, kind)
    result = PulledLog(kind, path, str(local))
    while True:
        cursor = state.files.get(kind, FileCursor())
        chunk = batch.ask(remote, FileFetch(path, cursor, max_bytes), check=True)
        if chunk is None:
            result.missing = True
            return result
        state.files[kind], reason = apply_chunk(local, cursor, chunk)
        state.save(state_path)
        result.new_bytes += len(chunk.data)
        result.reset = result.reset or reason
        if state.files[kind].offset >= chunk.size or not chunk.data:
            result.total_bytes = state.files[kind].offset
            return result


def pull_server(
    remote,
    container: str,
    local_dir: Path,
    state: PullState,
    state_path: Path,
    since: str | None = None,
    kind: str = DEFAULT_KIND,
) -> PulledLog:
    """Append the container's new log lines (with the engine's timestamps) to `server.log`."""
    local = local_copy(local_dir, "server")
    result = PulledLog("server", cli_for(kind).logs_hint(container), str(local))
    run = remote.run(server_fetch_command(container, state.server, since, kind), check=False)
    if run.exit_status == 3 or not run.stdout.strip():
        result.missing = True
        return result
    cid, lines = split_server_fetch(run.stdout)
    fresh, cursor = new_server_lines(state.server, cid, lines, since)
    if cursor.generation != state.server.generation and local.exists():
        local.replace(local.with_name(f"server.log.{cursor.generation}"))
        result.reset = "new container"
    data = "".join(l + "\n" for l in fresh).encode()
    local.parent.mkdir(parents=True, exist_ok=True)
    with open(local, "ab") as fh:
        fh.write(data)
    state.server = cursor
    state.save(state_path)
    result.new_bytes, result.total_bytes = len(data), local.stat().st_size
    return result


def pull_logs(
    remote, host, kinds: tuple[str, ...], local_dir: Path | None = None, since: str | None = None
) -> list[PulledLog]:
    """Pull the given kinds of log of `host` into its local run directory, incrementally."""
    local_dir = local_dir or local_log_dir(host.name)
    local_dir.mkdir(parents=True, exist_ok=True)
    state_path = local_dir / ".pull-state.json"
    state = PullState.load(state_path)
    results = []
    for kind, source in log_sources(host, kinds).items():
        if kind == "server":
            results.append(pull_server(remote, source, local_dir, state, state_path, since, host.engine))
        else:
            results.append(pull_file(remote, kind, source, local_dir, state, state_path))
    return results


def follow(remote, host, kinds: tuple[str, ...], since, lines, duration: float, on_line) -> bool:
    """Stream `host`'s logs of `kinds` to `on_line(stream, line)` for `duration` seconds; False
    when the stream was still open at its deadline (the usual end), True when it ended first."""
    try:
        remote.run(
            follow_command(host, kinds, since, lines, duration), timeout=duration + 5, on_line=on_line, check=False
        )
    except CommandTimedOut:
        return False
    return True
