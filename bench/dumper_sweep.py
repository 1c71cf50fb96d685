"""Dumper loop overhead across step sizes, compute-bound and launch-bound (issue 15).

For every step size (512 .. 32k tokens, Kimi width H = 7,168, bf16) and two
kinds of step:
- `compute`: the matmul chain of `dumper_gpu.py`, calibrated to ~9.4 ms per
  1k tokens (77 ms at 8k, as the reference step): the GPU is the bottleneck;
- `launch`: 61 "layers" of ~20 kernels each (1,221 launches): two full-width
  ops per layer (RMS norm, residual add) plus 18 tiny ops on a [T, 64] slice,
  like a 61-layer prefill of a small batch: at small T the launching CPU
  thread is the bottleneck, at large T the full-width ops take over;
the benchmark runs R repetitions of (loop without dump, loop with the dumper,
drain; the order alternates, ABBA), the dumper's pool roomy (N + 2 buffers: no backpressure in the loop),
and reports per-repetition overhead, median, min and max, plus the CPU time
of each `capture()` call.  Every loop waits for the forward stream once per
step, as SGLang's scheduler does.

Diagnosis variants (`--variants`), each the same loop:
- `dump`: the dumper as configured (writer threads or the writer process);
- `copy-only`: capture + copies, but the writers write nothing (the buffer is
  freed once its copy landed): what the forward thread and the GPU pay alone;
- `bg-threads`: no capture; 8 threads of this process write dump-sized files
  during the loop: what writer *threads* cost the forward thread (GIL, CPU);
- `bg-procs`: no capture; 8 processes write the same files: what writing
  costs when it is out of the process (CPU, memory, disk only).

Usage: python3 bench/dumper_sweep.py --out sweep.json [--sizes 512,1024,...]
       [--kinds compute,launch] [--reps 3] [--variants dump] [--writer process]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if __name__ == "__main__" and sys.argv[1:2] == ["--bg-writer"]:  # a background writer process: no torch
    sys.path.insert(0, os.path.dirname(HERE))
    from remote_ops.dumper import dumpfile  # noqa: E402
else:
    import dumper_gpu as base  # noqa: E402  (puts the dumper package on sys.path too)
    import torch  # noqa: E402

    from remote_ops.dumper import dumpfile  # noqa: E402

SIZES = [512, 1024, 2048, 4096, 8192, 16384, 32768]
MS_PER_TOKEN = 77.0 / 8192  # compute step: the reference 8k step's 77 ms, scaled


class LaunchStep:
    """61 layers x 20 kernels: launch-bound at small T, memory-bound at large T."""

    LAYERS, SMALL_OPS, NARROW = 61, 18, 64

    def __init__(self, tokens, hidden, dev, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.tokens, self.hidden, self.dev = tokens, hidden, dev
        self.w = torch.randn(self.NARROW, self.NARROW, device=dev, generator=g, dtype=torch.bfloat16) * 0.1
        self.capture_at = {2, 30, 58}
        self.kernels = self.LAYERS * (2 + self.SMALL_OPS) + 1

    def inputs(self, seed):
        return base.Step.inputs(self, seed)

    def run(self, x0):
        x, aux = x0, []
        for i in range(self.LAYERS):
            if i in self.capture_at:
                aux.append(x + x0)  # "hidden_states + residual": a fresh allocation, as in the model
            h = torch.nn.functional.rms_norm(x, (self.hidden,))
            s = h[:, : self.NARROW]
            for _ in range(self.SMALL_OPS // 3):
                s = s @ self.w
                s = torch.sigmoid(s)
                s = s * 1.5
            x = x + h
        return torch.nn.functional.rms_norm(x, (self.hidden,)), aux


def make_step(kind, tokens, hidden, dev):
    if kind == "compute":
        return base.Step(tokens, hidden, dev, tokens * MS_PER_TOKEN)
    return LaunchStep(tokens, hidden, dev)


# --------------------------------------------------------------------------- loops


def timed_loop(step, lens, inputs, dumper=None, cap_times=None):
    """Seconds per step of the scheduler-like loop; `cap_times` collects capture() CPU seconds.

    `inputs` holds (x0, forward batch) pairs made before the loop: the batch's
    positions exist before the forward in SGLang too, so neither loop pays for them.
    """
    base.sync(step.dev)
    t0 = time.perf_counter()
    for x0, fb in inputs:
        hidden, aux = step.run(x0)
        if dumper is not None:
            c0 = time.perf_counter()
            dumper.capture(fb, hidden, aux)
            if cap_times is not None:
                cap_times.append(time.perf_counter() - c0)
        del hidden, aux
        base.main_stream_sync(step.dev)
    return (time.perf_counter() - t0) / len(inputs)


def steps_for(step_s, step_bytes, min_s, max_bytes, min_steps=4, max_steps=120):
    """Loop length: at least `min_s` of steps, at most `max_bytes` of dump, within bounds."""
    by_time = math.ceil(min_s / max(step_s, 1e-4))
    by_bytes = max(1, int(max_bytes // step_bytes))
    return max(min_steps, min(by_time, by_bytes, max_steps))


class BackgroundWriters:
    """Dump-sized files written at full speed by threads or processes, until stopped."""

    def __init__(self, mode, folder, count, file_bytes):
        self.mode, self.folder, self.count, self.file_bytes = mode, folder, count, file_bytes
        self.stop_path = os.path.join(folder, "STOP")
        self.threads, self.procs = [], []

    def __enter__(self):
        os.makedirs(self.folder, exist_ok=True)
        if self.mode == "threads":
            self.stop = threading.Event()
            self.threads = [
                threading.Thread(target=bg_write_loop, args=(self.folder, k, self.file_bytes, self.stop))
                for k in range(self.count)
            ]
            [t.start() for t in self.threads]
        else:
            self.procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--bg-writer",
                        self.folder,
                        str(k),
                        str(self.file_bytes),
                    ]
                )
                for k in range(self.count)
            ]
        time.sleep(0.5)  # let them reach full speed
        return self

    def __exit__(self, *exc):
        if self.threads:
            self.stop.set()
            [t.join() for t in self.threads]
        if self.procs:
            open(self.stop_path, "w").close()
            for p in self.procs:
                p.wait(timeout=120)
        shutil.rmtree(self.folder, ignore_errors=True)


def bg_write_loop(folder, k, file_bytes, stop=None):
    """Write span-like files (dumpfile.write_span: sha256, 16 MiB writes, fsync, rename, manifest) until stopped."""
    h = 7168
    tokens = max(1, file_bytes // (4 * h * 2 + 8))
    hidden = os.urandom(tokens * h * 2)
    aux = os.urandom(tokens * 3 * h * 2)
    pos = bytes(tokens * 4)
    stop_path = os.path.join(folder, "STOP")
    i = 0
    while not (stop.is_set() if stop is not None else os.path.exists(stop_path)):
        ids = (k * 1000003 + i).to_bytes(4, "little") * tokens
        dumpfile.write_span(folder, 0, ids, pos, hidden, aux, h, "BF16", 0, {}, True)
        os.unlink(os.path.join(folder, "rank0", dumpfile.dump_file_name(dumpfile.dump_key(ids, 0))))
        i += 1


# --------------------------------------------------------------------------- one point of the sweep


def summary(values):
    vals = sorted(values)
    return {
        "median": round(statistics.median(vals), 2),
        "min": round(vals[0], 2),
        "max": round(vals[-1], 2),
        "runs": [round(v, 2) for v in values],
    }


def sweep_point(kind, tokens, args, dev, variants):
    """All variants at one (kind, size): R repetitions of (none, variant) pairs."""
    step = make_step(kind, tokens, args.hidden, dev)
    lens = base.request_lengths(tokens)
    warm = make_inputs(step, lens, range(2))
    timed_loop(step, lens, warm)
    probe = timed_loop(step, lens, warm)
    step_bytes = tokens * 4 * args.hidden * 2
    n = steps_for(probe, step_bytes, args.min_loop_s, args.max_loop_bytes)
    inputs = make_inputs(step, lens, range(10, 10 + n))
    out = {
        "kind": kind,
        "tokens": tokens,
        "steps": n,
        "requests": len(lens),
        "kernels_or_matmuls": getattr(step, "kernels", getattr(step, "n_mm", None)),
        "variants": {},
    }
    for variant in variants:
        out["variants"][variant] = run_variant(variant, step, lens, inputs, args, n, step_bytes)
    del inputs
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    return out


def make_inputs(step, lens, seeds):
    out = []
    for s in seeds:
        x0, ids = step.inputs(s)
        out.append((x0, base.forward_batch(ids, lens, step.dev)))
    return out


def run_variant(variant, step, lens, inputs, args, n, step_bytes):
    folder = base.fresh(os.path.join(args.dir, "sweep"))
    dumper = None
    if variant in ("dump", "copy-only"):
        dumper = base.make_dumper(folder, step, n + 2, args.writers, extra_env=args.extra_env)
        if variant == "copy-only":
            disable_writing(dumper)
        timed_loop(step, lens, inputs[:2], dumper)  # warm-up: side stream, writers, first files
        dumper.flush(600)
        parts = instrument(dumper)
    nones, withs, caps, drains = [], [], [], []
    for rep in range(args.reps):
        if rep % 2 == 0:  # ABBA: none first on even repetitions, last on odd ones (cancels slow drift)
            nones.append(timed_loop(step, lens, inputs))
        if dumper is not None:
            cap = []
            withs.append(timed_loop(step, lens, inputs, dumper, cap))
            caps += cap
            t0 = time.perf_counter()
            dumper.flush(600)
            drains.append(time.perf_counter() - t0)
        else:
            mode = "threads" if variant == "bg-threads" else "procs"
            with BackgroundWriters(mode, os.path.join(folder, "bg"), args.writers, int(sum(lens) / len(lens)) * 57352):
                withs.append(timed_loop(step, lens, inputs))
        if rep % 2 == 1:
            nones.append(timed_loop(step, lens, inputs))
    res = {
        "step_ms_none": summary([v * 1e3 for v in nones]),
        "step_ms_with": summary([v * 1e3 for v in withs]),
        "overhead_pct": summary([(w / z - 1) * 100 for w, z in zip(withs, nones)]),
    }
    if caps:
        cs = sorted(caps)
        res["capture_us"] = {
            "median": round(statistics.median(cs) * 1e6, 1),
            "p90": round(cs[int(len(cs) * 0.9)] * 1e6, 1),
            "max": round(cs[-1] * 1e6, 1),
            "calls": len(cs),
        }
        res["capture_parts_us"] = {k: round(statistics.median(v) * 1e6, 1) for k, v in parts.items() if v}
        res["capture_parts_max_us"] = {k: round(max(v) * 1e6, 1) for k, v in parts.items() if v}
        res["drain_s"] = [round(d, 2) for d in drains]
        res["stats"] = {
            k: v
            for k, v in dumper.stats.snapshot().items()
            if k in ("files", "bytes", "errors", "dropped_batches", "backpressure_waits", "queue_high_water")
        }
    if dumper is not None:
        dumper.close()
    shutil.rmtree(folder, ignore_errors=True)
    return res


def instrument(dumper):
    """Time the parts of capture() (pool, staging, hand-over, counters) in place; returns their lists."""
    parts = {}
    targets = [
        ("acquire", getattr(dumper, "pool", None), "acquire"),
        ("stage", dumper.stager, "stage"),
        ("stage", dumper.stager, "queue"),  # the GPU path with the writer process
        ("hand_over", getattr(dumper, "sink", None), "job"),
        ("hand_over", getattr(dumper, "writers", None), "submit"),
        ("counters", dumper.stats, "add"),
    ]
    for name, obj, attr in targets:
        if obj is None or not hasattr(obj, attr):
            continue
        times = parts.setdefault(name, [])
        setattr(obj, attr, _timed(getattr(obj, attr), times))
    return parts


def _timed(fn, times):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            times.append(time.perf_counter() - t0)

    return wrapper


def disable_writing(dumper):
    """The writers take each span and write nothing (capture + copies + buffer turnover only)."""
    if getattr(dumper, "writers", None) is None:
        raise SystemExit("the copy-only variant needs writer threads (--writer thread, or the old code)")
    dumper.writers.write_one = lambda job, span: None


# --------------------------------------------------------------------------- profiler


def profile_point(kind, tokens, args, dev, steps=4):
    """torch.profiler over a few steps with the dumper: where the forward thread's time goes."""
    from torch.profiler import ProfilerActivity, profile, record_function

    step = make_step(kind, tokens, args.hidden, dev)
    lens = base.request_lengths(tokens)
    inputs = make_inputs(step, lens, range(steps + 2))
    folder = base.fresh(os.path.join(args.dir, "prof"))
    dumper = base.make_dumper(folder, step, steps + 4, args.writers, extra_env=args.extra_env)
    timed_loop(step, lens, inputs[:2], dumper)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for x0, fb in inputs[2:]:
            with record_function("step.run"):
                hidden, aux = step.run(x0)
            with record_function("dumper.capture"):
                dumper.capture(fb, hidden, aux)
            del hidden, aux
            base.main_stream_sync(step.dev)
    dumper.flush(600)
    dumper.close()
    shutil.rmtree(folder, ignore_errors=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    if args.trace_dir:
        prof.export_chrome_trace(os.path.join(args.trace_dir, "trace-%s-%d.json" % (kind, tokens)))
    return table


# --------------------------------------------------------------------------- main


def run(args):
    dev = torch.device(args.device)
    base.fresh(args.dir)
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "writers": args.writers,
        "extra_env": args.extra_env,
        "reps": args.reps,
        "points": [],
    }
    for kind in args.kinds:
        for tokens in args.sizes:
            t0 = time.perf_counter()
            point = sweep_point(kind, tokens, args, dev, args.variants)
            point["wall_s"] = round(time.perf_counter() - t0, 1)
            res["points"].append(point)
            print(json.dumps(compact(point)), flush=True)
    if args.profile:
        kind, tokens = args.profile.split(":")
        res["profile_table"] = profile_point(kind, int(tokens), args, dev)
        print(res["profile_table"], flush=True)
    return res


