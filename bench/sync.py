"""`dumps sync` (host to host) vs rsync run by hand between the same hosts vs the laptop relay.
Goals: >= 0.95x hand rsync, >= 1.8x the relay (group pull + push).

One run brings up a HostLab of 3 hosts (real sshd on 127.x addresses): src1 and
src2 each hold `--mib` MiB of dump files (written by the format's own writer,
hidden size 7168; the data is SYNTHETIC stand-in-like bf16: Gaussian values,
seeded), dst holds none.  Then, in one run:

1. engine (unshaped loopback): on dst, `rsync` over ssh (AES-GCM) from src1 vs
   the project's own stream (`ssh -c aes128-gcm src tar cf - FILES | tar xf -`,
   then sha256 of every file, as `dumps pull` checks): which engine serves best.
2. shaped: a delay proxy (`hostlab.delay`, `--rate-mbit` per connection, `--rtt-ms`)
   in front of each host; every method goes through it, both sources at once:
     sync        `remote-ops dumps sync --from src1-x,src2-x --to dst` (sha256 on arrival)
     sync-zstd   the same with `--compress zstd` (ratio from rsync's own byte count)
     sync-packed the same without `--compress`, from sources compacted at rest first (`dumps compact`'s
                 on-host pass, `.hsz`): run after every other method, since compaction replaces the
                 plain files; its rate is the plain bytes over the wall time, as for the others
     hand-rsync  on dst, by hand: `rsync -a -e "ssh <strict opts>" src:DIR/rank0/ DIR/` x 2 in parallel
                 (default cipher), and hand-rsync-gcm with `-c aes128-gcm@openssh.com`
     relay       `remote-ops dumps pull --host src1-x,src2-x --jobs 1` to this machine, then
                 `rsync` (AES-GCM) of each shard to dst, in parallel
   Rates are the dumps' (plain) bytes over the wall time of the whole command (CLI start,
   grants and revokes included for sync).  Before each method the page cache's
   dirty pages are written (`sync`) and the order of the methods rotates per rep.

    .venv/bin/python bench/sync.py [--mib 300] [--rate-mbit 40] [--rtt-ms 1] [--reps 1] [--methods ...] [--json out.json]

Exit 1 when a goal is not met.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remote_ops import onhost
from remote_ops.dumper import dumpfile
from remote_ops.hostlab import HostLab

H = 7168
SOURCES = ("src1", "src2")
DEST = "dst"
GCM = "aes128-gcm@openssh.com"


def write_shard(root: Path, mib: int, tokens: int, seed: int) -> int:
    """Dump files of `tokens` tokens until `mib` MiB: SYNTHETIC bf16 (Gaussian, seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per_file = tokens * (4 * H * 2 + 8)
    n = max(1, (mib << 20) // per_file)
    total = 0
    for i in range(n):
        ids = (np.arange(tokens, dtype=np.int32) + seed * 1_000_003 + i * 100_003).tobytes()
        pos = np.arange(tokens, dtype=np.int32).tobytes()
        vals = rng.standard_normal(tokens * 4 * H, dtype=np.float32)
        bf16 = (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        rec = dumpfile.write_span(
            str(root), 0, ids, pos, bf16[: tokens * H * 2], bf16[tokens * H * 2 :], H, fsync=False
        )
        total += int(rec["bytes"])
    return total


def ssh_words(lab: HostLab, cipher: str | None) -> list[str]:
    words = [
        "ssh", "-i", str(lab.client_key.private), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
        "-o", f"UserKnownHostsFile={lab.known_hosts}", "-o", "StrictHostKeyChecking=yes", "-F", "/dev/null",
    ]  # fmt: skip
    return words + (["-c", cipher] if cipher else [])


def addr(lab: HostLab, name: str) -> str:
    """The address of `name` (a host, or a delayed alias) as the inventory gives it."""
    return lab.spec(name).address


def clear(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def on_dst(lab: HostLab, command: str, timeout: float = 3600) -> float:
    """Run `command` on dst over its own SSH (as an operator would by hand); its wall seconds."""
    with lab.connect(DEST) as remote:
        t0 = time.monotonic()
        remote.run(command, timeout=timeout)
        return time.monotonic() - t0


def hand_rsync(lab: HostLab, sources: list[str], scratch: Path, cipher: str | None) -> float:
    """Both shards by hand on dst, in parallel: `rsync -a -e "ssh ..." root@SRC:DIR/rank0/ SCRATCH/SRC/`."""
    clear(scratch)
    rsh = shlex.join(ssh_words(lab, cipher))
    parts = []
    for name in sources:
        src = f"root@{addr(lab, name)}:{lab.spec(name).dump.dir}/rank0/"
        parts.append(shlex.join(["rsync", "-a", "-e", rsh, src, str(scratch / name) + "/"]) + " &")
    return on_dst(lab, " ".join(parts) + " wait")


def engine_stream(lab: HostLab, source: str, scratch: Path) -> tuple[float, float]:
    """The project's stream run on dst (ssh AES-GCM + tar), then sha256 of every file: (seconds, seconds)."""
    clear(scratch)
    src = lab.spec(source).dump.dir
    rsh = shlex.join([*ssh_words(lab, GCM), f"root@{addr(lab, source)}"])
    stream = f"{rsh} {shlex.quote(f'tar -C {shlex.quote(src)} -cf - rank0')} | tar -C {shlex.quote(str(scratch))} -xf -"
    check = f"find {shlex.quote(str(scratch))} -name '*.safetensors' -exec sha256sum {{}} + > /dev/null"
    return on_dst(lab, stream), on_dst(lab, check)


def engine_rsync(lab: HostLab, source: str, scratch: Path) -> float:
    clear(scratch)
    rsh = shlex.join(ssh_words(lab, GCM))
    src = f"root@{addr(lab, source)}:{lab.spec(source).dump.dir}/rank0/"
    return on_dst(lab, shlex.join(["rsync", "-a", "-e", rsh, src, str(scratch) + "/"]))


def cli(lab: HostLab, state: Path, *args: str) -> tuple[float, dict]:
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(lab.inventory_dir), "REMOTE_OPS_STATE_DIR": str(state)}
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json", "-q"],
        env=env, capture_output=True, text=True, timeout=3600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"remote-ops {' '.join(args)} exited {p.returncode}:\n{p.stderr[-3000:]}\n{p.stdout[-2000:]}")
    return seconds, json.loads(p.stdout)


def sync_run(lab: HostLab, sources: list[str], state: Path, *extra: str) -> tuple[float, dict]:
    dst_dir = Path(lab.spec(DEST).dump.dir)
    clear(dst_dir)
    return cli(lab, state, "dumps", "sync", "--from", ",".join(sources), "--to", DEST, *extra)


def relay(lab: HostLab, sources: list[str], dst_alias: str, state: Path, scratch: Path, local: Path) -> float:
    """Group pull to this machine, then a push of each shard to dst (rsync AES-GCM, in parallel)."""
    clear(local)
    clear(scratch)
    t0 = time.monotonic()
    cli(lab, state, "dumps", "pull", "--host", ",".join(sources), "--jobs", "1", "--dest", str(local))
    rsh = shlex.join(ssh_words(lab, GCM))
    names = sorted(p.name for p in (local / "rank0").glob("*.safetensors"))
    procs = []
    for i in range(len(sources)):  # as many pushes at once as the sync has sources
        listing = local / f".push-{i}"
        listing.write_text("".join(f"rank0/{n}\n" for n in names[i :: len(sources)]))
        procs.append(
            subprocess.Popen(
                [
                    "rsync",
                    "-a",
                    f"--files-from={listing}",
                    "-e",
                    rsh,
                    f"{local}/",
                    f"root@{addr(lab, dst_alias)}:{scratch}/",
                ],
                stdin=subprocess.DEVNULL,
            )
        )
    for p in procs:
        if p.wait(timeout=3600) != 0:
            raise SystemExit("relay push failed")
    return time.monotonic() - t0


def compact_sources(lab: HostLab, sources: list[str], jobs: int) -> dict:
    """Compact each source's dumps at rest, as `dumps compact` runs on a host (python3 on stdin)."""
    out: dict = {"bytes_before": 0, "bytes_after": 0, "seconds": 0.0}
    for name in sources:
        p = subprocess.run(
            ["python3", "-", "compact", lab.spec(name).dump.dir, "--jobs", str(jobs)],
            input=onhost.bundled("compact_onhost.py"), capture_output=True, check=True, timeout=3600,
        )  # fmt: skip
        doc = json.loads(p.stdout.decode().splitlines()[-1])
        if not doc.get("ok"):
            raise SystemExit(f"compact on {name} failed: {doc}")
        for k in ("bytes_before", "bytes_after", "seconds"):
            out[k] += doc[k]
    out["kept"] = round(out["bytes_after"] / out["bytes_before"], 4) if out["bytes_before"] else None
    out["seconds"] = round(out["seconds"], 2)
    out["jobs"] = jobs
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=300, help="MiB of dumps per source")
    ap.add_argument("--tokens", type=int, default=430, help="tokens per dump file (hidden size 7168)")
    ap.add_argument("--rate-mbit", type=float, default=40.0, help="the shaped link, per connection")
    ap.add_argument("--rtt-ms", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument(
        "--methods", default="sync,sync-zstd,hand-rsync,hand-rsync-gcm,relay,sync-packed", help="comma-separated"
    )
    ap.add_argument("--compact-jobs", type=int, default=2, help="worker processes of the compaction before sync-packed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with (
        HostLab(names=[*SOURCES, DEST], docker=False) as lab,
        tempfile.TemporaryDirectory(prefix="ro-sync-bench-") as tmp,
    ):
        tmpd = Path(tmp)
        state, local = tmpd / "state", tmpd / "relay-local"
        scratch = Path(lab.spec(DEST).dump.dir).parent / "scratch"
        total = sum(write_shard(Path(lab.spec(s).dump.dir), a.mib, a.tokens, i + 1) for i, s in enumerate(SOURCES))
        os.sync()
        result: dict = {"mib_per_source": a.mib, "bytes": total, "rate_mbit": a.rate_mbit, "rtt_ms": a.rtt_ms}

        # 1. the engine, unshaped, one source
        one = sum(p.stat().st_size for p in (Path(lab.spec("src1").dump.dir) / "rank0").glob("*.safetensors"))
        eng: dict[str, list[float]] = {"rsync-gcm": [], "tar-stream": [], "tar-stream+sha256": []}
        for _ in range(a.reps):
            eng["rsync-gcm"].append(one / 1e6 / engine_rsync(lab, "src1", scratch))
            os.sync()
            t_stream, t_sha = engine_stream(lab, "src1", scratch)
            eng["tar-stream"].append(one / 1e6 / t_stream)
            eng["tar-stream+sha256"].append(one / 1e6 / (t_stream + t_sha))
            os.sync()
        result["engine_mb_s"] = {k: round(statistics.median(v), 1) for k, v in eng.items()}

        # 2. shaped: every path through a delay proxy
        alias = {n: lab.add_delay(n, a.rtt_ms, rate_mbit=a.rate_mbit, alias=f"{n}-x") for n in (*SOURCES, DEST)}
        srcs = [alias[s] for s in SOURCES]
        methods = a.methods.split(",")
        times: dict[str, list[float]] = {m: [] for m in methods}
        at_rest = [m for m in methods if m == "sync-packed"]  # after the others: compaction replaces the files
        methods = [m for m in methods if m not in at_rest]
        wire, inner, packed_wire = {}, [], {}

        def run(method: str) -> float:
            if method.startswith("sync"):
                extra = ["--compress", "zstd"] if method == "sync-zstd" else []
                t, doc = sync_run(lab, srcs, state, "--dest-address", "127.0.0.1", *extra)
                assert doc["moved"] == doc["plan"]["files"] and not doc["failed"], doc
                if method == "sync-packed":
                    packed_wire.update(bytes=doc["bytes"])
                elif extra:
                    wire.update(bytes=doc["bytes"], wire_bytes=doc["wire_bytes"])
                else:
                    inner.append(
                        {"workflow_s": doc["seconds"], "transfers_s": [x["seconds"] for x in doc["transfers"].values()]}
                    )
                return t
            if method.startswith("hand-rsync"):
                return hand_rsync(lab, srcs, scratch, GCM if method.endswith("gcm") else None)
            return relay(lab, srcs, alias[DEST], state, scratch, local)

        for rep in range(a.reps):
            for method in methods[rep % len(methods) :] + methods[: rep % len(methods)]:  # order rotates
                clear(scratch)
                clear(Path(lab.spec(DEST).dump.dir))
                os.sync()  # no method pays for the writeback of the one before
                times[method].append(run(method))
        if at_rest:
            os.sync()
            result["compact"] = compact_sources(lab, list(SOURCES), a.compact_jobs)
            for _rep in range(a.reps):
                clear(Path(lab.spec(DEST).dump.dir))
                os.sync()
                times["sync-packed"].append(run("sync-packed"))
        result["sync_inside"] = inner
        med = {m: statistics.median(v) for m, v in times.items()}
        result["seconds"] = {m: round(v, 2) for m, v in med.items()}
        result["mb_s"] = {m: round(total / 1e6 / v, 1) for m, v in med.items()}
        x = {"sync_vs_hand_rsync": "hand-rsync", "sync_vs_hand_rsync_gcm": "hand-rsync-gcm", "sync_vs_relay": "relay"}
        result["x"] = {k: round(med[m] / med["sync"], 3) for k, m in x.items() if m in med and "sync" in med}
        saving = round(1 - wire["wire_bytes"] / wire["bytes"], 4) if wire.get("bytes") else None
        result["zstd"] = {**wire, "saving": saving}
        if packed_wire:
            result["packed_at_rest"] = {**packed_wire, "saving": round(1 - packed_wire["bytes"] / total, 4)}
        for m in ("sync-zstd", "sync-packed"):
            if m in med and "sync" in med:
                result["x"][f"{m}_vs_sync"] = round(med["sync"] / med[m], 3)
        if "sync-zstd" in med and "sync-packed" in med:
            result["x"]["sync-packed_vs_sync-zstd"] = round(med["sync-zstd"] / med["sync-packed"], 3)
        result["data"] = "SYNTHETIC stand-in-like bf16 (Gaussian, seeded), hidden size 7168"
        ok = result["x"].get("sync_vs_hand_rsync", 0) >= 0.95 and result["x"].get("sync_vs_relay", 0) >= 1.8
        result["goals_met"] = ok
    print(json.dumps(result, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
