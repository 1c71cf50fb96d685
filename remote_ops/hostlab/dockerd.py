"""One real `dockerd` per lab, isolated in a temp dir, that can never reach a registry.

Isolation and safety choices, and why:

- data-root, exec-root, pidfile, unix socket and an empty `--config-file` live
  in the lab dir, so the machine's own Docker (if any) is untouched.
- `--iptables=false --ip-masq=false --ip-forward=false` and a bridge of our
  own (`ip link add NAME type bridge`) with an address in a private /24 under
  10.231.0.0/16; before the bridge exists, `unreachable 10.231.0.0/16 metric
  4000` is routed locally, and forwarding out of the bridge is dropped, so
  container traffic never leaves the machine.  Published ports
  (`-p 127.0.0.1:P:P`) work through docker-proxy.
- `HTTP_PROXY`/`HTTPS_PROXY` point at a closed loopback port: a pull that
  slips past `--pull=never` fails at once, locally.
- `--add-runtime nvidia=<runc>` plus a fake `nvidia-container-runtime-hook`
  (reads stdin, exits 0) on dockerd's PATH make `--gpus all` and
  `--runtime nvidia` work without GPUs (a stand-in: no device is exposed).
- Stopping: SIGTERM (dockerd stops containers and its containerd), then the
  whole tree by PID, then any containerd shim whose command line names this
  lab's exec-root, then leftover mounts, the bridge and the firewall rule.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ._proc import LabDaemon, LabError, alive, free_port, kill_tree, pids_with_arg, run, spawn, wait_for
from .images import _file_lock, docker

LAB_RANGE = "10.231.0.0/16"
HOOK = "#!/bin/sh\n# remote-ops hostlab standin for NVIDIA's OCI prestart hook: no GPUs here.\ncat >/dev/null\nexit 0\n"
DAEMON_PATH = "/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/sbin:/usr/local/bin"
#: Subnets picked by labs of live processes: one file per /24 holding the picker's PID, written
#: under a lock, so labs started at the same moment (pytest-xdist workers, concurrent runs, a
#: podman network whose bridge appears only with its first container) never share one.
SUBNET_DIR = Path(tempfile.gettempdir()) / "remote-ops-subnets"


@dataclass
class Dockerd(LabDaemon):
    """A lab dockerd rooted at `dir` with bridge `bridge` on `subnet` (a /24)."""

    LOG = "dockerd.log"

    dir: Path
    bridge: str
    subnet: str
    proc: subprocess.Popen | None = None
    proxy_port: int = 0

    @property
    def run_dir(self) -> Path:
        """Socket + exec-root home: `dir`, or a short /tmp path when `dir` is long.

        Unix socket paths must fit in 108 bytes, and containerd's lives at
        `<exec-root>/containerd/containerd.sock`.
        """
        if len(str(self.dir)) <= 60:
            return self.dir
        return Path("/tmp") / f"ro-dk-{hashlib.sha1(str(self.dir).encode()).hexdigest()[:12]}"

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def host(self) -> str:
        """The DOCKER_HOST value for this daemon."""
        return f"unix://{self.socket}"

    @property
    def exec_root(self) -> Path:
        return self.run_dir / "x"  # short: containerd's socket path must stay < 108 bytes

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    def docker(
        self, *args: str, timeout: float = 120.0, check: bool = True, input: bytes | None = None
    ) -> subprocess.CompletedProcess:
        """Run the docker CLI against this daemon (see `images.docker`)."""
        return docker(self.socket, *args, timeout=timeout, check=check, input=input)

    # -- start ----------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "Dockerd":
        """Create the bridge, write the fake hook, start dockerd, wait for `docker info`."""
        if self.running:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_hook()
        setup_bridge(self.bridge, self.subnet)
        (self.dir / "daemon.json").write_text("{}\n")
        self._clear_stale_pidfile()
        self.proxy_port = free_port()
        proc = self.proc = spawn(self.argv(), self.log_file, env=self.env())
        wait_for(
            self._answers, timeout, f"dockerd (log: {self.log_file})", interval=0.1, alive=lambda: proc.poll() is None
        )
        return self

    def _clear_stale_pidfile(self) -> None:
        """Remove a pidfile left by a killed dockerd of ours.  dockerd refuses to start while the
        PID in it is alive, and with pid_max 32768 a busy machine soon reuses that PID for
        something else; the file is ours to drop unless that PID is still a dockerd of this dir."""
        pidfile = self.dir / "docker.pid"
        try:
            pid = int(pidfile.read_text().strip() or 0)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid else b""
        except (OSError, ValueError):
            cmdline = b""
        if b"dockerd" not in cmdline or str(self.dir).encode() not in cmdline:
            pidfile.unlink(missing_ok=True)

    def _answers(self) -> bool:
        """True once `docker version` gets the server's answer on our socket."""
        if not self.socket.exists():
            return False
        try:
            return self.docker("version", timeout=10, check=False).returncode == 0
        except LabError:
            return False

    def argv(self) -> list[str]:
        runc = shutil.which("runc") or "/usr/sbin/runc"
        d = self.dir
        return [
            "dockerd",
            "--config-file",
            str(d / "daemon.json"),
            "--data-root",
            str(d / "data"),
            "--exec-root",
            str(self.exec_root),
            "--pidfile",
            str(d / "docker.pid"),
            "-H",
            self.host,
            "--iptables=false",
            "--ip-masq=false",
            "--ip-forward=false",
            "--bridge",
            self.bridge,
            "--add-runtime",
            f"nvidia={runc}",
            "--shutdown-timeout",
            "3",
            "--log-level",
            "warn",
        ]

    def env(self) -> dict[str, str]:
        proxy = f"http://127.0.0.1:{self.proxy_port}"
        return {
            "PATH": f"{self.bin_dir}:{DAEMON_PATH}",
            "HOME": str(self.dir),
            "HTTP_PROXY": proxy,
            "HTTPS_PROXY": proxy,
            "http_proxy": proxy,
            "https_proxy": proxy,
            "NO_PROXY": "",
            "no_proxy": "",
        }

    def _write_hook(self) -> None:
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        hook = self.bin_dir / "nvidia-container-runtime-hook"
        hook.write_text(HOOK)
        hook.chmod(0o755)

    # -- stop -----------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        """Stop dockerd and everything it started; remove bridge and rules. Idempotent."""
        if self.proc is not None:
            kill_tree(self.proc.pid, term_timeout=timeout / 2, timeout=timeout / 2, proc=self.proc)
            self.proc = None
        leftovers = pids_with_arg(str(self.exec_root))
        for pid in leftovers:
            kill_tree(pid, timeout=5)
        unmount_under(self.dir)
        if self.run_dir != self.dir:
            unmount_under(self.run_dir)
            shutil.rmtree(self.run_dir, ignore_errors=True)
        teardown_bridge(self.bridge, self.subnet)
        release_subnet(self.subnet)


