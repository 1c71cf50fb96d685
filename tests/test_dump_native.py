"""The native copy queue (remote_ops/dumper/hsq.c), on CPU memory.

No GPU here: `cuda_standin.c` is a clearly named stand-in for the libcuda entry
points hsq.c calls (copies done at once with memmove, host functions run at
once).  What these tests prove is hsq.c's own logic: the bytes land where the
torch path puts them, the completion post comes once per job and in order, the
calls after the fence run on the native thread, a refused copy cancels its job
(ring entry marked, post made, seq reported, the dumper frees the slot), and
the build / fallback.  The real driver's timing is measured on the H200
(bench/dumper_paired.py, bench/README.md).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from remote_ops.dumper import native, staging
from remote_ops.dumper.cudadrv import SEM_T_BYTES, load_libc

HERE = Path(__file__).parent
if shutil.which("cc") is None:  # scripts/setup --test installs gcc; without it nothing here can be built
    pytest.skip("no C compiler (cc): the native copy queue cannot be built", allow_module_level=True)


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> ctypes.CDLL:
    """The libcuda stand-in, built once per test session."""
    out = tmp_path_factory.mktemp("standin") / "libcuda-standin.so"
    include = ["-I", str(native.HEADER.parent)]  # hsq_cuda.h: the cuda.h subset it shares with hsq.c
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", *include, "-o", str(out), str(HERE / "cuda_standin.c")], check=True
    )
    return ctypes.CDLL(str(out))


@pytest.fixture(autouse=True)
def reset(standin):
    for name in ("standin_fail_copy", "standin_fail_record", "standin_copies", "standin_syncs", "standin_host_fns"):
        ctypes.c_long.in_dll(standin, name).value = 0


class Semaphore:
    """A process-private sem_t the queue posts (as the writer process's "copies landed" one)."""

    def __init__(self):
        self.libc = load_libc()
        self.mem = ctypes.create_string_buffer(SEM_T_BYTES)
        self.addr = ctypes.addressof(self.mem)
        assert self.libc.sem_init(self.addr, 0, 0) == 0

    def take_all(self) -> int:
        n = 0
        while self.libc.sem_trywait(self.addr) == 0:
            n += 1
        return n


def sources(rows, h, strided, seed=3):
    g = torch.Generator().manual_seed(seed)

    def one():
        big = torch.randn(rows + 2, 2 * h if strided else h, generator=g).to(torch.bfloat16)
        return big[:, :h]

    return (
        one(),
        [one() for _ in range(3)],
        torch.arange(100, 101 + rows, dtype=torch.int64),
        torch.arange(rows + 1, dtype=torch.int32),
    )


class FenceOnly:
    """The one ctypes entry point a Stager with the native queue still calls itself (at close)."""

    def event_destroy(self, event):
        pass


def cpu_stager(monkeypatch, standin, copy) -> staging.Stager:
    """A Stager on CPU tensors whose native queue drives the stand-in libcuda."""
    stager = staging.Stager(FenceOnly(), copy, libcuda=standin._name)
    stager.device_index, stager.side_raw, stager.fence_event = -1, 1, 1  # CPU tensors: get_device() is -1
    monkeypatch.setattr(staging, "_RAW_STREAM", lambda index: 0)
    stager.open_native()
    assert stager.native is not None and stager.copy == copy
    return stager


def written(buf, rows, h) -> list:
    out = []
    for region, row_bytes in enumerate((2 * h, 6 * h, 8, 4)):
        start = buf.layout.offsets[region]
        out.append(bytes(buf.mem[start : start + rows * row_bytes]))
    return out


@pytest.mark.parametrize("copy", ["native", "inline"])
@pytest.mark.parametrize("strided", [False, True])
def test_native_queue_places_every_byte_like_the_torch_path_and_posts_once_per_job(monkeypatch, standin, copy, strided):
    rows, h = 5, 8
    hidden, aux, ids, pos = sources(rows, h, strided)
    stager, sem = cpu_stager(monkeypatch, standin, copy), Semaphore()
    plan = stager.plan(hidden, aux, ids, pos, rows, h)
    assert plan is not None
    buf = staging.HostBuffer(rows + 3, h, torch.bfloat16, pin=False)
    assert stager.queue(plan, buf, rows, post_addr=sem.addr, seq=1) == (8, 4)
    stager.synchronize()
    assert sem.take_all() == 1 and ctypes.c_long.in_dll(standin, "standin_copies").value == 6
    ref = staging.HostBuffer(rows + 3, h, torch.bfloat16, pin=False)
    staging._copy_torch(ref, hidden, aux, ids, pos, rows, non_blocking=False)
    assert written(buf, rows, h) == written(ref, rows, h)
    stager.close()
    assert stager.native is None


@pytest.mark.parametrize("wait", [0, 1, 2])  # sleeps (default); polls; SCHED_BATCH (diagnosis knobs)
def test_the_calls_after_the_fence_run_on_the_native_thread_in_job_order(monkeypatch, standin, wait):
    rows, h = 4, 8
    stager, sem = cpu_stager(monkeypatch, standin, "native"), Semaphore()
    stager.native.lib.set_wait(stager.native.handle, wait)
    bufs = [staging.HostBuffer(rows, h, torch.bfloat16, pin=False) for _ in range(3)]
    batches = [sources(rows, h, False, seed=s) for s in range(100)]
    for seq, (hidden, aux, ids, pos) in enumerate(batches, 1):  # more jobs than the ring: it must wrap
        stager.queue(stager.plan(hidden, aux, ids, pos, rows, h), bufs[seq % 3], rows, sem.addr, seq=seq)
    stager.synchronize()
    assert sem.take_all() == 100 and stager.native.state.issued == 100
    assert ctypes.c_ulong.in_dll(standin, "standin_copy_thread").value != standin.standin_self()
    hidden, aux, ids, pos = batches[-1]
    ref = staging.HostBuffer(rows, h, torch.bfloat16, pin=False)
    staging._copy_torch(ref, hidden, aux, ids, pos, rows, non_blocking=False)
    assert written(bufs[100 % 3], rows, h) == written(ref, rows, h)
    stager.close()


@pytest.mark.parametrize("strided", [False, True])
def test_paced_copies_land_every_byte_and_the_thread_posts_itself(monkeypatch, standin, strided):
    """The pacing experiment (hsq_set_pacing): copies cut into slices (here 40 bytes: pieces of rows,
    and of the contiguous hidden copy), each waited for; the post made by the thread, no host function."""
    rows, h = 5, 8
    stager, sem = cpu_stager(monkeypatch, standin, "native"), Semaphore()
    stager.native.lib.set_pacing(stager.native.handle, 40, 0, 1)
    for name in ("standin_host_fns", "standin_event_syncs"):
        ctypes.c_long.in_dll(standin, name).value = 0
    bufs = []
    for seq in (1, 2):
        hidden, aux, ids, pos = sources(rows, h, strided, seed=seq)
        bufs.append((staging.HostBuffer(rows + 3, h, torch.bfloat16, pin=False), (hidden, aux, ids, pos)))
        stager.queue(stager.plan(hidden, aux, ids, pos, rows, h), bufs[-1][0], rows, sem.addr, seq=seq)
    stager.synchronize()
    assert sem.take_all() == 2 and ctypes.c_long.in_dll(standin, "standin_host_fns").value == 0
    assert ctypes.c_long.in_dll(standin, "standin_event_syncs").value > 2 * 6  # slices were waited for
    assert ctypes.c_long.in_dll(standin, "standin_copies").value > 2 * 6  # copies were cut
    for buf, (hidden, aux, ids, pos) in bufs:
        ref = staging.HostBuffer(rows + 3, h, torch.bfloat16, pin=False)
        staging._copy_torch(ref, hidden, aux, ids, pos, rows, non_blocking=False)
        assert written(buf, rows, h) == written(ref, rows, h)
    stager.close()


@pytest.mark.parametrize("copy", ["native", "inline"])
def test_gathered_steps_are_one_job_of_every_copy_at_their_rows(monkeypatch, standin, copy):
    """queue_gathered through hsq.c: three steps (one strided) as one job: 18 copies, one post, each
    step's rows where the torch path would put them at its first row."""
    h = 8
    steps = [(3, False), (5, True), (2, False)]
    stager, sem = cpu_stager(monkeypatch, standin, copy), Semaphore()
    buf = staging.HostBuffer(16, h, torch.bfloat16, pin=False)
    parts, srcs, first = [], [], 0
    for i, (rows, strided) in enumerate(steps):
        hidden, aux, ids, pos = sources(rows, h, strided, seed=10 + i)
        srcs.append((first, rows, hidden, aux, ids, pos))
        parts.append((stager.plan(hidden, aux, ids, pos, rows, h), first, rows))
        first += rows
    stager.queue_gathered(parts, buf, sem.addr, 0, (0, 0), 1)
    stager.synchronize()
    assert sem.take_all() == 1 and ctypes.c_long.in_dll(standin, "standin_copies").value == 18
    got = written(buf, first, h)
    for first, rows, hidden, aux, ids, pos in srcs:
        ref = staging.HostBuffer(rows, h, torch.bfloat16, pin=False)
        staging._copy_torch(ref, hidden, aux, ids, pos, rows, non_blocking=False)
        for region, (row_bytes, want) in enumerate(zip((2 * h, 6 * h, 8, 4), written(ref, rows, h))):
            assert got[region][first * row_bytes : (first + rows) * row_bytes] == want, (first, region)
    too_many = [parts[0]] * (native.MAX_COPIES // 6 + 1)
    with pytest.raises(staging.CudaError, match="copies in one gathered job"):
        stager.queue_gathered(too_many, buf, sem.addr, 0, (0, 0), 2)
    stager.close()


def test_the_dumper_gathers_small_steps_into_native_jobs(tmp_path, monkeypatch, standin):
    """The dumper with SGLANG_HS_DUMP_COPY=native gathers too: one hsq job per gathered group, files
    bit-exact, the steps per job capped by what one job holds."""
    from types import SimpleNamespace

    from test_dump_capture import assert_spans_written, make_batch, make_dumper

    d = make_dumper(tmp_path, writer="process", buffers=2, copy="native", gather_tokens=64, gather_steps=20)
    try:
        d.driver = SimpleNamespace(make_current=lambda ctx: None, current_context=lambda: 0)
        d.stager = cpu_stager(monkeypatch, standin, "native")
        d._start_gather()
        assert d.gather is not None and d.gather.max_steps == native.MAX_COPIES // 6
        batches = [make_batch([2, 1], seed=30 + i) for i in range(10)]
        for b in batches:
            d.capture(b.fb, b.hidden, b.aux)
        assert d.flush(10)
        assert d.job_seq == 2 and ctypes.c_long.in_dll(standin, "standin_copies").value == 60
        assert d.stats.snapshot()["files"] == 20 and d.stats.snapshot()["errors"] == 0
        for b in batches:
            assert_spans_written(b, tmp_path)
    finally:
        d.close(10)


def test_a_refused_copy_cancels_its_job_posts_for_it_and_is_reported(monkeypatch, standin):
    rows, h = 4, 8
    stager, sem = cpu_stager(monkeypatch, standin, "native"), Semaphore()
    mark = ctypes.c_int64(0)
    ctypes.c_long.in_dll(standin, "standin_fail_copy").value = 6 + 3  # the 3rd copy of the 2nd job
    buf = staging.HostBuffer(rows, h, torch.bfloat16, pin=False)
    for seq in (1, 2, 3):
        hidden, aux, ids, pos = sources(rows, h, False, seed=seq)
        plan = stager.plan(hidden, aux, ids, pos, rows, h)
        stager.queue(plan, buf, rows, sem.addr, (ctypes.addressof(mark), 7) if seq == 2 else (0, 0), seq)
    stager.synchronize()
    assert sem.take_all() == 3  # the child moves past the cancelled job
    assert mark.value == 7 and ctypes.c_long.in_dll(standin, "standin_syncs").value >= 1
    assert stager.native.failures() == [2] and stager.native.failures() == []
    assert "a copy refused: CUresult 700" in stager.native.error()
    stager.close()


def test_a_refused_fence_raises_on_the_forward_thread_with_nothing_queued(monkeypatch, standin):
    rows, h = 4, 8
    stager, sem = cpu_stager(monkeypatch, standin, "native"), Semaphore()
    ctypes.c_int.in_dll(standin, "standin_fail_record").value = 1
    hidden, aux, ids, pos = sources(rows, h, False)
    buf = staging.HostBuffer(rows, h, torch.bfloat16, pin=False)
    with pytest.raises(staging.CudaError, match="code 400"):
        stager.queue(stager.plan(hidden, aux, ids, pos, rows, h), buf, rows, sem.addr, seq=1)
    stager.synchronize()
    assert sem.take_all() == 0 and ctypes.c_long.in_dll(standin, "standin_copies").value == 0
    stager.close()


def test_the_dumper_frees_the_slot_of_a_job_the_native_thread_cancelled(tmp_path, monkeypatch):
    """Dumper bookkeeping for a cancelled job: slot back in the pool, sources dropped, counted."""
    from remote_ops.dumper.config import DumpConfig
    from remote_ops.dumper.dumper import Dumper

    d = Dumper(DumpConfig(root=str(tmp_path), writer="thread"), 0, True, [1, 2, 3], 8, {})
    try:
        d._pool_for(torch.zeros(1, 8, dtype=torch.bfloat16))
        bufs = [d.pool.acquire(4, 8, torch.bfloat16, False, 0.0) for _ in range(2)]
        d.inflight = {bufs[0].slot: (2, 4, 5), bufs[1].slot: (1, 4, 6)}
        d.held.extend([(5, ("a",)), (6, ("b",))])

        class Cancelled:  # what NativeQueue reports after its thread cancelled job 5
            def failures(self):
                return [5]

            def error(self):
                return "a copy refused: CUresult 700"

        d.stager.native = Cancelled()
        before = d.pool.in_use
        d._drop_native_failures()
        assert list(d.inflight) == [bufs[1].slot] and [s for s, _ in d.held] == [6]
        assert d.pool.in_use == before - 1 and d.stats.counts["dropped_batches"] == 1
        assert d.stats.counts["errors"] == 1
    finally:
        d.stager.native = None
        d.close(5)


def test_the_library_is_built_once_per_source_and_looked_up_first(tmp_path, monkeypatch):
    source = tmp_path / "hsq.c"
    source.write_bytes(native.SOURCE.read_bytes() + b"/* a version no folder has a build of */\n")
    monkeypatch.setattr(native, "SOURCE", source)
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "lib"))
    path = native.find_or_build()
    assert path.parent == tmp_path / "lib" and path.name == native.library_name(source.read_bytes())
    mtime = path.stat().st_mtime_ns
    assert native.find_or_build() == path and path.stat().st_mtime_ns == mtime
    assert native.library_name(b"other source") != path.name


def test_without_a_compiler_the_stager_falls_back_to_ctypes_calls(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "empty"))
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(native, "SOURCE", tmp_path / "hsq.c")  # a source no folder has a build of
    (tmp_path / "hsq.c").write_text("/* not built */\n")
    monkeypatch.setattr(native, "_LIBRARY", None)
    monkeypatch.setattr(native, "_LOAD_ERROR", None)
    stager = staging.Stager(object(), "native")
    stager.side_raw = 1
    stager.open_native()
    assert stager.native is None and stager.copy == "calls"
    assert "no C compiler" in caplog.text
