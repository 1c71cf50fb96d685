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
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from .. import onhost
from ..core import shell
from ..core.logparse import ExtractionSummary, parse_extraction
from ..errors import CommandTimedOut, NotFound, Refused

CLIENT_NAME = "extract_onhost.py"


@dataclass(frozen=True)
class ExtractPaths:
    """Where the run lives on the host."""

    workdir: str
    log: str
    dump_dir: str

    @property
    def client(self) -> str:
        return str(PurePosixPath(self.workdir) / CLIENT_NAME)

    @property
    def dataset(self) -> str:
        return str(PurePosixPath(self.workdir) / "dataset.jsonl")

    def file(self, name: str) -> str:
        return str(PurePosixPath(self.workdir) / name)


def paths_for(host) -> ExtractPaths:
    return ExtractPaths(str(PurePosixPath(host.logs.dir) / "extract"), host.logs.extraction, host.dump.dir)


def client_source() -> bytes:
    return onhost.source(CLIENT_NAME)


# --------------------------------------------------------------------------- commands (pure)


def alive_check(p: ExtractPaths) -> str:
    """Shell test: the recorded PID is alive and still runs our client (not a reused PID)."""
    pidfile = shell.quote(p.file("client.pid"))
    return (
        f'pid=$(cat {pidfile} 2>/dev/null) && [ -n "$pid" ] && '
        f"tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -q {shell.quote(CLIENT_NAME)}"
    )


def launch_command(
    p: ExtractPaths,
    server_url: str,
    concurrency: int,
    retries: int,
    dataset: str,
    limit: int | None = None,
    dump_grace: float = 30.0,
) -> str:
    """Start the client detached in its own session; print its PID."""
    argv = [
        "python3",
        p.client,
        "--dataset",
        dataset,
        "--server",
        server_url,
        "--workdir",
        p.workdir,
        "--log",
        p.log,
        "--dump-dir",
        p.dump_dir,
        "--concurrency",
        str(concurrency),
        "--retries",
        str(retries),
        "--dump-grace",
        f"{dump_grace:g}",
    ]
    if limit:
        argv += ["--limit", str(limit)]
    out = shell.quote(p.file("client.out"))
    # `cd || exit; cmd &` - not `cd && cmd &`, which backgrounds a subshell holding the channel open
    return f"cd {shell.quote(p.workdir)} || exit 1; setsid nohup {shell.join(argv)} >> {out} 2>&1 < /dev/null & echo $!"


def status_command(p: ExtractPaths, log_lines: int = 400, with_keys: bool = False) -> str:
    """One round trip: alive, pid, log tail, counts, missing, client output (+ every done key)."""
    keys = [("keys", done_keys_command(p))] if with_keys else []
    return shell.sections(
        keys
        + [
            ("alive", alive_check(p)),
            ("pid", f"cat {shell.quote(p.file('client.pid'))}; echo"),
            ("log", f"tail -n {int(log_lines)} {shell.quote(p.log)}; echo"),
            ("counts", f"python3 {shell.quote(p.client)} count --workdir {shell.quote(p.workdir)}"),
            ("missing", f"cat {shell.quote(p.file('missing.jsonl'))}; echo"),
            ("out", f"tail -n 20 {shell.quote(p.file('client.out'))}"),
        ]
    )


def done_keys_command(p: ExtractPaths) -> str:
    """Every dump key with an `ok` line in the host's manifest, one a line (empty without a manifest)."""
    return f"python3 {shell.quote(p.client)} done-keys --workdir {shell.quote(p.workdir)}"


# --------------------------------------------------------------------------- status (pure parse)


@dataclass
class ExtractStatus:
    host: str
    running: bool
    pid: int | None
    summary: ExtractionSummary
    manifest_ok: int  # samples of the CURRENT dataset done (ok line for their dump key)
    missing: list[dict]
    client_out: str
    dataset_total: int = 0  # samples in the current dataset (after --limit)
    dataset_id: str | None = None  # sha256 of the dataset file, 16 hex
    reused_ids: int = 0  # ids done earlier with OTHER token ids: sent again (new dumps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = self.summary.to_dict()
        return d


