"""How fast the copy kernel (hsk.cu, SGLANG_HS_DUMP_COPY=kernel) moves a job to host memory, next to the
copy engine, and what each does to a launch-bound loop running beside it.  GPU only (run on the device).

Why: in run 32 the kernel mode cost the step after an 8,192-token capture +13..+16 % while the copy
engine's path cost ~+1 %.  This measures the two suspects: the kernel's throughput into device-mapped
host memory (a slow kernel overlaps the next step), and the slowdown of small kernels queued beside it.

    python3 bench/hsk_throughput.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote_ops.dumper.cudadrv import Driver  # noqa: E402
from remote_ops.dumper.kernelcopy import KernelCopy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dumper_sweep import LaunchStep  # noqa: E402


def host_buffer(driver: Driver, nbytes: int):
    """A page-locked, device-mapped host buffer (as the dumper's shared segment is in kernel mode)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    driver.register(host.data_ptr(), nbytes, device_map=True)
    return host, driver.device_pointer(host.data_ptr())


def timed(stream: torch.cuda.Stream, queue, repeats: int) -> float:
    """Median ms of `queue()` on `stream`, by CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        queue()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def throughput(driver, copier, src, dst_host, dst_dev, nbytes, blocks_list, repeats):
    """GB/s of one contiguous copy of `nbytes`: the copy engine, then the kernel at each block count."""
    side = torch.cuda.Stream()
    handle = side.cuda_stream
    out = {"bytes": nbytes}
    ms = timed(side, lambda: driver.d2h(dst_host, src, nbytes, handle), repeats)
    out["copy_engine_gbs"] = round(nbytes / ms / 1e6, 2)
    for blocks in blocks_list:
        copier.blocks = blocks
        ms = timed(
            side, lambda: Driver.check(copier.launch(handle, (src, 0, dst_dev, 0, nbytes, 0)), "launch"), repeats
        )
        out["kernel_%d_gbs" % blocks] = round(nbytes / ms / 1e6, 2)
    return out


def loops(kernels: int, step_tokens: int):
    """Loops to run beside a copy: `small` (launch-bound, like a small prefill step), `bulk` (each
    kernel an elementwise pass over 128 MB that fills every SM) and `step` (dumper_paired's launch
    step of `step_tokens` tokens: 61 layers of rms_norm, add and small matmuls; memory-bound at 8k)."""
    x = torch.zeros(4096, device="cuda")
    y = torch.zeros(32 * 2**20, device="cuda")
    launch_step = LaunchStep(step_tokens, 7168, torch.device("cuda"))
    x0, _ids = launch_step.inputs(0)

    def small():
        for _ in range(kernels):
            x.add_(1.0)

    def bulk():
        for _ in range(kernels // 12):
            y.mul_(1.0001)

    return {"small": small, "bulk": bulk, "step": lambda: launch_step.run(x0)}


def interference(driver, copier, src, dst_host, dst_dev, nbytes, blocks_list, args):
    """Wall ms of each loop on the main stream, alone and with a copy of `nbytes` queued on a side stream
    just before it (the copy engine, then the kernel at each block count), and how long that copy took
    beside the loop (`..._copy_ms`, CUDA events on the side stream)."""
    side = torch.cuda.Stream()
    handle = side.cuda_stream

    def kernel_copy(blocks):
        def queue():
            copier.blocks = blocks
            Driver.check(copier.launch(handle, (src, 0, dst_dev, 0, nbytes, 0)), "launch")

        return queue

    copies = {"alone": lambda: None, "copy_engine": lambda: driver.d2h(dst_host, src, nbytes, handle)}
    copies.update({"kernel_%d" % b: kernel_copy(b) for b in blocks_list})
    out = {"bytes": nbytes, "kernels": args.kernels, "step_tokens": args.step_tokens}
    for loop_name, loop in loops(args.kernels, args.step_tokens).items():
        for name, queue in copies.items():
            times, copy_ms = [], []
            for _ in range(args.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record(side)
                queue()
                end.record(side)
                t0 = time.perf_counter()
                loop()
                torch.cuda.current_stream().synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                copy_ms.append(start.elapsed_time(end))
            out["%s_%s_ms" % (loop_name, name)] = round(statistics.median(times), 3)
            if name != "alone":
                out["%s_%s_copy_ms" % (loop_name, name)] = round(statistics.median(copy_ms), 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", default="32,235,470", help="copy sizes in MB (235: a 4,096-row job)")
    p.add_argument("--blocks", default="1,2,4,8,16,32")
    p.add_argument("--kernels", type=int, default=1200, help="small kernels in the interference loop")
    p.add_argument("--step-tokens", type=int, default=8192, help="tokens of the launch step loop")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.zeros(1, device="cuda")
    driver = Driver.load()
    copier = KernelCopy(driver, 16)
    sizes = [int(float(m) * 1e6) // 256 * 256 for m in args.mb.split(",")]
    blocks_list = [int(b) for b in args.blocks.split(",")]
    src_t = torch.randn(max(sizes) // 4, device="cuda")
    host, dev = host_buffer(driver, max(sizes))
    src = src_t.data_ptr()
    result = {"gpu": torch.cuda.get_device_name(), "throughput": [], "interference": []}
    for n in sizes:
        result["throughput"].append(throughput(driver, copier, src, host.data_ptr(), dev, n, blocks_list, args.repeats))
        print(json.dumps(result["throughput"][-1]), flush=True)
    for n in sizes:
        row = interference(driver, copier, src, host.data_ptr(), dev, n, blocks_list, args)
        result["interference"].append(row)
        print(json.dumps(row), flush=True)
    host_ok = torch.equal(host[: sizes[0]], src_t.view(torch.uint8)[: sizes[0]].cpu())
    result["kernel_copy_bit_exact"] = bool(host_ok)
    print("bit exact:", host_ok)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
