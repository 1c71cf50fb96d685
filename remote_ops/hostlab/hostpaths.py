"""Where one lab host keeps what a real host keeps under / (a path type, apart from `lab.py`
so that `gpu_standin` can find a recorded lab's hosts without importing the lab)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class HostPaths:
    """Where one lab host keeps what a real host keeps under / (all under `root`)."""

    root: Path

    @property
    def checkout(self) -> Path:
        return self.root / "sglang"

    @property
    def dump_dir(self) -> Path:
        return self.root / "data" / "eagle3-dumps"

    @property
    def logs_dir(self) -> Path:
        return self.root / "data" / "eagle3-logs"

    @property
    def audit_log(self) -> Path:
        return self.root / "var" / "log" / "remote-ops" / "audit.jsonl"

    @property
    def lock_dir(self) -> Path:
        return self.root / "var" / "lock" / "remote-ops.lock"

    @property
    def model_dir(self) -> Path:
        return self.root / "models" / "standin-model"

    @property
    def bin(self) -> Path:
        """This host's own programs, first on its SSH sessions' PATH (the GPU stand-in goes here)."""
        return self.root / "bin"

    def create(self) -> None:
        for d in (self.dump_dir, self.logs_dir, self.audit_log.parent, self.lock_dir.parent, self.model_dir):
            d.mkdir(parents=True, exist_ok=True)
