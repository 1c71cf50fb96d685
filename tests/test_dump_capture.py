"""The dumper on CPU torch: ForwardBatch-shaped batches in, verified files out.

The batches are stand-ins with SGLang 0.5.9's ForwardBatch field names
(forward_mode, input_ids, positions, extend_seq_lens_cpu, extend_prefix_lens_cpu,
can_run_tbo); the CPU path of the staging replaces pinned memory, the side
stream and the event, everything else (pool, writer threads, files) is real.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

from remote_ops.dumper import attach, dumper as dumper_mod, dumpfile  # noqa: E402
from remote_ops.dumper.runtime import Runtime, ServerArgsView  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H = 32


class StandinForwardMode(IntEnum):
    """Names as in sglang.srt.model_executor.forward_batch_info.ForwardMode."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5


@dataclass
class StandinForwardBatch:
    """The ForwardBatch fields the dumper reads, with SGLang's names and types."""

    forward_mode: StandinForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: Optional[torch.Tensor]
    extend_seq_lens_cpu: Optional[List[int]]
    extend_prefix_lens_cpu: Optional[List[int]]
    can_run_tbo: bool = False
    seq_lens_cpu: Optional[torch.Tensor] = None


@dataclass
class Batch:
    """A batch plus the tensors the forward produced, for comparison with the files."""

    fb: StandinForwardBatch
    hidden: torch.Tensor
    aux: List[torch.Tensor]
    lens: List[int] = field(default_factory=list)
    prefixes: List[int] = field(default_factory=list)


def make_batch(lens, prefixes=None, seed=0, mode=StandinForwardMode.EXTEND, hidden=H):
    g = torch.Generator().manual_seed(seed)
    prefixes = prefixes or [0] * len(lens)
    total = sum(lens)
    ids = torch.randint(0, 163840, (total,), generator=g)  # int64, as SGLang holds them
    positions = torch.cat([torch.arange(p, p + n) for n, p in zip(lens, prefixes)])
    fb = StandinForwardBatch(
        mode,
        len(lens),
        ids,
        positions,
        list(lens),
        list(prefixes),
        seq_lens_cpu=torch.tensor([n + p for n, p in zip(lens, prefixes)]),
    )
    hid = torch.randn(total, hidden, generator=g).bfloat16()
    aux = [torch.randn(total, hidden, generator=g).bfloat16() for _ in range(3)]
    return Batch(fb, hid, aux, list(lens), list(prefixes))


def standin_model(layers=61, hidden=H):
    cfg = SimpleNamespace(num_hidden_layers=layers, hidden_size=hidden, architectures=["DeepseekV3ForCausalLM"])
    return SimpleNamespace(
        config=cfg, model=SimpleNamespace(layers_to_capture=[], layers=[]), capture_aux_hidden_states=False
    )


def runtime(rank=0, version="0.5.9", tp=8, **args):
    return Runtime(version, rank, tp, ServerArgsView(dict(tp_size=tp, **args)), "test")


WRITER = {"mode": "process"}


@pytest.fixture(params=["process", "thread"], autouse=True)
def writer_mode(request):
    """Every test runs with the writer process (the default) and with writer threads."""
    WRITER["mode"] = request.param
    yield request.param
    WRITER["mode"] = "process"


def make_dumper(root, rank=0, **env):
    full = {
        "SGLANG_HS_DUMP_DIR": str(root),
        "SGLANG_HS_DUMP_BUFFERS": "2",
        "SGLANG_HS_DUMP_WRITERS": "2",
        "SGLANG_HS_DUMP_WRITER": WRITER["mode"],
    }
    full.update({k if k.startswith("SGLANG") else "SGLANG_HS_DUMP_" + k.upper(): str(v) for k, v in env.items()})
    model = standin_model()
    d = attach(model, env=full, runtime=runtime(rank))
    return d


@pytest.fixture
def dumpers():
    made = []
    yield made
    for d in made:
        if d is not None:
            d.close(timeout=10)


