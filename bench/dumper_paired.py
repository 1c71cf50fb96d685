"""Dumper loop overhead, measured in interleaved blocks (issue 15): noise-robust, with diagnosis variants.

Why not long A/B loops (dumper_sweep.py): on the VM a launch-bound loop's
step time moves by +-20 % between repetitions seconds apart, so the median of
4-6 repetitions cannot show a 1 % effect.  Here every point runs many short
rounds; a round is one block of K steps per arm (no dump, then each variant,
in an order that rotates from round to round), and the overhead of a variant
is the median over rounds of (its block's mean step / the no-dump block's mean
step of the same round) - 1: slow drifts of the machine cancel inside a round.
After a block that wrote, the dumper is flushed outside the timed region, so
the next block starts with an idle writer and no block pays for another's
writing; the pool has K + 2 buffers (no backpressure inside a block).

Per block it also records: each step's GPU time (CUDA events around the
step's kernels on the forward stream), each capture()'s wall and CPU time
(thread_time: wall >> CPU means the forward thread was waiting or
descheduled), the forward thread's voluntary / involuntary context switches
(/proc/thread-self/status), and with --parts the wall time of capture()'s
parts (skip checks, plan, pool, queue = fence + copies + sem_post, submit, and
within it the hand-over message).

Variants (the writer process in each):
- `normal`: writer process at nice 10, SCHED_OTHER, CUDA host function signal;
- `batch`: SCHED_BATCH (the default): a woken writer thread never preempts;
- `idle`: SCHED_IDLE;
- `copy-only`: capture + copies + host function, nothing handed to the writer
  (slots freed when their semaphore is posted): the forward thread's and the GPU's share;
- `aa`: no dump either (an A/A control): its "overhead" shows what the method
  resolves at that point;
- `write-only`: capture's bookkeeping and the writer's writing, no DMA and no
  host function (the slot's semaphore posted from the CPU; the writer writes
  what the buffer holds): the writer's share;
With --pin-forward CPUS the forward thread runs on CPUS and every writer
process on the other CPUs (or --writer-cpus).

Usage: python3 bench/dumper_paired.py --points launch:512,compute:4096 --variants normal,batch \
           [--rounds-min 8 --point-s 20 --block-s 0.2] [--pin-forward 1] [--parts] --out paired.json
       (--points all = both kinds at 512 .. 32k)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dumper_gpu as base  # noqa: E402  (puts the dumper package on sys.path too)
import dumper_sweep as sweep  # noqa: E402
import torch  # noqa: E402

from remote_ops.dumper.staging import Staged  # noqa: E402

VARIANTS = {
    "normal": {"SGLANG_HS_DUMP_WRITER_SCHED": "normal"},
    "batch": {"SGLANG_HS_DUMP_WRITER_SCHED": "batch"},
    "idle": {"SGLANG_HS_DUMP_WRITER_SCHED": "idle"},
    "default": {},
    "copy-only": {},
    "write-only": {"SGLANG_HS_DUMP_WRITER_SCHED": "batch"},
    "calls": {},  # the default with gathering off, as every variant not named gather*: each step its own job
    # small steps gathered into one copy job (remote_ops/dumper/gather.py): the defaults, and 2k rows
    # (buffers of 4,096 rows at least: a gathered job fits the slot; the dumper never gathers more rows than
    # its buffers hold, and SGLang's buffers are chunked_prefill_size rows, 8,192 by default)
    "gather": {"SGLANG_HS_DUMP_BUFFER_TOKENS": "4096"},
    # Diagnosis, does the step after a capture pay for capture()'s own Python: the checks and the plan,
    # then nothing kept, copied or written (plan-only); the checks alone (checks-only)
    "plan-only": {},
    "checks-only": {},
    # gathering with each step's plan made at its own capture (as before the plans moved to the job; the
    # job plans again, which is ~1/8 of a warm pass more than before)
    "gather-eager": {"SGLANG_HS_DUMP_BUFFER_TOKENS": "4096"},
    # diagnosis, is a gathered job's next-step spill the writer's 8 workers hashing and writing 235 MB at once
    "gather-w2": {"SGLANG_HS_DUMP_BUFFER_TOKENS": "4096", "SGLANG_HS_DUMP_WRITERS": "2"},
    "gather-8k": {  # 8,192 rows gathered (SGLang's default chunked_prefill_size): 4k steps go in pairs
        "SGLANG_HS_DUMP_GATHER_TOKENS": "8192",
        "SGLANG_HS_DUMP_BUFFER_TOKENS": "8192",
    },
    # diagnosis, is the gathered job's next-step spill the writer's disk I/O (no fsync) or its burst of CPU
    # work (one writer worker instead of 8: the same bytes hashed and written, spread over more steps)
    "gather-nofsync": {"SGLANG_HS_DUMP_BUFFER_TOKENS": "4096", "SGLANG_HS_DUMP_FSYNC": "0"},
    "gather-w1": {"SGLANG_HS_DUMP_BUFFER_TOKENS": "4096", "SGLANG_HS_DUMP_WRITERS": "1"},
    "gather-2k": {"SGLANG_HS_DUMP_GATHER_TOKENS": "2048", "SGLANG_HS_DUMP_BUFFER_TOKENS": "4096"},
    # Diagnosis, is the next step's spill the held sources (the caching allocator cannot reuse their
    # memory until the next capture): calls with the sources let go at once (the copies may then read
    # memory the next step reuses: timing only), and write-only that holds them as calls does
    "calls-nohold": {},
    "hold-only": {"SGLANG_HS_DUMP_WRITER_SCHED": "batch"},
    # Diagnosis, DMA or host function: copy-only's copies with the post made from the CPU at once (no host
    # function), and copy-only's fence + host function with no copy
    "dma-only": {},
    "hostfn-only": {},
    # The floor (FloorDumper, no dumper at all): what any dumper that moves a step's bytes to the host with
    # the copy engine must pay at least; jobs made by the dumper's gathering rule, each one fence + ONE
    # contiguous copy of the job's bytes from a buffer of our own, nothing else (floor); plus the dumper's
    # completion signal, a cuLaunchHostFunc sem_post (floor-hostfn)
    "floor": {},
    "floor-hostfn": {},
    # diagnosis, do the dumper's strided aux copies (3 cuMemcpy2DAsync into [rows, 3H] host rows) cost the
    # next step more than contiguous ones: each step's 6 copies as the dumper lays them out (floor-rows),
    # or all 6 contiguous, aux in 3 host planes (floor-planar); both with the host function
    "floor-rows": {},
    "floor-planar": {},
}


# --------------------------------------------------------------------------- measuring one block


def ctx_switches():
    """(voluntary, involuntary) context switches of the calling thread so far."""
    vol = inv = 0
    try:
        with open("/proc/thread-self/status") as fh:
            for line in fh:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    inv = int(line.split()[1])
    except OSError:
        pass
    return vol, inv


class Block:
    """One timed block of K steps, with or without capture; collects everything measured."""

    def __init__(self, step, inputs, dev):
        self.step, self.inputs, self.dev = step, inputs, dev
        self.cuda = dev.type == "cuda"
        self.events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda else (None, None)
            for _ in inputs
        ]

    def run(self, dumper=None, before_capture=None):
        base.sync(self.dev)
        caps = []
        vol0, inv0 = ctx_switches()
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        for (x0, fb), (ev0, ev1) in zip(self.inputs, self.events):
            if self.cuda:
                ev0.record()
            hidden, aux = self.step.run(x0)
            if self.cuda:
                ev1.record()
            if dumper is not None:
                if before_capture is not None:
                    before_capture()
                c0, k0 = time.perf_counter(), time.thread_time()
                dumper.capture(fb, hidden, aux)
                caps.append((time.perf_counter() - c0, time.thread_time() - k0))
            del hidden, aux
            base.main_stream_sync(self.dev)
        wall = time.perf_counter() - t0
        cpu = time.thread_time() - cpu0
        vol1, inv1 = ctx_switches()
        n = len(self.inputs)
        gpu = [a.elapsed_time(b) for a, b in self.events] if self.cuda else []
        return {
            "step_s": wall / n,
            "cpu_share": cpu / wall,
            "gpu_ms": statistics.median(gpu) if gpu else None,
            "vol_per_step": (vol1 - vol0) / n,
            "invol_per_step": (inv1 - inv0) / n,
            "caps": caps,
        }


# --------------------------------------------------------------------------- variants


class Arm:
    """A variant: its dumper (None for the no-dump arm) and how to drain it."""

    def __init__(self, name, dumper=None, flush=None, before_capture=None, parts=None):
        self.name, self.dumper, self.before_capture, self.parts = name, dumper, before_capture, parts
        self._flush = flush

    def flush(self, timeout=60.0):
        """True once everything captured is written (or freed); False at the deadline."""
        if self._flush is not None:
            return self._flush(timeout)
        return self.dumper.flush(timeout) if self.dumper is not None else True

    def close(self):
        if self.dumper is not None:
            self.flush()
            self.dumper.close()


def make_arm(name, step, folder, buffers, args, warm_inputs):
    if name in ("none", "aa"):
        return Arm(name)
    if name.startswith("floor"):
        return floor_arm(name, step, warm_inputs)
    env = dict(args.dump_env)
    env.update(VARIANTS[name])
    if "SGLANG_HS_DUMP_BUFFER_TOKENS" in env:  # never smaller than the step
        env["SGLANG_HS_DUMP_BUFFER_TOKENS"] = str(max(int(env["SGLANG_HS_DUMP_BUFFER_TOKENS"]), step.tokens))
    if not name.startswith("gather") and name != "default":  # the per-step path the diagnoses were built on
        env.setdefault("SGLANG_HS_DUMP_GATHER_TOKENS", "0")
    if args.writer_cpus:  # with --pin-forward every writer process leaves the forward thread's CPUs alone
        env["SGLANG_HS_DUMP_WRITER_CPUS"] = ",".join(str(c) for c in args.writer_cpus)
    dumper = base.make_dumper(base.fresh(os.path.join(folder, name)), step, buffers, args.writers, extra_env=env)
    arm = Arm(name, dumper)
    if name in ("copy-only", "dma-only", "hostfn-only"):
        arm = copy_only(dumper, name)
    elif name in ("write-only", "hold-only"):
        write_only(dumper, hold=name == "hold-only")
    elif name in ("plan-only", "checks-only"):
        python_only(dumper, plan=name == "plan-only")
    elif name == "gather-eager":
        plan_at_capture(dumper)
    elif name == "calls-nohold":
        submit = dumper._submit_to_process
        dumper._submit_to_process = lambda buf, ids, pos, spans, rows, keep=None, **kw: submit(
            buf, ids, pos, spans, rows, None, **kw
        )
    for x0, fb in warm_inputs:  # warm-up: side stream, writer process, first files
        hidden, aux = step.run(x0)
        if arm.before_capture is not None:
            arm.before_capture()
        arm.dumper.capture(fb, hidden, aux)
        del hidden, aux
        base.main_stream_sync(step.dev)
    arm.flush()
    if args.parts:
        arm.parts = instrument(arm.dumper)
    return arm


class FloorDumper:
    """The least a copy-engine dumper can do, as a `capture(fb, hidden, aux)` stand-in: no checks, plans,
    slots, ring or writer.  Steps are taken into jobs by the dumper's gathering rule (up to `job_rows`
    rows and `job_steps` steps; a larger step alone); a job is one fence on the forward stream and ONE
    cuMemcpyDtoHAsync of all its bytes (57,356 per row: hidden, 3 aux, ids, positions) from a device
    buffer of our own into a page-locked one, on a side stream (`copies` "one"; or each step's 6 copies
    laid out as the dumper does, "rows", or all contiguous, "planar"); plus, by `signal`, a host function
    that posts a semaphore (as the dumper does).  The steps' tensors are held until
    the next job is queued, as the dumper holds its sources.  Timing only: the bytes are not theirs."""

    def __init__(self, dev, hidden_size, signal="none", job_rows=4096, job_steps=8, max_rows=4096, copies="one"):
        from remote_ops.dumper.cudadrv import Driver

        self.drv = drv = Driver.load()
        if drv is None:
            raise RuntimeError("the floor arms need libcuda.so.1")
        self.signal, self.job_rows, self.job_steps = signal, job_rows, job_steps
        self.copies, self.row_width = copies, hidden_size * 2  # bf16 row bytes
        self.row_bytes = 4 * self.row_width + 8 + 4
        self.capacity = max(max_rows, job_rows)
        nbytes = self.capacity * self.row_bytes
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.side = torch.cuda.Stream(device=dev)
        self.side_raw, self.dev_index = self.side.cuda_stream, self.side.device_index
        self.event = drv.event_create()
        self.sem = ctypes.create_string_buffer(64)
        if drv.libc.sem_init(ctypes.addressof(self.sem), 0, 0) != 0:
            raise OSError("sem_init failed")
        self.gather, self.rows, self.held = [], 0, []
        self.job_seq = self.steps = 0
        self.stats = SimpleNamespace(static={"copy": "floor-" + signal}, counts={})

    def capture(self, fb, hidden, aux):
        rows = hidden.shape[0]
        self.steps += 1
        if self.rows + rows > self.job_rows:  # the waiting steps first, as the dumper does (a large step alone)
            self._job()
        self.gather.append((hidden, aux, rows))
        self.rows += rows
        if self.rows >= self.job_rows or len(self.gather) >= self.job_steps:
            self._job()

    def _job(self):
        if not self.gather:
            return
        drv, side = self.drv, self.side_raw
        drv.event_record_fn(self.event, torch._C._cuda_getCurrentRawStream(self.dev_index))
        drv.wait_event_fn(side, self.event, 0)
        if self.copies == "one":
            rc = drv.d2h_fn(self.dst.data_ptr(), self.src.data_ptr(), self.rows * self.row_bytes, side)
        else:
            rc, first = 0, 0
            for _h, _a, n in self.gather:
                rc = rc or self._step_copies(first, n)
                first += n
        if self.signal == "hostfn":
            rc = rc or drv.host_fn(side, drv.sem_post_addr, ctypes.addressof(self.sem))
        if rc:
            raise RuntimeError("floor job: CUresult %d" % rc)
        self.held, self.gather, self.rows = self.gather, [], 0
        self.job_seq += 1
        self.stats.counts["batches"] = self.steps

    def _step_copies(self, first, n):
        """One step's 6 copies at row `first` of the host regions (hidden [R, H], aux, ids int64, positions
        int32): aux as 3 strided copies into [R, 3H] rows, as the dumper lays it out ("rows"), or into 3
        planes of [R, H] ("planar": all 6 copies contiguous)."""
        drv, side, w, cap = self.drv, self.side_raw, self.row_width, self.capacity
        src, dst = self.src.data_ptr(), self.dst.data_ptr()
        aux_at, ids_at, pos_at = cap * w, cap * 4 * w, cap * (4 * w + 8)
        rc = drv.d2h_fn(dst + first * w, src, n * w, side)
        for k in range(3):
            if self.copies == "rows":
                p = drv.params
                p.srcDevice, p.srcPitch = src + aux_at + k * cap * w, w
                p.dstHost, p.dstPitch = dst + aux_at + first * 3 * w + k * w, 3 * w
                p.WidthInBytes, p.Height = w, n
                rc = rc or drv.copy2d_fn(drv.params_ref, side)
            else:
                rc = rc or drv.d2h_fn(dst + aux_at + k * cap * w + first * w, src + aux_at + k * cap * w, n * w, side)
        rc = rc or drv.d2h_fn(dst + ids_at + first * 8, src + ids_at, n * 8, side)
        return rc or drv.d2h_fn(dst + pos_at + first * 4, src + pos_at, n * 4, side)

    def flush(self, timeout=60.0):
        self._job()
        self.side.synchronize()
        self.held = []
        return True

    def close(self):
        self.flush()
        self.drv.event_destroy(self.event)


def floor_arm(name, step, warm_inputs):
    """An Arm whose 'dumper' is a FloorDumper (floor, floor-hostfn, floor-rows, floor-planar),
    warmed like make_arm's."""
    signal, copies = {
        "floor": ("none", "one"),
        "floor-hostfn": ("hostfn", "one"),
        "floor-rows": ("hostfn", "rows"),
        "floor-planar": ("hostfn", "planar"),
    }[name]
    dumper = FloorDumper(step.dev, step.hidden, signal, max_rows=step.tokens, copies=copies)
    arm = Arm(name, dumper)
    for x0, fb in warm_inputs:
        hidden, aux = step.run(x0)
        dumper.capture(fb, hidden, aux)
        del hidden, aux
        base.main_stream_sync(step.dev)
    arm.flush()
    return arm


