"""The extraction run: start, watch and stop `extract_onhost.py` on a host.

The client (stdlib-only, `remote_ops/onhost/extract_onhost.py`) runs beside the
container with the host's `python3` and talks to the server's published port
(`127.0.0.1:<server.port>`).  Everything it needs lives in one work dir on the
host, `<logs.dir>/extract/`: the client script, the dataset, its manifest
(sample id -> dump key, per dataset), `run.json` + `dataset.keys` (the current
dataset), `missing.jsonl`, `client.pid`, `client.out`.  Done-ness is decided by
the dump key (the content), never by the sample id, and every count shown
relates to the current dataset.  Its
progress log is the inventory's `logs.extraction`, which `logs pull/summary`
read.

It is started detached in its own session (`setsid`), its PID recorded, and
stopped by that PID (after checking the PID still belongs to the client);
every wait here has a deadline.

The pure half is `remote_ops.core.extractplan` (work dir paths, the launch
command, a group's split and merged status) and the probe units of
`remote_ops.probes.extract` (alive, status, done keys: commands and parsers);
here are the round trips, the waits and the group's local record.

A local dataset is checked here (`check_dataset`, the rules of
`remote_ops.core.datasetcheck`) before anything is uploaded: a bad line is a
ConfigError (exit 3) naming `FILE:LINE`, never the client's failure on the host.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path, PurePosixPath

from .. import onhost
from ..core import datasetcheck, dumpcheck, shell
from ..core.extractplan import CLIENT_NAME, ExtractPaths, ExtractStatus, Sample, launch_command, paths_for, shard_bytes
from ..errors import CommandTimedOut, ConfigError, NotFound, Refused
from ..probes import batch
from ..probes.dumpdir import DumpDir, DumpDirState
from ..probes.extract import (
    ClientLogSince,
    ClientOutput,
    DoneKeys,
    ExtractAlive,
    ExtractStatusProbes,
    FileSha,
)
from ..probes.system import HostPython, python_problem
from ..serving import serving_for


def client_source() -> bytes:
    return onhost.source(CLIENT_NAME)


def check_dataset(path: Path) -> None:
    """ConfigError (exit 3) naming `FILE:LINE` and why, for the first bad line of a local dataset.

    Read line by line (bytes), so a non-UTF-8 line is named, not a decode error;
    nothing is sent anywhere.  The hint lists the next bad lines, if any."""
    try:
        with open(path, "rb") as fh:
            problems = datasetcheck.check_lines(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read the dataset: {exc.strerror or exc}", source=str(path)) from None
    if problems:
        first, more = problems[0], problems[1:]
        rest = f"; more bad lines: {', '.join(str(p.line) for p in more)}" if more else ""
        raise ConfigError(
            first.reason,
            source=f"{path}:{first.line}",
            hint='each line one JSON object: {"id": ..., "input_ids": [token ids]}' + rest,
        )


def dump_bytes_per_token(host) -> int:
    """The client's first guess at a dump's size per token (final + 3 aux hidden states, ids, positions)."""
    return dumpcheck.float_bytes_per_token(host.model.hidden_size) + 8


# --------------------------------------------------------------------------- edges


def status(remote, host, wait_s: float = 0.0, paths: ExtractPaths | None = None) -> ExtractStatus:
    """One round trip: is the client alive, the log's tail, manifest and missing counts (after
    waiting up to `wait_s` on the host for a running client to exit).  `paths`: another client's
    work dir of the same layout (regenerate's), default the extraction's."""
    asked = ExtractStatusProbes(paths or paths_for(host), wait_s=wait_s)
    return asked.read(host.name, batch.run(remote, asked.probes, check=True))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload_if_changed(remote, data: bytes, path: str, mode: int = 0o644) -> bool:
    """Upload unless the host already has the same bytes (checked by sha256, one round trip)."""
    have = remote.run(shell.quiet(shell.sha256_of(path)), check=False).stdout.strip()
    if have == _sha256(data):
        return False
    remote.put(data, path, mode=mode)
    return True


def start(
    remote,
    host,
    dataset: str,
    *,
    concurrency: int = 8,
    retries: int = 5,
    server_url: str | None = None,
    limit: int | None = None,
    wait_s: float = 30.0,
    local_dataset: bool | None = None,
    dump_grace: float = 30.0,
    dataset_checked: bool = False,
) -> ExtractStatus:
    """Check a local dataset (unless the caller did: `dataset_checked`), refuse without a usable
    python3 on the host (the client runs with it), without a dump dir the server can write
    (`_usable_dump_dir`: it is resolved here, once) or if a client is running, ship the client
    (+ that dataset), launch with the resolved dump dir, await `started`."""
    p = paths_for(host)
    local = Path(dataset).expanduser()
    if not dataset_checked and (local_dataset is True or (local_dataset is None and local.is_file())):
        check_dataset(local)
    alive, python, dump_dir = ExtractAlive(p), HostPython(), DumpDirState(p.dump_dir)
    sec = batch.run(remote, [python, alive, dump_dir])
    _refuse_without_python(host, python.read(sec))
    p = replace(p, dump_dir=_usable_dump_dir(host, dump_dir.read(sec)))
    remote.run(["mkdir", "-p", p.workdir, str(PurePosixPath(p.log).parent)])
    if alive.read(sec):
        raise Refused(
            "an extraction client is already running on this host",
            host=host.name,
            hint=f"remote-ops extract status --host {host.name}  (or extract stop)",
        )
    upload_if_changed(remote, client_source(), p.client, 0o755)
    remote_dataset = _place_dataset(remote, p, dataset, local_dataset)
    url = server_url or f"http://127.0.0.1:{host.server.port}"
    before = _log_size(remote, p)
    remote.run(
        launch_command(
            p,
            url,
            concurrency,
            retries,
            remote_dataset,
            limit,
            dump_grace,
            dump_bytes_per_token(host),
            serving_for(host).client_args(host),
        )
    )
    _await_started(remote, host, p, before, wait_s)
    return status(remote, host)


def _usable_dump_dir(host, state: DumpDir) -> str:
    """Preflight: the dump dir the server writes into, resolved once on the host (a symlink: its
    target, which the client is given and every count names); missing, not a directory or not
    writable is exit 9 naming the path (`details.reason`: `probes.dumpdir`'s cause)."""
    problem = state.problem()
    if problem:
        cause, sentence = problem
        raise Refused(
            f"preflight: {sentence}: the server cannot write its dumps there; nothing started",
            host=host.name,
            details={"reason": cause, "dump_dir": state.configured, "resolved": state.resolved},
            hint=f"make it (mkdir -p {shell.quote(state.configured)}), then restart the server "
            f"(`remote-ops container restart --host {host.name}`): a server started before its dump dir "
            "was removed keeps writing into the removed one",
        )
    return state.path


def _refuse_without_python(host, found: tuple[tuple[int, ...] | None, str | None]) -> None:
    """Preflight: the client runs with the host's python3 (3.8+); missing or older is exit 9,
    naming what needs it (`probes.system.python_problem`)."""
    problem = python_problem(*found)
    if problem:
        raise Refused(
            f"preflight: {problem}",
            host=host.name,
            hint="install python3 (3.8 or newer) on the host, on the SSH session's PATH",
        )


def _place_dataset(remote, p: ExtractPaths, dataset: str, local: bool | None) -> str:
    """A local dataset file is uploaded into the work dir; otherwise it must exist on the host."""
    path = Path(dataset).expanduser()
    if local is True or (local is None and path.is_file()):
        upload_if_changed(remote, path.read_bytes(), p.dataset)
        return p.dataset
    if remote.run(["test", "-f", dataset], check=False).exit_status != 0:
        raise NotFound(f"dataset {dataset} is neither a local file nor a file on the host", host=remote.name)
    return dataset


def _log_size(remote, p: ExtractPaths) -> int:
    out = remote.run(f"stat -c %s {shell.quote(p.log)} 2>/dev/null || echo 0", check=False).stdout.strip()
    return int(out) if out.isdigit() else 0


def _await_started(
    remote,
    host,
    p: ExtractPaths,
    log_offset: int,
    wait_s: float,
    what: str = "extraction client",
    command: str = "extract start",
) -> None:
    """Wait (bounded) for the client's `started` line; a client that died shows its output.
    `what` / `command`: the client and the command that starts it, in the errors' words."""
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
                f"the {what} exited at start",
                host=host.name,
                details={"client_out": client_out},
                hint=client_out[-300:] or None,
            )
        time.sleep(0.3)
    raise CommandTimedOut(
        f"{what} did not log `started` within {wait_s:g}s",
        host=host.name,
        command=command,
        timeout=wait_s,
    )


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


DATASET_ERROR = "dataset error: "  # how extract_onhost.py names a bad dataset line on stderr


def plan_start(
    remote,
    host,
    dataset: str,
    *,
    concurrency: int = 8,
    retries: int = 5,
    server_url: str | None = None,
    limit: int | None = None,
    dump_grace: float = 30.0,
    dataset_checked: bool = False,
    local_dataset: bool | None = None,
) -> dict:
    """What `start` would do, read in one round trip, changing nothing (for --dry-run / --diff).
    A bad local dataset, or no usable python3 on the host, is refused as `start` refuses it.
    `local_dataset` as `start`'s (None: a local file when there is one)."""
    p = paths_for(host)
    local = Path(dataset).expanduser()
    is_local = local.is_file() if local_dataset is None else local_dataset
    if not dataset_checked and is_local:
        check_dataset(local)
    remote_dataset = p.dataset if is_local else dataset
    alive, client, on_host = ExtractAlive(p), FileSha(p.client, "client"), FileSha(remote_dataset, "dataset")
    python, dump_dir = HostPython(), DumpDirState(p.dump_dir)
    sec = batch.run(remote, [alive, client, on_host, python, dump_dir])
    _refuse_without_python(host, python.read(sec))
    p = replace(p, dump_dir=_usable_dump_dir(host, dump_dir.read(sec)))
    url = server_url or f"http://127.0.0.1:{host.server.port}"
    return {
        "dump_dir": p.dump_dir,
        "already_running": alive.read(sec),
        "upload_client": client.read(sec) != _sha256(client_source()),
        "upload_dataset": is_local and on_host.read(sec) != _sha256(local.read_bytes()),
        "dataset_on_host": remote_dataset,
        "command": launch_command(
            p,
            url,
            concurrency,
            retries,
            remote_dataset,
            limit,
            dump_grace,
            dump_bytes_per_token(host),
            serving_for(host).client_args(host),
        ),
    }


def wait_finished(
    remote,
    host,
    timeout_s: float,
    on_status=None,
    interval_s: float = 2.0,
    paths: ExtractPaths | None = None,
    what: tuple[str, str, str] = ("extraction", "extract start --wait", "extract status"),
) -> ExtractStatus:
    """Poll (one round trip each) until the client has exited; CommandTimedOut at the deadline.
    `paths` / `what`: another client of the same layout, and (the run, the command that waits,
    the command that follows it) in the timeout's words."""
    deadline = time.monotonic() + timeout_s
    wait_s = 0.0  # the first status at once; then each one waits on the host for the exit
    while True:
        st = status(remote, host, wait_s, paths)
        if on_status:
            on_status(st)
        if not st.running:
            return st
        if time.monotonic() + interval_s > deadline:
            run, command, follow = what
            raise CommandTimedOut(
                f"{run} still running after {timeout_s:g}s (it goes on; `{follow}` follows it)",
                host=host.name,
                command=command,
                timeout=timeout_s,
            )
        wait_s = interval_s


def stop(remote, host, wait_s: float = 60.0, paths: ExtractPaths | None = None) -> ExtractStatus:
    """SIGTERM the client by its recorded PID (it finishes in-flight requests), KILL at the deadline.
    `paths`: another client of the same layout (regenerate's)."""
    p = paths or paths_for(host)
    alive = ExtractAlive(p)
    if not batch.ask(remote, alive):
        return status(remote, host, paths=p)
    pidfile = shell.quote(p.file("client.pid"))
    remote.run(f"kill -TERM $(cat {pidfile})", check=False)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not batch.ask(remote, alive):
            return status(remote, host, paths=p)
        time.sleep(0.3)
    remote.run(f"{alive.command()} && kill -KILL $(cat {pidfile})", check=False)
    return status(remote, host, paths=p)


# --------------------------------------------------------------------------- a group: the local record


def ledger_dir() -> Path:
    from ..paths import state_dir

    return state_dir() / "extract" / "fleet"


def load_ledger(dataset_id: str) -> dict | None:
    import json

    path = ledger_dir() / f"{dataset_id}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def latest_ledger(host_names: list[str]) -> dict | None:
    """The most recent group run that involved any of these hosts (for `extract status`)."""
    import json

    best = None
    for path in ledger_dir().glob("*.json") if ledger_dir().is_dir() else []:
        doc = json.loads(path.read_text())
        if set(doc.get("hosts", {})) & set(host_names) and (best is None or doc["updated"] > best["updated"]):
            best = doc
    return best


def record_seen(ledger: dict, keys: dict[str, set[str]], shards: dict[str, list[Sample]] | None = None) -> None:
    """Write what each reachable host has done (and its new shard) to the local record, atomically."""
    import json

    for name, ks in keys.items():
        rec = ledger["hosts"].setdefault(name, {})
        rec["done"] = sorted(ks)
        rec["seen"] = time.time()
        if shards is not None:
            rec["shard"] = len(shards.get(name, []))
    ledger["updated"] = time.time()
    ledger_dir().mkdir(parents=True, exist_ok=True)
    path = ledger_dir() / f"{ledger['dataset_id']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(ledger))
    path.with_suffix(".tmp").replace(path)


# --------------------------------------------------------------------------- a group: edges (one host each)


def probe_done(remote, host) -> tuple[bool, set[str]]:
    """Ship the client if changed; (is a client running, every key done on this host)."""
    p = paths_for(host)
    remote.run(["mkdir", "-p", p.workdir, str(PurePosixPath(p.log).parent)])
    upload_if_changed(remote, client_source(), p.client, 0o755)
    alive, keys = ExtractAlive(p), DoneKeys(p)
    sec = batch.run(remote, [alive, keys], check=True)
    return alive.read(sec), keys.read(sec)


def start_shard(remote, host, shard: list[Sample], **kwargs) -> ExtractStatus:
    """Put this host's shard file in its work dir and start its client on it."""
    p = paths_for(host)
    upload_if_changed(remote, shard_bytes(shard), p.file("shard.jsonl"))  # lines of a checked dataset
    return start(remote, host, p.file("shard.jsonl"), local_dataset=False, **kwargs)


def status_with_keys(
    remote, host, wait_s: float = 0.0, paths: ExtractPaths | None = None
) -> tuple[ExtractStatus, set[str]]:
    """`status` plus every done key, in the same round trip (`wait_s`, `paths`: as `status`)."""
    asked = ExtractStatusProbes(paths or paths_for(host), with_keys=True, wait_s=wait_s)
    sec = batch.run(remote, asked.probes, check=True)
    return asked.read(host.name, sec), asked.keys.read(sec) if asked.keys else set()