def span_files(batch: Batch, root: Path, rank=0):
    """Expected (path, span tensors) for every request of a batch."""
    out, start = [], 0
    for n, p in zip(batch.lens, batch.prefixes):
        ids = batch.fb.input_ids[start : start + n].to(torch.int32)
        key = dumpfile.dump_key(ids.numpy().tobytes(), p)
        want = {
            "hidden_states": batch.hidden[start : start + n],
            "aux_hidden_states": torch.cat([a[start : start + n] for a in batch.aux], 1),
            "input_ids": ids,
            "positions": batch.fb.positions[start : start + n].to(torch.int32),
        }
        out.append((root / f"rank{rank}" / f"{key}.safetensors", want, p))
        start += n
    return out


def test_split_spans_uses_the_cpu_lengths():
    fb = make_batch([3, 0, 5, 2], [0, 4, 7, 0]).fb
    spans = dumper_mod.split_spans(fb)
    assert [(s.start, s.tokens, s.prefix_len) for s in spans] == [(0, 3, 0), (3, 5, 7), (8, 2, 0)]


def test_several_requests_random_lengths_and_partial_spans_round_trip_bit_exact(tmp_path, dumpers):
    d = make_dumper(tmp_path)
    dumpers.append(d)
    import random

    rng = random.Random(7)
    batches = []
    for seed in range(5):
        lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 6))]
        prefixes = [rng.choice([0, 0, rng.randint(1, 500)]) for _ in lens]
        batches.append(make_batch(lens, prefixes, seed=seed))
        d.capture(batches[-1].fb, batches[-1].hidden, batches[-1].aux)
    assert d.flush(30)
    for batch in batches:
        for path, want, prefix in span_files(batch, tmp_path):
            got = st_torch.load_file(str(path))
            for name, tensor in want.items():
                assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (path, name)
            meta = dumpfile.read_header(str(path)).metadata
            assert meta["partial"] == ("true" if prefix else "false") and meta["prefix_len"] == str(prefix)
            assert (
                meta["layers_to_capture"] == "[2, 30, 58]" and meta["eagle_aux_hidden_state_layer_ids"] == "[1, 29, 57]"
            )
            assert meta["sglang_version"] == "0.5.9" and meta["dtype"] == "bfloat16" and meta["rank"] == "0"
            assert meta["hidden_states_norm"] == "post-norm"
    report = dumpfile.verify_dir(str(tmp_path), hidden_size=H)
    total_spans = sum(len(b.lens) for b in batches)
    assert report.ok and report.files == total_spans, report.problems
    stats = json.loads((tmp_path / "rank0" / "stats.json").read_text())
    assert stats["files"] == total_spans and stats["errors"] == 0 and stats["dropped_spans"] == 0
    assert stats["tokens"] == sum(sum(b.lens) for b in batches)


def test_only_plain_extend_batches_are_captured(tmp_path, dumpers, monkeypatch):
    d = make_dumper(tmp_path)
    dumpers.append(d)
    for mode in (StandinForwardMode.DECODE, StandinForwardMode.MIXED, StandinForwardMode.TARGET_VERIFY):
        b = make_batch([4, 4], mode=mode)
        d.capture(b.fb, b.hidden, b.aux)
    tbo = make_batch([3])
    tbo.fb.can_run_tbo = True
    d.capture(tbo.fb, tbo.hidden, tbo.aux)
    monkeypatch.setattr(dumper_mod, "graph_capturing", lambda: True)
    b = make_batch([5])
    d.capture(b.fb, b.hidden, b.aux)
    d.flush(10)
    assert not list((tmp_path / "rank0").glob("*.safetensors"))
    assert d.stats.snapshot()["skipped"] == {
        "decode": 1,
        "mixed": 1,
        "target_verify": 1,
        "two_batch_overlap": 1,
        "graph_capture": 1,
    }


def test_bad_shapes_and_missing_aux_are_counted_not_raised(tmp_path, dumpers):
    d = make_dumper(tmp_path)
    dumpers.append(d)
    b = make_batch([4, 4])
    d.capture(b.fb, b.hidden[:5], b.aux)  # fewer rows than the lengths say
    d.capture(b.fb, b.hidden, None)  # capture switched off underneath
    d.flush(10)
    snap = d.stats.snapshot()
    assert snap["errors"] == 1 and snap["skipped"] == {"no_aux": 1} and snap["files"] == 0