def compact(point):
    """One line per point for the log: overhead median [min..max] and capture CPU per variant."""
    out = {"kind": point["kind"], "tokens": point["tokens"], "steps": point["steps"]}
    for name, v in point["variants"].items():
        o = v["overhead_pct"]
        out[name] = "%.2f%% [%.2f..%.2f] none %.2fms cap %s %s" % (
            o["median"],
            o["min"],
            o["max"],
            v["step_ms_none"]["median"],
            v.get("capture_us", {}).get("median"),
            v.get("capture_parts_us"),
        )
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=SIZES)
    p.add_argument("--kinds", type=lambda v: v.split(","), default=["compute", "launch"])
    p.add_argument("--variants", type=lambda v: v.split(","), default=["dump"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--writer", default=None, help="SGLANG_HS_DUMP_WRITER for the dumper (thread|process)")
    p.add_argument("--min-loop-s", type=float, default=0.3)
    p.add_argument("--max-loop-bytes", type=float, default=4e9)
    p.add_argument("--profile", default=None, help="KIND:TOKENS: a torch.profiler table of a few steps")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--dir", default=os.path.abspath(".bench-sweep"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.extra_env = {"SGLANG_HS_DUMP_WRITER": args.writer} if args.writer else {}
    return args


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--bg-writer":
        bg_write_loop(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    cli = parse()
    result = run(cli)
    if cli.out:
        with open(cli.out, "w") as fh:
            fh.write(json.dumps(result, indent=1, default=str) + "\n")
    shutil.rmtree(cli.dir, ignore_errors=True)
