"""`HostLab`: N real sshd hosts on loopback plus one dockerd (or one podman), with client files.

A lab directory holds everything: the client key, `known_hosts`,
`ssh_config`, an `inventory/` directory (one YAML file per host, the format of
`remote_ops.core.inventory`), per-host state (`hosts/<name>/…`), the dockerd's
data and a `lab.json` recording PIDs.  All hosts share this machine's
filesystem, so every path a host's inventory names (SGLang checkout, dump
dir, logs, audit log, lock dir, model dir) lies under that host's own
directory.  All hosts share the one dockerd, so container names, image names
and server ports are per host too.

Typical use (tests and `remote-ops sandbox`)::

    with HostLab(hosts=3) as lab:
        remote = lab.connect("lab1")
        remote.run(["docker", "ps"])          # reaches the lab dockerd

`HostLab(engine="podman", docker=False)` gives hosts whose inventory says
`engine: podman`, served by one lab podman (hostlab/podman.py) instead.

Addresses are random in 127.0.0.0/8 (never 127.0.0.x/127.0.1.x), checked free,
so parallel labs do not clash.  Stopping is by PID, with deadlines, idempotent,
and registered with `atexit` as a safety net (`keep=True` opts out: a sandbox
that must outlive the process; `HostLab.attach(dir).stop()` stops it later).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..core.inventory import HostSpec, Inventory, load_inventory
from ..remote import FabricRemote
from ..remote.sshconfig import SshTarget, Timeouts, load_ssh_config, resolve_target
from ._proc import LabError, alive, can_bind, free_port, kill_tree, same_root
from .delay import DelayProxy
from .dockerd import Dockerd, dockerd_available, pick_subnet
from .hostpaths import HostPaths
from .podman import LabPodman
from .sshd import DEFAULT_PATH, KeyPair, SshdHost, make_key, sshd_available

#: Timeouts for lab connections: loopback, so short connects; commands as usual.
LAB_TIMEOUTS = Timeouts(connect=5.0, banner=10.0, auth=10.0, command=120.0, keepalive=5)


@dataclass
class LabHost:
    """One lab host: its sshd, its paths and its per-host names."""

    name: str
    sshd: SshdHost
    paths: HostPaths
    server_port: int

    @property
    def address(self) -> str:
        return self.sshd.address

    @property
    def port(self) -> int:
        return self.sshd.port

    @property
    def container_name(self) -> str:
        return f"sglang-eagle3-{self.name}"

    @property
    def image_name(self) -> str:
        return f"remote-ops/sglang-eagle3-{self.name}"

    def inventory_entry(self, lab: "HostLab", base_image: str) -> dict:
        """The inventory mapping for this host (SSH settings + per-host paths)."""
        p = self.paths
        return {
            "address": self.address,
            "port": self.port,
            "user": "root",
            "identity_file": str(lab.client_key.private),
            "known_hosts": str(lab.known_hosts),
            "engine": lab.engine,
            "gpus": {"count": 0},
            "sglang": {
                "checkout": str(p.checkout),
                "version": lab.sglang_version,
                "base_image": base_image,
                "patch": lab.patch,
            },
            "container": {
                "name": self.container_name,
                "image": self.image_name,
                "gpus": "all",
                "shm_size": "1g",
                "restart": "no",
                "healthcheck_start_period_s": 60,
            },
            "model": {"path": str(p.model_dir), "served_name": "standin", "num_layers": 8, "hidden_size": 64},
            "dump": {"dir": str(p.dump_dir), "min_free_gb": 0},
            "server": {"port": self.server_port, "tp": 1, "healthy_timeout_s": 120},
            "logs": {
                "dir": str(p.logs_dir),
                "extraction": str(p.logs_dir / "extraction.log"),
                "training": str(p.logs_dir / "training.log"),
            },
            "audit_log": str(p.audit_log),
            "lock_dir": str(p.lock_dir),
        }


def lab_unavailable() -> str | None:
    """None if this machine can run a lab (root, sshd, dockerd), else the reason."""
    if os.geteuid() != 0:
        return "the host lab needs root (sshd on extra loopback addresses, dockerd, iptables)"
    return sshd_available() or dockerd_available()


def random_loopback(port: int = 22, taken: AbstractSet[str] = frozenset(), tries: int = 200) -> str:
    """A random 127.A.B.C (A >= 2) where `port` is free to listen on."""
    for _ in range(tries):
        addr = f"127.{random.randint(2, 254)}.{random.randint(0, 255)}.{random.randint(2, 254)}"
        if addr not in taken and can_bind(addr, port):
            return addr
    raise LabError(f"no free loopback address with port {port} after {tries} tries")


def pick_endpoint(port: int | None, taken: set[str]) -> tuple[str, int]:
    """A free loopback address and port: port 22 (or `port`) when possible.

    If something listens on 0.0.0.0:22 (a system sshd), no 127.x address can
    take port 22, so a free port is used instead.
    """
    try:
        return random_loopback(port or 22, taken, tries=200 if port else 20), port or 22
    except LabError:
        if port:
            raise
    address = random_loopback(0, taken)
    return address, free_port(address)


class HostLab:
    """N sshd hosts + one dockerd + client files in one directory (see module doc)."""

    def __init__(
        self,
        dir: str | Path | None = None,
        *,
        hosts: int = 3,
        names: list[str] | None = None,
        docker: bool = True,
        keep: bool = False,
        base_image: str = "remote-ops/base-python:bookworm",
        sglang_version: str = "0.5.9",
        port: int | None = None,
        patch: str = "deepseek-v2",
        engine: str = "docker",
    ) -> None:
        self.id = secrets.token_hex(3)
        self._owns_dir = dir is None
        self.dir = Path(dir) if dir else Path(tempfile.mkdtemp(prefix="ro-lab-", dir="/tmp"))
        self.names = names or [f"lab{i + 1}" for i in range(hosts)]
        self.use_docker = docker
        self.engine = engine  # the hosts' inventory `engine`; "podman": a lab podman serves them
        self.podman: LabPodman | None = None
        self.keep = keep
        self.base_image = base_image
        self.sglang_version = sglang_version
        self.patch = patch  # the patch spec its inventory names (sglang.patch)
        self.port = port
        self.hosts: list[LabHost] = []
        self.delayed: dict[str, tuple[str, DelayProxy]] = {}  # alias -> (host name, proxy)
        self.dockerd: Dockerd | None = None
        self.startup_s: float | None = None
        self._stopped = False

    # -- files ----------------------------------------------------------------
    @property
    def client_key(self) -> KeyPair:
        return KeyPair(self.dir / "client" / "id_ed25519")

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def inventory_dir(self) -> Path:
        return self.dir / "inventory"

    @property
    def docker_host(self) -> str | None:
        """DOCKER_HOST for the lab dockerd (None without docker)."""
        return self.dockerd.host if self.dockerd else None

    @property
    def session_bin(self) -> Path:
        """Put first on PATH in SSH sessions: `docker` here is Debian's 20.10 client."""
        return self.dir / "bin"

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> "HostLab":
        """Bring up dockerd and every sshd, then write known_hosts, ssh_config, inventory."""
        t0 = time.monotonic()
        if not self.keep:
            atexit.register(self.stop)
        self.dir.mkdir(parents=True, exist_ok=True)
        make_key(self.client_key.private, "remote-ops-lab-client")
        try:
            self._start_dockerd()
            self._start_podman()
            self._write_session_bin()
            self._start_hosts()
            self.write_client_files()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.write_state()
        return self

    def _start_dockerd(self) -> None:
        if self.use_docker:
            self.dockerd = Dockerd(self.dir / "docker", bridge=f"rolab{self.id}", subnet=pick_subnet())
            self.dockerd.start()

    def _start_podman(self) -> None:
        if self.engine == "podman":
            self.podman = LabPodman(self.dir / "podman", bridge=f"ropm{self.id}", subnet=pick_subnet())
            self.podman.start()

    def _write_session_bin(self) -> None:
        self.session_bin.mkdir(parents=True, exist_ok=True)
        link = self.session_bin / "docker"
        if os.path.exists("/usr/bin/docker") and not link.is_symlink():
            link.symlink_to("/usr/bin/docker")

    def session_env(self, paths: HostPaths | None = None) -> dict[str, str]:
        """Environment every SSH session of a host gets (sshd_config SetEnv): its own bin dir
        (`paths.bin`), then the lab's, first on PATH."""
        own = f"{paths.bin}:" if paths else ""
        env = {"PATH": f"{own}{self.session_bin}:{DEFAULT_PATH}"}
        if self.docker_host:
            env["DOCKER_HOST"] = self.docker_host
        if self.podman is not None:
            env.update(self.podman.env())
        return env

    def _start_hosts(self) -> None:
        taken: set[str] = set()
        for name in self.names:
            address, port = pick_endpoint(self.port, taken)
            taken.add(address)
            paths = HostPaths(self.dir / "hosts" / name)
            sshd = SshdHost(
                name, address, port, self.dir / "hosts" / name / "sshd", self.client_key, env=self.session_env(paths)
            )
            host = LabHost(name, sshd, paths, free_port())
            host.paths.create()
            sshd.start()
            self.hosts.append(host)

    def write_client_files(self) -> None:
        """known_hosts, ssh_config and inventory/<name>.yaml for every host and every delayed alias."""
        lines = [h.sshd.known_hosts_line() for h in self.hosts]
        lines += [self._alias_known_hosts_line(alias) for alias in self.delayed]
        self.known_hosts.write_text("".join(line + "\n" for line in lines))
        self.ssh_config.write_text(
            "".join(self._ssh_config_block(h.name, h.address, h.port) for h in self.hosts)
            + "".join(self._ssh_config_block(a, p.listen_address, p.listen_port) for a, (_, p) in self.delayed.items())
        )
        self.inventory_dir.mkdir(parents=True, exist_ok=True)
        for h in self.hosts:
            self._write_inventory(h.name, h.inventory_entry(self, self.base_image))
        for alias, (name, proxy) in self.delayed.items():
            entry = self.host(name).inventory_entry(self, self.base_image)
            self._write_inventory(alias, {**entry, "address": proxy.listen_address, "port": proxy.listen_port})

    def _write_inventory(self, name: str, entry: dict) -> None:
        text = "# written by remote_ops.hostlab: a lab host on loopback\n" + yaml.safe_dump(
            {"hosts": {name: entry}}, sort_keys=False
        )
        (self.inventory_dir / f"{name}.yaml").write_text(text)

    def _alias_known_hosts_line(self, alias: str) -> str:
        """The delayed alias's own known_hosts line: its proxy's address, the real host's key."""
        name, proxy = self.delayed[alias]
        keytype, key = self.host(name).sshd.known_hosts_line().split()[1:3]
        host = proxy.listen_address if proxy.listen_port == 22 else f"[{proxy.listen_address}]:{proxy.listen_port}"
        return f"{host} {keytype} {key}"

    # -- latency --------------------------------------------------------------
    def add_delay(self, name: str, rtt_ms: float, *, rate_mbit: float | None = None, alias: str | None = None) -> str:
        """Put a delay proxy with `rtt_ms` (and a rate cap) in front of host `name`; return its alias.

        The alias is a host of its own in the inventory, ssh_config and
        known_hosts (the proxy's loopback address, the real host's key), with
        the real host's paths, container and server: the same machine, further
        away."""
        alias = alias or f"{name}-rtt{rtt_ms:g}"
        taken = {h.address for h in self.hosts} | {p.listen_address for _, p in self.delayed.values()}
        address, port = pick_endpoint(self.port, taken)
        h = self.host(name)
        proxy = DelayProxy(address, port, h.address, h.port, rtt_ms, self.dir, rate_mbit=rate_mbit).start()
        self.delayed[alias] = (name, proxy)
        self.write_client_files()
        self.write_state()
        return alias

    def _ssh_config_block(self, name: str, address: str, port: int) -> str:
        return (
            f"Host {name}\n  HostName {address}\n  Port {port}\n  User root\n"
            f"  IdentityFile {self.client_key.private}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.known_hosts}\n  StrictHostKeyChecking yes\n"
            f"  BatchMode yes\n  ConnectTimeout 5\n\n"
        )

    def stop(self) -> None:
        """Stop every sshd tree and the dockerd, by PID with deadlines; idempotent."""
        from .faults import heal_lab  # local: faults imports lab types

        if self._stopped:
            return
        heal_lab(self)
        for _, proxy in self.delayed.values():
            proxy.stop()
        for h in self.hosts:
            h.sshd.stop()
        if self.dockerd is not None:
            self.dockerd.stop()
        if self.podman is not None:
            self.podman.stop()
        self._stopped = True
        self.write_state()
        if self._owns_dir and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "HostLab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- hosts ----------------------------------------------------------------
    def host(self, name: str) -> LabHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no lab host named {name!r} (have {[h.name for h in self.hosts]})")

    def restart(self, name: str) -> LabHost:
        """Start a stopped host again, same address, port and host key."""
        h = self.host(name)
        h.sshd.start()
        self.write_state()
        return h

    def inventory(self) -> Inventory:
        return load_inventory([self.inventory_dir])

    def spec(self, name: str) -> HostSpec:
        return self.inventory().one(name)

    def target(self, name: str, *, policy: str = "strict", timeouts: Timeouts | None = None, **overrides) -> SshTarget:
        """The SshTarget for `name` from the lab inventory + ssh_config (as the CLI resolves it).

        `overrides` replace HostSpec fields first (e.g. known_hosts=…, proxy_jump=…).
        """
        spec = self.spec(name)
        if overrides:
            spec = spec.model_copy(update=overrides)
        return resolve_target(spec, load_ssh_config(self.ssh_config), policy=policy, timeouts=timeouts or LAB_TIMEOUTS)

    def connect(self, name: str, **kwargs) -> FabricRemote:
        """A connected FabricRemote to `name` (caller closes it)."""
        return FabricRemote(self.target(name, **kwargs)).connect()

    def fake_gpus(self, name: str, *cases: str, state: dict | None = None) -> dict:
        """Give host `name` the STAND-IN nvidia-smi (and dmesg/journalctl) with the named fault
        cases (`gpu_standin.CASES`; none: healthy), or exactly `state`; returns the case data."""
        from . import gpu_standin

        data = state if state is not None else gpu_standin.case(*cases)
        gpu_standin.install(self.host(name).paths.bin, data)
        return data

    def no_fake_gpus(self, name: str) -> None:
        """Take the GPU stand-in away from host `name` (no NVIDIA driver again)."""
        from . import gpu_standin

        gpu_standin.remove(self.host(name).paths.bin)

    def install_sglang(self, name: str, version: str | None = None, git: bool = True) -> Path:
        """Put the real SGLang `version` tree (from the PyPI wheel) in `name`'s checkout.

        The checkout gets the layout of a git checkout (`python/sglang/…`) and,
        with `git=True`, a real git repository with one commit, so `git status`
        and `git diff` on the host behave as on a clone.
        """
        from ..wheels import fetch_sglang_wheel, unpack_python_tree

        checkout = self.host(name).paths.checkout
        if checkout.exists():
            shutil.rmtree(checkout)
        unpack_python_tree(fetch_sglang_wheel(version or self.sglang_version), checkout)
        if git and shutil.which("git"):
            _git_commit(checkout, f"sglang {version or self.sglang_version} (from the PyPI wheel)")
        return checkout

    # -- state file -----------------------------------------------------------
    def write_state(self) -> None:
        """Record PIDs and addresses in lab.json (for `attach` from another process)."""
        state = {
            "id": self.id,
            "stopped": self._stopped,
            "dockerd": {
                "pid": self.dockerd.pid,
                "dir": str(self.dockerd.dir),
                "bridge": self.dockerd.bridge,
                "subnet": self.dockerd.subnet,
            }
            if self.dockerd
            else None,
            "hosts": [
                {"name": h.name, "address": h.address, "port": h.port, "pid": h.sshd.pid, "server_port": h.server_port}
                for h in self.hosts
            ],
            "delayed": [
                {
                    "alias": a,
                    "host": n,
                    "address": p.listen_address,
                    "port": p.listen_port,
                    "rtt_ms": p.rtt_ms,
                    "pid": p.pid,
                }
                for a, (n, p) in self.delayed.items()
            ],
        }
        (self.dir / "lab.json").write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def attach(cls, dir: str | Path) -> "RecordedLab":
        """The lab recorded in `dir/lab.json`, to inspect or stop from another process."""
        return RecordedLab(Path(dir))


