"""Bulk pull from a lab host: remote-ops vs plain rsync, tar over ssh and Fabric get.  Goal: >= 1.2x rsync.

One run brings up a HostLab host (real sshd on a 127.x address, strict host
keys), writes one 2 GiB file and 2,000 files of 256 KiB (random bytes) into its
dump dir, and pulls each data set with every method, interleaved, `--reps`
times (median reported; the machine is shared, so single runs are noisy):

  rsync        `rsync -W -e "ssh <strict opts>"` (plain: default cipher)
  rsync-gcm    the same with `-c aes128-gcm@openssh.com` (what a tuned rsync gets)
  tar-ssh      `ssh host tar cf - ... | tar xf -` (default cipher)
  fabric       Fabric `Connection.get` per file, as shipped (strict known_hosts loaded)
  remote-ops   `remote_ops.remote.transfer.pull` (ssh AES-GCM streams, tar batches, sha256 verified, 2 jobs)

Every method's output is checked (size; remote-ops also checks sha256 while it
receives).  Source files stay in the page cache for every method alike.

The 2,000 small copies of every run are kept until the end of the bench (~1.6 GB
per method and rep): deleting them right away made the *next* method pay for
ext4's inode allocator skipping thousands of recently deleted inodes
(`recently_deleted`/`find_inode_bit` were ~20 % of all CPU samples in `perf`),
which measured the order of the methods rather than the methods.

    .venv/bin/python bench/pull.py [--reps 3] [--big-mib 2048] [--small 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
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

from remote_ops.hostlab import HostLab
from remote_ops.remote import transfer

SMALL_SIZE = 256 << 10


def make_data(root: Path, big_mib: int, small: int) -> dict[str, list[tuple[str, int, str]]]:
    """The two data sets on the host: [(relative name, size, sha256)]."""
    (root / "big").mkdir(parents=True, exist_ok=True)
    (root / "small").mkdir(parents=True, exist_ok=True)
    big = root / "big" / "dump.bin"
    if not big.exists() or big.stat().st_size != big_mib << 20:
        subprocess.run(
            ["dd", "if=/dev/urandom", f"of={big}", "bs=1M", f"count={big_mib}", "status=none"],
            check=True,
            timeout=600,
        )
    sets = {"big": [("big/dump.bin", big.stat().st_size, _sha(big))], "small": []}
    for i in range(small):
        path = root / "small" / f"f{i:04d}.bin"
        if not path.exists():
            path.write_bytes(os.urandom(SMALL_SIZE))
        sets["small"].append((f"small/f{i:04d}.bin", SMALL_SIZE, _sha(path)))
    return sets


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def ssh_cmd(target, ciphers=None) -> list[str]:
    """The strict ssh argv (same policy as remote-ops), optionally without cipher preference."""
    return transfer.ssh_argv(target, ciphers=ciphers)[:-2]


def run_rsync(target, root, files, dest, ciphers=None):
    rsh = shlex.join(ssh_cmd(target, ciphers))
    names = "\n".join(n for n, _, _ in files).encode()
    subprocess.run(
        ["rsync", "-W", "--files-from=-", "-e", rsh, f"{target.user}@{target.hostname}:{root}/", str(dest)],
        input=names,
        check=True,
        timeout=900,
    )


def run_tar(target, root, files, dest):
    remote = f"tar -C {shlex.quote(str(root))} -cf - --null -T -"
    names = b"".join(n.encode() + b"\0" for n, _, _ in files)
    ssh = subprocess.Popen(
        ssh_cmd(target) + ["--", target.hostname, remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    untar = subprocess.Popen(["tar", "-C", str(dest), "-xf", "-"], stdin=ssh.stdout)
    ssh.stdout.close()
    ssh.stdin.write(names)
    ssh.stdin.close()
    if untar.wait(timeout=900) or ssh.wait(timeout=60):
        raise RuntimeError("tar over ssh failed")


def run_fabric(target, root, files, dest):
    """Fabric as its users run it, but with host keys checked against the lab's known_hosts."""
    import paramiko
    from fabric import Config, Connection

    conn = Connection(
        target.hostname,
        user=target.user,
        port=target.port,
        config=Config(overrides={"load_ssh_configs": False}),
        connect_kwargs={"key_filename": list(target.identity_files), "look_for_keys": False, "allow_agent": False},
    )
    conn.client.load_host_keys(os.path.expanduser(target.known_hosts[0]))
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        for name, _, _ in files:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            conn.get(f"{root}/{name}", str(dest / name))
    finally:
        conn.close()


