"""Would copies issued by another process spare the forward thread?  A probe for issue 15 (GPU only).

Why: on the H200 VM the dumper's copy job costs the forward thread ~6 us per driver call, and moving
those calls to a native thread of the same process made the next step pay as much (bench/README.md,
causes 11 and 14).  A design left to try has the writer process issue the copies itself (from CUDA
IPC handles).  Before building it, this measures the two things it rests on, without IPC:

- the forward side's cost of handing a job to another process: one pipe write per step;
- the GPU side: the copies then come from a second CUDA context on the same GPU (no MPS).  If the
  GPU time-sliced the two contexts, the model's kernels would wait for the other context's copies.

Arms, run in interleaved blocks of launch-bound steps (dumper_sweep.py's LaunchStep; the scheduler
waits for the forward stream only, as SGLang does):
- `none`, `none2` (A/A): no copies;
- `inproc`: per step a fence and 6 driver copy calls (the job's bytes) on a side stream of this
  process, through the dumper's own ctypes `Driver` (what SGLANG_HS_DUMP_COPY=calls does);
- `xproc`: per step one pipe write to a child process (its own CUDA context) that queues the same 6
  copies from its own GPU buffer into its own pinned buffer, and waits for them.

    python3 bench/xproc_copy_probe.py --tokens 1024,4096 --point-s 60 --out result.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

BYTES_PER_TOKEN = 57344  # final hidden + 3 aux at H = 7,168, bf16
COPIES = 6


def split(nbytes: int, parts: int):
    """(offset, size) of `parts` near-equal pieces of `nbytes`."""
    size = nbytes // parts
    return [(i * size, size if i < parts - 1 else nbytes - i * size) for i in range(parts)]


def child_main(conn, nbytes: int) -> None:
    """The copying process: its own context, its own buffers; one job per message, 'q' to stop."""
    import torch

    from remote_ops.dumper.cudadrv import Driver

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    driver = Driver.load()
    side = torch.cuda.Stream()
    handle, pieces = side.cuda_stream, split(nbytes, COPIES)
    conn.send("ready")
    while True:
        msg = conn.recv_bytes()
        if msg == b"q":
            return
        for off, size in pieces:
            driver.d2h(dst.data_ptr() + off, src.data_ptr() + off, size, handle)
        side.synchronize()
        conn.send_bytes(b"d")  # the parent drains these at the end of a block


class InProc:
    """The dumper's per-step copy job without the dumper: fence + 6 driver copies on a side stream."""

    def __init__(self, torch, nbytes: int):
        from remote_ops.dumper.cudadrv import Driver

        self.torch, self.driver = torch, Driver.load()
        self.src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.side = torch.cuda.Stream()
        self.event = self.driver.event_create()
        self.pieces = split(nbytes, COPIES)

    def job(self) -> None:
        main = self.torch.cuda.current_stream().cuda_stream
        side = self.side.cuda_stream
        self.driver.fence(self.event, main, side)
        for off, size in self.pieces:
            self.driver.d2h(self.dst.data_ptr() + off, self.src.data_ptr() + off, size, side)


def run_block(torch, step, x0, steps: int, arm) -> float:
    """Median ms of `steps` steps, each followed by the arm's `after_step()` and a wait on the forward
    stream; then the arm's `finish(steps)` (its copies done before the next block starts)."""
    after_step, finish = arm
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        hidden, aux = step.run(x0)
        after_step()
        del hidden, aux
        torch.cuda.current_stream().synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    finish(steps)
    return statistics.median(times)


def run_point(torch, tokens: int, args) -> dict:
    from dumper_sweep import LaunchStep

    nbytes = tokens * BYTES_PER_TOKEN
    step = LaunchStep(tokens, 7168, torch.device("cuda"))
    x0, _ids = step.inputs(0)
    inproc = InProc(torch, nbytes)
    parent, child_end = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=child_main, args=(child_end, nbytes), daemon=True)
    child.start()
    if not parent.poll(120):
        raise RuntimeError("the copying process did not start within 120 s")
    parent.recv()

    def acks(n):
        for _ in range(n):
            if not parent.poll(30):
                raise RuntimeError("the copying process did not finish a job within 30 s")
            parent.recv_bytes()

    nothing = (lambda: None, lambda n: None)
    arms = {
        "none": nothing,
        "inproc": (inproc.job, lambda n: None),
        "xproc": (lambda: parent.send_bytes(b"j"), acks),
        "none2": nothing,
    }
    for _ in range(3):  # warm-up
        for arm in arms.values():
            run_block(torch, step, x0, 2, arm)
    rounds, deadline = [], time.monotonic() + args.point_s
    while time.monotonic() < deadline or len(rounds) < 5:
        order = list(arms.items())
        if len(rounds) % 2:
            order.reverse()
        rounds.append({name: run_block(torch, step, x0, args.steps, arm) for name, arm in order})
    parent.send_bytes(b"q")
    child.join(30)
    base = [r["none"] for r in rounds]
    out = {"tokens": tokens, "job_bytes": nbytes, "rounds": len(rounds), "none_ms": round(statistics.median(base), 3)}
    for name in ("inproc", "xproc", "none2"):
        pct = sorted((r[name] / r["none"] - 1) * 100 for r in rounds)
        out[name + "_pct"] = {
            "median": round(statistics.median(pct), 2),
            "p25": round(pct[len(pct) // 4], 2),
            "p75": round(pct[3 * len(pct) // 4], 2),
        }
    out["rounds_ms"] = rounds
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--steps", type=int, default=8, help="steps per block")
    p.add_argument("--point-s", type=float, default=60.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    torch.zeros(1, device="cuda")
    result = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "points": []}
    for tokens in (int(t) for t in args.tokens.split(",")):
        point = run_point(torch, tokens, args)
        result["points"].append(point)
        print(json.dumps({k: v for k, v in point.items() if k != "rounds_ms"}), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
