"""Extraction (pure): the work dir layout, the command line that starts the on-host
client (`remote_ops/onhost/extract_onhost.py`), its status record, and a group's
split (samples -> shards by dump key) and merged status.

The probes that ask the client how it stands (alive, status, done keys) and
read the answers back are `remote_ops.probes.extract`.  Nothing here runs
anything; `remote_ops.workflows.extract` ships the client, runs the commands
over a `Remote` and keeps the group's local record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, ClassVar

from . import shell

if TYPE_CHECKING:  # logparse's regexes are compiled on import; health's probe builder needs none of them
    from .inventory import HostSpec
    from .logparse import ExtractionSummary

CLIENT_NAME = "extract_onhost.py"
#: The on-host client skeleton (`remote_ops/onhost/client.py`): shipped beside every client, which imports it.
BASE_NAME = "client.py"


@dataclass(frozen=True)
class ExtractPaths:
    """Where a client's run lives on the host: every on-host client's work dir layout.
    `client_name` is the program's file name (a subclass names another client with the same
    layout: `core.regenplan.RegenPaths`)."""

    workdir: str
    log: str
    dump_dir: str

    client_name: ClassVar[str] = CLIENT_NAME

    @property
    def client(self) -> str:
        return str(PurePosixPath(self.workdir) / self.client_name)

    @property
    def dataset(self) -> str:
        return str(PurePosixPath(self.workdir) / "dataset.jsonl")

    def file(self, name: str) -> str:
        return str(PurePosixPath(self.workdir) / name)

    @property
    def shipped(self) -> list[tuple[str, str]]:
        """(file name in `remote_ops/onhost/`, path on the host) of what a start ships: the client and
        the skeleton beside it."""
        return [(self.client_name, self.client), (BASE_NAME, self.file(BASE_NAME))]


def paths_for(host: HostSpec) -> ExtractPaths:
    return ExtractPaths(str(PurePosixPath(host.logs.dir) / "extract"), host.logs.extraction, host.dump.dir)


def launch_command(
    p: ExtractPaths,
    server_url: str,
    concurrency: int,
    retries: int,
    dataset: str,
    limit: int | None = None,
    dump_grace: float = 30.0,
    dump_bytes_per_token: int | None = None,
    serving_args: tuple[str, ...] = (),
) -> str:
    """Start the extraction client detached (`client_command`); print its PID.

    `dump_bytes_per_token` is the client's estimate of a dump's size until it
    has dump files of its own to measure (it names a full dump disk with it).
    `serving_args`: the serving engine's client options (`remote_ops.serving`: vLLM's
    `--serving vllm --model NAME`)."""
    options = ["--dump-dir", p.dump_dir, "--dump-grace", f"{dump_grace:g}"]
    if limit:
        options += ["--limit", str(limit)]
    if dump_bytes_per_token:
        options += ["--dump-bytes-per-token", str(int(dump_bytes_per_token))]
    return client_command(p, dataset, server_url, concurrency, retries, [*options, *serving_args])


def client_command(
    p: ExtractPaths, dataset: str, server_url: str, concurrency: int, retries: int, options: list[str]
) -> str:
    """Start the on-host client `p.client` detached in its own session, its output appended to
    `client.out`; print its PID.  `options`: the client's own (after the skeleton's)."""
    argv = ["python3", p.client, "--dataset", dataset, "--server", server_url, "--workdir", p.workdir, "--log", p.log]
    argv += ["--concurrency", str(concurrency), "--retries", str(retries), *options]
    out = shell.quote(p.file("client.out"))
    # `cd || exit; cmd &` - not `cd && cmd &`, which backgrounds a subshell holding the channel open
    return f"cd {shell.quote(p.workdir)} || exit 1; setsid nohup {shell.join(argv)} >> {out} 2>&1 < /dev/null & echo $!"


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
    #: the cause the current run's client stopped on (its `fatal` line: `cause`, `dir`, `says`,
    #: `since`), e.g. the dump dir gone; None when it did not
    fatal: dict | None = None

    def outcome(self) -> tuple[int, str | None]:
        """A finished run's exit code (0, 7 or 10) and the sentence that names why (pure):
        7 when the client stopped on a fatal cause or samples failed (as `dataset regenerate
        --wait` when chats fail), 10 when samples have no dump file; 0 otherwise."""
        s = self.summary
        if self.fatal:
            return 7, f"the client stopped: {self.fatal.get('says') or self.fatal.get('cause')}"
        if s.failed:
            last = next((line for line in reversed(s.error_lines) if " failed " in line), "")
            return 7, f"{s.failed} sample(s) failed" + (f"; last: {last}" if last else "")
        missing = len(self.missing) or (s.missing_dumps or 0)
        if missing:
            return 10, f"{missing} sample(s) produced no dump file (listed in missing.jsonl in the work dir)"
        return 0, None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = self.summary.to_dict()
        return d


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