def parse_status(host: str, output: str) -> ExtractStatus:
    import json

    parts = shell.split_sections(output)
    pid_text = parts.get("pid", (1, ""))[1].strip()
    missing = []
    for line in parts.get("missing", (1, ""))[1].splitlines():
        try:
            missing.append(json.loads(line))
        except ValueError:
            pass
    counts = _json_or_empty(parts.get("counts", (1, ""))[1])
    return ExtractStatus(
        host,
        parts.get("alive", (1, ""))[0] == 0,
        int(pid_text) if pid_text.isdigit() else None,
        parse_extraction(parts.get("log", (1, ""))[1]),
        int(counts.get("done") or 0),
        missing,
        parts.get("out", (1, ""))[1],
        int(counts.get("total") or 0),
        counts.get("dataset_id"),
        _reused_ids(parts.get("log", (1, ""))[1]),
    )


def _reused_ids(log_text: str) -> int:
    """`reused_ids=N` of the last `started` line (the current run), 0 if none."""
    started = [line for line in log_text.splitlines() if " started " in line]
    field = next((w for w in (started[-1].split() if started else []) if w.startswith("reused_ids=")), "")
    value = field.partition("=")[2]
    return int(value) if value.isdigit() else 0


def _json_or_empty(text: str) -> dict:
    import json

    try:
        doc = json.loads(text.strip() or "{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


# --------------------------------------------------------------------------- edges


def status(remote, host) -> ExtractStatus:
    """One round trip: is the client alive, the log's tail, manifest and missing counts."""
    return parse_status(host.name, remote.run(status_command(paths_for(host))).stdout)


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
) -> ExtractStatus:
    """Ship client (+ dataset when it is a local file), refuse if one is running, launch, await `started`."""
    p = paths_for(host)
    remote.run(["mkdir", "-p", p.workdir, str(PurePosixPath(p.log).parent)])
    if remote.run(alive_check(p), check=False).exit_status == 0:
        raise Refused(
            "an extraction client is already running on this host",
            host=host.name,
            hint=f"remote-ops extract status --host {host.name}  (or extract stop)",
        )
    upload_if_changed(remote, client_source(), p.client, 0o755)
    remote_dataset = _place_dataset(remote, p, dataset, local_dataset)
    url = server_url or f"http://127.0.0.1:{host.server.port}"
    before = _log_size(remote, p)
    remote.run(launch_command(p, url, concurrency, retries, remote_dataset, limit, dump_grace))
    _await_started(remote, host, p, before, wait_s)
    return status(remote, host)


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


def _await_started(remote, host, p: ExtractPaths, log_offset: int, wait_s: float) -> None:
    """Wait (bounded) for the client's `started` line; a client that died shows its output."""
    deadline = time.monotonic() + wait_s
    probe = shell.sections(
        [
            ("log", f"tail -c +{log_offset + 1} {shell.quote(p.log)}"),
            ("alive", alive_check(p)),
            ("out", f"tail -n 20 {shell.quote(p.file('client.out'))}"),
        ]
    )
    while time.monotonic() < deadline:
        parts = shell.split_sections(remote.run(probe, check=False).stdout)
        if " started " in parts.get("log", (1, ""))[1]:
            return
        if parts.get("alive", (1, ""))[0] != 0 and time.monotonic() > deadline - wait_s + 2:
            raise Refused(
                "the extraction client exited at start",
                host=host.name,
                details={"client_out": parts.get("out", (1, ""))[1]},
                hint=parts.get("out", (1, ""))[1][-300:] or None,
            )
        time.sleep(0.3)
    raise CommandTimedOut(
        f"extraction client did not log `started` within {wait_s:g}s",
        host=host.name,
        command="extract start",
        timeout=wait_s,
    )


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
) -> dict:
    """What `start` would do, read in one round trip, changing nothing (for --dry-run / --diff)."""
    p = paths_for(host)
    local = Path(dataset).expanduser()
    remote_dataset = p.dataset if local.is_file() else dataset
    probe = shell.sections(
        [("alive", alive_check(p)), ("client", shell.sha256_of(p.client)), ("dataset", shell.sha256_of(remote_dataset))]
    )
    sec = shell.split_sections(remote.run(probe, check=False).stdout)
    have = {k: sec.get(k, (1, ""))[1].strip() for k in ("client", "dataset")}
    url = server_url or f"http://127.0.0.1:{host.server.port}"
    return {
        "already_running": sec.get("alive", (1, ""))[0] == 0,
        "upload_client": have["client"] != _sha256(client_source()),
        "upload_dataset": local.is_file() and have["dataset"] != _sha256(local.read_bytes()),
        "dataset_on_host": remote_dataset,
        "command": launch_command(p, url, concurrency, retries, remote_dataset, limit, dump_grace),
    }


