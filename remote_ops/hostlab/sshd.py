"""A real OpenSSH server on a loopback address: one lab "host".

Each host has its own directory with an ed25519 host key, an sshd_config and a
log.  The server runs in the foreground (`sshd -D -e -f CONFIG`) in its own
session; stopping it kills the listener and every descendant (per-connection
children call setsid, so killing the listener alone would leave sessions
alive).  Remote sessions get `DOCKER_HOST` (and a PATH whose `docker` is the
lab's chosen client) through sshd_config `SetEnv`, so `docker` run over SSH
reaches the lab dockerd.

A lab host models a standard server, not this machine's own login: sshd
starts the command through the user's shell, and Debian's bash sources
`~/.bashrc` when sshd runs it as a top-level shell.  Debian's stock
`~/.bashrc` returns at once for a non-interactive shell; a developer's own
(pyenv/conda init without that guard) costs ~0.1 s per session and puts a
shim first on PATH.  So sessions get `SHLVL=1` (`SESSION_ENV`): bash then
counts itself as a nested shell and reads no rc file, as on a plain host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ._proc import LabDaemon, kill_tree, port_open, run, spawn, wait_for

SSHD = "/usr/sbin/sshd"
#: sshd's compiled-in default PATH, with the lab's bin dir put first.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Every lab session's environment: bash started by sshd reads ~/.bashrc only as a top-level shell.
SESSION_ENV = {"SHLVL": "1"}


@dataclass
class KeyPair:
    """An OpenSSH key pair on disk."""

    private: Path

    @property
    def public(self) -> Path:
        return Path(str(self.private) + ".pub")

    def public_line(self) -> str:
        return self.public.read_text().strip()


def make_key(path: Path, comment: str = "remote-ops-lab") -> KeyPair:
    """Create an ed25519 key pair at `path` (kept if it already exists)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], timeout=30)
    return KeyPair(path)


@dataclass
class SshdHost(LabDaemon):
    """One sshd listening on `address:port`, configured from files under `dir`.

    `env` is exported to every SSH session through `SetEnv` (DOCKER_HOST, PATH).
    """

    LOG = "sshd.log"

    name: str
    address: str
    port: int
    dir: Path
    client_key: KeyPair
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def host_key(self) -> KeyPair:
        return KeyPair(self.dir / "ssh_host_ed25519_key")

    @property
    def config_file(self) -> Path:
        return self.dir / "sshd_config"

    def known_hosts_line(self) -> str:
        """The known_hosts line for this host (`[addr]:port` form when port != 22)."""
        keytype, key = self.host_key.public_line().split()[:2]
        return f"{_known_host_name(self.address, self.port)} {keytype} {key}"

    def prepare(self) -> None:
        """Write host key, authorized_keys and sshd_config; check the config with `sshd -t`."""
        self.dir.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation dir
        make_key(self.host_key.private, f"{self.name}-host")
        (self.dir / "authorized_keys").write_text(self.client_key.public_line() + "\n")
        self.config_file.write_text(self.render_config())
        run([SSHD, "-t", "-f", str(self.config_file)], timeout=15)

    def render_config(self) -> str:
        """The sshd_config text: key auth only, SFTP, SetEnv for the lab dockerd."""
        lines = [
            f"ListenAddress {self.address}:{self.port}",
            f"HostKey {self.host_key.private}",
            f"PidFile {self.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "MaxSessions 32",
            "MaxStartups 64:30:128",
            "UseDNS no",
            "PrintMotd no",
            "LogLevel INFO",
            "AllowTcpForwarding yes",
            "Subsystem sftp internal-sftp",
        ]
        env = {**SESSION_ENV, **self.env}
        lines.append("SetEnv " + " ".join(f'{k}="{v}"' for k, v in sorted(env.items())))
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 15.0) -> "SshdHost":
        """Start sshd in the foreground in its own session; wait until the port accepts."""
        if self.running:
            return self
        self.prepare()  # always: a kept lab (the sandbox) restarts on a new address
        self.proc = proc = spawn([SSHD, "-D", "-e", "-f", str(self.config_file)], self.log_file, subreaper=True)
        try:
            wait_for(
                lambda: port_open(self.address, self.port),
                timeout,
                f"sshd {self.name} on {self.address}:{self.port} (log: {self.log_file})",
                alive=lambda: proc.poll() is None,
            )
        except BaseException:
            self.stop()  # not yet known to the lab: nobody else would stop it
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Kill the listener and every session under it (a host crash); idempotent."""
        if self.proc is None:
            return
        kill_tree(self.proc.pid, timeout=timeout, proc=self.proc)
        self.proc = None


def _known_host_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def sshd_available() -> str | None:
    """None if sshd and ssh-keygen are installed, else why not (for skip messages)."""
    if not os.path.exists(SSHD):
        return f"{SSHD} not found (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen not found (apt-get install openssh-client)"
    return None
