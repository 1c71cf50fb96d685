"""deploy's records: the local run record (JSON per run) and the host's audit line."""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from pathlib import Path

from ... import __version__
from ...paths import host_dir


def write_record(host_name: str, doc: dict) -> Path:
    """runs/<UTC time>-deploy.json under the host's state dir (atomic rename)."""
    runs = host_dir(host_name) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-deploy.json")
    tmp = path.with_suffix(".tmp")
    from ...core.jsonable import to_jsonable

    tmp.write_text(json.dumps(to_jsonable(doc), indent=2) + "\n")
    tmp.replace(path)
    return path


def _audit_line(record: dict) -> dict:
    """The short line appended to the host's audit log."""
    return {
        "time": record["time"],
        "tool": f"remote-ops {__version__}",
        "action": "deploy",
        "user": getpass.getuser(),
        "client": socket.gethostname(),
        "ok": record["ok"],
        "up_to_date": record["up_to_date"],
        "image": record["image"],
        "image_id": record.get("image_id"),
        "steps": {s["name"]: s["status"] for s in record["steps"]},
        "error": (record.get("error") or {}).get("message"),
        "failed_step": record.get("failed_step"),
    }


def _error_doc(failure: BaseException | None) -> dict | None:
    """The run record's `error`: the typed error's dict, a signal, or a bug's repr."""
    if failure is None:
        return None
    if hasattr(failure, "to_dict"):
        return failure.to_dict()
    return {"error": "internal", "exit_code": 1, "message": f"{type(failure).__name__}: {failure}"}


def _failed_step(steps: list) -> str | None:
    """The name of the first failed step (a list of `StepResult`), or None."""
    return next((s.name for s in steps if s.status == "failed"), None)
