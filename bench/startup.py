"""Start-up: `remote-ops --help` / `--version` and a whole `health` run, side by side.

Times, in one run and on this machine (medians of `--repeat` runs, each a fresh
process, as an operator's shell starts them):

  python -c pass                      the bare interpreter (the floor)
  ssh -V                              OpenSSH's client, for scale
  remote-ops --version / --help       this tree
  the same from another tree          with --before DIR holding remote_ops/ (e.g. `git archive`)
  remote-ops health --host lab1       CLI wall, against one real lab sshd on loopback (0 ms RTT)
  remote-ops health --host NAME        with --health-host NAME: this environment's host (the sandbox)
  daemon: ...                         with --daemon: the same commands handed to a warm fork server
                                      (`remote-ops daemon start`, in a private runtime dir), interleaved
                                      with the in-process runs; plus the server's own start time

Every in-process row runs with REMOTE_OPS_DAEMON=0, so a server the user has running is never used.

    .venv/bin/python bench/startup.py [--repeat 20] [--before /tmp/before] [--daemon] [--json out.json]
    REMOTE_OPS_STATE_DIR=... .venv/bin/python bench/startup.py --health-host sandbox --daemon
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def wall(argv: list[str], env: dict, repeat: int, cwd: str | None = None) -> float:
    """Median wall seconds of `argv` run `repeat` times (after one warm-up run).  `python -m`
    imports remote_ops from `cwd` first, so `cwd` picks the tree that runs."""
    times, cpu = [], []
    for i in range(repeat + 1):
        t, c = time.perf_counter(), _children_cpu()
        _run(argv, env, cwd)
        if i:
            times.append(time.perf_counter() - t)
            cpu.append(_children_cpu() - c)
    key = (
        " ".join(argv[-3:]) + (f" @{cwd}" if cwd else "") + (" ~daemon" if env.get("REMOTE_OPS_DAEMON") == "1" else "")
    )
    CPU[key] = statistics.median(cpu)
    ROUNDS.setdefault(key, []).append((statistics.median(times), statistics.median(cpu)))
    return statistics.median(times)


def _run(argv: list[str], env: dict, cwd: str | None, deadline_s: float = 120.0) -> None:
    """Run `argv` to its end, waited for with a blocking waitpid.  (`subprocess.run(timeout=)`
    without pipes polls with sleeps growing to 50 ms: a 70 ms command read as 114 ms.)  The
    deadline is a watchdog that kills the child."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watchdog = threading.Timer(deadline_s, proc.kill)
    watchdog.start()
    try:
        proc.wait()
    finally:
        watchdog.cancel()


#: every `wall` call's (wall, cpu) by command, for interleaved rounds of one run each
ROUNDS: dict[str, list[tuple[float, float]]] = {}


def _medians_of_rounds() -> dict[str, float]:
    """The interleaved health rounds' medians (wall; CPU into CPU), under the rows' names."""
    out = {}
    for key, runs in ROUNDS.items():
        if "health" in key and len(runs) > 1:
            CPU[key] = statistics.median(c for _, c in runs)
            name = ("before: " if "@" in key else "daemon: " if "~" in key else "") + "remote-ops "
            name += key.split(" @")[0].split(" ~")[0]
            out[name] = statistics.median(w for w, _ in runs)
    return out


def as_installed_env() -> dict:
    """This environment as an installed remote-ops runs in: its bytecode compiled (pip compiles an
    installed package; a development shell with PYTHONDONTWRITEBYTECODE=1 would otherwise time
    the compilation of every module on every run), PYTHONDONTWRITEBYTECODE dropped."""
    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "remote_ops"), quiet=1)
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


#: median CPU seconds (user + system) of each timed command, by its last words
CPU: dict[str, float] = {}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--before", default=None, help="a tree (holding remote_ops/) to compare against")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--health-host",
        default=None,
        metavar="NAME",
        help="time `health --host NAME` with this environment's inventory (e.g. sandbox, "
        "after `remote-ops sandbox up` and `deploy --host sandbox --yes`) instead of a lab host",
    )
    ap.add_argument("--daemon", action="store_true", help="also time runs handed to a warm fork server")
    args = ap.parse_args()
    py, env = sys.executable, {**as_installed_env(), "REMOTE_OPS_DAEMON": "0"}
    with _server(py, env) if args.daemon else _no_server() as denv:
        rows = _rows(args, py, env, denv)
    _report(args, rows)


