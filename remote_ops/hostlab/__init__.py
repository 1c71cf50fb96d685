"""Real local test hosts: sshd on loopback addresses, one isolated dockerd, base images.

Used by the test suite (`tests/conftest.py`) and by `remote-ops sandbox`.
Everything here needs root and Debian's openssh-server, docker.io, iptables,
debootstrap and busybox-static (see `scripts/setup`).

Main entry points:

- `HostLab` (lab.py): N hosts + dockerd + known_hosts/ssh_config/inventory.
- `Faults` and `crash/refuse/drop/freeze/thaw/hang_command` (faults.py).
- `busybox_image`, `base_python_image`, `import_tar` (images.py).
- `SshdHost`, `Dockerd`: the single daemons, if a caller needs just one.
- `lab_unavailable()`: None, or why a lab cannot run here (for skips).
"""

from ._proc import LabError
from .dockerd import Dockerd
from .faults import Faults, crash, drop, freeze, hang_command, iptables_available, refuse, thaw, unblock
from .images import BASE_PYTHON_TAG, BUSYBOX_TAG, base_python_image, base_python_tarball, busybox_image, import_tar
from .lab import LAB_TIMEOUTS, HostLab, HostPaths, LabHost, RecordedLab, lab_unavailable
from .sshd import SshdHost

__all__ = [
    "LabError",
    "Dockerd",
    "Faults",
    "crash",
    "drop",
    "freeze",
    "hang_command",
    "iptables_available",
    "refuse",
    "thaw",
    "unblock",
    "BASE_PYTHON_TAG",
    "BUSYBOX_TAG",
    "base_python_image",
    "base_python_tarball",
    "busybox_image",
    "import_tar",
    "LAB_TIMEOUTS",
    "HostLab",
    "HostPaths",
    "LabHost",
    "RecordedLab",
    "lab_unavailable",
    "SshdHost",
]