class ProcessGate:
    """The writer process stopped (SIGSTOP) until `set()` continues it (SIGCONT)."""

    def __init__(self, pid):
        self.pid = pid
        os.kill(pid, signal.SIGSTOP)

    def set(self):
        os.kill(self.pid, signal.SIGCONT)


def gate_writers(d):
    """Hold every writer (threads, or the whole writer process) until the returned gate is set."""
    if d.sink is not None:
        return ProcessGate(d.sink.pid)
    gate = threading.Event()
    real = d._write_one

    def gated(job, span):
        assert gate.wait(30)
        real(job, span)

    d._write_one = gated
    d.writers.write_one = gated
    return gate


def test_backpressure_blocks_forward_only_when_the_pool_is_full(tmp_path, dumpers):
    d = make_dumper(tmp_path, buffers=1)
    dumpers.append(d)
    gate = gate_writers(d)
    first, second = make_batch([5, 6], seed=1), make_batch([7], seed=2)
    t0 = time.monotonic()
    d.capture(first.fb, first.hidden, first.aux)
    assert time.monotonic() - t0 < 5  # the pool had room: no wait for the disk
    blocked = threading.Thread(target=d.capture, args=(second.fb, second.hidden, second.aux))
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive()  # waiting for a buffer
    gate.set()
    blocked.join(10)
    assert not blocked.is_alive()
    d.flush(10)
    snap = d.stats.snapshot()
    assert snap["files"] == 3 and snap["dropped_batches"] == 0
    assert snap["backpressure_waits"] == 1 and snap["backpressure_wait_s"] >= 0.4
    assert snap["queue_high_water"] == 1


def test_drop_policy_counts_and_never_waits(tmp_path, dumpers):
    d = make_dumper(tmp_path, buffers=1, policy="drop")
    dumpers.append(d)
    gate = gate_writers(d)
    kept, dropped = make_batch([5, 6], seed=1), make_batch([7, 8, 9], seed=2)
    d.capture(kept.fb, kept.hidden, kept.aux)
    t0 = time.monotonic()
    d.capture(dropped.fb, dropped.hidden, dropped.aux)
    assert time.monotonic() - t0 < 2  # a waiting capture would block until gate.set(), below: forever
    gate.set()
    d.flush(10)
    snap = d.stats.snapshot()
    assert (snap["files"], snap["dropped_batches"], snap["dropped_spans"], snap["dropped_tokens"]) == (2, 1, 3, 24)
    assert dumpfile.verify_dir(str(tmp_path)).ok


def test_backpressure_wait_has_a_deadline(tmp_path, dumpers):
    d = make_dumper(tmp_path, buffers=1, wait_s=1)
    dumpers.append(d)
    gate = gate_writers(d)
    a, b = make_batch([3], seed=1), make_batch([4], seed=2)
    d.capture(a.fb, a.hidden, a.aux)
    d.capture(b.fb, b.hidden, b.aux)
    gate.set()
    d.flush(10)
    snap = d.stats.snapshot()
    assert snap["backpressure_timeouts"] == 1 and snap["dropped_tokens"] == 4 and snap["files"] == 1


def test_a_failing_write_is_counted_and_frees_the_buffer(tmp_path, dumpers):
    """A real failure: a directory sits where the first span's file must be renamed to."""
    d = make_dumper(tmp_path, buffers=1)
    dumpers.append(d)
    batches = [make_batch([4], seed=seed) for seed in range(3)]
    ((path, _, _),) = span_files(batches[0], tmp_path)
    path.mkdir(parents=True)
    for b in batches:
        d.capture(b.fb, b.hidden, b.aux)
    d.flush(10)
    snap = d.stats.snapshot()
    assert snap["errors"] == 1 and snap["files"] == 2


def test_rank_gating_and_all_ranks_validation(tmp_path, dumpers):
    b = make_batch([6, 3], [0, 2], seed=5)
    silent = make_dumper(tmp_path / "gated", rank=1)
    dumpers.append(silent)
    assert silent.writer is False
    silent.capture(b.fb, b.hidden, b.aux)
    assert not (tmp_path / "gated" / "rank1").exists()
    for rank in (0, 1, 2):
        d = make_dumper(tmp_path / "all", rank=rank, all_ranks=1)
        dumpers.append(d)
        d.capture(b.fb, b.hidden, b.aux)
        d.flush(10)
    result = dumpfile.compare_ranks(str(tmp_path / "all"))
    assert result["ok"] and result["compared"] == 2 and result["identical"] == 2
    assert dumpfile.verify_dir(str(tmp_path / "all")).ok