def copy_only(dumper, name="copy-only"):
    """Capture and copies as usual; no job to the writer: the host function posts a private semaphore
    instead of the child's, and a slot (and its sources) is freed once its post came (posts come in order).
    dma-only: the copies, and the post made from the CPU at once; hostfn-only: the fence and the host
    function, no copy."""

    pending = []
    sink = dumper.sink
    libc = sink.libc
    sem = ctypes.create_string_buffer(64)
    if libc.sem_init(ctypes.addressof(sem), 0, 0) != 0:
        raise OSError("sem_init failed")
    sink.landed_addr = ctypes.addressof(sem)
    sink.post_landed = lambda: libc.sem_post(ctypes.addressof(sem))
    counter = [0]

    def submit(buf, id_size, pos_size, spans, rows, keep=None, batches=1):
        counter[0] += 1
        pending.append((buf.slot, keep))
        return counter[0]

    def reap(block=False, timeout=60.0):
        deadline = time.monotonic() + timeout
        while pending:
            if libc.sem_trywait(ctypes.addressof(sem)) == 0:
                dumper.pool.release(pending.pop(0)[0])
                continue
            if not block or time.monotonic() > deadline:
                break
            time.sleep(0.0005)
        return not pending

    dumper._submit_to_process = submit
    stager, drv = dumper.stager, dumper.driver
    if name == "dma-only":
        queue = stager.queue
        stager.queue = lambda plan, buf, rows, post=0: (queue(plan, buf, rows), sink.post_landed())[0]
    elif name == "hostfn-only":

        def fence_and_post(plan, buf, rows, post=0):
            side, event = stager.side_raw, stager.fence_event
            drv.event_record_fn(event, torch._C._cuda_getCurrentRawStream(stager.device_index))
            drv.wait_event_fn(side, event, 0)
            drv.host_fn(side, drv.sem_post_addr, post)
            return plan[4], plan[6]

        stager.queue = fence_and_post
    arm = Arm(name, dumper, flush=lambda timeout: reap(True, timeout), before_capture=reap)
    arm.keep_alive = sem
    return arm


