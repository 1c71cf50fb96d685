"""Extraction (pure): the work dir layout, the command lines that start and read the
on-host client (`remote_ops/onhost/extract_onhost.py`), the parser of its status,
and a group's split (samples -> shards by dump key) and merged status.

Nothing here runs anything; `remote_ops.workflows.extract` ships the client,
runs these commands over a `Remote` and keeps the group's local record.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from . import shell

if TYPE_CHECKING:  # logparse's regexes are compiled on import; health's probe builder needs none of them
    from .logparse import ExtractionSummary

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
    dump_bytes_per_token: int | None = None,
) -> str:
    """Start the client detached in its own session; print its PID.

    `dump_bytes_per_token` is the client's estimate of a dump's size until it
    has dump files of its own to measure (it names a full dump disk with it)."""
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
    if dump_bytes_per_token:
        argv += ["--dump-bytes-per-token", str(int(dump_bytes_per_token))]
    out = shell.quote(p.file("client.out"))
    # `cd || exit; cmd &` - not `cd && cmd &`, which backgrounds a subshell holding the channel open
    return f"cd {shell.quote(p.workdir)} || exit 1; setsid nohup {shell.join(argv)} >> {out} 2>&1 < /dev/null & echo $!"


#: `extract status` reads at most this much of each log line (the host cuts the rest):
#: a 16 MB line in the log must not travel, nor be parsed (`logparse.LINE_LIMIT`).
LOG_LINE_BYTES = 64 * 1024


def status_command(p: ExtractPaths, log_lines: int = 400, with_keys: bool = False, wait_s: float = 0.0) -> str:
    """One round trip: alive, pid, log tail, counts, missing, client output (+ every done key).

    With `wait_s`, the host first waits up to that long for a running client to exit
    (`wait_exit_command`), so a `--wait` loop sees the end within 0.1 s, not at its next poll."""
    keys = [("keys", done_keys_command(p))] if with_keys else []
    waited = [("waited", wait_exit_command(p, wait_s))] if wait_s > 0 else []
    return shell.sections(
        waited
        + keys
        + [
            ("alive", alive_check(p)),
            ("pid", f"cat {shell.quote(p.file('client.pid'))}; echo"),
            ("log", f"tail -n {int(log_lines)} {shell.quote(p.log)} | cut -b 1-{LOG_LINE_BYTES}; echo"),
            ("counts", f"python3 {shell.quote(p.client)} count --workdir {shell.quote(p.workdir)}"),
            ("missing", f"cat {shell.quote(p.file('missing.jsonl'))}; echo"),
            ("out", f"tail -n 20 {shell.quote(p.file('client.out'))}"),
        ]
    )


def wait_exit_command(p: ExtractPaths, wait_s: float) -> str:
    """Return when the running client exits, or after `wait_s` seconds.  Exit 0 either way.

    Each 0.1 s step reads the PID's state: it must exist and not be a zombie (an exited
    client whose parent has not reaped it yet is gone for us; `kill -0` would still see it)."""
    steps = max(1, int(wait_s * 10))
    running = "grep -q '^State:[[:space:]]*[^Z[:space:]]' /proc/$pid/status 2>/dev/null"
    return (
        f"if {alive_check(p)}; then n=0; "
        f"while {running} && [ $n -lt {steps} ]; do sleep 0.1; n=$((n+1)); done; fi; true"
    )


def done_keys_command(p: ExtractPaths) -> str:
    """Every dump key with an `ok` line in the host's manifest, one a line (empty without a manifest)."""
    return f"python3 {shell.quote(p.client)} done-keys --workdir {shell.quote(p.workdir)}"


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
    from .logparse import parse_extraction

    counts = _json_or_empty(parts.get("counts", (1, ""))[1])
    log = parts.get("log", (1, ""))[1]
    return ExtractStatus(
        host,
        parts.get("alive", (1, ""))[0] == 0,
        _count(pid_text),
        parse_extraction(log),
        _count(counts.get("done")) or 0,
        missing,
        parts.get("out", (1, ""))[1],
        _count(counts.get("total")) or 0,
        counts.get("dataset_id") if isinstance(counts.get("dataset_id"), str) else None,
        _reused_ids(log),
    )


def _count(value) -> int | None:
    """A count the host printed (text or a JSON number): None unless 0..10**18."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return int(text) if text.isdigit() and text.isascii() and len(text) <= 18 else None


def _reused_ids(log_text: str) -> int:
    """`reused_ids=N` of the last `started` line (the current run), 0 if none."""
    from .logparse import bounded_lines

    started = ""
    for line in bounded_lines(log_text):
        started = line if " started " in line else started
    field = next((w for w in started.split() if w.startswith("reused_ids=")), "")
    return _count(field.partition("=")[2]) or 0


def _json_or_empty(text: str) -> dict:
    import json

    try:
        doc = json.loads(text.strip() or "{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


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
    """The local dataset as `Sample`s (first `max_samples` only), with the client's key rule.

    Lines are split as the client splits them (on \\n only); a bad line raises the
    client's DatasetError (`workflows.extract.check_dataset` names it first)."""
    from ..onhost.extract_onhost import dump_key, read_dataset

    parsed = read_dataset(str(path))
    with open(path, "rb") as fh:
        lines = [text.rstrip("\r\n") for raw in fh if (text := raw.decode("utf-8")).strip()]
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


def new_ledger(dataset_id: str, samples: list[Sample]) -> dict:
    return {"dataset_id": dataset_id, "keys": list(dict.fromkeys(s.key for s in samples)), "hosts": {}, "updated": 0.0}


def absent_done(ledger: dict | None, selected: list[str]) -> set[str]:
    """Keys last seen done on hosts of the record that are not selected now (a dead host's work)."""
    out: set[str] = set()
    for name, rec in (ledger or {}).get("hosts", {}).items():
        if name not in selected:
            out |= set(rec.get("done", []))
    return out