def wait_finished(remote, host, timeout_s: float, on_status=None, interval_s: float = 2.0) -> ExtractStatus:
    """Poll (one round trip each) until the client has exited; CommandTimedOut at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = status(remote, host)
        if on_status:
            on_status(st)
        if not st.running:
            return st
        if time.monotonic() + interval_s > deadline:
            raise CommandTimedOut(
                f"extraction still running after {timeout_s:g}s (it goes on; `extract status` follows it)",
                host=host.name,
                command="extract start --wait",
                timeout=timeout_s,
            )
        time.sleep(interval_s)


def stop(remote, host, wait_s: float = 60.0) -> ExtractStatus:
    """SIGTERM the client by its recorded PID (it finishes in-flight requests), KILL at the deadline."""
    p = paths_for(host)
    if remote.run(alive_check(p), check=False).exit_status != 0:
        return status(remote, host)
    pidfile = shell.quote(p.file("client.pid"))
    remote.run(f"kill -TERM $(cat {pidfile})", check=False)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if remote.run(alive_check(p), check=False).exit_status != 0:
            return status(remote, host)
        time.sleep(0.3)
    remote.run(f"{alive_check(p)} && kill -KILL $(cat {pidfile})", check=False)
    return status(remote, host)


# --------------------------------------------------------------------------- a group: sharded (pure)
#
# `extract start --host GROUP` splits the samples not yet dumped across the
# group's hosts.  Done-ness is the union, over the hosts, of the dump keys with
# an `ok` line in each host's manifest (content, not sample id), plus what a
# local record (`fleet_ledger`) last saw on hosts of an earlier split that are
# no longer selected (a dead host).  Each host gets its own shard file and runs
# its own client against its own server; no scheduler: the manifests decide.


@dataclass(frozen=True)
class Sample:
    """One dataset line: its id, dump key, token count and the line itself (sent as is)."""

    id: str
    key: str
    tokens: int
    line: str


def read_samples(path: Path, max_samples: int | None = None) -> list[Sample]:
    """The local dataset as `Sample`s (first `max_samples` only), with the client's key rule."""
    from ..onhost.extract_onhost import dump_key, read_dataset

    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    parsed = read_dataset(str(path))
    samples = [Sample(sid, dump_key(ids), len(ids), line) for (sid, ids), line in zip(parsed, lines)]
    return samples[:max_samples] if max_samples else samples


def split_pending(samples: list[Sample], done: set[str], hosts: list[str]) -> dict[str, list[Sample]]:
    """Samples whose key is not done, split over `hosts` balanced by tokens (pure).

    Samples sharing a key (the same content) go to the same host, so no key is
    sent by two hosts; each key group goes to the host with the fewest tokens
    so far, which keeps the dataset's order within a shard.
    """
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        if s.key not in done:
            groups.setdefault(s.key, []).append(s)
    shards: dict[str, list[Sample]] = {h: [] for h in hosts}
    load = {h: 0 for h in hosts}
    for group in groups.values():
        target = min(hosts, key=lambda h: (load[h], hosts.index(h)))
        shards[target] += group
        load[target] += group[0].tokens
    return shards


def shard_bytes(samples: list[Sample]) -> bytes:
    return "".join(s.line + "\n" for s in samples).encode()


_KEY = re.compile(r"[0-9a-f]{32}-p\d+")


def parse_keys(text: str) -> set[str]:
    """Dump keys, one a line (anything else, e.g. an error message, is ignored)."""
    return {ln.strip() for ln in text.splitlines() if _KEY.fullmatch(ln.strip())}


