"""A lab podman: Debian's podman with its own storage, config, network and API socket in a lab dir.

A lab host whose inventory says `engine: podman` (`HostLab(engine="podman")`)
gets, through its SSH sessions' environment (`env`), this podman's config
(`CONTAINERS_CONF`, `CONTAINERS_STORAGE_CONF`) and API socket
(`CONTAINER_HOST=unix://.../podman.sock`): the podman CLI there and the
engine's API relay (`remote_ops.engine.podman`) both reach this one, so the
machine's own podman state (`/var/lib/containers`, `/run/podman`) is never
touched.  With `CONTAINER_HOST` set the podman CLI is a client of that
service, so the lab starts it (`start_service`, PID recorded, no idle
timeout), as a host with podman's socket unit would have it; when it is not
running, the engine's relay starts one, as on any host (`service_pids`
finds both by the socket path in their command line).

Isolation and safety, as for the lab dockerd (hostlab/dockerd.py):

- storage (`graphroot`, `runroot`), the network config dir, the events log
  and the socket live in the lab dir;
- one bridge network of our own (a free 10.231.N.0/24, under the lab range
  that is routed nowhere), the default for every container; a raw-table rule
  drops anything arriving on that bridge for an address outside its subnet,
  so container traffic never leaves the machine (published ports still work:
  their replies go to the bridge's gateway);
- `default_ulimits = []`: podman 4.3's default `nofile` limit is above this
  machine's hard limit, which makes every container fail to start;
- nothing pulls: images come from rootfs tarballs (`import_tar`), builds run
  with `--pull=never`; besides, the lab's registries.conf has no search
  registry and blocks docker.io, and the sessions' proxies point at a closed
  loopback port.

Stopping (`stop`): every container (`rm -af`), then by PID the API service and
anything else whose command line names this lab dir (conmon), leftover mounts,
the firewall rule and the bridge; the images go with the lab dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ._proc import LabError, kill_tree, pids_with_arg, run, spawn, wait_for
from .dockerd import LAB_RANGE, release_subnet, unmount_under

PODMAN = "/usr/bin/podman"
CATATONIT = "/usr/libexec/podman/catatonit"
#: No registry at all: short names resolve to local images only, docker.io is blocked.
REGISTRIES = 'unqualified-search-registries = []\n\n[[registry]]\nlocation = "docker.io"\nblocked = true\n'
#: A closed loopback port (port 1 is never listened on here).
DEAD_PROXY = "http://127.0.0.1:1"


def podman_unavailable() -> str | None:
    """None if podman (with catatonit, for `--init`) and iptables are installed, else why not."""
    if not os.path.exists(PODMAN):
        return f"{PODMAN} not found (apt-get install podman catatonit)"
    if not os.path.exists(CATATONIT):
        return f"{CATATONIT} not found (apt-get install catatonit): podman needs it for --init"
    if not shutil.which("iptables"):
        return "iptables not found (apt-get install iptables)"
    return None


@dataclass
class LabPodman:
    """The lab's podman rooted at `dir`, its network `bridge` on `subnet` (a /24 under `LAB_RANGE`)."""

    dir: Path
    bridge: str
    subnet: str
    service: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "podman.sock"

    @property
    def network(self) -> str:
        return self.bridge

    def env(self) -> dict[str, str]:
        """What every SSH session of a podman lab host gets (sshd SetEnv): the lab's config, its
        socket, and proxies at a closed loopback port (a pull that slips through fails at once)."""
        return {
            "CONTAINERS_CONF": str(self.dir / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.dir / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(self.dir / "registries.conf"),
            "CONTAINER_HOST": f"unix://{self.socket}",
            "HTTP_PROXY": DEAD_PROXY,
            "HTTPS_PROXY": DEAD_PROXY,
        }

    def start(self) -> "LabPodman":
        """Write the config, the network and its egress rule; start the API service."""
        if (reason := podman_unavailable()) is not None:
            raise LabError(reason)
        for d in ("storage", "run", "networks", "tmp"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        (self.dir / "containers.conf").write_text(self._containers_conf())
        (self.dir / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.dir / "storage"}"\nrunroot = "{self.dir / "run"}"\n'
        )
        (self.dir / "registries.conf").write_text(REGISTRIES)
        (self.dir / "networks" / f"{self.network}.json").write_text(json.dumps(self._network_doc()))
        run(["ip", "route", "replace", "unreachable", LAB_RANGE, "metric", "4000"])
        _egress_rule("-I", self.bridge, self.subnet)
        return self.start_service()

    def start_service(self, timeout: float = 30.0) -> "LabPodman":
        """`podman system service` on the lab socket, no idle timeout, until `stop_service`."""
        env = {**os.environ, **{k: v for k, v in self.env().items() if k != "CONTAINER_HOST"}}
        argv = [PODMAN, "system", "service", "--time=0", f"unix://{self.socket}"]
        self.service = proc = spawn(argv, self.dir / "service.log", env=env)
        wait_for(
            self.socket.is_socket,
            timeout,
            f"podman API service on {self.socket} (log: {self.dir / 'service.log'})",
            alive=lambda: proc.poll() is None,
        )
        return self

    def stop_service(self) -> None:
        """Stop every API service on the lab socket (the lab's, or one the engine's relay started)."""
        if self.service is not None:
            kill_tree(self.service.pid, term_timeout=5, timeout=10, proc=self.service)
            self.service = None
        for pid in self.service_pids():
            kill_tree(pid, term_timeout=5, timeout=10)

    def _containers_conf(self) -> str:
        return (
            "[containers]\ndefault_ulimits = []\n\n"
            f'[network]\nnetwork_config_dir = "{self.dir / "networks"}"\ndefault_network = "{self.network}"\n\n'
            f'[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
            f'events_logfile_path = "{self.dir / "events.log"}"\ntmp_dir = "{self.dir / "tmp"}"\n'
        )

    def _network_doc(self) -> dict:
        base = self.subnet.rsplit(".", 1)[0]
        return {
            "name": self.network,
            "id": (self.bridge.encode().hex() * 64)[:64],
            "driver": "bridge",
            "network_interface": self.bridge,
            "created": "2026-01-01T00:00:00Z",
            "subnets": [{"subnet": self.subnet, "gateway": f"{base}.1"}],
            "ipv6_enabled": False,
            "internal": False,
            "dns_enabled": False,
            "ipam_options": {"driver": "host-local"},
        }

    def podman(
        self, *args: str, timeout: float = 120.0, input: bytes | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run the podman CLI here against the lab's storage (directly, not through the service)."""
        env = {k: v for k, v in self.env().items() if k != "CONTAINER_HOST"}
        env |= {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}
        return run([PODMAN, *args], timeout=timeout, input=input, check=check, env=env)

    def import_tar(self, tarball: bytes, tag: str) -> str:
        """Import a rootfs tarball as `tag` (podman names it `localhost/TAG`); return the image id."""
        return self.podman("import", "-", tag, input=tarball, timeout=300).stdout.decode().strip().splitlines()[-1]

    def service_pids(self) -> list[int]:
        """PIDs of this lab's API service (its command line names the lab's socket)."""
        return pids_with_arg(f"unix://{self.socket}")

    def wait_service_gone(self, timeout: float = 15.0) -> None:
        wait_for(lambda: not self.service_pids(), timeout, f"podman API service on {self.socket} to exit")

    def stop(self) -> None:
        """Remove the containers, stop the service and conmons by PID, unmount, unroute."""
        if self.dir.exists() and (self.dir / "storage.conf").exists():
            self.podman("rm", "-a", "-f", "-t", "0", check=False, timeout=60)
        self.stop_service()
        for pid in pids_with_arg(str(self.dir)):
            kill_tree(pid, term_timeout=5, timeout=10)
        unmount_under(self.dir)
        while _egress_rule("-D", self.bridge, self.subnet, check=False):
            pass
        if run(["ip", "link", "show", self.bridge], check=False).returncode == 0:
            run(["ip", "link", "del", self.bridge], check=False)
        release_subnet(self.subnet)


def _egress_rule(op: str, bridge: str, subnet: str, check: bool = True) -> bool:
    """Drop what arrives on the lab bridge for an address outside its subnet (raw table: before
    netavark's own forward and NAT rules)."""
    argv = ["iptables", "-w", "5", "-t", "raw", op, "PREROUTING", "-i", bridge, "!", "-d", subnet, "-j", "DROP"]
    return run(argv, check=check).returncode == 0
