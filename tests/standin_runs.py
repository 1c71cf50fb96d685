"""Extraction runs on the computing SGLang stand-in, deployed on lab2, shared by the audit tests.

`extraction(lab, standin_base, faults)` deploys the stand-in with the fault switches `faults`
(the inventory's `container.env`: STANDIN_FINAL_NORM=pre, STANDIN_DROP_AUX=1, ...) through the
real deploy workflow, empties the dump dir and the extraction work dir, and runs the real
extraction client over 16 fresh prompts (with loss masks) to the end.  A run is kept for the
session and given again while lab2 still holds it (same container settings, the extraction's
run.json naming its dataset): tests/test_audit.py and tests/test_contract_guards.py share one
deployment per fault set.  A test that changes a dump restores it.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = 16
_RUNS: dict[tuple, "Run"] = {}


@dataclass
class Run:
    """One extraction on lab2: its spec (deployed), the samples and where things lie."""

    spec: object
    faults: dict
    samples: list[dict]
    dump_dir: Path
    workdir: Path
    model_dir: Path
    dataset_id: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def rows(self) -> dict[str, dict]:
        """The client manifest's ok lines by key."""
        lines = (self.workdir / "manifest.jsonl").read_text().splitlines()
        return {r["key"]: r for r in map(json.loads, lines) if r.get("status") == "ok"}


def prompts(seed: int) -> list[dict]:
    """16 prompts of 2 to ~400 tokens with a loss mask on their second half; fresh keys per seed."""
    rng = random.Random(seed)
    out = []
    for i in range(SAMPLES):
        ids = [rng.randrange(32000) for _ in range(rng.randint(2, 400))]
        out.append(
            {"id": f"a{i}", "input_ids": ids, "loss_mask": [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)}
        )
    return out


def _spec(lab, standin_base, faults: dict):
    from remote_ops.workflows import sandbox

    host = lab.host("lab2")
    sandbox.write_model_config(host.paths.model_dir)
    s = lab.spec("lab2")
    env = {"STANDIN_LOAD_SECONDS": "0.5", "STANDIN_REQUIRE_PATCH": "1", **faults}
    return s.model_copy(
        update={
            "sglang": s.sglang.model_copy(update={"base_image": standin_base}),
            "server": s.server.model_copy(update={"launcher": sandbox.STANDIN_LAUNCHER, "healthy_timeout_s": 60}),
            "container": s.container.model_copy(update={"env": env}),
        }
    )


def _still_there(run: Run) -> bool:
    try:
        doc = json.loads((run.workdir / "run.json").read_text())
    except (OSError, ValueError):
        return False
    files = list((run.dump_dir / "rank0").glob("*.safetensors"))
    return doc.get("dataset_id") == run.dataset_id and len(files) == SAMPLES


def extraction(lab, standin_base, faults: dict | None = None) -> Run:
    """lab2 serving the stand-in with `faults`, and a finished 16-sample extraction on it."""
    from conftest import connect

    from remote_ops.workflows import deploy, extract

    faults = dict(faults or {})
    key = tuple(sorted(faults.items()))
    host = lab.host("lab2")
    spec = _spec(lab, standin_base, faults)
    t0 = time.monotonic()
    remote = connect(lab, "lab2")
    try:
        _reset_checkout(host)
        known = _RUNS.get(key)
        # a no-op while it serves these settings; it recreates a server whose mount of the dump dir
        # is stale (another file on this worker may have removed and remade that dir)
        deploy.deploy(remote, spec, why="audit test")
        if known is not None and _still_there(known):
            return known
        # the dump dir is bind-mounted into the server: its contents go, the dir itself stays
        subprocess.run(["find", str(host.paths.dump_dir), "-mindepth", "1", "-delete"], check=True, timeout=30)
        subprocess.run(["rm", "-rf", str(host.paths.logs_dir / "extract")], check=True, timeout=30)
        samples = prompts(time.time_ns())
        with tempfile.TemporaryDirectory(prefix="audit-run-") as tmp:  # a local file: uploaded, as operators do
            ds = Path(tmp) / "prepared.jsonl"
            ds.write_text("".join(json.dumps(s) + "\n" for s in samples))
            extract.start(remote, spec, str(ds), concurrency=4, dump_grace=5)
        st = extract.wait_finished(remote, spec, 120, interval_s=0.3)
        assert st.summary.done == SAMPLES, st
        run = Run(spec, faults, samples, host.paths.dump_dir, host.paths.logs_dir / "extract", host.paths.model_dir)
        run.dataset_id = json.loads((run.workdir / "run.json").read_text())["dataset_id"]
        run.seconds = round(time.monotonic() - t0, 1)
        _RUNS.clear()  # one deployment at a time: the others are gone from the host
        _RUNS[key] = run
        return run
    finally:
        remote.close()


def _reset_checkout(host) -> None:
    """lab2's SGLang checkout back to the pristine tree (as the sglang_host fixture does)."""
    checkout = str(host.paths.checkout)
    for argv in (["git", "-C", checkout, "reset", "-q", "--hard"], ["git", "-C", checkout, "clean", "-qfdx"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
