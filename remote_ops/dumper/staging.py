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
The copies are DMA only (no kernel, no GPU allocation): hidden rows as they
are, each aux tensor as a strided 2D copy into its third of the [rows, 3H]
rows, ids and positions in their source dtype (the writer converts them to
int32).  `plan` reads what the copies need from the tensors (one pass, no side
effect), `queue` issues fence, copies and the optional semaphore post through
the driver by ctypes (see `cudadrv`) with prebuilt per-buffer copy
descriptors (the 9 calls cost 90-128 us cold inside a forward loop on the
H200 VMs: the largest part of `capture()`).  Completion: with the writer
process a `sem_post` host function right behind the copies on the side
stream; with writer threads, a blocking-sync event (waiting sleeps instead of
spinning a core).  CPU path (tests, CPU-only hosts): plain synchronous
copies, no event, nothing held.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .cudadrv import CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST, CUDA_MEMCPY2D, CudaError
from .layout import REGION_AUX, REGION_HIDDEN, REGION_IDS, REGION_POS, REGION_SCALE, SCALE_ROW_BYTES, Layout

log = logging.getLogger("remote_ops_dump")
FP8 = torch.float8_e4m3fn  # FP8 storage: the buffers hold fp8.encode_step's values and scales
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", FP8: "F8_E4M3"}
ID_DTYPES = (torch.int32, torch.int64)
ID_SIZES = {torch.int32: 4, torch.int64: 8}
FLOAT_SIZES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, FP8: 1}
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
    ):
        self.capacity, self.hidden_size, self.dtype = capacity, hidden_size, dtype
        self.slot, self.gen, self.driver = slot, gen, None
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.layout = Layout(capacity, hidden_size, self.esize, scaled=dtype is FP8)
        self.fd = -1
        self.map: Optional[mmap.mmap] = None
        if shared:
            self._shared(pin, driver)
        else:
            self.flat = torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=pin)
            self.mem = memoryview((ctypes.c_ubyte * self.layout.nbytes).from_address(self.flat.data_ptr())).cast("B")
        self.base = self.flat.data_ptr()
        self.hidden = self._region(REGION_HIDDEN).view(dtype).view(capacity, hidden_size)
        self.aux = self._region(REGION_AUX).view(dtype).view(capacity, 3 * hidden_size)
        self.scale = self._region(REGION_SCALE).view(torch.float32).view(capacity, -1)  # [C, 4]; FP8 only
        self.copies = self._copy_descriptors()
        self.row_bytes = hidden_size * self.esize
        offsets = self.layout.offsets  # the regions' host addresses (the copies' targets)
        self.dsts = tuple(
            self.base + offsets[r] for r in (REGION_HIDDEN, REGION_AUX, REGION_IDS, REGION_POS, REGION_SCALE)
        )

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

    def _shared(self, pin: bool, driver) -> None:
        from .procwriter import shared_segment

        self.fd, mapped = shared_segment(self.layout.nbytes, "hs-dump-slot%d" % self.slot)
        self.map = mapped
        self.flat = torch.frombuffer(mapped, dtype=torch.uint8)
        self.mem = memoryview(mapped)
        if pin:
            try:
                driver.register(self.flat.data_ptr(), self.layout.nbytes)
                self.driver = driver
            except Exception as exc:  # e.g. a locked-memory limit: still correct, copies become synchronous
                log.error(
                    "[hs-dump] could not page-lock a %d-byte host buffer (%r): copies into it "
                    "will block the forward thread",
                    self.layout.nbytes,
                    exc,
                )

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
    buffer's prebuilt descriptors, one ctypes call per driver call (no torch
    Stream/Event objects, no record_stream).  `stage` is the general path (CPU,
    torch copies).
    """

    def __init__(self, driver: Any = None) -> None:
        self.driver = driver
        self.side_stream: Any = None
        self.side_raw = 0
        self.fence: Any = None
        self.fence_event = 0  # a CUevent of our own (driver path)
        self.device_index: Optional[int] = None  # the GPU of the first batch (the side stream's)

    def plan(
        self,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
        ids,
        positions,
        rows: int,
        width: int,
        scale: Optional[torch.Tensor] = None,
    ) -> Optional[tuple]:
        """What the DMA copies need, read from the tensors in one pass (no side effect), or None when the
        batch needs the general path (which also reports bad shapes): no driver, float tensors not
        [>= rows, width] row-contiguous of one dumpable dtype, ids/positions not 1D contiguous int32/int64
        of >= rows values, another GPU than the first batch's.  Returns (hidden pointer, hidden row pitch in bytes,
        [(aux pointer, row pitch in bytes)] x 3, ids pointer, id size, positions pointer or 0, position size,
        scale pointer or 0).  FP8 storage (`scale`: fp8.encode_step's [rows, 4] float32): `aux` are the
        three thirds of its one contiguous [rows, 3H] tensor (copied as one block), `scale` contiguous."""
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
        scale_ptr = 0
        if scale is not None:
            if not _fp8_planned(srcs, width, scale, rows):
                return None
            scale_ptr = scale.data_ptr()
        return (hidden.data_ptr(), pitch, srcs, ids.data_ptr(), id_size, pos_ptr, pos_size, scale_ptr)

    def queue(self, plan: tuple, buf: HostBuffer, rows: int, post_addr: int = 0) -> Tuple[int, int]:
        """Fence (side stream waits for the current stream), the copies of `plan` into `buf`, and, when
        `post_addr`, a `sem_post(post_addr)` host function behind them; (id size, position size).
        The caller keeps the source tensors alive until the copies are seen complete."""
        drv, side, event = self.driver, self.side_raw, self.fence_event
        if drv.event_record_fn(event, _RAW_STREAM(self.device_index)) or drv.wait_event_fn(side, event, 0):
            raise CudaError("fence (cuEventRecord / cuStreamWaitEvent) failed")  # _fence, inline: every step
        rc = self._copy_rows(plan, buf, 0, rows) or self._signal(post_addr)
        if rc:
            raise CudaError("a copy or the completion post failed: CUresult %d" % rc)
        return plan[4], plan[6]

    def queue_gathered(self, parts: Sequence[Tuple[tuple, int, int]], buf: HostBuffer, post_addr: int, stream: int):
        """Gathered steps (see `gather`): one fence on `stream` (the forward stream the steps ran on; the
        caller may be another thread, with the CUDA context made current), each step's copies at its
        first row in `buf` (`parts`: (plan, first row, rows)), one `sem_post(post_addr)` host function.
        The caller holds the sources."""
        self._fence(stream)
        rc = 0
        for plan, first, rows in parts:
            rc = rc or self._copy_rows(plan, buf, first, rows)
        rc = rc or self._signal(post_addr)
        if rc:
            raise CudaError("a copy or the completion post failed: CUresult %d" % rc)

    def _fence(self, stream: int) -> None:
        """What is queued on the side stream from now on waits for the work queued on `stream` so far."""
        drv, event = self.driver, self.fence_event
        if drv.event_record_fn(event, stream) or drv.wait_event_fn(self.side_raw, event, 0):
            raise CudaError("fence (cuEventRecord / cuStreamWaitEvent) failed")

    def _signal(self, post_addr: int) -> int:
        """Behind what is queued on the side stream: a `sem_post(post_addr)` host function (when
        `post_addr`); a CUresult."""
        drv = self.driver
        return drv.host_fn(self.side_raw, drv.sem_post_addr, post_addr) if post_addr else 0

    def _copy_rows(self, plan: tuple, buf: HostBuffer, first: int, rows: int) -> int:
        """The copies of `plan` into rows [first, first + rows) of `buf`, on the side stream; a CUresult."""
        hidden_ptr, pitch, srcs, ids_ptr, id_size, pos_ptr, pos_size, scale_ptr = plan
        drv, side = self.driver, self.side_raw
        d_hidden, d_aux, d_ids, d_pos, d_scale = buf.dsts
        width, copies = buf.row_bytes, buf.copies
        d2h, copy2d = drv.d2h_fn, drv.copy2d_fn
        if pitch == width:
            rc = d2h(d_hidden + first * width, hidden_ptr, rows * width, side)
        else:
            p, ref = copies[3]
            p.srcDevice, p.srcPitch, p.dstHost, p.Height = hidden_ptr, pitch, d_hidden + first * width, rows
            rc = copy2d(ref, side)
        aux_row = d_aux + first * 3 * width
        if scale_ptr:  # FP8 storage: the aux values are one contiguous [rows, 3H] block, then the scales
            rc = rc or d2h(aux_row, srcs[0][0], rows * 3 * width, side)
            rc = rc or d2h(d_scale + first * SCALE_ROW_BYTES, scale_ptr, rows * SCALE_ROW_BYTES, side)
        else:
            for k in range(3):
                p, ref = copies[k]
                p.srcDevice, p.srcPitch = srcs[k]
                p.dstHost, p.Height = aux_row + k * width, rows
                rc = rc or copy2d(ref, side)
        rc = rc or d2h(d_ids + first * id_size, ids_ptr, rows * id_size, side)
        if pos_ptr:
            rc = rc or d2h(d_pos + first * pos_size, pos_ptr, rows * pos_size, side)
        return rc

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
        scale: Optional[torch.Tensor] = None,
    ) -> Staged:
        """Queue (CUDA) or do (CPU) the copies; `event`: record a blocking-sync event behind them (writer
        threads); without it the caller queues its own completion signal on `side_stream` right after.
        `plan`: from `plan()` (driver copies), else torch copies on the side stream.  On a GPU the
        result's `keep` holds the sources.  FP8 storage: `hidden`/`aux` are fp8.encode_step's values and
        `scale` its scales."""
        if not hidden.is_cuda:
            id_size, pos_size = _copy_torch(buf, hidden, aux, ids, positions, rows, non_blocking=False, scale=scale)
            return Staged(buf, rows, None, id_size, pos_size)
        side = self.side_stream if self.side_stream is not None else self._side(hidden.device)
        keep = (hidden, tuple(aux), ids, positions) if scale is None else (hidden, tuple(aux), ids, positions, scale)
        if plan is not None:
            id_size, pos_size = self.queue(plan, buf, rows)
        else:
            if self.fence_event:
                self.driver.fence(self.fence_event, _raw_stream(hidden.get_device()), self.side_raw)
            else:
                self.fence.record(torch.cuda.current_stream(hidden.device))
                side.wait_event(self.fence)
            with torch.cuda.stream(side):
                id_size, pos_size = _copy_torch(buf, hidden, aux, ids, positions, rows, True, scale)
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
        return self.side_stream

    def synchronize(self) -> None:
        """Wait for every queued copy (error paths: before a slot may be reused or freed)."""
        if self.side_stream is not None:
            self.side_stream.synchronize()

    def close(self) -> None:
        """Destroy the fence event (after synchronize: nothing may still wait on it)."""
        if self.fence_event and self.driver is not None:
            self.driver.event_destroy(self.fence_event)
            self.fence_event = 0


_RAW_STREAM: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # set: fence_event may be made


def _raw_stream(device_index: int) -> int:
    """The current stream's cudaStream_t as an int, without building a torch Stream object."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _copy_torch(buf, hidden, aux, ids, positions, rows, non_blocking, scale=None):
    """The general path: torch copies (cat for aux); ids/positions kept int32 or int64; returns item sizes.
    FP8 storage (`scale`): each aux third copied into its place (no cat of e4m3 values), then the scales."""
    buf.hidden[:rows].copy_(hidden[:rows], non_blocking=non_blocking)
    if scale is None:
        buf.aux[:rows].copy_(torch.cat([a[:rows] for a in aux], dim=1), non_blocking=non_blocking)
    else:
        width = buf.hidden_size
        for k, a in enumerate(aux):
            buf.aux[:rows, k * width : (k + 1) * width].copy_(a[:rows], non_blocking=non_blocking)
        buf.scale[:rows].copy_(scale[:rows], non_blocking=non_blocking)
    sizes = []
    for index, t in ((REGION_IDS, ids), (REGION_POS, positions)):
        if t is None:
            sizes.append(4)
            continue
        t = t[:rows] if t.dtype in ID_DTYPES else t[:rows].to(torch.int64)
        buf.id_view(index, t.dtype, rows).copy_(t, non_blocking=non_blocking)
        sizes.append(t.element_size())
    return sizes[0], sizes[1]


def _fp8_planned(srcs: Sequence[Tuple[int, int]], width: int, scale: torch.Tensor, rows: int) -> bool:
    """FP8 storage's driver copies take the aux values as one block and the scales as one: the aux
    sources must be the consecutive thirds of one [rows, 3H] e4m3 tensor, the scales [>= rows, 4]
    contiguous float32 (what fp8.encode_step makes)."""
    base = srcs[0][0]
    if any(ptr != base + k * width or pitch != 3 * width for k, (ptr, pitch) in enumerate(srcs)):
        return False
    return scale.dtype is torch.float32 and scale.stride() == (4, 1) and scale.shape[0] >= rows


def positions_into(buf: HostBuffer, positions: torch.Tensor) -> None:
    """Derived int32 positions (no `positions` on the batch) written straight into the buffer."""
    buf.id_view(REGION_POS, torch.int32, positions.numel()).copy_(positions)
