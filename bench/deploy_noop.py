#!/usr/bin/env python3
"""No-op re-deploy on a real lab host: remote-ops vs Ansible vs OpenSSH + ControlMaster.

Setup (not timed): one HostLab host (real sshd on 127.x + an offline dockerd),
the SGLang 0.5.9 stand-in base image, the real 0.5.9 tree in the checkout, and
one full `deploy`.  Then, with nothing changed, each contender does the checks
a no-op deploy needs and the same host-side bookkeeping:

- remote-ops: `python -m remote_ops deploy --host bench --yes --json` from this
  checkout (a new process per run: Python start-up, inventory, connect, one
  read-only batched probe), and the same in-process (connect + `deploy.deploy`).
- health on the same deployed host: `python -m remote_ops health --host bench
  --json` (new process) and in-process (connect + `health.check_host`), round
  trips counted: the other read-only command an operator re-runs.
- OpenSSH + ControlMaster: the very command strings a no-op deploy sends (captured
  from one: today one read-only probe) over `ssh -S` (cold: incl. the master's connect; warm).
- Ansible (ansible-core in its own venv, strict host keys, same key/known_hosts):
  a playbook doing the same checks as tasks (facts, nvidia-smi, docker version/info,
  df, sha256 of the target, SGLang version, buildx, image/container inspect, the
  lock's holder, up-to-date assertion; like remote-ops' no-op it writes nothing);
  default settings and with pipelining.

Usage (root; scripts/setup done):  .venv/bin/python bench/deploy_noop.py [--runs 5] [--ansible PATH]
Ansible: `python3 -m venv /tmp/ansible-venv && /tmp/ansible-venv/bin/pip install ansible-core`.
Everything stays on 127.0.0.0/8; no registry is contacted.
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
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote_ops.hostlab import HostLab, base_python_image  # noqa: E402
from remote_ops.hostlab.images import docker as lab_docker  # noqa: E402
from remote_ops.remote import FabricRemote  # noqa: E402
from remote_ops.workflows import container, deploy, sandbox  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAME = "bench"


def setup(tmp: Path):
    """Lab host + stand-in image + real tree + inventory + a first full deploy."""
    lab = HostLab(tmp / "lab", names=[NAME]).start()
    base = base_python_image(lab.dockerd.socket)
    standin = sandbox.build_standin_base(
        lambda *a, timeout=600: lab_docker(lab.dockerd.socket, *a, timeout=timeout), "0.5.9", base
    )
    lab.install_sglang(NAME)
    sandbox.write_model_config(lab.host(NAME).paths.model_dir)
    entry = sandbox.standin_overrides(lab.host(NAME).inventory_entry(lab, standin), standin)
    inv = tmp / "inventory"
    inv.mkdir()
    (inv / f"{NAME}.yaml").write_text(yaml.safe_dump({"hosts": {NAME: entry}}))
    os.environ.update(REMOTE_OPS_INVENTORY=str(inv), REMOTE_OPS_STATE_DIR=str(tmp / "state"))
    spec = _spec(inv)
    with FabricRemote(lab.target(NAME)).connect() as remote:
        first = deploy.deploy(remote, spec)
        _wait_docker_healthy(remote, spec, 90)
    return lab, spec, first


def _spec(inv: Path):
    from remote_ops.core.inventory import load_inventory

    return load_inventory([inv]).one(NAME)


def _wait_docker_healthy(remote, spec, timeout: float) -> None:
    """Docker's first HEALTHCHECK runs one interval after start; wait for it (deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = container.inspect_container(remote, spec.container.name)
        if info and info.health == "healthy":
            return
        time.sleep(1)
    raise SystemExit("container did not become healthy in time")


def bench_cli(runs: int) -> list[dict]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "remote_ops", "deploy", "--host", NAME, "--yes", "--json", "-q"],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
        )
        wall = time.perf_counter() - t
        doc = json.loads(p.stdout)
        assert p.returncode == 0 and doc["up_to_date"], (p.returncode, p.stderr[-500:])
        out.append({"wall_s": wall, "round_trips": doc["round_trips"], "inner_s": doc["wall_s"]})
    return out


def bench_health(lab, spec, runs: int) -> dict:
    """`health` on the deployed host: CLI (new process) and in-process, with round trips."""
    from remote_ops.workflows import health

    cli, inproc, trips = [], [], []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "remote_ops", "health", "--host", NAME, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
        )
        cli.append(time.perf_counter() - t)
        assert p.returncode in (0, 11), (p.returncode, p.stderr[-500:])
        t = time.perf_counter()
        with FabricRemote(lab.target(NAME)).connect() as remote:
            r = health.check_host(lambda _h: remote, spec, expected_image=deploy.image_ref(spec))
        inproc.append(time.perf_counter() - t)
        trips.append(r.round_trips)
    return {
        "cli_s": statistics.median(cli),
        "inprocess_s": statistics.median(inproc),
        "round_trips": trips[0],
        "cli_all_s": cli,
        "inprocess_all_s": inproc,
    }