def setup_bridge(bridge: str, subnet: str) -> None:
    """Route the lab range nowhere first, then create `bridge` with `.1` of `subnet`."""
    run(["ip", "route", "replace", "unreachable", LAB_RANGE, "metric", "4000"])
    if run(["ip", "link", "show", bridge], check=False).returncode != 0:
        run(["ip", "link", "add", bridge, "type", "bridge"])
    gateway = subnet.rsplit(".", 1)[0] + ".1/24"
    run(["ip", "addr", "replace", gateway, "dev", bridge])
    run(["ip", "link", "set", bridge, "up"])
    _iptables_forward("-I", bridge)


def teardown_bridge(bridge: str, subnet: str) -> None:
    """Delete the bridge and its forward-drop rule (the unreachable route stays: other labs share it)."""
    while _iptables_forward("-D", bridge, check=False):
        pass
    if run(["ip", "link", "show", bridge], check=False).returncode == 0:
        run(["ip", "link", "del", bridge], check=False)


def _iptables_forward(op: str, bridge: str, check: bool = True) -> bool:
    """Drop anything forwarded out of the lab bridge (belt and braces with ip_forward=0)."""
    if not shutil.which("iptables"):
        return False
    proc = run(["iptables", "-w", "5", op, "FORWARD", "-i", bridge, "!", "-o", bridge, "-j", "DROP"], check=check)
    return proc.returncode == 0


def pick_subnet() -> str:
    """A random free 10.231.N.0/24 (N in 1..254): not routed on this machine and not reserved by
    a live process; reserved for this one until `release_subnet` (or until this process exits)."""
    SUBNET_DIR.mkdir(parents=True, exist_ok=True)
    with _file_lock(SUBNET_DIR / ".lock", 30.0):
        routes = run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout.decode()
        taken = {line.split()[0] for line in routes.splitlines() if line.startswith("10.231.")}
        taken |= _reserved_subnets()
        free = [f"10.231.{n}.0/24" for n in range(1, 255) if f"10.231.{n}.0/24" not in taken]
        if not free:
            raise LabError("no free /24 left under 10.231.0.0/16")
        subnet = random.choice(free)
        _reservation(subnet).write_text(f"{os.getpid()}\n")
    return subnet


def _reservation(subnet: str) -> Path:
    return SUBNET_DIR / subnet.split("/")[0]


def _reserved_subnets() -> set[str]:
    """Subnets reserved by live processes (a dead process's reservation is removed)."""
    out = set()
    for path in SUBNET_DIR.glob("10.231.*"):
        try:
            pid = int(path.read_text().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid and alive(pid):
            out.add(f"{path.name}/24")
        else:
            path.unlink(missing_ok=True)
    return out


def release_subnet(subnet: str) -> None:
    """Drop the reservation of `subnet` (its lab is stopping); no error if there is none."""
    _reservation(subnet).unlink(missing_ok=True)


def unmount_under(path: Path) -> None:
    """Lazily unmount anything still mounted below `path` (deepest first)."""
    prefix = str(path.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for mnt in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        run(["umount", "-l", mnt], check=False, timeout=15)


def dockerd_available() -> str | None:
    """None if dockerd, a docker client, runc and ip are installed, else why not."""
    for tool, pkg in (("dockerd", "docker.io"), ("runc", "runc"), ("ip", "iproute2"), ("containerd", "containerd")):
        if not shutil.which(tool, path=DAEMON_PATH):
            return f"{tool} not found (apt-get install {pkg})"
    if not os.path.exists("/usr/bin/docker") and not shutil.which("docker"):
        return "no docker client (apt-get install docker.io)"
    return None