def python_only(dumper, plan):
    """capture() up to its skip checks and span list (and, with `plan`, the plan's ~25 tensor-attribute
    reads), then nothing: no slot, copy, job or write.  What a step pays for capture()'s Python alone."""
    from remote_ops.dumper.dumper import _span_tuples

    def capture(fb, hidden, aux):
        if dumper._skip_reason(fb, hidden, aux) is None:
            _spans, rows = _span_tuples(fb)
            if plan:
                dumper.stager.plan(hidden, aux, fb.input_ids, fb.positions, rows, dumper.hidden_size)

    dumper.capture = capture


def plan_at_capture(dumper):
    """Gathering with the plan and its starts made at each step's capture (as before plans moved to the job)."""
    gathered = dumper._gathered

    def eager(hidden, aux, fb, spans, rows):
        plan = dumper.stager.plan(hidden, aux, fb.input_ids, fb.positions, rows, dumper.hidden_size)
        _starts = (plan[0], plan[2][0][0], plan[2][1][0], plan[2][2][0], plan[3], plan[5]) if plan else None
        return gathered(hidden, aux, fb, spans, rows)

    dumper._gathered = eager


def write_only(dumper, hold=False):
    """No DMA and no host function: the slot's semaphore is posted from the CPU; the writer writes the buffer.
    `hold`: the sources stay referenced until the child saw the post, as the copy path holds them."""

    def stage(buf, hidden, aux, ids, positions, rows, event=True, plan=None):
        return Staged(buf, rows, None, 8, 8, (hidden, tuple(aux), ids, positions) if hold else None)

    dumper.stager.plan = lambda *a: None  # the general path, i.e. stage() below
    dumper.stager.stage = stage
    dumper.driver = SimpleNamespace(post_when_done=lambda stream, addr: dumper.sink.post_landed())


