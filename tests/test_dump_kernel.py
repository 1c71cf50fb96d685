"""The copy kernel (SGLANG_HS_DUMP_COPY=kernel: remote_ops/dumper/hsk.cu, hsk.ptx, kernelcopy.py), on CPU.

There is no GPU here, so the kernel's own source runs as C: hsk.cu compiled by
the host compiler with HSK_HOST, whose `hsk_run_grid` runs every (block,
thread) of a grid one after the other, each doing exactly the loads and stores
the GPU thread would.  What is proved: the index math places every byte of
contiguous, row-pitched and oddly aligned copies for any grid shape; the
checked-in PTX was generated from this source; and the dumper with the kernel
mode gathers steps into one launch whose table `KernelDriver` (a named
stand-in for cuModuleLoadData/cuLaunchKernel and the device-mapped
registration: it runs the table through `hsk_run_grid`) turns into files
bit-exact through the real writer process; and the staged mode
(SGLANG_HS_DUMP_COPY=staged) runs the same kernel into a staging buffer laid
out for the job's rows and moves each job with one contiguous copy, packed
jobs the writer reads right.  That NVRTC's PTX does the same on a GPU, and
what the kernel costs, is for the H200 (bench/README.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")

from test_dump_capture import assert_spans_written, make_batch, make_dumper  # noqa: E402
from test_dump_gather import MemmoveDriver  # noqa: E402

from remote_ops.dumper import kernelcopy, staging  # noqa: E402

COPY = ctypes.c_uint64 * 6


class Table(ctypes.Structure):
    _fields_ = [("count", ctypes.c_uint64), ("copies", COPY * kernelcopy.MAX_COPIES)]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """hsk.cu built for the CPU; its hsk_run_grid(table, blocks, threads)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("hsk") / "libhsk_host.so"
    cmd = [cc, "-O1", "-shared", "-fPIC", "-Wall", "-DHSK_HOST", "-x", "c", str(kernelcopy.SOURCE), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(out))
    lib.hsk_run_grid.argtypes, lib.hsk_run_grid.restype = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], ctypes.c_int
    return lib.hsk_run_grid


def run(grid, copies, blocks, threads):
    table = Table(len(copies))
    for slot, values in zip(table.copies, copies):
        slot[:] = values
    grid(ctypes.addressof(table), blocks, threads)


def test_the_checked_in_ptx_comes_from_this_source():
    first = kernelcopy.PTX.read_text().splitlines()[0]
    digest = hashlib.sha256(kernelcopy.SOURCE.read_bytes()).hexdigest()
    assert first.endswith(digest), "hsk.cu changed: run scripts/build-hsk-ptx"
    assert ".entry hsk_copy_all(" in kernelcopy.PTX.read_text() and ".version 7.0" in kernelcopy.PTX.read_text()


@pytest.mark.parametrize("blocks,threads", [(1, 1), (3, 7), (2, 64)])
def test_every_byte_lands_for_contiguous_pitched_and_odd_copies(grid, blocks, threads):
    src = (ctypes.c_ubyte * 4096).from_buffer(bytearray(range(256)) * 16)
    dst = (ctypes.c_ubyte * 4096)()
    s, d = ctypes.addressof(src), ctypes.addressof(dst)
    copies = [
        (s, 0, d, 0, 512, 0),  # contiguous, 16-byte elements
        (s + 512, 96, d + 1024, 160, 48, 5),  # 5 rows of 48 bytes: source pitch 96, destination pitch 160
        (s + 8, 0, d + 2048, 0, 24, 0),  # 8-byte elements (ids of 3 int64)
        (s + 4, 0, d + 2100, 0, 12, 0),  # 4-byte elements
        (s + 3, 0, d + 2201, 0, 7, 0),  # bytes
        (s, 0, d + 3000, 0, 0, 0),  # empty
    ]
    run(grid, copies, blocks, threads)
    want = bytearray(4096)
    for src_at, src_pitch, dst_at, dst_pitch, width, height in copies:
        for r in range(height or 1):
            a, b = src_at - s + r * src_pitch, dst_at - d + r * dst_pitch
            want[b : b + width] = bytes(src)[a : a + width]
    assert bytes(dst) == bytes(want)


