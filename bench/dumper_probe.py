"""Probes of the staging mechanisms on the GPU host (issue 15): do they work, what do they cost.

1. host memory for the copies: torch's pinned allocation vs a shared memfd
   segment page-locked with cuMemHostRegister (what a writer *process* can
   read): D2H bandwidth of a 470 MB batch;
2. aux rows [T, 3H] from 3 tensors: torch.cat + one copy vs 3 strided
   cuMemcpy2DAsync (no kernel, no allocation): GPU time and bit-equality;
3. forward-thread CPU time of one batch's staging: the torch path (event,
   wait, record_stream, cat, .to(int32), copies) vs the ctypes path, into
   torch-pinned buffers and into memfd segments page-locked by cuMemHostRegister;
4. cuLaunchHostFunc(sem_post): posted only after the stream's work.

Usage: python3 bench/dumper_probe.py [--out probe.json]
Without a CUDA GPU and libcuda.so.1 it parses its arguments, imports the
driver bindings and writes a result that says so (the CPU smoke run).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.environ.get("DUMPER_IMPL_ROOT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from remote_ops.dumper.cudadrv import SEM_SLOT_BYTES, Driver  # noqa: E402

H = 7168


def gpu_ms(fn, stream, reps=5):
    """Median GPU milliseconds of fn() queued on `stream` (CUDA events)."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times), 3)


def shared_segment(nbytes, drv):
    fd = os.memfd_create("probe", 0)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    drv.register(t.data_ptr(), nbytes)
    return fd, mm, t


def probe_bandwidth(drv, tokens=8192):
    nbytes = tokens * 4 * H * 2
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    out = {}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t0 = time.perf_counter()
    fd, mm, shared = shared_segment(nbytes, drv)
    out["memfd_register_s"] = round(time.perf_counter() - t0, 3)
    out["shared_is_pinned"] = bool(shared.is_pinned())
    for name, host in (("torch_pinned", pinned), ("memfd_registered", shared)):
        ms = gpu_ms(lambda host=host: drv.d2h(host.data_ptr(), src.data_ptr(), nbytes, side.cuda_stream), side)
        out[name] = {"ms": ms, "GBps": round(nbytes / ms / 1e6, 1)}
    ms = gpu_ms(lambda shared=shared: shared.copy_(src.view(torch.uint8), non_blocking=True), side)
    out["memfd_registered_torch_copy"] = {"ms": ms, "GBps": round(nbytes / ms / 1e6, 1)}
    drv.unregister(shared.data_ptr())
    del shared
    mm.close()
    os.close(fd)
    return out


def probe_aux(drv, tokens=8192):
    aux = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    side = torch.cuda.Stream()
    host_a = torch.empty(tokens, 3 * H, dtype=torch.bfloat16, pin_memory=True)
    host_b = torch.empty(tokens, 3 * H, dtype=torch.bfloat16, pin_memory=True)
    row = 3 * H * 2

    def cat_copy():
        host_a.copy_(torch.cat(aux, dim=1), non_blocking=True)

    def strided():
        for k, a in enumerate(aux):
            drv.d2h_2d(
                host_b.data_ptr() + k * H * 2, row, a.data_ptr(), a.stride(0) * 2, H * 2, tokens, side.cuda_stream
            )

    out = {"cat_then_copy_ms": gpu_ms(cat_copy, side), "three_2d_copies_ms": gpu_ms(strided, side)}
    torch.cuda.synchronize()
    out["bit_equal"] = bool(torch.equal(host_a.view(torch.int16), host_b.view(torch.int16)))
    return out