def instrument(dumper):
    """Wall time of capture()'s parts, wrapped in place; returns name -> list of seconds."""
    parts = {}
    targets = [
        ("skip", dumper, "_skip_reason"),
        ("shapes", dumper, "_shapes_ok"),
        ("plan", dumper.stager, "plan"),
        ("acquire", dumper.pool, "acquire"),
        ("queue", dumper.stager, "queue"),  # fence, copies, sem_post host function (the usual GPU path)
        ("stage", dumper.stager, "stage"),  # the general path (CPU, torch copies)
        ("submit", dumper, "_submit_to_process"),  # lock, release of copied sources, hand-over (ring entry)
        ("hand_over", dumper.sink, "job"),
    ]
    drv = dumper.driver  # each driver entry point queue() calls (read from the instance at every call)
    targets += [
        ("cu_event_record", drv, "event_record_fn"),
        ("cu_wait_event", drv, "wait_event_fn"),
        ("cu_d2h", drv, "d2h_fn"),
        ("cu_copy2d", drv, "copy2d_fn"),
        ("cu_host_fn", drv, "host_fn"),
    ]
    for name, obj, attr in targets:
        if obj is None or getattr(obj, attr, None) is None:
            continue
        setattr(obj, attr, sweep._timed(getattr(obj, attr), parts.setdefault(name, [])))
    return parts


# --------------------------------------------------------------------------- one point