class KernelDriver(MemmoveDriver):
    """MemmoveDriver plus what the kernel mode calls: the module load (a handle), the launch (the table
    through the CPU build of hsk.cu, on the grid asked for), device-mapped registration (the device
    address is the host one, as with UVA)."""

    def __init__(self, grid):
        super().__init__()
        self.grid, self.launches, self.registered = grid, [], []

    def kernel(self, ptx, name):
        assert name == b"hsk_copy_all" and b".entry hsk_copy_all(" in ptx
        return 99

    def launch_fn(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        assert function == 99 and (gy, gz, by, bz, shared, extra) == (1, 1, 1, 1, 0, None)
        self.launches.append((gx, bx, Table.from_address(params[0]).count))
        self.grid(params[0], gx, bx)
        return 0

    def register(self, addr, nbytes, device_map=False):
        self.registered.append(device_map)

    def device_pointer(self, addr):
        return addr

    def unregister(self, addr):
        pass


def test_the_dumper_in_kernel_mode_writes_gathered_steps_with_one_launch_per_job(tmp_path, grid, monkeypatch):
    d = make_dumper(tmp_path, writer="process", buffers=2, copy="kernel", gather_tokens=64, gather_steps=20)
    try:
        driver = KernelDriver(grid)
        d.driver, d.stager = driver, staging.Stager(driver, "kernel", kernel_blocks=3)
        d.stager.device_index, d.stager.side_raw, d.stager.fence_event = -1, 1, 1  # CPU: get_device() is -1
        d.stager.kernel = kernelcopy.KernelCopy(driver, 3)
        monkeypatch.setattr(staging, "_RAW_STREAM", lambda index: 5)
        make = d._make_buffer  # page-locked as on a GPU, so the buffers are device-mapped
        d._make_buffer = lambda slot, gen, rows, h, dtype, pin, shared: make(slot, gen, rows, h, dtype, True, shared)
        d._start_gather()
        assert d.gather is not None and d.gather.max_steps == kernelcopy.MAX_COPIES // 6
        batches = [make_batch([2, 1], seed=130 + i) for i in range(10)]
        for b in batches:
            d.capture(b.fb, b.hidden, b.aux)
        big = make_batch([40, 30], seed=140)  # 70 rows >= 64: its own job, one launch of its 6 copies
        d.capture(big.fb, big.hidden, big.aux)
        assert d.flush(10)
        assert driver.registered and all(driver.registered)
        assert [(n, count) for _b, n, count in driver.launches] == [(256, 48), (256, 12), (256, 6)]  # 8 steps, 2, 1
        assert driver.launches[0][0] == 3 and len(driver.posts) == 3 and d.job_seq == 3
        assert d.stats.snapshot()["files"] == 22 and d.stats.snapshot()["errors"] == 0
        for b in batches + [big]:
            assert_spans_written(b, tmp_path)
    finally:
        d.close(10)


class StagedDriver(KernelDriver):
    """KernelDriver whose contiguous copies are counted too: the staged copy's one DMA per job."""

    def __init__(self, grid):
        super().__init__(grid)
        self.dmas = []

    def d2h_fn(self, dst, src, nbytes, stream):
        self.dmas.append(nbytes)
        return super().d2h_fn(dst, src, nbytes, stream)


def staged_dumper(tmp_path, grid, monkeypatch):
    """A dumper in staged mode whose kernel runs as C and whose staging buffer is CPU memory."""
    d = make_dumper(tmp_path, writer="process", buffers=2, copy="staged", gather_tokens=64, gather_steps=20)
    driver = StagedDriver(grid)
    d.driver, d.stager = driver, staging.Stager(driver, "staged", kernel_blocks=3)
    d.stager.device_index, d.stager.side_raw, d.stager.fence_event = -1, 1, 1  # CPU: get_device() is -1
    d.stager.kernel = kernelcopy.KernelCopy(driver, 3)
    monkeypatch.setattr(staging, "_RAW_STREAM", lambda index: 5)
    make = d._make_buffer  # page-locked as on a GPU
    d._make_buffer = lambda slot, gen, rows, h, dtype, pin, shared: make(slot, gen, rows, h, dtype, True, shared)
    d._start_gather()
    return d, driver


def test_the_staged_copy_lands_each_job_packed_with_one_launch_and_one_dma(tmp_path, grid, monkeypatch):
    """Gathered steps and a large step alone: each job is one kernel launch into the staging buffer, laid
    out for the job's own rows, then ONE contiguous DMA of exactly those bytes; the ring entry says
    `packed`, and the child reads the spans from that layout: the files are bit-exact."""
    from remote_ops.dumper.layout import Layout

    d, driver = staged_dumper(tmp_path, grid, monkeypatch)
    try:
        assert d.stager.packs and d.gather is not None and d.gather.max_steps == kernelcopy.MAX_COPIES // 6
        batches = [make_batch([2, 1], seed=150 + i) for i in range(10)]
        for b in batches:
            d.capture(b.fb, b.hidden, b.aux)
        big = make_batch([40, 30], seed=160)  # 70 rows >= 64: its own job
        d.capture(big.fb, big.hidden, big.aux)
        assert d.flush(10)
        assert not any(driver.registered)  # host buffers are not device-mapped: the kernel stores to the GPU
        assert [count for _b, _n, count in driver.launches] == [48, 12, 6]  # 8 steps, 2, 1
        h, esize = d.hidden_size, 2
        assert driver.dmas == [Layout(rows, h, esize).nbytes for rows in (24, 6, 70)]
        assert len(driver.posts) == 3 and d.job_seq == 3
        assert d.stats.snapshot()["files"] == 22 and d.stats.snapshot()["errors"] == 0
        for b in batches + [big]:
            assert_spans_written(b, tmp_path)
    finally:
        d.close(10)
    assert d.stager.staging is None


def test_a_staged_step_without_positions_goes_unpacked_through_the_calls(tmp_path, grid, monkeypatch):
    """A step whose positions the dumper fills in on the host (none from the model) is not packed: its
    positions go straight into the host buffer, which the staged DMA would overwrite, so it takes the
    per-copy calls into the slot's usual layout, and is written bit-exact all the same."""
    d, driver = staged_dumper(tmp_path, grid, monkeypatch)
    try:
        b = make_batch([50, 30], seed=170)
        positions, b.fb.positions = b.fb.positions, None  # the spans give the same positions
        d.capture(b.fb, b.hidden, b.aux)
        b.fb.positions = positions
        assert d.flush(10)
        assert driver.launches == [] and len(driver.dmas) == 2  # the calls: hidden and ids in one piece each
        assert d.stats.snapshot()["files"] == 2 and d.stats.snapshot()["errors"] == 0
        assert_spans_written(b, tmp_path)
    finally:
        d.close(10)


def test_the_staging_buffer_grows_only_after_the_side_stream_drained(monkeypatch):
    """A job larger than the staging buffer: the side stream is synchronized before the old buffer is let
    go (its last job may still read it), and the new one holds a whole host buffer's bytes."""
    stager = staging.Stager(None, "staged")
    synced = []
    monkeypatch.setattr(stager, "synchronize", lambda: synced.append(True))
    first = stager._staging_base(100, 400)
    assert stager.staging.numel() == 400 and not synced
    assert stager._staging_base(300, 400) == first and not synced
    stager._staging_base(500, 800)
    assert synced == [True] and stager.staging.numel() == 800


def test_no_room_for_the_staging_buffer_cancels_that_job_and_falls_back_to_the_calls(tmp_path, grid, monkeypatch):
    """The GPU cannot hold the staging buffer: the job that asked is cancelled and counted (never written
    from a half-made copy), the mode says `calls` from then on, and later steps are written bit-exact."""
    d, driver = staged_dumper(tmp_path, grid, monkeypatch)
    try:
        real_empty = torch.empty

        def no_room(*args, **kw):
            if kw.get("device") is not None:
                raise torch.cuda.OutOfMemoryError("no room")
            return real_empty(*args, **kw)

        monkeypatch.setattr(staging.torch, "empty", no_room)
        lost = make_batch([40, 30], seed=180)
        d.capture(lost.fb, lost.hidden, lost.aux)
        monkeypatch.setattr(staging.torch, "empty", real_empty)
        assert not d.stager.packs and d.stager.copy == "calls" and driver.launches == []
        assert d.stats.snapshot()["errors"] == 1 and d.stats.static["copy"] == "calls"  # stats.json says so
        kept = make_batch([50, 20], seed=181)
        d.capture(kept.fb, kept.hidden, kept.aux)
        assert d.flush(10)
        assert d.stats.snapshot()["files"] == 2
        assert_spans_written(kept, tmp_path)
    finally:
        d.close(10)


def test_the_staged_copy_with_done_flags(tmp_path, grid, monkeypatch):
    """Staged jobs signalled by done flags: one launch, one DMA and one flag write per job, no host
    function; the files are bit-exact."""
    d, driver = staged_dumper(tmp_path, grid, monkeypatch)
    writes = []

    def write32(stream, dptr, value, flags):
        writes.append(value)
        ctypes.c_uint32.from_address(dptr).value = value
        return 0

    driver.write32_fn = write32
    try:
        d.sink.enable_flags(driver)
        d.flags = True
        batches = [make_batch([2, 1], seed=210 + i) for i in range(8)]
        for b in batches:
            d.capture(b.fb, b.hidden, b.aux)
        assert d.flush(10)
        assert len(driver.launches) == len(driver.dmas) == len(writes) == 1 and driver.posts == []
        for b in batches:
            assert_spans_written(b, tmp_path)
    finally:
        d.close(10)