def probe_cpu_cost(drv, tokens, calls=300, host="pinned"):
    """Forward-thread seconds per batch for each staging path; host buffers torch-pinned or memfd+registered."""
    hidden = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    aux = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ids = torch.randint(0, 1000, (tokens,), device="cuda")
    pos = torch.arange(tokens, device="cuda")
    sizes = [tokens * H * 2, tokens * 3 * H * 2, tokens * 8, tokens * 8]
    if host == "memfd":
        keep = [shared_segment(n, drv) for n in sizes]
        hb, ab, ib, pb = [t for _, _, t in keep]
    else:
        hb, ab, ib, pb = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    side = torch.cuda.Stream()
    fence = torch.cuda.Event()
    hv, av = hb.view(torch.bfloat16).view(tokens, H), ab.view(torch.bfloat16).view(tokens, 3 * H)
    iv, pv = ib.view(torch.int32)[:tokens], pb.view(torch.int32)[:tokens]

    def torch_path():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for t in [hidden, ids, *aux, pos]:
                t.record_stream(side)
            hv.copy_(hidden, non_blocking=True)
            av.copy_(torch.cat(aux, dim=1), non_blocking=True)
            iv.copy_(ids.to(torch.int32), non_blocking=True)
            pv.copy_(pos.to(torch.int32), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)

    sem = ctypes.create_string_buffer(SEM_SLOT_BYTES)
    drv.libc.sem_init(ctypes.addressof(sem), 1, 0)
    sem_addr = ctypes.addressof(sem)

    def ctypes_path():
        s = side.cuda_stream
        fence.record(torch.cuda.current_stream())
        side.wait_event(fence)
        for t in (hidden, ids, aux[0], aux[1], aux[2], pos):
            t.record_stream(side)
        drv.d2h(hb.data_ptr(), hidden.data_ptr(), tokens * H * 2, s)
        for k, a in enumerate(aux):
            drv.d2h_2d(ab.data_ptr() + k * H * 2, 3 * H * 2, a.data_ptr(), H * 2, H * 2, tokens, s)
        drv.d2h(ib.data_ptr(), ids.data_ptr(), tokens * 8, s)
        drv.d2h(pb.data_ptr(), pos.data_ptr(), tokens * 8, s)
        drv.post_when_done(s, sem_addr)

    out = {}
    for name, fn in (("torch_path_us", torch_path), ("ctypes_path_us", ctypes_path)):
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if i % 8 == 7:
                side.synchronize()
        side.synchronize()
        out[name] = round(statistics.median(times) * 1e6, 1)
    posted = 0
    while drv.libc.sem_trywait(sem_addr) == 0:
        posted += 1
    out["sem_posts_seen"] = posted
    return out


def probe_host_func_order(drv):
    """sem_post queued behind ~200 ms of GPU work must not be visible before that work ends."""
    side = torch.cuda.Stream()
    sem = ctypes.create_string_buffer(SEM_SLOT_BYTES)
    addr = ctypes.addressof(sem)
    drv.libc.sem_init(addr, 1, 0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(side):
        for _ in range(200):
            a = a @ a / 90.0
    drv.post_when_done(side.cuda_stream, addr)
    early = drv.libc.sem_trywait(addr) == 0
    side.synchronize()
    time.sleep(0.01)
    late = drv.libc.sem_trywait(addr) == 0
    return {"posted_before_work_done": early, "posted_after": late}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the result JSON here")
    args = p.parse_args(argv)
    drv = Driver.load()
    res = {"driver_loaded": drv is not None, "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if drv is None or not torch.cuda.is_available():
        res["skipped"] = "needs a CUDA GPU and libcuda.so.1"
    else:
        res["cudart_has_register"] = hasattr(torch.cuda.cudart(), "cudaHostRegister")
        res["bandwidth"] = probe_bandwidth(drv)
        res["aux"] = probe_aux(drv)
        res["host_func_order"] = probe_host_func_order(drv)
        res["cpu_cost"] = {str(t): probe_cpu_cost(drv, t) for t in (512, 8192)}
        res["cpu_cost_memfd"] = {str(t): probe_cpu_cost(drv, t, host="memfd") for t in (512, 8192)}
    print(json.dumps(res, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
