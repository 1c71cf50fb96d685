"""SpecForge 0.2.0 on a GPU: the run.yaml `train start` renders, on an export made in the sandbox.

Two steps, because the GPU machine has no SSH libraries and the tool's renderer lives there:

    # here: the run.yaml of `train start` for a CUDA host (remote_ops.workflows.train.run_yaml),
    # beside a copy of a sandbox export, the sandbox target and the draft config
    .venv/bin/python bench/specforge_gpu.py render --export DIR --target DIR --draft-config FILE \
        --eval-export DIR --epochs 6 --dest .bench/sf
    # on the GPU machine (torch with CUDA, SpecForge 0.2.0 and its pure-Python needs on PYTHONPATH)
    python3 bench/specforge_gpu.py run --dir .bench/sf --out $OUT/specforge_gpu.json

`run` replaces the host paths in run.yaml (`model.target_model_path`, `model.draft_model_config`,
`data.*_path`, `output_dir`) by the copies beside it, nothing else, and starts the training
image's entrypoint (docker/train/remote_ops_train.py: SpecForge's own CLI, its CUDA path as is:
nccl, the Triton loss, FSDP's default).  It reports wall time, steps/s, SpecForge's last
`acc_k`/`ploss_k` and eval `simulated_acc_len`, read with remote_ops.core.specforge_run (pure).
`parse --log FILE` reads a captured log only (the CPU smoke run does that).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def render(a: argparse.Namespace) -> int:
    from remote_ops.workflows import train

    dest = Path(a.dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name, src in (("data", a.export), ("eval", a.eval_export), ("target", a.target)):
        if src:
            shutil.copytree(src, dest / name, symlinks=False)
    shutil.copy(a.draft_config, dest / "draft_config.json")
    samples = sum(1 for _ in (dest / "data").rglob("*.ckpt"))
    spec = SimpleNamespace(model=SimpleNamespace(path="/host/target"))
    plan = train.RunPlan(
        "bench",
        a.epochs,
        "/host/data",
        "/host/out",
        1,
        train.IMAGE_DRAFT_CONFIG,
        device="cuda",
        samples=samples,
        eval_data="/host/eval" if a.eval_export else None,
        log_interval=a.log_interval,
    )
    (dest / "run.yaml").write_text(train.run_yaml(spec, None, plan))  # the paths are the plan's
    print(f"rendered {dest}/run.yaml: {samples} samples, {a.epochs} epochs", file=sys.stderr)
    return 0


def localize(doc: dict, here: Path) -> dict:
    """run.yaml's host paths -> the copies in `here` (pure)."""
    doc = json.loads(json.dumps(doc))
    doc["model"]["target_model_path"] = str(here / "target")
    doc["model"]["draft_model_config"] = str(here / "draft_config.json")
    doc["data"]["hidden_states_path"] = str(here / "data")
    if "eval_hidden_states_path" in doc["data"]:
        doc["data"]["eval_hidden_states_path"] = str(here / "eval")
    doc["output_dir"] = str(here / "out")
    return doc


def report(log_text: str, wall_s: float | None, total: int | None) -> dict:
    from remote_ops.core import specforge_run as sfr

    m = sfr.run_metrics(log_text, total)
    out = {"wall_s": wall_s, **m.to_dict()}
    steps = out.get("step")
    if wall_s and steps:
        out["steps_per_s"] = round(steps / wall_s, 2)
    return out


def run(a: argparse.Namespace) -> int:
    here = Path(a.dir).resolve()
    doc = localize(json.loads((here / "run.yaml").read_text()), here)
    shutil.rmtree(here / "out", ignore_errors=True)
    (here / "run.local.yaml").write_text(json.dumps(doc, indent=1))
    log = here / "train.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        rc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "docker/train/remote_ops_train.py"),
                "train",
                "--config",
                str(here / "run.local.yaml"),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=a.timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        ).returncode
    wall = time.monotonic() - t0
    samples = sum(1 for _ in (here / "data").rglob("*.ckpt"))
    result = {
        "rc": rc,
        "samples": samples,
        "epochs": doc["training"]["num_epochs"],
        **report(log.read_text(), wall, samples * doc["training"]["num_epochs"]),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
        shutil.copy(log, Path(a.out).with_suffix(".log"))
    return rc


def parse(a: argparse.Namespace) -> int:
    print(json.dumps(report(Path(a.log).read_text(), None, None), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--export", required=True)
    r.add_argument("--eval-export")
    r.add_argument("--target", required=True)
    r.add_argument("--draft-config", required=True)
    r.add_argument("--epochs", type=int, default=6)
    r.add_argument("--log-interval", type=int, default=10)
    r.add_argument("--dest", required=True)
    g = sub.add_parser("run")
    g.add_argument("--dir", required=True)
    g.add_argument("--out")
    g.add_argument("--timeout", type=float, default=540)
    p = sub.add_parser("parse")
    p.add_argument("--log", required=True)
    a = ap.parse_args(argv)
    return {"render": render, "run": run, "parse": parse}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
