"""The extraction run: start, watch and stop `extract_onhost.py` on a host.

The client (stdlib-only, `remote_ops/onhost/extract_onhost.py`, built on the on-host skeleton
`client.py`, shipped beside it) runs beside the container with the host's `python3` and talks
to the server's published port (`127.0.0.1:<server.port>`).  Everything it needs lives in one
work dir on the host, `<logs.dir>/extract/`: the client's two files, the dataset, its manifest
(sample id -> dump key, per dataset), `run.json` + `dataset.keys` (the current dataset),
`missing.jsonl`, `client.pid`, `client.out`.  Done-ness is decided by the dump key (the
content), never by the sample id, and every count shown relates to the current dataset.  Its
progress log is the inventory's `logs.extraction`, which `logs pull/summary` read.

Shipping, starting detached, status, waits and stop are every client's (`workflows.hostclient`:
`Extraction` names this one); here are the extraction's own preflight (the dump dir the server
writes, resolved once on the host, and the server container's mount of it: a dir removed and made
again since the container started is refused, `stale_mount_error`), its launch options and the
group's local record.

The pure half is `remote_ops.core.extractplan` (work dir paths, the launch command, a group's
split and merged status) and the probe units of `remote_ops.probes.extract` (alive, status,
done keys: commands and parsers).

A local dataset is checked here (`check_dataset`, the rules of
`remote_ops.core.datasetcheck`) before anything is uploaded: a bad line is a
ConfigError (exit 3) naming `FILE:LINE`, never the client's failure on the host.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from ..core import datasetcheck, dumpcheck, shell
from ..core.extractplan import ExtractPaths, ExtractStatus, Sample, launch_command, paths_for, shard_bytes
from ..engine.labels import DUMP_DIR_ID
from ..engine.types import ContainerInfo
from ..errors import NotFound, Refused, StaleMount
from ..probes.dumpdir import REPLACED, DumpDir, DumpDirState, replaced_mount
from ..probes.engine import EngineObjects
from ..probes.extract import FileSha
from ..serving import serving_for
from .hostclient import Client, check_file, sha256, upload_if_changed, url_for


def check_dataset(path: Path) -> None:
    """ConfigError (exit 3) naming `FILE:LINE` and why, for the first bad line of a local dataset."""
    hint = 'each line one JSON object: {"id": ..., "input_ids": [token ids]}'
    check_file(path, datasetcheck.check_lines, "dataset", hint)


class Extraction(Client):
    """The extraction client, `extract_onhost.py` in `<logs.dir>/extract/`."""

    name, a_name = "extraction client", "an extraction client"
    paths = staticmethod(paths_for)
    start_command, what = "extract start", ("extraction", "extract start --wait", "extract status")
    busy = "remote-ops extract status --host {host}  (or extract stop)"


CLIENT = Extraction()
status, status_with_keys, stop = CLIENT.status, CLIENT.status_with_keys, CLIENT.stop
wait_finished, probe_done = CLIENT.wait_finished, CLIENT.probe_done


def dump_bytes_per_token(host) -> int:
    """The client's first guess at a dump's size per token (final + 3 aux hidden states, ids, positions),
    in the storage the inventory's `dump.storage` picks (FP8: about half)."""
    return dumpcheck.bytes_per_token(host.model.hidden_size, storage=host.dump.storage)


class _Options:
    """A start's options: the dataset (checked here when it is a local file, unless the caller
    did: `dataset_checked`; `local_dataset` None: a local file when there is one) and the
    client's launch options."""

    def __init__(
        self,
        host,
        dataset: str,
        *,
        concurrency: int = 8,
        retries: int = 5,
        server_url: str | None = None,
        limit: int | None = None,
        dump_grace: float = 30.0,
        local_dataset: bool | None = None,
        dataset_checked: bool = False,
    ) -> None:
        self.host, self.dataset, self.local = host, dataset, Path(dataset).expanduser()
        self.is_local = self.local.is_file() if local_dataset is None else local_dataset
        if not dataset_checked and self.is_local:
            check_dataset(self.local)
        self.launch = (url_for(host, server_url), concurrency, retries)
        self.limit, self.dump_grace = limit, dump_grace

    def command(self, p: ExtractPaths, dataset: str) -> str:
        url, concurrency, retries = self.launch
        serving = serving_for(self.host).client_args(self.host)
        per_token = dump_bytes_per_token(self.host)
        return launch_command(p, url, concurrency, retries, dataset, self.limit, self.dump_grace, per_token, serving)


def start(remote, host, dataset: str, *, wait_s: float = 30.0, **options) -> ExtractStatus:
    """Check a local dataset, refuse without a usable python3 on the host (the client runs with
    it), without a dump dir the server can write (`_usable_dump_dir`: it is resolved here, once),
    while the server container mounts a dump dir removed and made again since it started
    (`stale_mount_error`, exit 9) or if a client is running, ship the client (+ that dataset),
    launch with the resolved dump dir, await `started` (at most `wait_s` seconds).  `options`:
    `_Options`'s."""
    o = _Options(host, dataset, **options)
    p, _sec, running = _preflight(remote, host)
    place = partial(_place_dataset, remote, p, dataset, o.is_local)
    return CLIENT.launch(remote, host, p, running, place, partial(o.command, p), wait_s)