@dataclass
class RecordedLab:
    """A lab started by another process (e.g. `sandbox up`), known from its lab.json."""

    dir: Path

    @property
    def state(self) -> dict:
        path = self.dir / "lab.json"
        return json.loads(path.read_text()) if path.exists() else {"hosts": [], "dockerd": None}

    def running(self) -> bool:
        """True if any recorded daemon PID is still alive and still ours."""
        return any(_ours(pid, self.dir) for pid in self._pids())

    def _pids(self) -> list[int]:
        s = self.state
        pids = [h["pid"] for h in s["hosts"] + s.get("delayed", []) if h.get("pid")]
        return pids + ([s["dockerd"]["pid"]] if s.get("dockerd") and s["dockerd"].get("pid") else [])

    def stop(self) -> None:
        """Stop recorded sshd trees and dockerd by PID (checked to be this lab's), clean up."""
        from .dockerd import Dockerd

        s = self.state
        for h in s.get("delayed", []) + s["hosts"]:
            if h.get("pid") and _ours(h["pid"], self.dir):
                kill_tree(h["pid"], timeout=10)
        d = s.get("dockerd")
        if d:
            dockerd = Dockerd(Path(d["dir"]), d["bridge"], d["subnet"])
            if d.get("pid") and _ours(d["pid"], self.dir):
                kill_tree(d["pid"], term_timeout=15, timeout=15)
            dockerd.stop()
        from .faults import heal_recorded

        heal_recorded(s.get("id", ""))
        self._mark_stopped(s)

    def _mark_stopped(self, state: dict) -> None:
        """Record that the lab was stopped, so a later `status` says "not running", not "degraded"."""
        path = self.dir / "lab.json"
        if path.exists():
            path.write_text(json.dumps({**state, "stopped": True}, indent=2) + "\n")


def _ours(pid: int, lab_dir: Path) -> bool:
    """PID is alive, shares our root and its command line names a file of this lab (guards against
    PID reuse, also by a lab at the same path in another chroot)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return alive(pid) and str(lab_dir.resolve()).encode() in cmdline and same_root(pid)


def _git_commit(checkout: Path, message: str) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "remote-ops lab",
        "GIT_AUTHOR_EMAIL": "lab@localhost",
        "GIT_COMMITTER_NAME": "remote-ops lab",
        "GIT_COMMITTER_EMAIL": "lab@localhost",
    }
    for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", message]):
        subprocess.run(
            ["git", "-C", str(checkout), *argv[1:]],
            check=True,
            env=env,
            capture_output=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