def test_positions_are_derived_when_the_batch_has_none(tmp_path, dumpers):
    d = make_dumper(tmp_path)
    dumpers.append(d)
    b = make_batch([4, 3], [0, 9])
    expected = span_files(b, tmp_path)
    b.fb.positions = None
    d.capture(b.fb, b.hidden, b.aux)
    d.flush(10)
    got = [st_torch.load_file(str(p))["positions"].tolist() for p, _, _ in expected]
    assert got == [[0, 1, 2, 3], [9, 10, 11]]


#: a forward process in a child: `d` = the dumper attached to a stand-in model, H hidden size
#: (argv: dump dir, repo root, H, buffers, writers); the scripts below append their loop
CHILD_DUMPER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[2])
    from types import SimpleNamespace as NS
    from enum import IntEnum
    from remote_ops.dumper import attach
    from remote_ops.dumper.runtime import Runtime, ServerArgsView
    class ForwardMode(IntEnum):
        EXTEND = 1
    H = int(sys.argv[3])
    model = NS(config=NS(num_hidden_layers=61, hidden_size=H), model=NS(layers_to_capture=[], layers=[]))
    env = {"SGLANG_HS_DUMP_DIR": sys.argv[1], "SGLANG_HS_DUMP_BUFFERS": sys.argv[4], "SGLANG_HS_DUMP_WRITERS": sys.argv[5]}
    d = attach(model, env=env, runtime=Runtime("0.5.9", 0, 1, ServerArgsView({})))
""")

KILL_CHILD = CHILD_DUMPER + textwrap.dedent("""
    seed = 0
    while True:  # until SIGKILL
        g = torch.Generator().manual_seed(seed)
        lens = [1500, 2500, 1000]
        T = sum(lens)
        fb = NS(forward_mode=ForwardMode.EXTEND, input_ids=torch.randint(0, 99999, (T,), generator=g),
                positions=torch.arange(T), extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0, 0, 0])
        d.capture(fb, torch.randn(T, H, generator=g).bfloat16(), [torch.randn(T, H, generator=g).bfloat16() for _ in range(3)])
        seed += 1
""")


def test_sigkill_mid_write_leaves_no_partial_file_visible(tmp_path):
    """Kill the writing process while a temp file is open: every visible file verifies."""
    root = tmp_path / "dumps"
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(root), str(REPO), "1024", "3", "3"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        folder = root / "rank0"
        while time.monotonic() < deadline:
            names = os.listdir(folder) if folder.exists() else []
            listed = len(dumpfile.read_manifest(str(folder / dumpfile.MANIFEST_NAME)).records)
            if listed >= 2 and any(n.startswith(".tmp-") and ".safetensors" in n for n in names):
                break
            time.sleep(0.002)
        else:
            pytest.fail("the child never had a temp file open: %s" % child.stderr.read1(2000) if child.poll() else "")
        os.killpg(child.pid, signal.SIGKILL)  # the forward process and its writer process
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
    report = dumpfile.verify_dir(str(root))
    assert report.ok, [p for p in report.problems if p.level == "error"]
    visible = [p for p in (root / "rank0").iterdir() if p.suffix == ".safetensors" and not p.name.startswith(".tmp-")]
    for path in visible:  # listed or not, nothing visible is partial
        header = dumpfile.read_header(str(path))
        assert header.data_start + header.data_len == path.stat().st_size
    assert report.files >= 2


PARENT_DIES = CHILD_DUMPER + textwrap.dedent("""
    os.kill(d.sink.pid, signal.SIGSTOP)  # the writer holds every job until this process is gone
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        lens = [5, 7]
        fb = NS(forward_mode=ForwardMode.EXTEND, input_ids=torch.randint(0, 99999, (12,), generator=g),
                positions=torch.arange(12), extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0, 0])
        d.capture(fb, torch.randn(12, H, generator=g).bfloat16(), [torch.randn(12, H, generator=g).bfloat16() for _ in range(3)])
    sys.stdout.write("%d\\n" % d.sink.pid)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # before any flush: the jobs are only in the ring, their posts made
