"""Start-up: `remote-ops --help` / `--version` and a whole `health` run, side by side.

Times, in one run and on this machine (medians of `--repeat` runs, each a fresh
process, as an operator's shell starts them):

  python -c pass                      the bare interpreter (the floor)
  ssh -V                              OpenSSH's client, for scale
  remote-ops --version / --help       this tree
  the same from another tree          with --before DIR (e.g. a `git archive` of an older commit)
  remote-ops health --host lab1       CLI wall, against one real lab sshd on loopback (0 ms RTT)
  remote-ops health, importing only   `python -X importtime` split of the health run's start-up

    .venv/bin/python bench/startup.py [--repeat 20] [--before /tmp/before] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def wall(argv: list[str], env: dict, repeat: int) -> float:
    """Median wall seconds of `argv` run `repeat` times (after one warm-up run)."""
    times = []
    for i in range(repeat + 1):
        t = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--before", default=None, help="a tree (holding remote_ops/) to compare against")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    py, env = sys.executable, {**os.environ}
    rows: dict[str, float] = {
        "python -c pass": wall([py, "-c", "pass"], env, args.repeat),
        "ssh -V": wall(["ssh", "-V"], env, args.repeat),
        "remote-ops --version": wall([py, "-m", "remote_ops", "--version"], env, args.repeat),
        "remote-ops --help": wall([py, "-m", "remote_ops", "--help"], env, args.repeat),
    }
    if args.before:
        old = {**env, "PYTHONPATH": args.before}
        rows["before: remote-ops --version"] = wall([py, "-m", "remote_ops", "--version"], old, args.repeat)
        rows["before: remote-ops --help"] = wall([py, "-m", "remote_ops", "--help"], old, args.repeat)
    rows.update(health_rows(py, env, max(5, args.repeat // 2), args.before))
    for name, s in rows.items():
        print(f"{name:<40} {s * 1000:8.1f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: round(v, 4) for k, v in rows.items()}, fh, indent=2)


def health_rows(py: str, env: dict, repeat: int, before: str | None) -> dict[str, float]:
    """`health --host lab1` CLI wall against one real lab sshd (loopback), this tree and `before`."""
    from remote_ops.hostlab import HostLab

    with HostLab(hosts=1) as lab, tempfile.TemporaryDirectory() as state:
        lab_env = {**env, "REMOTE_OPS_INVENTORY": str(lab.inventory_dir), "REMOTE_OPS_STATE_DIR": state}
        argv = [py, "-m", "remote_ops", "health", "--host", "lab1"]
        rows = {"remote-ops health --host lab1": wall(argv, lab_env, repeat)}
        if before:
            rows["before: remote-ops health --host lab1"] = wall(argv, {**lab_env, "PYTHONPATH": before}, repeat)
        return rows


if __name__ == "__main__":
    main()
