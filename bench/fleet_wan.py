#!/usr/bin/env python3
"""Fleets at WAN latency: one run, side by side, medians, at 0 and `--rtt-ms` (default 50) ms RTT.

Setup (not timed): a HostLab with `--hosts` (8) real sshd hosts sharing one
offline dockerd, the SGLang 0.5.9 stand-in base image, the real 0.5.9 tree in
each checkout, one full `deploy` per host (its container runs the SGLang
STAND-IN server: no model, no GPU), and for each host a delay proxy
(`HostLab.add_delay`) at `--rtt-ms`, reached as `<host>-far` with its own
known_hosts line.  Inventory: group `near` (the hosts direct), group `far`
(the same hosts through the proxies).

Timed (each `--repeat` times, medians):

1. `health` (CLI) and no-op `deploy` on all hosts vs one host, at 0 and RTT.
   health: `remote-ops health --host GROUP` (a new process, the CLI's own fan-out).
   deploy: `fleet.fan_out` of connect + `deploy.deploy` in one process (the
   code path `run_on_hosts` uses; `deploy --host GROUP` is another helper's).
2. single-host CLI at RTT: no-op deploy and health, against the physical
   floor: start-up (`remote-ops --version` in a new process) + 5 RTT
   (TCP + SSH handshake + auth) + 1 RTT per round trip the command reports.
3. OpenSSH ControlMaster cold with deploy's two command strings, at RTT.
4. Ansible (bench/deploy_noop.py's 14-task playbook) at RTT, defaults and pipelining.
5. sharded extraction: one host vs `--extract-hosts` (4) hosts, N samples per
   host (CLI `extract start --wait`); ratio = group wall / one-host wall
   (ideal: the same, total / (4 x one host's rate)).  The stand-in's prefill
   takes `--gpu-ms-per-1k-tokens` of simulated GPU time (a sleep, one prefill
   at a time per host): on real hosts that is GPU time, so it must not be this
   machine's shared CPU (the stand-in's own CPU per sample is small).
6. `dumps pull` of what (5) dumped: one host vs the group, aggregate MB/s, at 0 and RTT.

    .venv/bin/python bench/fleet_wan.py [--hosts 8] [--rtt-ms 50] [--repeat 3] [--daemon] [--json out.json]

CLI runs are in-process (REMOTE_OPS_DAEMON=0); with `--daemon` every CLI run is
handed to a warm fork server (`remote-ops daemon start`, started once, untimed,
in a private runtime dir).  Run it from a tree nobody edits meanwhile: the
server serves only the code it fingerprinted at its start.

Everything stays on 127.0.0.0/8; no registry is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import deploy_noop  # noqa: E402
import startup  # noqa: E402

from remote_ops.hostlab import HostLab, base_python_image  # noqa: E402
from remote_ops.hostlab.images import docker as lab_docker  # noqa: E402
from remote_ops.remote import FabricRemote  # noqa: E402
from remote_ops.workflows import deploy, fleet, sandbox  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
med = statistics.median


def setup(tmp: Path, n: int, rtt_ms: float, gpu_ms: float = 0.0):
    names = [f"w{i}" for i in range(1, n + 1)]
    lab = HostLab(tmp / "lab", names=names).start()
    try:
        return _prepare(lab, tmp, names, rtt_ms, gpu_ms)
    except BaseException:
        lab.stop()
        raise


def _prepare(lab, tmp: Path, names: list[str], rtt_ms: float, gpu_ms: float = 0.0):
    base = base_python_image(lab.dockerd.socket)
    standin = sandbox.build_standin_base(
        lambda *a, timeout=600: lab_docker(lab.dockerd.socket, *a, timeout=timeout), "0.5.9", base
    )
    for name in names:
        lab.install_sglang(name)
        sandbox.write_model_config(lab.host(name).paths.model_dir)
        lab.add_delay(name, rtt_ms, alias=f"{name}-far")
    near = {nm: sandbox.standin_overrides(lab.host(nm).inventory_entry(lab, standin), standin) for nm in names}
    for entry in near.values():  # simulated GPU time per prefill: sleeps, so hosts don't share it as CPU
        entry["container"]["env"]["STANDIN_GPU_MS_PER_1K_TOKENS"] = str(gpu_ms)
    # the same host names through the proxies (a host's name is part of its build inputs, so no aliases here)
    far = {
        nm: {
            **near[nm],
            "address": lab.delayed[f"{nm}-far"][1].listen_address,
            "port": lab.delayed[f"{nm}-far"][1].listen_port,
        }
        for nm in names
    }
    from remote_ops.core.inventory import load_inventory

    specs = {}
    for tag, hosts in (("0ms", near), ("rtt", far)):
        (tmp / f"inv-{tag}").mkdir()
        (tmp / f"inv-{tag}" / "fleet.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
        specs[tag] = load_inventory([tmp / f"inv-{tag}"]).hosts
    os.environ.update(REMOTE_OPS_STATE_DIR=str(tmp / "state"))
    # one after another: CPython 3.11.7's ast.parse is not thread-safe ("AST constructor recursion depth
    # mismatch" when two deploys verify the patch at once), seen here with forks=2
    run = fleet.fan_out([specs["0ms"][nm] for nm in names], lambda s: (0, _first_deploy(lab, s)), forks=1)
    assert run.exit_code == 0, json.dumps(run.to_dict(), default=str)[:3000]
    return lab, specs, names


def _first_deploy(lab, spec):
    with FabricRemote(lab.target(spec.name)).connect() as remote:
        deploy.deploy(remote, spec)
        deploy_noop._wait_docker_healthy(remote, spec, 120)


TMP = Path("/nonexistent")
INSTALLED_ENV: dict = {}  # os.environ as an installed remote-ops runs in (startup.as_installed_env), set in main


def cli(*args, ok=(0,), timeout=300, rtt=True) -> tuple[float, dict | None]:
    """One CLI run in a new process against the direct (`rtt=False`) or the delayed inventory."""
    env = {**INSTALLED_ENV, "REMOTE_OPS_INVENTORY": str(TMP / ("inv-rtt" if rtt else "inv-0ms"))}
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    wall = time.perf_counter() - t
    assert p.returncode in ok, (args, p.returncode, p.stderr[-800:])
    return wall, (json.loads(p.stdout) if p.stdout.strip().startswith("{") else None)


def repeat(fn, n):
    return [fn() for _ in range(n)]


def inprocess_deploy(lab, specs, hosts: list[str]) -> float:
    def one(spec):
        with FabricRemote(lab.target(spec.name, address=spec.address, port=spec.port)).connect() as remote:
            r = deploy.deploy(remote, spec)
        assert r.up_to_date, json.dumps(r.to_dict(), default=str)[:3000]
        return 0, r

    t = time.perf_counter()
    run = fleet.fan_out([specs[h] for h in hosts], one)
    assert run.exit_code == 0, run.to_dict()
    return time.perf_counter() - t


def fanout_section(lab, specs, names, r) -> dict:
    out = {}
    health_ok = (0, 11)
    for tag in ("0ms", "rtt"):
        rtt = tag == "rtt"
        out[tag] = {
            "health_1": med(
                repeat(lambda rtt=rtt: cli("health", "--host", names[0], "-q", ok=health_ok, rtt=rtt)[0], r)
            ),
            "health_n": med(
                repeat(lambda rtt=rtt: cli("health", "--host", "fleet", "-q", ok=health_ok, rtt=rtt)[0], r)
            ),
            "deploy_1": med(repeat(lambda tag=tag: inprocess_deploy(lab, specs[tag], names[:1]), r)),
            "deploy_n": med(repeat(lambda tag=tag: inprocess_deploy(lab, specs[tag], names), r)),
        }
        out[tag]["health_ratio"] = out[tag]["health_n"] / out[tag]["health_1"]
        out[tag]["deploy_ratio"] = out[tag]["deploy_n"] / out[tag]["deploy_1"]
    return out


def single_section(names, r, rtt_s) -> dict:
    far = names[0]
    startup = med(repeat(lambda: cli("--version")[0], r))
    dep = repeat(lambda: cli("deploy", "--host", far, "--yes", "--json", "-q"), r)
    hea = repeat(lambda: cli("health", "--host", far, "--json", "-q", ok=(0, 11)), r)
    dep_trips = dep[0][1]["round_trips"]
    out = {
        "startup_s": startup,
        "deploy_s": med(w for w, _ in dep),
        "deploy_round_trips": dep_trips,
        "health_s": med(w for w, _ in hea),
        "health_round_trips": 1,
    }
    out["deploy_floor_s"] = startup + (5 + dep_trips) * rtt_s
    out["health_floor_s"] = startup + (5 + 1) * rtt_s
    return out


def extraction_section(lab, names, k: int, per_host: int, tokens: int, r: int, tmp: Path) -> dict:
    group = ",".join(names[:k])
    one, many, cpu_one, cpu_many = [], [], [], []
    for i in range(r):
        ds1 = _dataset(tmp / f"x1-{i}.jsonl", per_host, tokens, offset=1000 * i + 1)
        dsk = _dataset(tmp / f"xk-{i}.jsonl", per_host * k, tokens, offset=1000 * i + 500)
        c = machine_cpu_s()
        one.append(
            cli(
                "extract",
                "start",
                "--host",
                names[0],
                "--dataset",
                str(ds1),
                "--wait",
                "600",
                "--json",
                "-q",
                timeout=700,
                rtt=False,
            )[0]
        )
        cpu_one.append(machine_cpu_s() - c)
        c = machine_cpu_s()
        many.append(
            cli(
                "extract",
                "start",
                "--host",
                group,
                "--dataset",
                str(dsk),
                "--wait",
                "600",
                "--json",
                "-q",
                timeout=700,
                rtt=False,
            )[0]
        )
        cpu_many.append(machine_cpu_s() - c)
    cores = os.cpu_count() or 1
    return {
        "hosts": k,
        "samples_per_host": per_host,
        "tokens_per_sample": tokens,
        "one_host_s": med(one),
        "group_s": med(many),
        "ratio_vs_ideal": med(many) / med(one),
        "runs": {"one": one, "group": many},
        # the whole machine's CPU (every session's, not only ours) during each run, and the wall
        # time that much CPU needs at best on this machine's cores
        "machine_cpu_one_s": med(cpu_one),
        "machine_cpu_group_s": med(cpu_many),
        "cpu_floor_group_s": med(cpu_many) / cores,
    }


def machine_cpu_s() -> float:
    """CPU seconds used by the whole machine so far (/proc/stat: user+nice+system+irq+softirq)."""
    fields = open("/proc/stat").readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def _dataset(path: Path, n: int, tokens: int, offset: int) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(
                json.dumps(
                    {"id": f"s{offset}-{i}", "input_ids": [(offset * 31 + i * 7919 + t) % 32000 for t in range(tokens)]}
                )
                + "\n"
            )
    return path


def pull_section(names, k: int, r: int, tmp: Path) -> dict:
    out = {}
    for tag in ("0ms", "rtt"):
        hosts = names[:k]
        res = {}
        for label, pattern in (("one", hosts[0]), ("group", ",".join(hosts))):
            rates, sizes = [], []
            for i in range(r):
                dest = tmp / f"pull-{tag}-{label}-{i}"
                _, doc = cli(
                    "dumps",
                    "pull",
                    "--host",
                    pattern,
                    "--dest",
                    str(dest),
                    "--json",
                    "-q",
                    "--allow-missing",
                    timeout=600,
                    rtt=tag == "rtt",
                )
                nbytes = doc["bytes"] if label == "group" else doc["pull"]["bytes"]
                secs = doc["seconds"] if label == "group" else doc["pull"]["seconds"]
                rates.append(nbytes / 1e6 / secs)
                sizes.append(nbytes)
                shutil.rmtree(dest, ignore_errors=True)
            res[label] = {"mb_per_s": med(rates), "mb": med(sizes) / 1e6}
        res["ratio"] = res["group"]["mb_per_s"] / res["one"]["mb_per_s"]
        out[tag] = res
    return out


def comparison_section(lab, specs, names, r: int, tmp: Path, ansible: str) -> dict:
    deploy_noop.NAME = f"{names[0]}-far"  # the lab's own alias (ssh_config, inventory) through the proxy
    spec = specs["rtt"][names[0]]
    out = {"openssh": deploy_noop.bench_openssh(lab, spec, r, tmp)}
    if os.path.exists(ansible):
        out["ansible"] = deploy_noop.bench_ansible(ansible, lab, spec, 2, tmp, False)
        out["ansible_pipelining"] = deploy_noop.bench_ansible(ansible, lab, spec, 2, tmp, True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--extract-hosts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=300, help="extraction samples per host")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument(
        "--gpu-ms-per-1k-tokens",
        type=float,
        default=200.0,
        help="the stand-in's simulated prefill time (a sleep, one GPU per host); 0: none",
    )
    ap.add_argument("--ansible", default="/tmp/ansible-venv/bin/ansible-playbook")
    ap.add_argument("--only", default="fanout,single,compare,extract,pull")
    ap.add_argument("--daemon", action="store_true", help="hand every CLI run to a warm fork server")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    only = set(args.only.split(","))
    res: dict = {
        "rtt_ms": args.rtt_ms,
        "hosts": args.hosts,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "gpu_ms_per_1k_tokens": args.gpu_ms_per_1k_tokens,
        "daemon": args.daemon,
    }
    with tempfile.TemporaryDirectory(prefix="ro-bench-wan-") as d:
        tmp = Path(d)
        global TMP, INSTALLED_ENV
        TMP = tmp
        INSTALLED_ENV = {**startup.as_installed_env(), "REMOTE_OPS_DAEMON": "0"}
        server = startup._server(sys.executable, INSTALLED_ENV) if args.daemon else startup._no_server()
        INSTALLED_ENV = server.__enter__() or INSTALLED_ENV
        t0 = time.perf_counter()
        lab, specs, names = setup(tmp, args.hosts, args.rtt_ms, args.gpu_ms_per_1k_tokens)
        res["setup_s"] = time.perf_counter() - t0
        try:
            for key, fn in (
                ("fanout", lambda: fanout_section(lab, specs, names, args.repeat)),
                ("single", lambda: single_section(names, args.repeat, args.rtt_ms / 1000)),
                ("compare", lambda: comparison_section(lab, specs, names, args.repeat, tmp, args.ansible)),
                (
                    "extract",
                    lambda: extraction_section(
                        lab, names, args.extract_hosts, args.samples, args.tokens, args.repeat, tmp
                    ),
                ),
                ("pull", lambda: pull_section(names, args.extract_hosts, args.repeat, tmp)),
            ):
                if key in only:
                    res[key] = fn()
                    print(f"{key}: {json.dumps(res[key], default=str)}", file=sys.stderr, flush=True)
        finally:
            lab.stop()
            server.__exit__(None, None, None)
    print(json.dumps(res, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