def bench_compare(other: Path, runs: int) -> dict:
    """This checkout against `other` (e.g. the commit before a change), interleaved run by run on
    the same deployed host: `deploy` (no-op) and `health`, CLI wall, the command's own wall
    (`wall_s` / `duration_s` in its JSON: after start-up) and round trips."""
    out: dict = {}
    for _ in range(runs):
        for label, tree in (("this", REPO), ("other", other)):
            row = out.setdefault(
                label,
                {
                    "deploy_cli_s": [],
                    "deploy_inner_s": [],
                    "health_cli_s": [],
                    "health_inner_s": [],
                    "deploy_round_trips": 0,
                    "health_round_trips": 0,
                },
            )
            for cmd in ("deploy", "health"):
                argv = [sys.executable, "-m", "remote_ops", cmd, "--host", NAME, "--json"]
                argv += ["--yes", "-q"] if cmd == "deploy" else []
                t = time.perf_counter()
                p = subprocess.run(
                    argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=tree
                )
                row[f"{cmd}_cli_s"].append(time.perf_counter() - t)
                doc = json.loads(p.stdout)
                if cmd == "deploy":
                    assert p.returncode == 0 and doc["up_to_date"], (tree, p.stderr[-500:])
                    row["deploy_inner_s"].append(doc["wall_s"])
                    row["deploy_round_trips"] = doc["round_trips"]
                else:
                    host = doc["hosts"][0] if "hosts" in doc else doc
                    row["health_inner_s"].append(host["duration_s"])
                    row["health_round_trips"] = host["round_trips"]
                    row["health_exit"] = p.returncode
    return {
        k: {m: (statistics.median(v) if isinstance(v, list) else v) for m, v in row.items()} for k, row in out.items()
    }


def bench_inprocess(lab, spec, runs: int) -> list[dict]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        with FabricRemote(lab.target(NAME)).connect() as remote:
            r = deploy.deploy(remote, spec)
            trips = remote.round_trips
        assert r.up_to_date
        out.append({"wall_s": time.perf_counter() - t, "round_trips": trips})
    return out


def noop_commands(lab, spec) -> list[str]:
    """The exact command strings a no-op deploy sends, captured from one (the seam's
    `on_command` hook): today one read-only probe."""
    seen: list[str] = []
    with FabricRemote(lab.target(spec.name)).connect() as remote:
        remote.on_command = lambda command, duration_s, exit_status: seen.append(command)
        result = deploy.deploy(remote, spec, why="bench-openssh")
    assert result.up_to_date, "the OpenSSH baseline replays a no-op deploy"
    return seen