@dataclass
class FleetStatus:
    """A group's extraction, merged: done by content over every host (and the dead ones last seen)."""

    dataset_id: str | None
    total: int
    done: int
    running: list[str]
    rate_samples_s: float
    rate_tokens_s: float
    eta_s: float | None
    duplicates: int  # keys with an ok line on more than one host
    hosts: list[ExtractStatus]
    unreachable: list[str]
    last_seen: list[str]  # hosts counted from the local record only

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hosts"] = [h.to_dict() for h in self.hosts]
        return d


def merge_status(
    ledger: dict | None, statuses: dict[str, ExtractStatus], keys: dict[str, set[str]], unreachable: list[str]
) -> FleetStatus:
    """Progress over the group: done = dataset keys done anywhere; rate = sum; ETA = slowest host (pure)."""
    seen = dict(keys)
    last_seen = []
    for name, rec in (ledger or {}).get("hosts", {}).items():
        if name not in seen:
            seen[name] = set(rec.get("done", []))
            last_seen.append(name)
    dataset_keys = set((ledger or {}).get("keys", []))
    union = set().union(*seen.values()) if seen else set()
    counts: dict[str, int] = {}
    for ks in seen.values():
        for k in ks:
            counts[k] = counts.get(k, 0) + 1
    running = [n for n, st in statuses.items() if st.running]
    etas = [eta for n in running if (eta := statuses[n].summary.eta_s) is not None]
    total = len(dataset_keys) if ledger else sum(st.dataset_total for st in statuses.values())
    done = len(dataset_keys & union) if ledger else sum(st.manifest_ok for st in statuses.values())
    return FleetStatus(
        (ledger or {}).get("dataset_id"),
        total,
        done,
        running,
        sum(statuses[n].summary.rate_samples_s or 0 for n in running),
        sum(statuses[n].summary.rate_tokens_s or 0 for n in running),
        max(etas) if etas else (0.0 if not running else None),
        sum(1 for k, c in counts.items() if c > 1 and (not ledger or k in dataset_keys)),
        list(statuses.values()),
        unreachable,
        last_seen,
    )


# --------------------------------------------------------------------------- a group: the local record


def ledger_dir() -> Path:
    from ..paths import state_dir

    return state_dir() / "extract" / "fleet"


def new_ledger(dataset_id: str, samples: list[Sample]) -> dict:
    return {"dataset_id": dataset_id, "keys": list(dict.fromkeys(s.key for s in samples)), "hosts": {}, "updated": 0.0}


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


def absent_done(ledger: dict | None, selected: list[str]) -> set[str]:
    """Keys last seen done on hosts of the record that are not selected now (a dead host's work)."""
    out: set[str] = set()
    for name, rec in (ledger or {}).get("hosts", {}).items():
        if name not in selected:
            out |= set(rec.get("done", []))
    return out


# --------------------------------------------------------------------------- a group: edges (one host each)


def probe_done(remote, host) -> tuple[bool, set[str]]:
    """Ship the client if changed; (is a client running, every key done on this host)."""
    p = paths_for(host)
    remote.run(["mkdir", "-p", p.workdir, str(PurePosixPath(p.log).parent)])
    upload_if_changed(remote, client_source(), p.client, 0o755)
    parts = shell.split_sections(
        remote.run(shell.sections([("alive", alive_check(p)), ("keys", done_keys_command(p))])).stdout
    )
    return parts.get("alive", (1, ""))[0] == 0, parse_keys(parts.get("keys", (1, ""))[1])


def start_shard(remote, host, shard: list[Sample], **kwargs) -> ExtractStatus:
    """Put this host's shard file in its work dir and start its client on it."""
    p = paths_for(host)
    upload_if_changed(remote, shard_bytes(shard), p.file("shard.jsonl"))
    return start(remote, host, p.file("shard.jsonl"), local_dataset=False, **kwargs)


def status_with_keys(remote, host) -> tuple[ExtractStatus, set[str]]:
    """`status` plus every done key, in the same round trip."""
    out = remote.run(status_command(paths_for(host), with_keys=True)).stdout
    return parse_status(host.name, out), parse_keys(shell.split_sections(out).get("keys", (1, ""))[1])
