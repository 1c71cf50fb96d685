"""The dumper at TP=2: rank gating, bit-exactness and loop overhead beside real all-reduce traffic (issue 16).

Two processes, one per GPU, torch.distributed (NCCL on GPUs, gloo on CPU).
A step imitates a TP prefill forward at Kimi width (H = 7,168, bf16): 61
layers of RMS norm -> [T,H]x[H,H] matmul (this rank's partial) -> all-reduce
-> residual add, the aux states captured at layers 2, 30, 58 ("hidden +
residual", fresh allocations) and the final state after a last norm.  Both
ranks hold the same weights and inputs, so after each all-reduce they hold
the same residual stream, as TP ranks do: every rank runs `capture()`, only
the writer rank writes.

Phases (each rank prints one JSON line per result; rank 0 merges them):
1. gating: SGLANG_HS_DUMP_ALL_RANKS unset -> files under rank0/ only;
   =1 -> rank0/ and rank1/, data sections identical (`dumpfile.compare_ranks`),
   every span bit-identical to that rank's tensors after the GPU memory was
   overwritten, `verify_dir` OK;
2. overhead: per step size, R repetitions (ABBA) of the loop without dump and
   with the dumper (pool with room), writer = rank 0 as in production;
3. sustained: many 8k steps through 4 buffers under backpressure, against the
   raw disk rate of the same disk.

Usage:
  GPUs:  python3 bench/dumper_tp2.py --out tp2.json
  CPU:   python3 bench/dumper_tp2.py --device cpu --hidden 256 --sizes 256,512 --reps 2 --no-sustained
Goals: loop overhead <= 1 % with NCCL traffic, sustained write >= 90 % of raw disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dumper_gpu as base  # noqa: E402  (puts the dumper package on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dumper_sweep import steps_for, summary  # noqa: E402

from remote_ops.dumper import attach, dumpfile  # noqa: E402
from remote_ops.dumper.runtime import Runtime, ServerArgsView  # noqa: E402

WORLD = 2
for name, value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(name, value)  # no NVLink multicast (device README)


class TPStep:
    """61 layers of norm -> partial matmul -> all-reduce -> residual add; aux at [2, 30, 58]."""

    LAYERS, CAPTURE_AT = 61, (2, 30, 58)

    def __init__(self, tokens, hidden, dev, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)  # same weights on every rank
        self.tokens, self.hidden, self.dev = tokens, hidden, dev
        self.w = [
            torch.randn(hidden, hidden, device=dev, generator=g, dtype=torch.bfloat16) / hidden**0.5 for _ in range(2)
        ]

    def inputs(self, seed):
        return base.Step.inputs(self, seed)

    def run(self, x0):
        x, aux = x0, []
        for i in range(self.LAYERS):
            if i in self.CAPTURE_AT:
                aux.append(x + x0)
            y = torch.nn.functional.rms_norm(x, (self.hidden,)) @ self.w[i % 2]
            dist.all_reduce(y)  # the TP all-reduce: sum of the ranks' partials
            x = x + y * (1.0 / WORLD)
        return torch.nn.functional.rms_norm(x, (self.hidden,)), aux


def make_dumper(folder, rank, tokens, hidden, dev, buffers, writers, all_ranks=False):
    """attach() as the init block does on TP rank `rank` of 2."""
    cfg = base.SimpleNamespace(num_hidden_layers=61, hidden_size=hidden, architectures=["BenchTP2Step"])
    model = base.SimpleNamespace(
        config=cfg, model=base.SimpleNamespace(layers_to_capture=[], layers=[]), capture_aux_hidden_states=False
    )
    env = {
        "SGLANG_HS_DUMP_DIR": folder,
        "SGLANG_HS_DUMP_BUFFERS": str(buffers),
        "SGLANG_HS_DUMP_WRITERS": str(writers),
        "SGLANG_HS_DUMP_BUFFER_TOKENS": str(tokens),
    }
    if all_ranks:
        env["SGLANG_HS_DUMP_ALL_RANKS"] = "1"
    runtime = Runtime("bench", rank, WORLD, ServerArgsView({"tp_size": WORLD}), "bench")
    dumper = attach(model, env=env, runtime=runtime)
    dumper.preallocate(torch.empty(1, hidden, device=dev, dtype=torch.bfloat16), tokens)
    return dumper


def loop(step, inputs, dumper=None):
    base.sync(step.dev)
    t0 = time.perf_counter()
    for x0, fb in inputs:
        hidden, aux = step.run(x0)
        if dumper is not None:
            dumper.capture(fb, hidden, aux)
        del hidden, aux
        base.main_stream_sync(step.dev)
    return (time.perf_counter() - t0) / len(inputs)


def make_inputs(step, lens, seeds):
    return [(x0, base.forward_batch(ids, lens, step.dev)) for x0, ids in (step.inputs(s) for s in seeds)]


# --------------------------------------------------------------------------- phases


def phase_gating(rank, args, dev):
    """Files only where they belong, bit-identical to the tensors and across ranks."""
    out = {}
    step = TPStep(args.gating_tokens, args.hidden, dev)
    lens = base.request_lengths(args.gating_tokens, mean=max(64, args.gating_tokens // 3))
    for all_ranks in (False, True):
        folder = os.path.join(args.dir, "gating-all" if all_ranks else "gating-default")
        if rank == 0:
            base.fresh(folder)
        dist.barrier()
        dumper = make_dumper(folder, rank, args.gating_tokens, args.hidden, dev, 6, 4, all_ranks)
        refs = capture_and_trash(step, lens, dumper, samples=3)
        dumper.flush(600)
        dumper.close()
        dist.barrier()
        mine = check_spans(folder, rank, refs, lens) if dumper.writer else None
        result = {
            "writer": dumper.writer,
            "spans_checked": mine[0] if mine else 0,
            "spans_bit_exact": mine[1] if mine else 0,
        }
        if rank == 0:
            dirs = sorted(d for d in os.listdir(folder) if d.startswith("rank"))
            cmp = dumpfile.compare_ranks(folder)
            report = dumpfile.verify_dir(folder, args.hidden)
            result.update(
                rank_dirs=dirs,
                verify_ok=report.ok,
                files=report.files,
                compared=cmp.get("compared"),
                identical=cmp.get("identical"),
                compare_ok=cmp.get("ok"),
            )
        out["all_ranks" if all_ranks else "default"] = result
        dist.barrier()
    return out


def capture_and_trash(step, lens, dumper, samples):
    """Capture, keep CPU references, free the tensors and overwrite the freed GPU memory at once."""
    refs = []
    for s in range(samples):
        x0, ids = step.inputs(1000 + s)
        hidden, aux = step.run(x0)
        fb = base.forward_batch(ids, lens, step.dev)
        dumper.capture(fb, hidden, aux)
        refs.append((hidden.cpu(), torch.cat([a.cpu() for a in aux], 1), ids.cpu(), fb.positions.cpu()))
        del hidden, aux, x0, fb
        trash = [
            torch.full((step.tokens, step.hidden), float("nan"), device=step.dev, dtype=torch.bfloat16)
            for _ in range(8)
        ]
        del trash
    return refs


def check_spans(folder, rank, refs, lens):
    from safetensors.torch import load_file

    checked = equal = 0
    for hidden, aux, ids, pos in refs:
        start = 0
        for n in lens:
            key = dumpfile.dump_key(ids[start : start + n].to(torch.int32).numpy().tobytes(), 0)
            got = load_file(os.path.join(folder, dumpfile.rank_dir_name(rank), key + ".safetensors"))
            same = (
                torch.equal(got["hidden_states"].view(torch.int16), hidden[start : start + n].view(torch.int16))
                and torch.equal(got["aux_hidden_states"].view(torch.int16), aux[start : start + n].view(torch.int16))
                and torch.equal(got["input_ids"], ids[start : start + n].to(torch.int32))
                and torch.equal(got["positions"], pos[start : start + n].to(torch.int32))
            )
            checked, equal, start = checked + 1, equal + int(same), start + n
    return checked, equal


def phase_overhead(rank, args, dev):
    """Loop overhead with the all-reduce traffic running; rank 0 writes (production gating)."""
    points = []
    for tokens in args.sizes:
        step = TPStep(tokens, args.hidden, dev)
        lens = base.request_lengths(tokens)
        warm = make_inputs(step, lens, range(2))
        loop(step, warm)
        probe = torch.tensor([loop(step, warm)], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # both ranks run the same number of steps
        n = steps_for(probe.item(), tokens * 4 * args.hidden * 2, args.min_loop_s, args.max_loop_bytes)
        inputs = make_inputs(step, lens, range(10, 10 + n))
        folder = os.path.join(args.dir, "overhead")
        if rank == 0:
            base.fresh(folder)
        dist.barrier()
        dumper = make_dumper(folder, rank, tokens, args.hidden, dev, n + 2, args.writers)
        loop(step, inputs[:2], dumper)
        dumper.flush(600)
        nones, withs = [], []
        for rep in range(args.reps):
            if rep % 2 == 0:
                nones.append(loop(step, inputs))
            withs.append(loop(step, inputs, dumper))
            dumper.flush(600)
            dist.barrier()
            if rep % 2 == 1:
                nones.append(loop(step, inputs))
        dumper.close()
        points.append(
            {
                "tokens": tokens,
                "steps": n,
                "step_ms_none": summary([v * 1e3 for v in nones]),
                "step_ms_with": summary([v * 1e3 for v in withs]),
                "overhead_pct": summary([(w / z - 1) * 100 for w, z in zip(withs, nones)]),
            }
        )
        print(
            json.dumps(
                {
                    "rank": rank,
                    "tokens": tokens,
                    "overhead_pct": points[-1]["overhead_pct"],
                    "none_ms": points[-1]["step_ms_none"]["median"],
                }
            ),
            flush=True,
        )
        del inputs
        dist.barrier()
    return points


def phase_sustained(rank, args, dev):
    """Many steps through 4 buffers under backpressure: the writer rank's sustained file rate vs raw disk."""
    out = {}
    if rank == 0:
        raw = base.raw_disk_files(base.fresh(os.path.join(args.dir, "raw")), 8, 1730 * 57352, args.raw_bytes)
        out["raw_disk_files"] = raw
    dist.barrier()
    tokens = args.sustained_tokens
    step = TPStep(tokens, args.hidden, dev)
    lens = base.request_lengths(tokens)
    folder = os.path.join(args.dir, "sustained")
    if rank == 0:
        base.fresh(folder)
    dist.barrier()
    dumper = make_dumper(folder, rank, tokens, args.hidden, dev, 4, args.writers)
    inputs = make_inputs(step, lens, range(2000, 2000 + args.sustained_steps))
    t0 = time.perf_counter()
    loop(step, inputs, dumper)
    dumper.flush(600)
    total = time.perf_counter() - t0
    dumper.close()
    dist.barrier()
    if rank == 0:
        nbytes = base.written_bytes(folder)
        out.update(
            seconds=round(total, 3),
            file_bytes=nbytes,
            GBps=round(nbytes / total / base.GB, 3),
            vs_raw_pct=round(nbytes / total / base.GB / out["raw_disk_files"]["GBps"] * 100, 1),
        )
    return out


