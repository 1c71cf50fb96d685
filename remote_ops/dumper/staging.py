"""Host staging for captured tensors: a bounded pool of (pinned) buffers and the async copy.

GPU path: the copies run on a side stream that first waits for the forward's
stream (one reused event).  The source tensors are not `record_stream`-ed:
the batch keeps Python references to them (`Staged.keep`, or the dumper's
`held` list with the writer process) until the copies are seen complete on
the host, so the caching allocator cannot hand their memory to later kernels
before the side stream read it; dropping the references then makes the
memory reusable at once.  (record_stream cost 6 torch calls per batch in
`capture()`, and the allocator recorded an event per marked block when the
forward freed it and queried it at later allocations.)
By default the copies are DMA only (no kernel, no GPU allocation; with the
experimental SGLANG_HS_DUMP_COPY=kernel a job's copies are instead one launch
of a copy kernel into device-mapped buffers, see `kernelcopy`; with the
experimental SGLANG_HS_DUMP_COPY=staged the same kernel gathers them into a GPU
staging buffer laid out for the job's rows, and one DMA copy moves the job to
the host buffer, see `Stager.packs`): hidden rows as they
are, each aux tensor as a strided 2D copy into its third of the [rows, 3H]
rows, ids and positions in their source dtype (the writer converts them to
int32).  `plan` reads what the copies need from the tensors (one pass, no side
effect), `queue` issues fence, copies and the optional semaphore post through
the driver by ctypes (see `cudadrv`) with prebuilt per-buffer copy
descriptors (the 9 calls cost 90-128 us cold inside a forward loop on the
H200 VMs: the largest part of `capture()`), or, with SGLANG_HS_DUMP_COPY=native
or inline, packs the job into one struct for `hsq.c` (see `native`).  Completion: with
the writer process a `sem_post` host function right behind the copies on the
side stream (or a done flag written by the GPU); with writer threads, a
blocking-sync event (waiting sleeps instead of spinning a core).  CPU path
(tests, CPU-only hosts): plain synchronous copies, no event, nothing held.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from . import native
from .cudadrv import (
    CU_MEMCPY_OPERAND_TYPE_POINTER,
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    CU_MEMORYTYPE_DEVICE,
    CU_MEMORYTYPE_HOST,
    CUDA_MEMCPY2D,
    MEMCPY3D_BATCH_OP,
    CudaError,
)
from .kernelcopy import KernelCopy
from .layout import REGION_AUX, REGION_HIDDEN, REGION_IDS, REGION_POS, Layout
from .native import NativeQueue

log = logging.getLogger("remote_ops_dump")
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
ID_DTYPES = (torch.int32, torch.int64)
ID_SIZES = {torch.int32: 4, torch.int64: 8}
FLOAT_SIZES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}
RECLAIM_SLICE_S = 0.01  # longest single wait for a written batch (another thread may have taken its post)


class HostBuffer:
    """One flat host allocation holding a whole batch (see `layout.Layout`).

    `shared=True` puts it in a memfd segment that the writer process maps too;
    `pin` page-locks it (torch's pinned allocator, or cuMemHostRegister for a
    shared segment) so that the copies into it are true asynchronous DMA.
    """

    def __init__(
        self,
        capacity: int,
        hidden_size: int,
        dtype: torch.dtype,
        pin: bool,
        shared: bool = False,
        slot: int = 0,
        gen: int = 0,
        driver=None,
        device_map: bool = False,
    ):
        self.capacity, self.hidden_size, self.dtype = capacity, hidden_size, dtype
        self.slot, self.gen, self.driver = slot, gen, None
        self.device_base = 0  # the device address of a device-mapped shared buffer (the copy kernel's target)
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.layout = Layout(capacity, hidden_size, self.esize)
        self.fd = -1
        self.map: Optional[mmap.mmap] = None
        if shared:
            self._shared(pin, driver, device_map)
        else:
            self.flat = torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=pin)
            self.mem = memoryview((ctypes.c_ubyte * self.layout.nbytes).from_address(self.flat.data_ptr())).cast("B")
        self.base = self.flat.data_ptr()
        self.hidden = self._region(REGION_HIDDEN).view(dtype).view(capacity, hidden_size)
        self.aux = self._region(REGION_AUX).view(dtype).view(capacity, 3 * hidden_size)
        self.copies = self._copy_descriptors()
        self.row_bytes = hidden_size * self.esize
        offsets = self.layout.offsets  # the regions' host addresses (the native queue's copy targets)
        self.dsts = tuple(self.base + offsets[r] for r in (REGION_HIDDEN, REGION_AUX, REGION_IDS, REGION_POS))
        # the same regions' device addresses when device-mapped (SGLANG_HS_DUMP_COPY=kernel), else None
        self.device_dsts = tuple(d - self.base + self.device_base for d in self.dsts) if self.device_base else None
        self.batch: Optional[tuple] = None  # (ops array, its address, [(src, dst, extent)] x 6): batch_ops()

    def _copy_descriptors(self) -> List[Tuple[CUDA_MEMCPY2D, Any]]:
        """cuMemcpy2DAsync descriptors with this buffer's side preset: aux 0..2 (into their thirds of the
        [C, 3H] rows), then hidden (used when its rows are strided); a batch sets only source and height."""
        width, offsets = self.hidden_size * self.esize, self.layout.offsets
        targets = [(self.base + offsets[REGION_AUX] + k * width, 3 * width) for k in range(3)]
        targets.append((self.base + offsets[REGION_HIDDEN], width))
        out = []
        for dst, pitch in targets:
            p = CUDA_MEMCPY2D()
            p.srcMemoryType, p.dstMemoryType = CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST
            p.dstHost, p.dstPitch, p.WidthInBytes = dst, pitch, width
            out.append((p, ctypes.byref(p)))
        return out

    def batch_ops(self) -> tuple:
        """The cuMemcpy3DBatchAsync ops of this buffer, destinations preset: hidden, aux 0..2 (into their
        thirds of the [C, 3H] rows), ids, positions; a batch sets sources, row lengths and heights.
        Returns (ops array, its address, [(src operand, dst operand, extent)] per op), made once."""
        if self.batch is None:
            width, offsets = self.hidden_size * self.esize, self.layout.offsets
            dsts = [(self.base + offsets[REGION_HIDDEN], width)]
            dsts += [(self.base + offsets[REGION_AUX] + k * width, 3 * width) for k in range(3)]
            dsts += [(self.base + offsets[REGION_IDS], 0), (self.base + offsets[REGION_POS], 0)]
            ops = (MEMCPY3D_BATCH_OP * 6)()
            views = []
            for op, (dst, pitch) in zip(ops, dsts):
                op.src.type = op.dst.type = CU_MEMCPY_OPERAND_TYPE_POINTER
                op.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                op.dst.op.ptr, op.dst.op.rowLength = dst, pitch
                op.extent.width, op.extent.height, op.extent.depth = width, 1, 1
                op.src.op.layerHeight = op.dst.op.layerHeight = 1
                views.append((op.src.op, op.dst.op, op.extent))
            self.batch = (ops, ctypes.addressof(ops), views)
        return self.batch

    def _shared(self, pin: bool, driver, device_map: bool = False) -> None:
        from .procwriter import shared_segment

        self.fd, mapped = shared_segment(self.layout.nbytes, "hs-dump-slot%d" % self.slot)
        self.map = mapped
        self.flat = torch.frombuffer(mapped, dtype=torch.uint8)
        self.mem = memoryview(mapped)
        if pin:
            try:
                driver.register(self.flat.data_ptr(), self.layout.nbytes, device_map)
                self.driver = driver
            except Exception as exc:  # e.g. a locked-memory limit: still correct, copies become synchronous
                log.error(
                    "[hs-dump] could not page-lock a %d-byte host buffer (%r): copies into it "
                    "will block the forward thread",
                    self.layout.nbytes,
                    exc,
                )
        if device_map and self.driver is not None:
            try:
                self.device_base = driver.device_pointer(self.flat.data_ptr())
            except Exception as exc:  # its jobs then take the ctypes calls
                log.error("[hs-dump] no device address for a host buffer (%r): copy calls, not the kernel", exc)

    def _region(self, index: int) -> torch.Tensor:
        start = self.layout.offsets[index]
        return self.flat[start : start + self.layout.sizes[index]]

    def id_view(self, index: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """The ids (REGION_IDS) or positions (REGION_POS) region as `rows` values of `dtype`."""
        return self._region(index).view(dtype)[:rows]

    def fits(self, rows: int, hidden_size: int, dtype: torch.dtype) -> bool:
        return rows <= self.capacity and hidden_size == self.hidden_size and dtype == self.dtype

    def free(self) -> None:
        """Unpin and unmap (a shared segment); only once no copy into it is pending."""
        if self.driver is not None:
            self.driver.unregister(self.base)
            self.driver = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BufferPool:
    """`count` buffer slots handed out to batches in flight: the dumper's bounded queue.

    A slot's buffer is made (by `make_buffer(slot, gen, rows)`) on first use and
    made again, larger, when a batch does not fit.  `acquire` blocks
    (backpressure) or returns None (drop).
    """

    def __init__(
        self,
        count: int,
        min_tokens: int,
        make_buffer: Callable[[int, int, int, int, torch.dtype], HostBuffer],
        reclaim: Optional[Callable[[float], int]] = None,
    ):
        """`reclaim(wait_s)`: frees the slots whose batch was written (calling `release`), waiting up to
        `wait_s` for one when none is; the writer process's way (nothing wakes up per batch to free them)."""
        self.count, self.min_tokens, self.make_buffer = count, min_tokens, make_buffer
        self.reclaim = reclaim
        self.buffers: List[Optional[HostBuffer]] = [None] * count
        self.free: List[int] = list(range(count - 1, -1, -1))
        self.cond = threading.Condition()
        self.in_use = 0
        self.high_water = 0
        self.last_wait = 0.0
        self.closed = False

    def acquire(
        self, rows: int, hidden_size: int, dtype: torch.dtype, block: bool, timeout: float
    ) -> Optional[HostBuffer]:
        """A buffer able to hold `rows` rows, or None (pool full and not blocking, timeout, closed).

        `last_wait` holds the seconds spent waiting for a free slot (not making its buffer).
        """
        slot = None
        with self.cond:  # the usual case, kept short: it runs on the forward thread once per batch
            if self.free and not self.closed:
                slot = self.free.pop()
                self.in_use += 1
                if self.in_use > self.high_water:
                    self.high_water = self.in_use
                self.last_wait = 0.0
        if slot is None:
            started = time.monotonic()
            slot = self._take_slot(block, timeout)
            self.last_wait = time.monotonic() - started
            if slot is None:
                return None
        buf = self.buffers[slot]
        if buf is None or not buf.fits(rows, hidden_size, dtype):
            try:
                buf = self._remake(slot, max(rows, self.min_tokens), hidden_size, dtype)
            except BaseException:
                self.release(slot)
                raise
        return buf

    def _remake(self, slot: int, rows: int, hidden_size: int, dtype: torch.dtype) -> HostBuffer:
        old = self.buffers[slot]
        self.buffers[slot] = None
        if old is not None:
            old.free()
        gen = old.gen + 1 if old is not None else 0
        buf = self.buffers[slot] = self.make_buffer(slot, gen, rows, hidden_size, dtype)
        return buf

    def preallocate(self, rows: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Make every free slot's buffer now (pinning is slow: keep it out of timed loops)."""
        with self.cond:
            for slot in self.free:
                buf = self.buffers[slot]
                if buf is None or not buf.fits(rows, hidden_size, dtype):
                    self._remake(slot, max(rows, self.min_tokens), hidden_size, dtype)

    def _take_slot(self, block: bool, timeout: float) -> Optional[int]:
        """Pop a slot under the lock (None when none becomes free in time)."""
        deadline = None
        while True:
            with self.cond:
                if self.closed:
                    return None
                if self.free:
                    self.in_use += 1
                    if self.in_use > self.high_water:
                        self.high_water = self.in_use
                    return self.free.pop()
                if deadline is None:
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if self.reclaim is None:
                    if not block or remaining <= 0:
                        return None
                    self.cond.wait(remaining)
                    continue
            if self.reclaim(0.0):  # outside the lock: reclaim calls release
                continue
            if not block or remaining <= 0:
                return None
            self.reclaim(min(remaining, RECLAIM_SLICE_S))

    def release(self, slot: int) -> None:
        """Give a slot back (its buffer is kept for reuse)."""
        with self.cond:
            self.in_use -= 1
            self.free.append(slot)
            self.cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no slot is in use (everything written), or the deadline; True if idle."""
        deadline = time.monotonic() + timeout
        if self.reclaim is not None and self.in_use:
            self.reclaim(0.0)
        while self.reclaim is not None and self.in_use and time.monotonic() < deadline:
            self.reclaim(min(max(0.0, deadline - time.monotonic()), RECLAIM_SLICE_S))
        with self.cond:
            while self.in_use and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            return not self.in_use

    def close(self, free: bool) -> None:
        """Refuse further slots; `free` unpins and unmaps the buffers (nothing may be in flight)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            if free:
                for slot, buf in enumerate(self.buffers):
                    if buf is not None:
                        buf.free()
                        self.buffers[slot] = None  # the memory goes with the last reference


@dataclass
class Staged:
    """A batch copied (or being copied) into a host buffer.

    `ready` is a blocking-sync CUDA event (writer threads), or None: copies done
    (CPU) or signalled through the slot's semaphore (writer process).  `keep`
    holds the GPU source tensors until the copies are seen complete (instead of
    `record_stream`): `wait` drops it; with the writer process the dumper takes
    it over (`Dumper.held`).
    """

    buffer: HostBuffer
    rows: int
    ready: Optional[Any]  # a torch.cuda.Event (or stream) to synchronize on
    id_size: int = 8
    pos_size: int = 8
    keep: Optional[tuple] = None

    def wait(self) -> None:
        """Block the calling (writer) thread until the copy landed in host memory, then let the sources go."""
        if self.ready is not None:
            self.ready.synchronize()
        self.keep = None


class Stager:
    """Copies a batch's tensors into a host buffer: DMA on a side stream (CUDA) or synchronously (CPU).

    The GPU path runs once per forward step on the thread that launches the
    model's kernels, whose Python runs cold there (a capture() cost 2-5x the
    same calls timed in a tight loop): so few calls as possible.  With the
    driver loaded, `plan` + `queue` do it: the fence is a CUevent recorded and
    waited on through ctypes on raw stream handles, the copies use the
    buffer's prebuilt descriptors (no torch Stream/Event objects, no
    record_stream).  `stage` is the general path (CPU, torch copies).
    """

    def __init__(self, driver=None, copy="calls", libcuda="libcuda.so.1", kernel_blocks: int = 8):
        self.driver = driver
        # "calls" (default): one ctypes call per driver call; "native": the forward thread records the
        # fence and hands the job to hsq.c's native thread, which makes the other calls; "inline": hsq.c
        # makes all of them on the forward thread in one foreign call; "batch": one cuMemcpy3DBatchAsync
        # call where the driver has it (H200, launch-bound 512-token steps: that call took 58 us, the six
        # calls ~55 us together).  native/inline fall back to "calls" where hsq.c cannot be built or opened.
        self.copy = copy
        self.batched = copy == "batch" and driver is not None and getattr(driver, "batch3d_fn", None) is not None
        self.libcuda = libcuda
        self.native: Optional[NativeQueue] = None
        # "kernel": the copies of a job as one launch of hsk.cu's kernel (kernelcopy.py), into device-mapped
        # buffers; "staged": that launch into `staging` (GPU memory, the job laid out for its own rows), then
        # one DMA copy of the whole job; loaded with the side stream, else "calls"
        self.kernel: Optional[KernelCopy] = None
        self.staging: Optional[torch.Tensor] = None  # "staged": one job's bytes on the GPU, reused job after job
        self.kernel_blocks = kernel_blocks
        self.side_stream: Any = None
        self.side_raw = 0
        self.fence: Any = None
        self.fence_event = 0  # a CUevent of our own (driver path)
        self.device_index: Optional[int] = None  # the GPU of the first batch (the side stream's)

    @property
    def packs(self) -> bool:
        """The fast paths land a job packed (`Layout(rows)` from the buffer's start, the ring entry says
        so): the staged copy, with its kernel loaded."""
        return self.copy == "staged" and self.kernel is not None

    def lands_packed(self, plan: tuple) -> bool:
        """Whether `queue` lands this plan's job packed (the staged copy takes only steps whose positions
        come from the model); the dumper tells the writer process the same, from this one answer."""
        return self.packs and plan[5] != 0

    def plan(
        self, hidden: torch.Tensor, aux: Sequence[torch.Tensor], ids, positions, rows: int, width: int
    ) -> Optional[tuple]:
        """What the DMA copies need, read from the tensors in one pass (no side effect), or None when the
        batch needs the general path (which also reports bad shapes): no driver, float tensors not
        [>= rows, width] row-contiguous of one dumpable dtype, ids/positions not 1D contiguous int32/int64
        of >= rows values, another GPU than the first batch's.  Returns (hidden pointer, hidden row pitch in bytes,
        [(aux pointer, row pitch in bytes)] x 3, ids pointer, id size, positions pointer or 0, position size)."""
        if self.driver is None:
            return None
        if self.device_index is None:
            self._side(hidden.device)
        if not self.fence_event or hidden.get_device() != self.device_index:
            return None
        dtype = hidden.dtype
        esize = FLOAT_SIZES.get(dtype, 0)
        if not esize or len(aux) != 3:
            return None
        try:
            srcs = []
            for t in aux:
                shape = t.shape
                pitch, col = t.stride()
                if t.dtype is not dtype or col != 1 or shape[0] < rows or shape[1] != width:
                    return None
                srcs.append((t.data_ptr(), pitch * esize))
            shape = hidden.shape
            pitch, col = hidden.stride()
        except ValueError:  # not 2D
            return None
        if col != 1 or shape[0] < rows or shape[1] != width:
            return None
        pitch *= esize  # bytes from here on
        id_size = ID_SIZES.get(ids.dtype, 0)
        if not id_size or ids.stride() != (1,) or ids.shape[0] < rows:
            return None
        pos_ptr, pos_size = 0, 4
        if positions is not None:
            pos_size = ID_SIZES.get(positions.dtype, 0)
            if not pos_size or positions.stride() != (1,) or positions.shape[0] < rows:
                return None
            pos_ptr = positions.data_ptr()
        return (hidden.data_ptr(), pitch, srcs, ids.data_ptr(), id_size, pos_ptr, pos_size)

    def queue(
        self,
        plan: tuple,
        buf: HostBuffer,
        rows: int,
        post_addr: int = 0,
        cancel: Tuple[int, int] = (0, 0),
        seq: int = 0,
        flag: Tuple[int, int] = (0, 0),
    ) -> Tuple[int, int]:
        """Fence (side stream waits for the current stream), the copies of `plan` into `buf`, and, when
        `post_addr`, a `sem_post(post_addr)` host function behind them, or when `flag` = (device address,
        value) has a value, the GPU's write of it there instead; (id size, position size).
        The caller keeps the source tensors alive until the copies are seen complete.  With the native
        queue's thread the calls after the fence are made there: a job it cannot queue is cancelled
        (`cancel`: the int64 address and value that mark job `seq`'s ring entry so) and reported by
        `native.failures()`."""
        if self.native is not None:
            return self._queue_native(plan, buf, rows, post_addr, cancel, seq)
        signalled = post_addr or flag[1]  # with the writer process
        if signalled and self.lands_packed(plan):
            self._queue_staged([(plan, 0, rows)], buf, rows, _RAW_STREAM(self.device_index), post_addr, flag)
            return plan[4], plan[6]
        if self.kernel is not None and buf.device_dsts is not None and signalled:
            copies = _native_copies(plan, buf, 0, rows, buf.device_dsts)
            stream = _RAW_STREAM(self.device_index)
            self._queue_kernel(copies if plan[5] else copies[:-6], stream, post_addr, flag)  # no positions
            return plan[4], plan[6]
        drv, side, event = self.driver, self.side_raw, self.fence_event
        if drv.event_record_fn(event, _RAW_STREAM(self.device_index)) or drv.wait_event_fn(side, event, 0):
            raise CudaError("fence (cuEventRecord / cuStreamWaitEvent) failed")  # _fence, inline: every step
        if self.batched:
            rc = _queue_batch(drv.batch3d_fn, side, buf.batch or buf.batch_ops(), plan, rows, buf.row_bytes)
        else:
            rc = self._copy_rows(plan, buf, 0, rows)
        rc = rc or self._signal(post_addr, flag)
        if rc:
            raise CudaError("a copy or the completion post failed: CUresult %d" % rc)
        return plan[4], plan[6]

    def queue_gathered(
        self,
        parts: Sequence[Tuple[tuple, int, int]],
        buf: HostBuffer,
        post_addr: int,
        stream: int,
        cancel: Tuple[int, int] = (0, 0),
        seq: int = 0,
        flag: Tuple[int, int] = (0, 0),
    ) -> None:
        """Gathered steps (see `gather`): one fence on `stream` (the forward stream the steps ran on; the
        caller may be another thread, with the CUDA context made current), each step's copies at its
        first row in `buf` (`parts`: (plan, first row, rows)), one `sem_post(post_addr)` host function
        (or the GPU's write of `flag`, as in `queue`).
        With the native queue: one job of all the copies (`cancel`, `seq` as in `queue`); else one
        ctypes call per driver call.  The caller holds the sources."""
        if self.native is not None:
            return self._queue_gathered_native(parts, buf, post_addr, stream, cancel, seq)
        if self.packs:
            return self._queue_staged(parts, buf, sum(n for _p, _f, n in parts), stream, post_addr, flag)
        if self.kernel is not None and buf.device_dsts is not None:
            vals: List[int] = []
            for plan, first, rows in parts:
                vals += _native_copies(plan, buf, first, rows, buf.device_dsts)
            return self._queue_kernel(vals, stream, post_addr, flag)
        self._fence(stream)
        rc = 0
        for plan, first, rows in parts:
            rc = rc or self._copy_rows(plan, buf, first, rows)
        rc = rc or self._signal(post_addr, flag)
        if rc:
            raise CudaError("a copy or the completion post failed: CUresult %d" % rc)

    def _queue_gathered_native(
        self, parts: Sequence[Tuple[tuple, int, int]], buf: HostBuffer, post_addr: int, stream: int, cancel, seq
    ) -> None:
        """`queue_gathered` as one hsq.c job: 6 copies per step (positions are always there when gathered)."""
        q = self.native
        assert q is not None, "called with the native queue open"
        vals: List[int] = []
        for plan, first, rows in parts:
            vals += _native_copies(plan, buf, first, rows)
        count = len(vals) // 6
        if count > native.MAX_COPIES:
            raise CudaError("%d copies in one gathered job: the native queue takes %d" % (count, native.MAX_COPIES))
        native.JOB_HEAD.pack_into(q.job, 0, seq, stream, post_addr, cancel[0], cancel[1], count, 0)
        struct.pack_into("<%dQ" % len(vals), q.job, native.JOB_HEAD.size, *vals)
        rc = q.lib.submit(q.handle, q.job_addr, native.SUBMIT_TIMEOUT_MS)
        if rc:
            raise CudaError("the native copy queue refused the gathered steps: code %d" % rc)

    def _fence(self, stream: int) -> None:
        """What is queued on the side stream from now on waits for the work queued on `stream` so far."""
        drv, event = self.driver, self.fence_event
        if drv.event_record_fn(event, stream) or drv.wait_event_fn(self.side_raw, event, 0):
            raise CudaError("fence (cuEventRecord / cuStreamWaitEvent) failed")

    def _signal(self, post_addr: int, flag: Tuple[int, int]) -> int:
        """Behind what is queued on the side stream: the GPU writes `flag`'s value at its address (done
        flags), else a `sem_post(post_addr)` host function (when `post_addr`); a CUresult."""
        drv = self.driver
        if flag[1]:
            return drv.write32_fn(self.side_raw, flag[0], flag[1], 0)
        return drv.host_fn(self.side_raw, drv.sem_post_addr, post_addr) if post_addr else 0

    def _queue_kernel(self, copies: Sequence[int], stream: int, post_addr: int, flag=(0, 0)) -> None:
        """Fence on `stream`, the copies (6 values each, device destinations) as one kernel launch on the
        side stream, the `sem_post(post_addr)` host function (or `flag`)."""
        assert self.kernel is not None, "called with the copy kernel loaded"
        self._fence(stream)
        rc = self.kernel.launch(self.side_raw, copies) or self._signal(post_addr, flag)
        if rc:
            raise CudaError("the copy kernel's launch or the completion post failed: CUresult %d" % rc)

    def _queue_staged(
        self, parts: Sequence[Tuple[tuple, int, int]], buf: HostBuffer, rows: int, stream: int, post_addr, flag
    ):
        """Fence on `stream`; the copy kernel gathers every part (plan, first row, rows) into `staging`,
        laid out as `Layout(rows)` (packed: no gap between the regions); ONE DMA copy of those bytes to the
        start of `buf`; the `sem_post(post_addr)` host function.  5 driver calls whatever the job's steps,
        built on cause 17 (6 copies per step cost the launch-bound step more than one per job); on the H200
        it was bit-exact but gained nothing over `calls` (bench/README.md, tenth session).  `flag`: as in
        `queue`."""
        assert self.kernel is not None, "called with the copy kernel loaded"
        layout = Layout(rows, buf.hidden_size, buf.esize)
        base = self._staging_base(layout.nbytes, buf.layout.nbytes)
        dsts = tuple(base + layout.offsets[r] for r in (REGION_HIDDEN, REGION_AUX, REGION_IDS, REGION_POS))
        vals: List[int] = []
        for plan, first, n in parts:
            vals += _native_copies(plan, buf, first, n, dsts)
        drv, side = self.driver, self.side_raw
        self._fence(stream)
        rc = self.kernel.launch(side, vals) or drv.d2h_fn(buf.base, base, layout.nbytes, side)
        rc = rc or self._signal(post_addr, flag)
        if rc:
            raise CudaError("the staged copy (kernel, DMA or completion post) failed: CUresult %d" % rc)

    def _staging_base(self, need: int, size: int) -> int:
        """The device address of `staging`, made (or made larger, after the side stream drained: its last
        job may still read it) to hold `size` bytes, a whole buffer's, when it holds fewer than `need`.
        Where the GPU has no room for it, the staged copy stops for good (`calls` from the next job on)
        and this job fails (CudaError: the dumper cancels it and counts it)."""
        if self.staging is None or self.staging.numel() < need:
            if self.staging is not None:
                self.synchronize()
            device = self.side_stream.device if self.side_stream is not None else "cpu"
            self.staging = None
            try:
                self.staging = torch.empty(max(need, size), dtype=torch.uint8, device=device)
            except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
                self.copy = "calls"
                log.error("[hs-dump] no GPU memory for the staged copy's %d bytes (%r): calls from now on", size, exc)
                raise CudaError("staging buffer: %r" % (exc,)) from exc
        return self.staging.data_ptr()

    def _copy_rows(self, plan: tuple, buf: HostBuffer, first: int, rows: int) -> int:
        """The copies of `plan` into rows [first, first + rows) of `buf`, on the side stream; a CUresult."""
        hidden_ptr, pitch, srcs, ids_ptr, id_size, pos_ptr, pos_size = plan
        drv, side = self.driver, self.side_raw
        d_hidden, d_aux, d_ids, d_pos = buf.dsts
        width, copies = buf.row_bytes, buf.copies
        d2h, copy2d = drv.d2h_fn, drv.copy2d_fn
        if pitch == width:
            rc = d2h(d_hidden + first * width, hidden_ptr, rows * width, side)
        else:
            p, ref = copies[3]
            p.srcDevice, p.srcPitch, p.dstHost, p.Height = hidden_ptr, pitch, d_hidden + first * width, rows
            rc = copy2d(ref, side)
        aux_row = d_aux + first * 3 * width
        for k in range(3):
            p, ref = copies[k]
            p.srcDevice, p.srcPitch = srcs[k]
            p.dstHost, p.Height = aux_row + k * width, rows
            rc = rc or copy2d(ref, side)
        rc = rc or d2h(d_ids + first * id_size, ids_ptr, rows * id_size, side)
        if pos_ptr:
            rc = rc or d2h(d_pos + first * pos_size, pos_ptr, rows * pos_size, side)
        return rc

    def _queue_native(
        self, plan: tuple, buf: HostBuffer, rows: int, post_addr: int, cancel: Tuple[int, int], seq: int
    ) -> Tuple[int, int]:
        """`queue` through hsq.c: the job packed in one call, one foreign call (see `native`); the sixth
        copy (positions) is ignored without positions."""
        q = self.native
        assert q is not None, "called with the native queue open"
        count = 6 if plan[5] else 5
        native.JOB6.pack_into(
            q.job, 0, seq, _RAW_STREAM(self.device_index), post_addr, cancel[0], cancel[1], count, 0,
            *_native_copies(plan, buf, 0, rows),
        )  # fmt: skip
        rc = q.lib.submit(q.handle, q.job_addr, native.SUBMIT_TIMEOUT_MS)
        if rc:
            raise CudaError("the native copy queue refused the batch: code %d" % rc)
        return plan[4], plan[6]

    def drain(self) -> None:
        """Before this thread queues anything on the side stream itself: the native thread made its calls."""
        if self.native is not None and self.native.threaded and not self.native.drain():
            raise CudaError("the native copy queue did not drain in time")

    def stage(
        self,
        buf: HostBuffer,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
        ids: torch.Tensor,
        positions: Optional[torch.Tensor],
        rows: int,
        event: bool = True,
        plan: Optional[tuple] = None,
    ) -> Staged:
        """Queue (CUDA) or do (CPU) the copies; `event`: record a blocking-sync event behind them (writer
        threads); without it the caller queues its own completion signal on `side_stream` right after.
        `plan`: from `plan()` (driver copies), else torch copies on the side stream.  On a GPU the
        result's `keep` holds the sources."""
        if not hidden.is_cuda:
            id_size, pos_size = _copy_torch(buf, hidden, aux, ids, positions, rows, non_blocking=False)
            return Staged(buf, rows, None, id_size, pos_size)
        side = self.side_stream if self.side_stream is not None else self._side(hidden.device)
        self.drain()
        keep = (hidden, tuple(aux), ids, positions)
        if plan is not None:
            id_size, pos_size = self.queue(plan, buf, rows)
        else:
            if self.fence_event:
                self.driver.fence(self.fence_event, _raw_stream(hidden.get_device()), self.side_raw)
            else:
                self.fence.record(torch.cuda.current_stream(hidden.device))
                side.wait_event(self.fence)
            with torch.cuda.stream(side):
                id_size, pos_size = _copy_torch(buf, hidden, aux, ids, positions, rows, non_blocking=True)
        if not event:
            return Staged(buf, rows, None, id_size, pos_size, keep)
        ready = torch.cuda.Event(blocking=True)
        ready.record(side)
        return Staged(buf, rows, ready, id_size, pos_size, keep)

    def _side(self, device) -> "torch.cuda.Stream":
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(device=device)
            self.side_raw = self.side_stream.cuda_stream
            self.device_index = self.side_stream.device_index
            self.fence = torch.cuda.Event()
            if self.driver is not None and _RAW_STREAM is not None:
                try:
                    self.fence_event = self.driver.event_create()
                except Exception as exc:
                    log.warning("[hs-dump] cuEventCreate failed (%r): torch events fence the copies", exc)
            if self.fence_event and self.copy in ("native", "inline"):
                self.open_native()
            elif self.fence_event and self.copy in ("kernel", "staged"):
                self.open_kernel()
        return self.side_stream

    def open_kernel(self) -> None:
        """The copy kernel in the current CUDA context, or the ctypes calls, said why."""
        try:
            self.kernel = KernelCopy(self.driver, self.kernel_blocks)
        except Exception as exc:
            log.warning("[hs-dump] copy kernel unavailable (%r): one ctypes call per driver call", exc)
            self.copy = "calls"

    def open_native(self) -> None:
        """The native queue on the side stream (this thread's CUDA context), or the ctypes calls, said why."""
        lib = native.load()
        try:
            if lib is None:
                raise OSError(native.load_error())
            self.native = native.NativeQueue(lib, self.side_raw, self.copy == "native", self.libcuda)
        except OSError as exc:
            log.warning("[hs-dump] native copy queue unavailable (%s): one ctypes call per driver call", exc)
            self.copy = "calls"

    def synchronize(self) -> None:
        """Wait for every queued copy (error paths: before a slot may be reused or freed)."""
        if self.native is not None and self.native.threaded:
            self.native.drain()
        if self.side_stream is not None:
            self.side_stream.synchronize()

    def close(self) -> None:
        """Stop the native queue's thread, destroy the fence event and let the staging buffer go (after
        synchronize: nothing may still wait on the one or read the other)."""
        if self.native is not None:
            if not self.native.close():
                log.error("[hs-dump] the native copy thread did not stop in time: its queue is left allocated")
            self.native = None
        if self.fence_event and self.driver is not None:
            self.driver.event_destroy(self.fence_event)
            self.fence_event = 0
        self.staging = None  # after synchronize (the caller's): no job reads it any more


def _native_copies(plan: tuple, buf: HostBuffer, first: int, rows: int, dsts: Optional[tuple] = None) -> tuple:
    """A step's 6 copies as hsq.c's `hsq_copy` fields (src, src pitch, dst, dst pitch, width, height; height
    0 = one contiguous copy), into rows [first, first + rows) of `buf`: hidden (contiguous, or rows at its
    pitch), aux k into its third of the [rows, 3H] rows, ids, positions.  `dsts`: the regions' addresses
    to use (the copy kernel's device addresses), else the host ones."""
    hidden_ptr, pitch, ((a0, p0), (a1, p1), (a2, p2)), ids_ptr, id_size, pos_ptr, pos_size = plan
    width = buf.row_bytes
    w3 = 3 * width
    d_hidden, d_aux, d_ids, d_pos = dsts or buf.dsts
    d_hidden += first * width
    d_aux += first * w3
    if pitch == width:
        hidden = (hidden_ptr, 0, d_hidden, 0, rows * width, 0)
    else:
        hidden = (hidden_ptr, pitch, d_hidden, width, width, rows)
    return hidden + (
        a0, p0, d_aux, w3, width, rows,
        a1, p1, d_aux + width, w3, width, rows,
        a2, p2, d_aux + 2 * width, w3, width, rows,
        ids_ptr, 0, d_ids + first * id_size, 0, rows * id_size, 0,
        pos_ptr, 0, d_pos + first * pos_size, 0, rows * pos_size, 0,
    )  # fmt: skip


def _queue_batch(fn, side: int, batch: tuple, plan: tuple, rows: int, width: int) -> int:
    """The copies of `plan` as one cuMemcpy3DBatchAsync call on `side`; its CUresult.  Hidden: one
    row of rows * width bytes when contiguous, else rows rows at its pitch; aux k: rows rows of width
    bytes at its pitch into rows of 3 * width; ids and positions: one row each."""
    hidden_ptr, pitch, srcs, ids_ptr, id_size, pos_ptr, pos_size = plan
    _ops, address, views = batch
    src, dst, ext = views[0]
    src.ptr = hidden_ptr
    if pitch == width:
        src.rowLength = dst.rowLength = ext.width = rows * width
        src.layerHeight = dst.layerHeight = ext.height = 1
    else:
        src.rowLength, dst.rowLength, ext.width = pitch, width, width
        src.layerHeight = dst.layerHeight = ext.height = rows
    for k in range(3):
        src, dst, ext = views[k + 1]
        src.ptr, src.rowLength = srcs[k]
        src.layerHeight = dst.layerHeight = ext.height = rows
    src, dst, ext = views[4]
    src.ptr = ids_ptr
    src.rowLength = dst.rowLength = ext.width = rows * id_size
    if not pos_ptr:
        return fn(5, address, 0, side)
    src, dst, ext = views[5]
    src.ptr = pos_ptr
    src.rowLength = dst.rowLength = ext.width = rows * pos_size
    return fn(6, address, 0, side)


_RAW_STREAM: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # set: fence_event may be made


def _raw_stream(device_index: int) -> int:
    """The current stream's cudaStream_t as an int, without building a torch Stream object."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _copy_torch(buf, hidden, aux, ids, positions, rows, non_blocking):
    """The general path: torch copies (cat for aux); ids/positions kept int32 or int64; returns item sizes."""
    buf.hidden[:rows].copy_(hidden[:rows], non_blocking=non_blocking)
    buf.aux[:rows].copy_(torch.cat([a[:rows] for a in aux], dim=1), non_blocking=non_blocking)
    sizes = []
    for index, t in ((REGION_IDS, ids), (REGION_POS, positions)):
        if t is None:
            sizes.append(4)
            continue
        t = t[:rows] if t.dtype in ID_DTYPES else t[:rows].to(torch.int64)
        buf.id_view(index, t.dtype, rows).copy_(t, non_blocking=non_blocking)
        sizes.append(t.element_size())
    return sizes[0], sizes[1]


def positions_into(buf: HostBuffer, positions: torch.Tensor) -> None:
    """Derived int32 positions (no `positions` on the batch) written straight into the buffer."""
    buf.id_view(REGION_POS, torch.int32, positions.numel()).copy_(positions)