def pct(values, q):
    vals = sorted(values)
    if not vals:
        return None
    k = (len(vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def spread(values, digits=2):
    return {
        "median": round(statistics.median(values), digits),
        "p25": round(pct(values, 0.25), digits),
        "p75": round(pct(values, 0.75), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }


def run_point(kind, tokens, args, dev, variants):
    step = sweep.make_step(kind, tokens, args.hidden, dev)
    lens = base.request_lengths(tokens)
    warm = sweep.make_inputs(step, lens, range(2))
    sweep.timed_loop(step, lens, warm)
    probe = sweep.timed_loop(step, lens, warm)
    step_bytes = tokens * 4 * args.hidden * 2
    k = max(args.min_steps, math.ceil(args.block_s / probe))
    k = max(args.min_steps, min(k, int(args.max_block_bytes // step_bytes), args.max_steps))
    inputs = sweep.make_inputs(step, lens, range(10, 10 + k))
    folder = base.fresh(os.path.join(args.dir, "paired"))
    arms = [make_arm("none", step, folder, k + 2, args, warm)]
    arms += [make_arm(v, step, folder, k + 2, args, warm) for v in variants]
    block = Block(step, inputs, dev)
    block.run()  # warm the block's events and allocations
    per_arm = {a.name: [] for a in arms}
    all_arms, broken = list(arms), []
    started, rounds = time.perf_counter(), 0
    while rounds < args.rounds_max and (rounds < args.rounds_min or time.perf_counter() - started < args.point_s):
        order = arms[rounds % len(arms) :] + arms[: rounds % len(arms)]
        if rounds % 2:
            order = order[::-1]
        for arm in order:
            res = block.run(arm.dumper, arm.before_capture)
            per_arm[arm.name].append(res)
            if not settle(step, warm, arm, args.settle_s):
                print("  %s: not drained within 60 s: dropped from this point" % arm.name, flush=True)
                broken.append(arm.name)
        arms = [a for a in arms if a.name not in broken]
        rounds += 1
    nones = [r["step_s"] for r in per_arm["none"]]
    out = {
        "kind": kind,
        "tokens": tokens,
        "steps_per_block": k,
        "rounds": rounds,
        "requests": len(lens),
        "kernels_or_matmuls": getattr(step, "kernels", getattr(step, "n_mm", None)),
        "wall_s": round(time.perf_counter() - started, 1),
        "none": dict(summarize_arm(per_arm["none"]), block_step_ms=[round(v * 1e3, 3) for v in nones]),
        "variants": {},
    }
    for arm in all_arms[1:]:
        if arm.name in broken:
            out["variants"][arm.name] = {"broken": "not drained within 60 s"}
            arm.dumper.close(timeout=5)
            continue
        runs = per_arm[arm.name]
        res = summarize_arm(runs)
        res["overhead_pct"] = spread([(r["step_s"] / z - 1) * 100 for r, z in zip(runs, nones)])
        res["block_step_ms"] = [round(r["step_s"] * 1e3, 3) for r in runs]
        if res.get("gpu_ms") and out["none"].get("gpu_ms"):
            res["gpu_overhead_pct"] = spread(
                [(r["gpu_ms"] / z["gpu_ms"] - 1) * 100 for r, z in zip(runs, per_arm["none"])]
            )
        if arm.parts:
            res["parts_us"] = {
                n: {"p50": round(statistics.median(v) * 1e6, 1), "p90": round(pct(v, 0.9) * 1e6, 1), "calls": len(v)}
                for n, v in arm.parts.items()
                if v
            }
        if arm.dumper is not None:
            res["stats"] = {
                k2: v
                for k2, v in arm.dumper.stats.snapshot().items()
                if k2 in ("files", "errors", "dropped_batches", "backpressure_waits", "signal", "writer_mode")
            }
        out["variants"][arm.name] = res
        arm.close()
    del inputs, block
    shutil.rmtree(folder, ignore_errors=True)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def settle(step, warm, arm, settle_s, timeout=60.0):
    """Untimed no-capture steps after every block until the arm's writing is done (and >= settle_s).

    The GPU and the forward thread stay busy between blocks, so every block starts from the same state;
    an idle flush instead let the GPU cool, and the block after it ran up to 4-6 % faster at compute-bound
    points (an A/A control showed it).  False when the writing did not finish within `timeout`."""
    started = time.perf_counter()
    i = 0
    while True:
        x0, _fb = warm[i % len(warm)]
        i += 1
        out = step.run(x0)
        del out
        base.main_stream_sync(step.dev)
        elapsed = time.perf_counter() - started
        if elapsed >= settle_s and arm.flush(0.0):
            return True
        if elapsed > timeout:
            return arm.flush(1.0)


def run_alt_point(tokens, args, dev, kind="launch", period=3, captures=5, variants=("default",)):
    """Step-level interleave: in one loop every `period`-th step is captured; each captured step's time
    over the uncaptured step right before it (which follows another uncaptured one), median over pairs.

    Adjacent steps share the machine's state, so this resolves what blocks cannot on launch-bound steps
    (whose speed moves +-30 % between blocks a fraction of a second apart); it counts what a step pays
    for its own capture (the forward thread's work, the copies starting beside the next kernels, the
    writer starting), not writer work that spills into later steps.  The same loop without any capture
    gives the A/A floor at the same positions.  Several `variants` (VARIANTS names) take turns in each
    loop, in an order that rotates and reverses, each with an A/A loop beside it: an A/B on one machine."""
    step = sweep.make_step(kind, tokens, args.hidden, dev)
    lens = base.request_lengths(tokens)
    warm = sweep.make_inputs(step, lens, range(2))
    mask = ([False] * (period - 1) + [True]) * captures + [False]  # the last capture's next step is timed too
    inputs = sweep.make_inputs(step, lens, range(10, 10 + len(mask)))
    folder = base.fresh(os.path.join(args.dir, "alt"))
    arms = [("dump" if len(variants) == 1 else v, make_arm(v, step, os.path.join(folder, v), captures + 2, args, warm))
            for v in variants]  # fmt: skip
    none = Arm("none")
    order = [a for name_arm in arms for a in (name_arm, ("aa", none))]
    ratios = {name: [] for name, _arm in order}
    caps = {name: [] for name, _arm in arms}
    rest = {name: [] for name, _arm in arms}  # the captured step less its capture() wall, over the step before
    spill = {name: [] for name, _arm in order}  # the step after a captured one, over the step before it
    tails = {name: [] for name, _arm in order}  # del + stream sync of the captured step less the step before's (us)
    loop_pct = {name: [] for name, _arm in order}  # per loop: its captured + next steps over twice the befores
    untimed = {name: 0 for name, _arm in arms}  # loops that ended with gathered steps (settle would copy them)
    started, loops = time.perf_counter(), 0
    while loops < 4 or (time.perf_counter() - started < args.point_s and loops < args.rounds_max):
        turn = order[loops % len(order) :] + order[: loops % len(order)]
        for name, use in turn if loops % 2 == 0 else turn[::-1]:
            times, walls, tail = [], [], []
            base.sync(dev)
            for (x0, fb), captured in zip(inputs, mask):
                t0 = time.perf_counter()
                hidden, aux = step.run(x0)
                wall = 0.0
                if captured and use.dumper is not None:
                    c0 = time.perf_counter()
                    use.dumper.capture(fb, hidden, aux)
                    wall = time.perf_counter() - c0
                    caps[name].append(wall)
                t1 = time.perf_counter()
                del hidden, aux
                base.main_stream_sync(dev)
                t2 = time.perf_counter()
                times.append(t2 - t0)
                walls.append(wall)
                tail.append(t2 - t1)
            ratios[name] += [(times[i] / times[i - 1] - 1) * 100 for i, c in enumerate(mask) if c]
            spill[name] += [
                (times[i + 1] / times[i - 1] - 1) * 100 for i, c in enumerate(mask) if c and i + 1 < len(mask)
            ]
            tails[name] += [(tail[i] - tail[i - 1]) * 1e6 for i, c in enumerate(mask) if c]
            caught = [i for i, c in enumerate(mask) if c]  # every loop holds whole gathered jobs (--alt-captures)
            paid = sum(times[i] + times[i + 1] for i in caught)
            loop_pct[name].append((paid / sum(2 * times[i - 1] for i in caught) - 1) * 100)
            if name in rest:
                rest[name] += [((times[i] - walls[i]) / times[i - 1] - 1) * 100 for i, c in enumerate(mask) if c]
                gathered = getattr(use.dumper, "gather", None)
                untimed[name] += 1 if gathered is not None and len(gathered) else 0
            settle(step, warm, use, args.settle_s)
        loops += 1
    copy_modes, jobs = {}, {}
    for name, arm in arms:
        copy_modes[name] = arm.dumper.stats.static.get("copy") if arm.dumper is not None else None
        if arm.dumper is not None:  # copy jobs and captured steps over the whole point, warm-up included
            jobs[name] = (arm.dumper.job_seq, arm.dumper.stats.counts.get("batches"))
        arm.close()
    shutil.rmtree(folder, ignore_errors=True)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    out = {"kind": kind, "tokens": tokens, "period": period, "loops": loops, "aa_pct": spread(ratios["aa"])}
    out["aa_next_step_pct"], out["aa_tail_us"] = spread(spill["aa"]), spread(tails["aa"], 1)
    for name, _arm in arms:
        key = "" if name == "dump" else name + "_"
        out[key + "step_overhead_pct"] = spread(ratios[name])
        out[key + "beyond_capture_pct"] = spread(rest[name])  # what the step paid besides capture()'s own wall
        out[key + "next_step_pct"] = spread(spill[name])  # what spilled into the next step
        out[key + "tail_us"] = spread(tails[name], 1)  # the captured step's stream sync, longer by
        out[key + "capture_us_p50"] = round(statistics.median(caps[name]) * 1e6, 1) if caps[name] else None
        out[key + "capture_us_mean"] = round(statistics.fmean(caps[name]) * 1e6, 1) if caps[name] else None
        out[key + "copy_mode"] = copy_modes[name]
        # gathering makes one captured step in K expensive: medians hide it, so the means, and their sum =
        # what one capture costs in all (its own step + the next), with its standard error
        both = [a + b for a, b in zip(ratios[name], spill[name])]
        out[key + "per_capture_mean_pct"] = mean_se(both)
        out[key + "per_capture_trim5_pct"] = trimmed_mean_se(both)  # 5 % cut at each end: the VM's outliers
        out[key + "pairs_pct"] = [[round(a, 3), round(b, 3)] for a, b in zip(ratios[name], spill[name])]
        out[key + "step_mean_pct"], out[key + "next_mean_pct"] = mean_se(ratios[name]), mean_se(spill[name])
        out[key + "untimed_flush_loops"] = untimed[name]
        out[key + "per_loop_pct"] = spread(loop_pct[name])  # median over loops: each holds whole jobs
        out[key + "jobs_steps"] = jobs.get(name)
    both = [a + b for a, b in zip(ratios["aa"], spill["aa"])]
    out["aa_per_capture_mean_pct"], out["aa_per_capture_trim5_pct"] = mean_se(both), trimmed_mean_se(both)
    out["aa_pairs_pct"] = [[round(a, 3), round(b, 3)] for a, b in zip(ratios["aa"], spill["aa"])]
    out["aa_per_loop_pct"] = spread(loop_pct["aa"])
    return out


def trimmed_mean_se(values, cut=0.05, digits=2):
    """mean_se of the values left after cutting `cut` of them at each end (None when too few remain).

    Gathering makes one captured step in K dearer (K = 8 at 512 tokens: 12.5 % of the pairs): a 5 % cut
    leaves those in, and takes off the VM's rare +20..+50 % steps that make the plain mean's error +-1-2 %."""
    vals = sorted(values)
    k = int(len(vals) * cut)
    return mean_se(vals[k : len(vals) - k], digits)


def mean_se(values, digits=2):
    """{"mean", "se", "n"}: the mean and its standard error (None when fewer than 2 values)."""
    if len(values) < 2:
        return None
    return {
        "mean": round(statistics.fmean(values), digits),
        "se": round(statistics.stdev(values) / math.sqrt(len(values)), digits),
        "n": len(values),
    }


def alt_line(kind, tokens, alt):
    """One printed line of a step-interleaved point: every arm's figures, then the A/A's."""
    a = alt["aa_pct"]
    line = "alt %s %6d: A/A %+.2f%% [p25 %+.2f p75 %+.2f]" % (kind, tokens, a["median"], a["p25"], a["p75"])
    for key in [k for k in alt if k.endswith("step_overhead_pct")]:
        o, name = alt[key], key[: -len("step_overhead_pct")] or "dump_"
        k = name.replace("dump_", "")
        line += (" | %scaptured step %+.2f%% [p25 %+.2f p75 %+.2f] n=%d, capture %s us (%s), beyond %+.2f%%,"
                 " next step %+.2f%%, sync %+.1f us") % (
            name, o["median"], o["p25"], o["p75"], o["n"], alt[k + "capture_us_p50"], alt[k + "copy_mode"],
            alt[k + "beyond_capture_pct"]["median"], alt[k + "next_step_pct"]["median"], alt[k + "tail_us"]["median"],
        )  # fmt: skip
        m, lp = alt[k + "per_capture_trim5_pct"], alt[k + "per_loop_pct"]
        line += (", per capture (5 %%-trimmed mean, both steps) %+.2f%% +- %.2f, per loop %+.2f%%"
                 " [p25 %+.2f p75 %+.2f], capture mean %s us, untimed %d, jobs/steps %s") % (
            m["mean"], m["se"], lp["median"], lp["p25"], lp["p75"], alt[k + "capture_us_mean"],
            alt[k + "untimed_flush_loops"], alt[k + "jobs_steps"],
        )  # fmt: skip
    line += " | A/A next step %+.2f%%, sync %+.1f us, per capture (trimmed) %+.2f%% +- %.2f, per loop %+.2f%% [p25 %+.2f p75 %+.2f]" % (
        alt["aa_next_step_pct"]["median"],
        alt["aa_tail_us"]["median"],
        alt["aa_per_capture_trim5_pct"]["mean"],
        alt["aa_per_capture_trim5_pct"]["se"],
        alt["aa_per_loop_pct"]["median"],
        alt["aa_per_loop_pct"]["p25"],
        alt["aa_per_loop_pct"]["p75"],
    )  # fmt: skip
    return line


def summarize_arm(runs):
    res = {
        "step_ms": spread([r["step_s"] * 1e3 for r in runs], 3),
        "cpu_share": round(statistics.median(r["cpu_share"] for r in runs), 3),
        "vol_per_step": round(statistics.median(r["vol_per_step"] for r in runs), 2),
        "invol_per_step": round(statistics.median(r["invol_per_step"] for r in runs), 2),
    }
    if runs and runs[0]["gpu_ms"] is not None:
        res["gpu_ms"] = round(statistics.median(r["gpu_ms"] for r in runs), 3)
    caps = [c for r in runs for c in r["caps"]]
    if caps:
        walls, cpus = [c[0] for c in caps], [c[1] for c in caps]
        res["capture_us"] = {
            "wall_p50": round(statistics.median(walls) * 1e6, 1),
            "wall_p90": round(pct(walls, 0.9) * 1e6, 1),
            "wall_max": round(max(walls) * 1e6, 1),
            "cpu_p50": round(statistics.median(cpus) * 1e6, 1),
            "cpu_p90": round(pct(cpus, 0.9) * 1e6, 1),
            "calls": len(caps),
        }
    return res


def compact(point):
    out = [
        "%s %6d k=%d r=%d none %.3f ms (gpu %s)"
        % (
            point["kind"],
            point["tokens"],
            point["steps_per_block"],
            point["rounds"],
            point["none"]["step_ms"]["median"],
            point["none"].get("gpu_ms"),
        )
    ]
    for name, v in point["variants"].items():
        if "broken" in v:
            out.append("  %-10s %s" % (name, v["broken"]))
            continue
        o = v["overhead_pct"]
        cap = v.get("capture_us", {})
        g = v.get("gpu_overhead_pct", {})
        out.append(
            "  %-10s %+6.2f%% [p25 %+.2f p75 %+.2f | %+.2f..%+.2f] gpu %+.2f%% cap wall %s cpu %s inv/step %s parts %s"
            % (
                name,
                o["median"],
                o["p25"],
                o["p75"],
                o["min"],
                o["max"],
                g.get("median", float("nan")),
                cap.get("wall_p50"),
                cap.get("cpu_p50"),
                v["invol_per_step"],
                {n: p["p50"] for n, p in v.get("parts_us", {}).items()},
            )
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- machine facts


def machine_facts():
    facts = {"uname": " ".join(platform.uname()), "cpus": os.cpu_count()}
    try:
        facts["affinity"] = sorted(os.sched_getaffinity(0))
    except AttributeError:
        pass
    for name, path in (
        ("clocksource", "/sys/devices/system/clocksource/clocksource0/current_clocksource"),
        ("smt_siblings_cpu0", "/sys/devices/system/cpu/cpu0/topology/thread_siblings_list"),
        ("smt_siblings_cpu1", "/sys/devices/system/cpu/cpu1/topology/thread_siblings_list"),
        ("loadavg", "/proc/loadavg"),
    ):
        try:
            with open(path) as fh:
                facts[name] = fh.read().strip()
        except OSError:
            facts[name] = None
    return facts


def matched_history(point, arms=("none", "default", "aa")):
    """Re-read a point run with short settles: each no-dump block that followed a dump block (and its
    drain) ran up to 4-6 % faster at compute-bound sizes, so compare the dump arm (never after a dump)
    with the no-dump blocks that also followed a no-dump block only.  Returns overhead % of the dump arm's
    median block over that pooled median, and the [p25..p75] of its blocks against it."""
    vals = {"none": point["none"]["block_step_ms"]}
    for name in arms[1:]:
        vals[name] = point["variants"][name]["block_step_ms"]
    seq = []
    for r in range(len(vals["none"])):
        order = list(arms[r % len(arms) :] + arms[: r % len(arms)])
        for name in order[::-1] if r % 2 else order:
            seq.append((name, vals[name][r]))
    clean = [v for (prev, _), (name, v) in zip(seq, seq[1:]) if name != "default" and prev != "default"]
    ref = statistics.median(clean)
    dump = [v / ref * 100 - 100 for v in vals["default"]]
    return {
        "overhead_pct": round(statistics.median(vals["default"]) / ref * 100 - 100, 2),
        "p25": round(pct(dump, 0.25), 2),
        "p75": round(pct(dump, 0.75), 2),
        "max": round(max(dump), 2),
        "reference_blocks": len(clean),
    }


def parse_points(text):
    if text == "none":
        return []
    if text == "all":
        return [(k, t) for k in ("compute", "launch") for t in sweep.SIZES]
    out = []
    for item in text.split(","):
        kind, tokens = item.split(":")
        out.append((kind, int(tokens)))
    return out


def parse_cpus(text):
    from remote_ops.dumper.config import parse_cpu_list

    return parse_cpu_list(text) if text else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--points", type=parse_points, default=parse_points("all"), help="'none' for no blocks")
    p.add_argument("--variants", type=lambda v: v.split(","), default=["default"])
    p.add_argument("--block-s", type=float, default=0.2, help="target length of one block")
    p.add_argument("--min-steps", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--max-block-bytes", type=float, default=1.5e9, help="dump bytes of one block at most")
    p.add_argument("--rounds-min", type=int, default=8)
    p.add_argument("--rounds-max", type=int, default=60)
    p.add_argument("--point-s", type=float, default=20.0, help="keep adding rounds until this long")
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--settle-s", type=float, default=0.05, help="untimed steps between blocks, at least")
    p.add_argument("--alt", type=parse_points, default=[], help="also the step-interleaved measure at these points")
    p.add_argument(
        "--alt-variants",
        type=lambda v: v.split(","),
        default=["default"],
        help="dumper variants that take turns in the step-interleaved measure (an A/B on one machine)",
    )
    p.add_argument(
        "--alt-captures",
        type=int,
        default=5,
        help="captured steps per loop of the step-interleaved measure (a multiple of the gather steps keeps "
        "every gathered job's copy inside the timed steps)",
    )
    p.add_argument("--parts", action="store_true", help="time capture()'s parts (adds ~1 us per wrapped call)")
    p.add_argument("--pin-forward", type=parse_cpus, default=None, help="CPUs of the forward thread, e.g. 1")
    p.add_argument("--writer-cpus", type=parse_cpus, default=None, help="CPUs of the writer (variant pinned)")
    p.add_argument(
        "--dump-env",
        type=lambda v: dict(kv.split("=", 1) for kv in v.split(",") if kv),
        default={},
        help="SGLANG_HS_DUMP_*=V,... for every dumper arm (a variant's own settings win)",
    )
    p.add_argument(
        "--forward-stream",
        choices=("default", "side"),
        default="default",
        help="run the steps on the legacy default stream, or on a stream created for them",
    )
    p.add_argument("--dir", default=os.path.abspath(".bench-paired"))
    p.add_argument("--out", default=None)
    p.add_argument("--matched", default=None, help="re-read a result file's points by matched history, then exit")
    args = p.parse_args(argv)
    if args.matched:
        with open(args.matched) as fh:
            for point in json.load(fh)["points"]:
                print(point["kind"], point["tokens"], json.dumps(matched_history(point)))
        return None
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.ones(1, device=dev)  # CUDA's own threads start now, before any pinning below
    if args.pin_forward:
        os.sched_setaffinity(threading_native_id(), set(args.pin_forward))
        if args.writer_cpus is None:
            args.writer_cpus = [c for c in range(os.cpu_count() or 1) if c not in args.pin_forward]
    base.fresh(args.dir)
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "machine": machine_facts(),
        "args": {k: v for k, v in vars(args).items() if k not in ("points",)},
        "points": [],
    }
    print(json.dumps(res["machine"]), flush=True)
    if args.forward_stream == "side" and dev.type == "cuda":  # steps and captures on a stream of their own,
        torch.cuda.set_stream(torch.cuda.Stream(device=dev))  # as a forward stream other than the legacy one
    try:
        for kind, tokens in args.alt:
            alt = run_alt_point(tokens, args, dev, kind, captures=args.alt_captures, variants=args.alt_variants)
            res.setdefault("alt", []).append(alt)
            line = alt_line(kind, tokens, alt)
            print(line, flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    fh.write(json.dumps(res, indent=1, default=str) + "\n")
        for kind, tokens in args.points:
            point = run_point(kind, tokens, args, dev, args.variants)
            res["points"].append(point)
            print(compact(point), flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    fh.write(json.dumps(res, indent=1, default=str) + "\n")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    return res


def threading_native_id():
    import threading

    return threading.get_native_id()


if __name__ == "__main__":
    main()