def _rows(args, py: str, env: dict, denv: dict | None) -> dict[str, float]:
    rows: dict[str, float] = {
        "python -c pass": wall([py, "-c", "pass"], env, args.repeat),
        "ssh -V": wall(["ssh", "-V"], env, args.repeat),
        "remote-ops --version": wall([py, "-m", "remote_ops", "--version"], env, args.repeat),
        "remote-ops --help": wall([py, "-m", "remote_ops", "--help"], env, args.repeat),
    }
    if args.before:
        rows["before: remote-ops --version"] = wall(
            [py, "-m", "remote_ops", "--version"], env, args.repeat, args.before
        )
        rows["before: remote-ops --help"] = wall([py, "-m", "remote_ops", "--help"], env, args.repeat, args.before)
    if denv:
        rows["daemon: remote-ops --version"] = wall([py, "-m", "remote_ops", "--version"], denv, args.repeat)
        rows["daemon: remote-ops --help"] = wall([py, "-m", "remote_ops", "--help"], denv, args.repeat)
    if args.health_host and denv:  # interleaved rounds: in-process, (before), handed over
        argv = [py, "-m", "remote_ops", "health", "--host", args.health_host]
        for _ in range(max(5, args.repeat // 2)):
            rows[f"remote-ops health --host {args.health_host}"] = wall(argv, env, 1)
            if args.before:
                rows[f"before: remote-ops health --host {args.health_host}"] = wall(argv, env, 1, args.before)
            rows[f"daemon: remote-ops health --host {args.health_host}"] = wall(argv, denv, 1)
        rows.update(_medians_of_rounds())
    elif args.health_host:
        argv = [py, "-m", "remote_ops", "health", "--host", args.health_host]
        n = max(5, args.repeat // 2)
        if args.before:  # interleaved rounds, so both trees see the same machine
            for _ in range(n):
                rows[f"remote-ops health --host {args.health_host}"] = wall(argv, env, 1)
                rows[f"before: remote-ops health --host {args.health_host}"] = wall(argv, env, 1, args.before)
            rows.update(_medians_of_rounds())
        else:
            rows[f"remote-ops health --host {args.health_host}"] = wall(argv, env, n)
    else:
        rows.update(health_rows(py, env, max(5, args.repeat // 2), args.before))
    return rows


def _report(args, rows: dict[str, float]) -> None:
    load = os.getloadavg()[0]
    for (name, s), cpu in zip(rows.items(), CPU.values()):
        print(f"{name:<40} wall {s * 1000:7.1f} ms   cpu {cpu * 1000:7.1f} ms")
    for name, s in START.items():
        print(f"{name:<40} wall {s * 1000:7.1f} ms")
    if START:
        print("(cpu = the timed process's own; a handed-over run's work is done in the server's worker)")
    print(f"(load average {load:.1f} on {os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "wall_s": {k: round(v, 4) for k, v in rows.items()},
                    "cpu_s": dict(zip(rows, (round(c, 4) for c in CPU.values()))),
                    "once_s": {k: round(v, 4) for k, v in START.items()},
                },
                fh,
                indent=2,
            )


@contextlib.contextmanager
def _no_server():
    yield None


@contextlib.contextmanager
def _server(py: str, env: dict):
    """A fork server for this tree in a private runtime dir; the env that uses it.  Its start
    (import everything, listen) is timed as the row "daemon start (once)"; stopped by PID."""
    runtime = tempfile.mkdtemp(prefix="rob-")
    denv = {**env, "XDG_RUNTIME_DIR": runtime, "REMOTE_OPS_DAEMON": "1"}
    t = time.perf_counter()
    started = subprocess.run(
        [py, "-m", "remote_ops", "daemon", "start", "--json"], env=denv, capture_output=True, text=True, timeout=60
    )
    START["daemon start (once)"] = time.perf_counter() - t
    pid = json.loads(started.stdout)["pid"]
    try:
        yield denv
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        shutil.rmtree(runtime, ignore_errors=True)


#: one-off timings (not medians): the fork server's start
START: dict[str, float] = {}


def health_rows(py: str, env: dict, repeat: int, before: str | None) -> dict[str, float]:
    """`health --host lab1` CLI wall against one real lab sshd (loopback), this tree and `before`."""
    from remote_ops.hostlab import HostLab

    with HostLab(hosts=1) as lab, tempfile.TemporaryDirectory() as state:
        lab_env = {**env, "REMOTE_OPS_INVENTORY": str(lab.inventory_dir), "REMOTE_OPS_STATE_DIR": state}
        argv = [py, "-m", "remote_ops", "health", "--host", "lab1"]
        rows = {"remote-ops health --host lab1": wall(argv, lab_env, repeat)}
        if before:
            rows["before: remote-ops health --host lab1"] = wall(argv, lab_env, repeat, before)
        return rows


if __name__ == "__main__":
    main()