def bench_openssh(lab, spec, runs: int, tmp: Path) -> dict:
    ctl = tmp / "ctl"
    base = [
        "ssh",
        "-F",
        str(lab.ssh_config),
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={ctl}",
        "-o",
        "ControlPersist=60",
    ]
    cmds = noop_commands(lab, spec)
    cold, warm = [], []
    for i in range(runs + 1):
        t = time.perf_counter()
        for c in cmds:
            subprocess.run([*base, NAME, c], capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        (cold if i == 0 else warm).append(time.perf_counter() - t)
    subprocess.run([*base, "-O", "exit", NAME], capture_output=True, timeout=30)
    return {"cold_s": cold[0], "warm_s": statistics.median(warm), "round_trips": len(cmds)}


PLAYBOOK = """
- hosts: {name}
  gather_facts: true
  gather_subset: [min, hardware]
  vars:
    target: "{target}"
    ref: "{ref}"
  tasks:
    - name: GPUs
      command: nvidia-smi --query-gpu=index,name --format=csv,noheader
      register: gpus
      failed_when: false
      changed_when: false
    - name: docker version
      command: docker version --format '{{% raw %}}{{{{json .}}}}{{% endraw %}}'
      register: dv
      changed_when: false
    - name: docker runtimes
      command: docker info --format '{{% raw %}}{{{{json .Runtimes}}}}{{% endraw %}}'
      changed_when: false
    - name: disk
      command: df -P -B1 {dump_parent}
      changed_when: false
    - name: target sha256
      stat: {{path: "{{{{ target }}}}", checksum_algorithm: sha256}}
      register: tf
    - name: SGLang version
      slurp: {{src: "{version_py}"}}
    - name: buildx
      command: docker buildx version
      failed_when: false
      changed_when: false
    - name: image labels
      command: docker image inspect {{{{ ref }}}}
      register: img
      changed_when: false
    - name: container
      command: docker container inspect {container}
      register: ctr
      changed_when: false
    - name: nobody holds the lock
      stat: {{path: "{lock}"}}
      register: lk
    - name: up to date?
      assert:
        that:
          - not lk.stat.exists
          - (img.stdout | from_json)[0].Config.Labels['org.remote-ops.source.sha256.after'] == tf.stat.checksum
          - (ctr.stdout | from_json)[0].Image == (img.stdout | from_json)[0].Id
          - (ctr.stdout | from_json)[0].State.Running
"""


def bench_ansible(ansible: str, lab, spec, runs: int, tmp: Path, pipelining: bool) -> dict:
    t = lab.target(NAME)
    inv = tmp / "ansible-inventory.ini"
    inv.write_text(
        f"{NAME} ansible_host={t.hostname} ansible_port={t.port} ansible_user={t.user} "
        f"ansible_ssh_private_key_file={t.identity_files[0]} ansible_python_interpreter=/usr/bin/python3\n"
    )
    play = tmp / "noop.yml"
    play.write_text(
        PLAYBOOK.format(
            name=NAME,
            target=spec.sglang.target_file,
            ref=deploy.image_tag(spec, deploy.load_patch(spec)),
            dump_parent=str(Path(spec.dump.dir)),
            container=spec.container.name,
            version_py=spec.sglang.checkout + "/python/sglang/_version.py",
            lock=spec.lock_dir,
            audit=spec.audit_log,
        )
    )
    env = {
        **os.environ,
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_PIPELINING": str(pipelining),
        "ANSIBLE_SSH_ARGS": f"-o UserKnownHostsFile={lab.known_hosts} -o StrictHostKeyChecking=yes "
        "-o ControlMaster=auto -o ControlPersist=60s",
        "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-local"),
        "ANSIBLE_NOCOLOR": "1",
    }
    times = []
    for _ in range(runs):
        s = time.perf_counter()
        p = subprocess.run(
            [ansible, "-i", str(inv), str(play)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        times.append(time.perf_counter() - s)
        if p.returncode != 0:
            raise SystemExit(f"ansible failed:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
    return {"median_s": statistics.median(times), "min_s": min(times), "tasks": PLAYBOOK.count("- name:") + 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ansible", default="/tmp/ansible-venv/bin/ansible-playbook")
    ap.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="another checkout (e.g. `git worktree add /tmp/old HEAD~1`) to time interleaved with this one",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ro-bench-noop-") as d:
        tmp = Path(d)
        lab, spec, first = setup(tmp)
        try:
            res = {
                "first_deploy_s": first.wall_s,
                "first_deploy_round_trips": first.round_trips,
                "cli": bench_cli(args.runs),
                "inprocess": bench_inprocess(lab, spec, args.runs),
                "health": bench_health(lab, spec, args.runs),
                **({"compare": bench_compare(args.compare.resolve(), args.runs)} if args.compare else {}),
                "openssh": bench_openssh(lab, spec, args.runs, tmp),
            }
            if os.path.exists(args.ansible):
                res["ansible"] = bench_ansible(args.ansible, lab, spec, max(2, args.runs // 2), tmp, False)
                res["ansible_pipelining"] = bench_ansible(args.ansible, lab, spec, max(2, args.runs // 2), tmp, True)
        finally:
            lab.stop()
    report(res)


def report(res: dict) -> None:
    cli = statistics.median(r["wall_s"] for r in res["cli"])
    inproc = statistics.median(r["wall_s"] for r in res["inprocess"])
    rows = [
        ("remote-ops deploy (CLI, new process)", cli, res["cli"][0]["round_trips"]),
        ("remote-ops deploy (in-process: connect + deploy)", inproc, res["inprocess"][0]["round_trips"]),
        ("remote-ops health (CLI, new process)", res["health"]["cli_s"], res["health"]["round_trips"]),
        (
            "remote-ops health (in-process: connect + check_host)",
            res["health"]["inprocess_s"],
            res["health"]["round_trips"],
        ),
        (
            "OpenSSH ControlMaster, the same commands, cold (incl. master connect)",
            res["openssh"]["cold_s"],
            res["openssh"]["round_trips"],
        ),
        ("OpenSSH ControlMaster, the same commands, warm", res["openssh"]["warm_s"], res["openssh"]["round_trips"]),
    ]
    for key, label in (
        ("ansible", "Ansible playbook (defaults)"),
        ("ansible_pipelining", "Ansible playbook (pipelining)"),
    ):
        if key in res:
            rows.append((f"{label}, {res[key]['tasks']} tasks", res[key]["median_s"], None))
    print(f"first full deploy: {res['first_deploy_s']:.2f}s, {res['first_deploy_round_trips']} round trips")
    for label, row in res.get("compare", {}).items():
        print(
            f"compare {label}: "
            + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    h = res["health"]
    print(
        f"health on the deployed host: CLI {h['cli_s']:.3f}s, in-process {h['inprocess_s']:.3f}s, "
        f"{h['round_trips']} round trip(s)"
    )
    print("| contender | median wall (s) | round trips | vs remote-ops CLI |")
    print("|---|---|---|---|")
    for label, wall, trips in rows:
        print(f"| {label} | {wall:.3f} | {trips if trips is not None else '-'} | {wall / cli:.1f}x |")
    print(json.dumps(res, indent=1, default=str), file=sys.stderr)


if __name__ == "__main__":
    main()