# --------------------------------------------------------------------------- processes


def worker(rank, args, port):
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=WORLD)
    dev = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    res = {"rank": rank, "backend": backend, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    res["gating"] = phase_gating(rank, args, dev)
    print(json.dumps({"rank": rank, "gating": res["gating"]}), flush=True)
    if args.sizes:
        res["overhead"] = phase_overhead(rank, args, dev)
    if not args.no_sustained:
        res["sustained"] = phase_sustained(rank, args, dev)
    with open(os.path.join(args.dir, "result-rank%d.json" % rank), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args):
    base.fresh(args.dir)
    torch.multiprocessing.spawn(worker, args=(args, free_port()), nprocs=WORLD, join=True)
    merged = {"ranks": [json.load(open(os.path.join(args.dir, "result-rank%d.json" % r))) for r in range(WORLD)]}
    merged["summary"] = summarize(merged["ranks"])
    return merged


def summarize(ranks):
    r0 = ranks[0]
    g = r0["gating"]
    out = {
        "gating_default_only_rank0": g["default"]["rank_dirs"] == ["rank0"]
        and not ranks[1]["gating"]["default"]["writer"],
        "gating_all_ranks_both": g["all_ranks"]["rank_dirs"] == ["rank0", "rank1"],
        "ranks_identical": bool(g["all_ranks"]["compare_ok"])
        and g["all_ranks"]["identical"] == g["all_ranks"]["compared"] > 0,
        "bit_exact": all(
            r["gating"][k]["spans_checked"] == r["gating"][k]["spans_bit_exact"]
            for r in ranks
            for k in ("default", "all_ranks")
        ),
        "verify_ok": g["default"]["verify_ok"] and g["all_ranks"]["verify_ok"],
    }
    if "overhead" in r0:
        out["overhead_median_pct_rank0"] = {p["tokens"]: p["overhead_pct"]["median"] for p in r0["overhead"]}
        out["overhead_max_pct_rank0"] = {p["tokens"]: p["overhead_pct"]["max"] for p in r0["overhead"]}
    if "sustained" in r0:
        out["sustained_vs_raw_pct"] = r0["sustained"].get("vs_raw_pct")
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[512, 1024, 2048, 4096, 8192, 16384, 32768],
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--gating-tokens", type=int, default=2048)
    p.add_argument("--min-loop-s", type=float, default=0.3)
    p.add_argument("--max-loop-bytes", type=float, default=4e9)
    p.add_argument("--sustained-tokens", type=int, default=8192)
    p.add_argument("--sustained-steps", type=int, default=24)
    p.add_argument("--raw-bytes", type=int, default=4 << 30)
    p.add_argument("--no-sustained", action="store_true")
    p.add_argument("--dir", default=os.path.abspath(".bench-tp2"))
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    cli = parse()
    result = run(cli)
    if cli.out:
        with open(cli.out, "w") as fh:
            fh.write(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(result["summary"], indent=1))
    shutil.rmtree(cli.dir, ignore_errors=True)
