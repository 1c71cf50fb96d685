"""SpecForge export vs a plain copy on the same disk, same run.  Goal: >= 80 % of the copy bandwidth.

Stdlib only (runs with any python3 >= 3.8, like the exporter on a host):

1. writes `--files` Kimi-sized dump files (H = 7168, bf16, `--tokens` each, random
   bytes) with the dump contract's own writer (`remote_ops/dumper/dumpfile.py`
   `write_span`, fsync on) and the matching prepared dataset (ids + loss mask);
2. for each `--jobs` value, runs `remote_ops/onhost/specforge_export.py export` in a
   fresh output dir: it first copies `--probe-mb` of the sources with the same
   number of streams (page cache dropped for them, output fsynced) = the disk
   anchor, then converts every file (sha256 checked over the converted bytes,
   fsync + rename per file);
3. prints export MB/s, copy MB/s and their ratio per jobs value.

    python3 bench/export_specforge.py [--dir /data/tmp] [--files 40] [--tokens 1730] [--jobs 1,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "remote_ops" / "dumper"))
import dumpfile  # noqa: E402  (stdlib-only dump contract module)


def make_dumps(root: Path, files: int, tokens: int, hidden: int) -> Path:
    """Dump files + the prepared dataset whose keys they carry; returns the dataset path."""
    rng = random.Random(0)
    rows = []
    floats = os.urandom(tokens * hidden * 2 * 4)  # reused payload: the bytes do not matter
    for i in range(files):
        ids = [rng.randrange(160000) for _ in range(tokens)]
        raw_ids = dumpfile.token_ids_bytes(ids)
        pos = dumpfile.token_ids_bytes(range(tokens))
        dumpfile.write_span(
            str(root),
            0,
            raw_ids,
            pos,
            memoryview(floats)[: tokens * hidden * 2],
            memoryview(floats)[tokens * hidden * 2 :],
            hidden,
            metadata={"hidden_states_norm": "post-norm"},
        )
        rows.append({"id": f"b{i}", "input_ids": ids, "loss_mask": [i % 2] * tokens})
    dataset = root / "prepared.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dataset


def run_export(dump_dir: Path, dataset: Path, out: Path, jobs: int, probe_mb: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "remote_ops" / "onhost" / "specforge_export.py"),
            "export",
            "--dump-dir",
            str(dump_dir),
            "--dataset",
            str(dataset),
            "--out",
            str(out),
            "--jobs",
            str(jobs),
            "--probe-mb",
            str(probe_mb),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    done = [json.loads(l) for l in proc.stdout.splitlines() if '"event": "done"' in l]
    if proc.returncode != 0 or not done:
        raise SystemExit(f"export failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    return done[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=1730)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--jobs", default="1,4,8")
    ap.add_argument("--probe-mb", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="export-bench-", dir=args.dir))
    try:
        dataset = make_dumps(base / "dumps", args.files, args.tokens, args.hidden)
        results = []
        for jobs in [int(j) for j in args.jobs.split(",")]:
            rep = run_export(base / "dumps", dataset, base / "out", jobs, args.probe_mb)
            results.append(
                {
                    "jobs": jobs,
                    "export_mb_s": rep["mb_per_s"],
                    "copy_mb_s": rep["disk_copy_probe"]["mb_per_s"],
                    "copy_runs_mb_s": rep["disk_copy_probe"]["runs_mb_per_s"],
                    "ratio": rep["ratio_to_disk"],
                    "bytes": rep["bytes_read"],
                    "files": rep["exported"],
                }
            )
            print(
                f"jobs {jobs}: export {rep['mb_per_s']} MB/s, copy probe {rep['disk_copy_probe']['mb_per_s']} MB/s "
                f"(before/after {rep['disk_copy_probe']['runs_mb_per_s']}) "
                f"({rep['disk_copy_probe']['bytes'] / 1e9:.2f} GB), ratio {rep['ratio_to_disk']}, "
                f"{rep['exported']} files / {rep['bytes_read'] / 1e9:.2f} GB",
                flush=True,
            )
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {"files": args.files, "tokens": args.tokens, "hidden": args.hidden, "results": results}, indent=1
                )
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