def plan_start(remote, host, dataset: str, **options) -> dict:
    """What `start` would do with these options, read in one round trip, changing nothing (for
    --dry-run / --diff).  A bad local dataset, no usable python3 on the host, an unusable dump dir
    or a stale mount of it in the server container is refused as `start` refuses it."""
    o = _Options(host, dataset, **options)
    remote_dataset = paths_for(host).dataset if o.is_local else dataset
    shas, on_host = CLIENT.file_shas(paths_for(host)), FileSha(remote_dataset, "dataset")
    p, sec, running = _preflight(remote, host, *shas, on_host)
    return {
        "dump_dir": p.dump_dir,
        "already_running": running,
        "upload_client": not CLIENT.current(p, shas, sec),
        "upload_dataset": o.is_local and on_host.read(sec) != sha256(o.local.read_bytes()),
        "dataset_on_host": remote_dataset,
        "command": o.command(p, remote_dataset),
    }


def _preflight(remote, host, *more) -> tuple[ExtractPaths, dict, bool]:
    """The client's preflight, the dump dir's and the server container's (its mount of the dump
    dir), with `more` probes, in one round trip: (the work dir with the resolved dump dir, the
    answers, is a client running)."""
    dump_dir, server = mount_probes(host)
    sec, running = CLIENT.preflight(remote, host, paths_for(host), *more, dump_dir, server)
    state = dump_dir.read(sec)
    usable = _usable_dump_dir(host, state)
    refuse_stale_mount(host, state, server.read(sec).container)
    return replace(paths_for(host), dump_dir=usable), sec, running


def mount_probes(host) -> tuple[DumpDirState, EngineObjects]:
    """The probes `stale_mount_error` decides from, asked in a round trip the caller makes anyway:
    the dump dir (`device:inode`, birth) and the server container (labels, start), deploy's and
    health's own (`probes.dumpdir`, `probes.engine`)."""
    return DumpDirState(paths_for(host).dump_dir), EngineObjects(host, api=True)


def refuse_stale_mount(host, state: DumpDir, c: ContainerInfo | None) -> None:
    """Preflight: StaleMount (exit 9) when the server container's mount of the dump dir is stale."""
    err = stale_mount_error(host.name, state, c)
    if err is not None:
        raise err


def stale_mount_error(host_name: str, state: DumpDir, c: ContainerInfo | None) -> StaleMount | None:
    """The refusal to start a client while the running server container `c` still mounts a dump
    dir that was removed and made again since it started (`probes.dumpdir.mount_of`, as deploy
    and health judge it): what it dumps would go into the deleted directory, nothing would reach
    the host, and the client would wait.  None when the mount is current, no container runs, it
    cannot be told, or the dir is gone (`_usable_dump_dir` refuses that).  Pure."""
    sentence = replaced_mount(state, c)
    if c is None or sentence is None:
        return None
    return StaleMount(
        f"preflight: {sentence}, so its dumps would never reach the host; nothing started",
        host=host_name,
        details={
            "reason": REPLACED,
            "dump_dir": state.path,
            "container": c.name,
            "recorded": c.labels.get(DUMP_DIR_ID),
            "now": state.identity,
        },
        hint=f"`remote-ops deploy --host {host_name}` recreates the container (it then mounts the dump dir "
        "as it is now), then `extract start` again",
    )


def group_stale_mount(errors: list[StaleMount]) -> StaleMount:
    """A group start's refusal when the server containers of some of its hosts mount a stale dump
    dir (`stale_mount_error` of each, in the hosts' order): the first host's, naming the others;
    `details.hosts` lists them all.  Nothing was started or stopped on any host.  Pure."""
    first, names = errors[0], [e.host or "" for e in errors]
    others = f" (also stale on {', '.join(names[1:])})" if len(names) > 1 else ""
    return StaleMount(
        f"{first.message} on any host of the group{others}",
        host=first.host,
        details={**first.details, "hosts": names},
        hint=f"`remote-ops deploy --host {','.join(names)}` recreates those containers, then `extract start` "
        f"again (or leave them out: --host 'GROUP,{','.join('!' + n for n in names)}')",
    )


def probe_group_host(remote, host) -> tuple[bool, set[str]]:
    """A group start's read of one host (`probe_done`: is a client running, the keys done) with the
    server container's mount of the dump dir judged in the same round trip: StaleMount (exit 9)
    when it is stale, before anything is split, started or stopped."""
    dump_dir, server = mount_probes(host)
    running, keys, sec = CLIENT.probe_done_with(remote, host, dump_dir, server)
    if dump_dir.output(sec)[0] == 0:  # a dump dir that did not answer is `start`'s to name
        refuse_stale_mount(host, dump_dir.read(sec), server.read(sec).container)
    return running, keys


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


def _place_dataset(remote, p: ExtractPaths, dataset: str, local: bool) -> str:
    """A local dataset file is uploaded into the work dir; otherwise it must exist on the host."""
    if local:
        upload_if_changed(remote, Path(dataset).expanduser().read_bytes(), p.dataset)
        return p.dataset
    if remote.run(["test", "-f", dataset], check=False).exit_status != 0:
        raise NotFound(f"dataset {dataset} is neither a local file nor a file on the host", host=remote.name)
    return dataset


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


def start_shard(remote, host, shard: list[Sample], **kwargs) -> ExtractStatus:
    """Put this host's shard file in its work dir and start its client on it."""
    p = paths_for(host)
    upload_if_changed(remote, shard_bytes(shard), p.file("shard.jsonl"))  # lines of a checked dataset
    return start(remote, host, p.file("shard.jsonl"), local_dataset=False, **kwargs)
