"""Start-up: whole CLI runs in a fresh process each, in interleaved rounds, against a bare interpreter.

Each round runs every row once, in the same order (after one warm-up round), so
that all rows see the same machine; a row's figure is the median of its rounds.
Every row is a new process started as a shell starts it, in-process (the CLI
runs as an installed package does: bytecode compiled).

  python -c pass                       the bare interpreter (the anchor)
  remote-ops --help
  remote-ops hosts                     this environment's inventory (or the lab's)
  remote-ops health --host H           H = --host (e.g. the deployed sandbox), else one lab host
                                       started here (a real sshd on loopback, 0 ms RTT); none
                                       with --no-health (a machine without sshd)

With --rtt-ms R (and --host, a deployed host with a plain address), a delay
proxy (`remote_ops.hostlab.delay`) at R ms round trip is put in front of the
host's sshd and three more rows join the same rounds, all through it:

  ssh H true                           OpenSSH, cold (no ControlMaster): the anchor at R
  remote-ops deploy --host H --yes     a no-op deploy (the host is up to date)
  remote-ops health --host H

The rows through the proxy use an inventory of their own (the host as it is,
its address and port the proxy's, a known_hosts line for it) and a state dir of
their own; nothing else changes.  `--before DIR` adds each remote-ops row once
more from another tree (holding remote_ops/, e.g. `git archive`), interleaved.
`--daemon` adds each remote-ops row once more handed to a warm fork server
(`remote-ops daemon start`, in a private runtime dir, started once before the
rounds and stopped by PID after them); every other row runs with
REMOTE_OPS_DAEMON=0, so a server someone has running is never used.

    .venv/bin/python bench/startup.py [--repeat 20] [--json out.json]
    REMOTE_OPS_STATE_DIR=... .venv/bin/python bench/startup.py --host sandbox --rtt-ms 50 [--before DIR] [--daemon]

Everything stays on 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's remote_ops, for the lab and the proxy too


@dataclass
class Row:
    """One timed command: its argv, environment and working directory (which tree runs)."""

    name: str
    argv: list[str]
    env: dict
    cwd: str = str(REPO)
    ok: tuple[int, ...] = (0,)
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)

    def run(self, deadline_s: float = 120.0) -> None:
        """Run once to its end, waited for with a blocking waitpid (`subprocess.run(timeout=)`
        without pipes polls with sleeps growing to 50 ms: a 70 ms command read as 114 ms); the
        deadline is a watchdog that kills the child."""
        cpu0, t0 = _children_cpu(), time.perf_counter()
        proc = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        watchdog = threading.Timer(deadline_s, proc.kill)
        watchdog.start()
        try:
            _, err = proc.communicate()
        finally:
            watchdog.cancel()
        self.walls.append(time.perf_counter() - t0)
        self.cpus.append(_children_cpu() - cpu0)
        if proc.returncode not in self.ok:
            raise SystemExit(f"{self.name}: exit {proc.returncode}\n{err.decode(errors='replace')[-2000:]}")

    def result(self) -> dict:
        return {"wall_s": round(statistics.median(self.walls), 4), "cpu_s": round(statistics.median(self.cpus), 4)}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def as_installed_env() -> dict:
    """This environment as an installed remote-ops runs in: its bytecode compiled (pip compiles an
    installed package; a development shell with PYTHONDONTWRITEBYTECODE=1 would otherwise time
    the compilation of every module on every run), PYTHONDONTWRITEBYTECODE dropped."""
    _compile(REPO)
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _compile(tree: Path) -> None:
    import compileall

    compileall.compile_dir(str(tree / "remote_ops"), quiet=1)


def rounds(rows: list[Row], repeat: int) -> None:
    """One warm-up round, then `repeat` rounds of every row once, in order."""
    for i in range(repeat + 1):
        for row in rows:
            row.run()
        if i == 0:
            for row in rows:
                row.walls.clear()
                row.cpus.clear()


def variants(env: dict, before: str | None, denv: dict | None) -> list[tuple[str, dict, str]]:
    """(label, environment, tree) for each way a remote-ops row runs: this tree in-process, the
    `before` tree in-process, this tree handed to the fork server (`denv`)."""
    out = [("", env, str(REPO))]
    if before:
        out.append(("before: ", env, before))
    if denv is not None:
        out.append(("daemon: ", denv, str(REPO)))
    return out


def cli_rows(py: str, host: str | None, ways: list[tuple[str, dict, str]], health_ok: tuple[int, ...]) -> list[Row]:
    """`--help`, `hosts`, `health --host HOST` (none without a host: `--no-health`), each way it runs."""
    commands = [(["--help"], (0,)), (["hosts"], (0,))] + ([(["health", "--host", host], health_ok)] if host else [])
    return [
        Row(f"{label}remote-ops {' '.join(c)}", [py, "-m", "remote_ops", *c], env, cwd, ok=ok)
        for c, ok in commands
        for label, env, cwd in ways
    ]


def far_rows(py: str, host: str, far: Far, ways: list[tuple[str, dict, str]]) -> list[Row]:
    """Through the delay proxy: OpenSSH cold, then remote-ops no-op deploy and health, each way."""
    far_env = {"REMOTE_OPS_INVENTORY": str(far.inventory), "REMOTE_OPS_STATE_DIR": str(far.state)}
    ssh = ["ssh", "-F", str(far.ssh_config), "-o", "ControlMaster=no", "-o", "ControlPath=none", host, "true"]
    rows = [Row(f"ssh {host} true @rtt", ssh, {**ways[0][1], **far_env})]
    for command, ok in ((["deploy", "--host", host, "--yes"], (0,)), (["health", "--host", host], (0, 11))):
        for label, env, cwd in ways:
            argv = [py, "-m", "remote_ops", *command]
            rows.append(Row(f"{label}remote-ops {' '.join(command)} @rtt", argv, {**env, **far_env}, cwd, ok=ok))
    return rows


@dataclass
class Far:
    """The files that make a host reachable through a delay proxy only."""

    inventory: Path
    state: Path
    ssh_config: Path


@contextlib.contextmanager
def through_proxy(host: str, rtt_ms: float, env: dict, work: Path):
    """A delay proxy at `rtt_ms` in front of `host`'s sshd (stopped by PID at the end), and the
    inventory, known_hosts, ssh_config and state dir that reach the host only through it."""
    import yaml

    from remote_ops.hostlab.delay import DelayProxy
    from remote_ops.hostlab.lab import pick_endpoint

    entry = _raw_entry(host, env)
    address, port = entry["address"], int(entry.get("port") or 22)
    listen, lport = pick_endpoint(port, {address})
    proxy = DelayProxy(listen, lport, address, port, rtt_ms, work).start()
    try:
        known = work / "known_hosts"
        known.write_text(_known_lines(Path(entry["known_hosts"]), address, port, _known_name(listen, lport)))
        (work / "inventory").mkdir()
        far_entry = {**entry, "address": listen, "port": lport, "known_hosts": str(known)}
        (work / "inventory" / "far.yaml").write_text(yaml.safe_dump({"hosts": {host: far_entry}}))
        config = work / "ssh_config"
        config.write_text(
            f"Host {host}\n  HostName {listen}\n  Port {lport}\n  User {entry.get('user') or 'root'}\n"
            f"  IdentityFile {entry['identity_file']}\n  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n"
            f"  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 10\n"
        )
        yield Far(work / "inventory", work / "state", config)
    finally:
        proxy.stop()


def _raw_entry(host: str, env: dict) -> dict:
    """`host`'s inventory entry as written (the sandbox's, or any inventory host with a plain address)."""
    import yaml

    from remote_ops.core.rawinv import default_inventory_paths, inventory_files

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        files = inventory_files(default_inventory_paths())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    for file in files:
        doc = yaml.safe_load(file.read_text()) if file.is_file() else None
        entry = ((doc or {}).get("hosts") or {}).get(host)
        if entry:
            if not (entry.get("address") and entry.get("known_hosts") and entry.get("identity_file")):
                raise SystemExit(f"{host}: --rtt-ms needs an address, known_hosts and identity_file in {file}")
            return dict(entry)
    raise SystemExit(f"{host}: not in the inventory")


def _known_name(address: str, port: int) -> str:
    """How known_hosts names an endpoint: the bare address on port 22, else `[address]:port`."""
    return address if port == 22 else f"[{address}]:{port}"


def _known_lines(known_hosts: Path, address: str, port: int, alias: str) -> str:
    """The host's known_hosts lines under the proxy's name (the same key, another address)."""
    names = {_known_name(address, port)}
    lines = [line.split(None, 1) for line in known_hosts.read_text().splitlines() if line.strip()]
    found = [f"{alias} {rest}\n" for first, rest in lines if set(first.split(",")) & names]
    if not found:
        raise SystemExit(f"no key for {address} in {known_hosts}")
    return "".join(found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20, help="rounds (after one warm-up round)")
    ap.add_argument("--host", default=None, help="an inventory host for `health` (e.g. sandbox); else a lab host")
    ap.add_argument("--rtt-ms", type=float, default=None, help="also time deploy/health/ssh through a delay proxy")
    ap.add_argument("--before", default=None, help="a tree (holding remote_ops/) timed interleaved with this one")
    ap.add_argument("--daemon", action="store_true", help="also time each row handed to a warm fork server")
    ap.add_argument("--no-health", action="store_true", help="no health rows, so no lab host (a machine without sshd)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rtt_ms is not None and (args.no_health or not args.host):
        ap.error("--rtt-ms needs --host (a deployed host), and not --no-health")
    if args.before:
        _compile(Path(args.before))
    py, env = sys.executable, {**as_installed_env(), "REMOTE_OPS_DAEMON": "0"}  # never a fork server
    with contextlib.ExitStack() as stack:
        host = None if args.no_health else (args.host or _lab_host(stack, env))
        denv = stack.enter_context(_server(py, env) if args.daemon else _no_server())
        ways = variants(env, args.before, denv)
        health_ok = (0, 11) if args.host else (0, 11, 12)  # a bare lab host has no container: health fails
        rows = [Row("python -c pass", [py, "-c", "pass"], env)] + cli_rows(py, host, ways, health_ok)
        if args.rtt_ms is not None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ro-startup-")))
            far = stack.enter_context(through_proxy(host, args.rtt_ms, env, work))
            rows += far_rows(py, host, far, ways)
        rounds(rows, args.repeat)
    report(rows, args)


@contextlib.contextmanager
def _no_server():
    yield None


@contextlib.contextmanager
def _server(py: str, env: dict):
    """A fork server for this tree in a private runtime dir; yields the environment that hands runs
    to it.  Stopped by PID (SIGTERM, then waited for with a deadline)."""
    import signal

    runtime = tempfile.mkdtemp(prefix="rob-")
    denv = {**env, "XDG_RUNTIME_DIR": runtime, "REMOTE_OPS_DAEMON": "1"}
    started = subprocess.run(
        [py, "-m", "remote_ops", "daemon", "start", "--json"], env=denv, cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    pid = json.loads(started.stdout)["pid"]
    try:
        yield denv
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        shutil.rmtree(runtime, ignore_errors=True)


def _lab_host(stack: contextlib.ExitStack, env: dict) -> str:
    """One real lab sshd on loopback (no container: `health` reports what it finds), its inventory
    and a state dir of its own in `env`."""
    from remote_ops.hostlab import HostLab

    lab = stack.enter_context(HostLab(hosts=1))
    state = stack.enter_context(tempfile.TemporaryDirectory(prefix="ro-startup-state-"))
    env.update(REMOTE_OPS_INVENTORY=str(lab.inventory_dir), REMOTE_OPS_STATE_DIR=state)
    return "lab1"


def report(rows: list[Row], args) -> dict:
    """Print each row (median wall and CPU, and its ratio to its anchor); write --json."""
    results = {row.name: row.result() for row in rows}
    anchor = results["python -c pass"]["wall_s"]
    ssh = next((r for n, r in results.items() if n.startswith("ssh ")), None)
    for name, r in results.items():
        base = ssh["wall_s"] if ssh and name.endswith("@rtt") else anchor
        print(
            f"{name:<48} wall {r['wall_s'] * 1000:7.1f} ms  cpu {r['cpu_s'] * 1000:7.1f} ms  {r['wall_s'] / base:5.2f}x"
        )
    load = os.getloadavg()[0]
    print(f"(medians of {args.repeat} interleaved rounds; load average {load:.1f} on {os.cpu_count()} cores)")
    doc = {
        "repeat": args.repeat,
        "rtt_ms": args.rtt_ms,
        "rows": results,
        "load_average": round(load, 2),
        "cpus": os.cpu_count(),
        "commit": _commit(),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _commit() -> str | None:
    if not shutil.which("git"):
        return None
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return p.stdout.strip() or None


if __name__ == "__main__":
    main()