def run_remote_ops(target, root, files, dest, jobs=2):
    items = [transfer.PullItem(n, dest / n, s, h) for n, s, h in files]
    transfer.pull(target, str(root), items, jobs=jobs)


def check(dest: Path, files) -> None:
    for name, size, _ in files:
        got = (dest / name).stat().st_size
        if got != size:
            raise RuntimeError(f"{name}: {got} bytes, want {size}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=2048)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--methods", default="rsync,rsync-gcm,tar-ssh,fabric,remote-ops")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dest-dir", default=None, help="where the pulled copies go (default: /tmp)")
    args = ap.parse_args()
    methods = {
        "rsync": run_rsync,
        "rsync-gcm": lambda *a: run_rsync(*a, ciphers=transfer.CIPHERS),
        "tar-ssh": run_tar,
        "fabric": run_fabric,
        "remote-ops": run_remote_ops,
    }
    chosen = args.methods.split(",")
    results: dict[str, dict[str, list[float]]] = {}
    with HostLab(hosts=1, docker=False) as lab:
        host, target = lab.hosts[0], lab.target(lab.hosts[0].name)
        root = host.paths.dump_dir / "bench"
        t0 = time.monotonic()
        sets = make_data(root, args.big_mib, args.small)
        print(
            f"data ready in {time.monotonic() - t0:.1f}s on {host.name} ({target.display}); "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        scratch = Path(tempfile.mkdtemp(prefix="ro-bench-pull-", dir=args.dest_dir))
        try:
            for rep in range(args.reps):
                for set_name, files in sets.items():
                    total = sum(s for _, s, _ in files)
                    for method in chosen:
                        dest = scratch / f"{method}-{rep}"
                        (dest / set_name).mkdir(parents=True)
                        subprocess.run(["sync"], timeout=120)
                        start = time.perf_counter()
                        methods[method](target, root, files, dest)
                        elapsed = time.perf_counter() - start
                        check(dest, files)
                        mbps = total / 1e6 / elapsed
                        results.setdefault(set_name, {}).setdefault(method, []).append(mbps)
                        print(f"rep {rep + 1} {set_name:5s} {method:10s} {mbps:8.1f} MB/s ({elapsed:.2f}s)", flush=True)
                        if set_name == "big":  # small outputs stay until the end, see below
                            shutil.rmtree(dest, ignore_errors=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": summary}, indent=1))
    ratios = [
        summary[s]["remote-ops"]["x_rsync"] for s in summary if "remote-ops" in summary[s] and "rsync" in summary[s]
    ]
    return 0 if ratios and min(ratios) >= 1.2 else 1


def report(results) -> dict:
    """Median MB/s per method and data set, and the ratio to plain rsync."""
    summary: dict = {}
    print("\nmedian MB/s (x plain rsync)")
    for set_name, per in results.items():
        base = statistics.median(per["rsync"]) if "rsync" in per else None
        summary[set_name] = {}
        line = []
        for method, runs in per.items():
            med = statistics.median(runs)
            ratio = round(med / base, 2) if base else None
            summary[set_name][method] = {
                "mb_per_s": round(med, 1),
                "x_rsync": ratio,
                "runs": [round(r, 1) for r in runs],
            }
            line.append(f"{method} {med:.0f} ({ratio}x)")
        print(f"  {set_name:5s}: " + ", ".join(line))
    return summary


if __name__ == "__main__":
    sys.exit(main())