""")


def test_the_writer_process_writes_what_landed_after_the_forward_process_died(tmp_path):
    """SIGKILL the forward process with four jobs published in the ring (CPU copies: landed, posted) and the
    writer stopped; once continued, the writer finds the parent gone, writes all four jobs, and exits."""
    if WRITER["mode"] != "process":
        pytest.skip("writer-process only")
    root, log = tmp_path / "dumps", tmp_path / "parent.log"
    with open(log, "w") as fh:  # a file, not a pipe: the stopped writer inherits it and would hold a pipe open
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT_DIES, str(root), str(REPO), "256", "4", "2"], stdout=fh, stderr=fh
        )
        assert parent.wait(120) == -signal.SIGKILL, log.read_text()[-2000:]
    pid = int(next(line for line in log.read_text().splitlines() if line.isdigit()))
    os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the writer process did not exit after its parent died")
    report = dumpfile.verify_dir(str(root), hidden_size=256)
    assert report.ok and report.files == 8, report.problems


def test_writer_process_death_drops_counted_and_never_blocks_the_forward(tmp_path, dumpers, writer_mode):
    """SIGKILL the writer process mid-run: batches in flight and later ones are counted as dropped."""
    if writer_mode != "process":
        pytest.skip("writer-process only")
    d = make_dumper(tmp_path, buffers=2)
    dumpers.append(d)
    first = make_batch([5, 6], seed=1)
    d.capture(first.fb, first.hidden, first.aux)
    d.flush(10)
    gate = gate_writers(d)  # stopped: the next batch stays in flight
    second = make_batch([7], seed=2)
    d.capture(second.fb, second.hidden, second.aux)
    os.kill(d.sink.pid, signal.SIGKILL)
    gate.set()
    deadline = time.monotonic() + 10
    while d.sink.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    third = make_batch([3], seed=3)
    d.capture(third.fb, third.hidden, third.aux)
    assert time.monotonic() - t0 < 1  # no wait for a writer that is gone
    snap = d.stats.snapshot()
    assert snap["files"] == 2 and snap["dropped_batches"] == 2 and snap["dropped_tokens"] == 10
    assert dumpfile.verify_dir(str(tmp_path)).ok


def test_two_processes_over_gloo_gate_ranks_and_write_bit_identical_spans(tmp_path, writer_mode):
    """bench/dumper_tp2.py on CPU: two torch.distributed ranks, a real all-reduce between layers."""
    if writer_mode != "process":
        pytest.skip("runs the default writer once")
    out = tmp_path / "tp2.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "dumper_tp2.py"),
            "--device",
            "cpu",
            "--hidden",
            "64",
            "--sizes",
            "",
            "--no-sustained",
            "--gating-tokens",
            "192",
            "--writers",
            "2",
            "--dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary == {
        "gating_default_only_rank0": True,
        "gating_all_ranks_both": True,
        "ranks_identical": True,
        "bit_exact": True,
        "verify_ok": True,
    }


def test_writer_process_runs_sched_batch_on_the_cpus_asked(tmp_path, dumpers, writer_mode):
    """SGLANG_HS_DUMP_WRITER_SCHED / _CPUS reach the child before its threads start (they inherit both)."""
    if writer_mode != "process" or not hasattr(os, "SCHED_BATCH"):
        pytest.skip("writer-process only, Linux scheduling policies")
    d = make_dumper(tmp_path, writer_cpus="0")
    dumpers.append(d)
    b = make_batch([4, 5], seed=4)
    d.capture(b.fb, b.hidden, b.aux)  # the child has read its config once it wrote a batch
    assert d.flush(10)
    tasks = os.listdir("/proc/%d/task" % d.sink.pid)
    assert len(tasks) >= 3  # reader, sequencer, writers
    for tid in map(int, tasks):
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        assert os.sched_getaffinity(tid) == {0}
    assert d.stats.snapshot()["files"] == 2


def test_cpu_list_parsing():
    from remote_ops.dumper.config import parse_cpu_list

    assert parse_cpu_list("") is None
    assert parse_cpu_list("2-4, 7,3") == [2, 3, 4, 7]
    for bad in ("x", "4-2", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_finished_jobs_are_read_from_shared_records_without_a_message(tmp_path, dumpers, writer_mode):
    """The writer process reports a job in the slot's record; flush (not the reaper's 1 s tick) collects it."""
    if writer_mode != "process":
        pytest.skip("writer-process only")
    d = make_dumper(tmp_path, buffers=2)
    dumpers.append(d)
    for seed in range(5):  # more batches than buffers: the pool reclaims slots itself
        b = make_batch([3, 4], seed=10 + seed)
        d.capture(b.fb, b.hidden, b.aux)
    t0 = time.monotonic()
    assert d.flush(10)
    assert time.monotonic() - t0 < 0.9
    snap = d.stats.snapshot()
    assert snap["files"] == 10 and snap["tokens"] == 35 and snap["errors"] == 0 and not d.inflight
    assert d.job_seq == 5 and d.sink.done_seq(0) != d.sink.done_seq(1)


def test_sources_are_held_until_the_child_saw_their_copies_land(tmp_path, dumpers, writer_mode):
    """No record_stream: a GPU batch's source tensors stay referenced (`held`) until the writer process
    reports (copied seq in the control segment) that the copies of that job landed; later jobs stay held."""
    if writer_mode != "process":
        pytest.skip("writer-process only")
    import weakref

    d = make_dumper(tmp_path, buffers=2)
    dumpers.append(d)
    for seed in range(3):
        b = make_batch([3, 4], seed=20 + seed)
        d.capture(b.fb, b.hidden, b.aux)
    assert d.flush(10)
    assert d.sink.copied_seq() == d.job_seq == 3  # the sequencer wrote it after each post
    landed, pending = torch.zeros(4), torch.zeros(4)
    gone = weakref.ref(landed)
    d.held.extend([(d.job_seq, (landed,)), (d.job_seq + 1, (pending,))])  # as the GPU path appends them
    del landed
    d._reclaim(0.0)
    assert gone() is None and [seq for seq, _keep in d.held] == [d.job_seq + 1]
    d.held.clear()


class _MemmoveDriver:
    """The driver entry points `Stager.queue` calls, done at once with memmove on CPU memory (the copy math)."""

    sem_post_addr = 0

    def __init__(self):
        self.posts = []
        self.event_record_fn = self.wait_event_fn = lambda *a: 0

    def d2h_fn(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        return 0

    def copy2d_fn(self, ref, stream):
        p = ref._obj
        for r in range(p.Height):
            ctypes.memmove(p.dstHost + r * p.dstPitch, p.srcDevice + r * p.srcPitch, p.WidthInBytes)
        return 0

    def host_fn(self, stream, fn, arg):
        self.posts.append(arg)
        return 0


@pytest.mark.parametrize("strided", [False, True])
def test_plan_and_queue_place_every_byte_like_the_torch_path(monkeypatch, writer_mode, strided):
    """The driver path's pointers, pitches (bytes) and per-buffer descriptors (one call per copy), checked
    on CPU memory: the buffer must hold what the general (torch) path puts there, for contiguous and
    strided sources."""
    if writer_mode != "process":
        pytest.skip("runs once")
    from remote_ops.dumper import staging

    rows, h = 5, 8
    g = torch.Generator().manual_seed(3)

    def src():
        big = torch.randn(rows + 2, 2 * h if strided else h, generator=g).to(torch.bfloat16)
        return big[:, :h]

    hidden, aux = src(), [src() for _ in range(3)]
    ids = torch.arange(100, 100 + rows + 1, dtype=torch.int64)
    pos = torch.arange(rows + 1, dtype=torch.int32)
    stager = staging.Stager(_MemmoveDriver())
    stager.device_index, stager.side_raw, stager.fence_event = -1, 1, 1  # CPU tensors: get_device() is -1
    monkeypatch.setattr(staging, "_RAW_STREAM", lambda index: 0)
    plan = stager.plan(hidden, aux, ids, pos, rows, h)
    assert plan is not None
    buf = staging.HostBuffer(rows + 3, h, torch.bfloat16, pin=False)
    assert stager.queue(plan, buf, rows, post_addr=1234) == (8, 4) and stager.driver.posts == [1234]
    ref = staging.HostBuffer(rows + 3, h, torch.bfloat16, pin=False)
    assert list(staging._copy_torch(ref, hidden, aux, ids, pos, rows, non_blocking=False)) == [8, 4]
    for region, row_bytes in enumerate((2 * h, 6 * h, 8, 4)):  # the rows written (the rest is uninitialized)
        start, end = ref.layout.offsets[region], ref.layout.offsets[region] + rows * row_bytes
        assert bytes(buf.mem[start:end]) == bytes(ref.mem[start:end]), region
    assert stager.plan(hidden, aux, ids, pos, rows + 3, h) is None  # too few rows: the general path reports it
    assert stager.plan(hidden, aux, ids[::2], pos, 3, h) is None  # strided ids: the general path


def assert_spans_written(batch: Batch, root: Path) -> None:
    for path, want, _prefix in span_files(batch, root):
        got = st_torch.load_file(str(path))
        for name, tensor in want.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (path, name)


def test_a_job_that_cannot_be_published_is_cancelled_and_the_child_moves_past_it(
    tmp_path, dumpers, writer_mode, monkeypatch
):
    """A hand-over (publishing the job in the ring) that fails with something other than a dead child is
    re-raised and counted as a capture error; the slot comes back, and the job's seq gets a cancelled ring
    entry plus its one "copies landed" post, so the child's sequencer (which takes jobs in seq order, one
    post each) moves past it and the next job is written after its own post."""
    if writer_mode != "process":
        pytest.skip("writer-process only")
    d = make_dumper(tmp_path, buffers=1)
    dumpers.append(d)
    b = make_batch([3, 4], seed=40)
    d.capture(b.fb, b.hidden, b.aux)
    assert d.flush(10)
    posts = []
    real_post = d.sink.post_landed
    monkeypatch.setattr(d.sink, "job", lambda *a, **k: (_ for _ in ()).throw(ValueError("boom")))
    monkeypatch.setattr(d.sink, "post_landed", lambda: posts.append(d.job_seq) or real_post())
    b2 = make_batch([5], seed=41)
    d.capture(b2.fb, b2.hidden, b2.aux)  # never raises: counted
    assert d.stats.snapshot()["errors"] == 1 and not d.inflight and d.pool.in_use == 0
    assert posts == [2]  # the cancelled entry's post, and no other
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while d.sink.copied_seq() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.sink.copied_seq() == 2  # the child took the cancelled job's post and entry
    b3 = make_batch([2, 2], seed=42)
    d.capture(b3.fb, b3.hidden, b3.aux)
    assert d.flush(10) and d.stats.snapshot()["files"] == 4
    assert d.job_seq == 3 and d.sink.copied_seq() == 3
    for batch in (b, b3):
        assert_spans_written(batch, tmp_path)


def test_a_batch_of_many_requests_sends_its_spans_past_the_ring(tmp_path, dumpers, writer_mode):
    """Spans that do not fit a ring entry go on the socket before the job is published; every span is
    written, and the jobs before and after it too."""
    if writer_mode != "process":
        pytest.skip("writer-process only")
    import marshal

    from remote_ops.dumper import procwriter

    d = make_dumper(tmp_path, buffers=2)
    dumpers.append(d)
    lens = [1 + i % 3 for i in range(700)]
    assert len(marshal.dumps([(0, n, 0) for n in lens])) > procwriter.JOB_BYTES - procwriter.JOB_SPANS_AT
    batches = [make_batch([3, 4], seed=50), make_batch(lens, seed=51), make_batch([2], seed=52)]
    for batch in batches:
        d.capture(batch.fb, batch.hidden, batch.aux)
    assert d.flush(30)
    snap = d.stats.snapshot()
    assert snap["errors"] == 0 and snap["files"] == 2 + 700 + 1 and snap["tokens"] == 7 + sum(lens) + 2
    for batch in batches:
        assert_spans_written(batch, tmp_path)
