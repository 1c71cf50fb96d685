"""Host staging for captured tensors: a bounded pool of (pinned) buffers and the async copy.

GPU path: the copy runs on a side stream that first waits for the forward's
stream; the source tensors are `record_stream`-ed so the caching allocator
cannot hand their memory to the next forward before the copy finished; an
event marks completion and the writer threads wait on it.  CPU path (tests,
CPU-only hosts): plain synchronous copies into ordinary memory, no event.
"""
from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class HostBuffer:
    """One flat host allocation holding a whole batch: hidden | aux | ids | positions.

    Rows of request b are contiguous in every region, so a span's tensors are
    plain byte ranges that the writer hands to write() without another copy.
    """

    def __init__(self, capacity: int, hidden_size: int, dtype: torch.dtype, pin: bool):
        self.capacity, self.hidden_size, self.dtype = capacity, hidden_size, dtype
        esize = torch.empty((), dtype=dtype).element_size()
        sizes = [capacity * hidden_size * esize, capacity * 3 * hidden_size * esize, capacity * 4, capacity * 4]
        self.flat = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
        self.offsets = [sum(sizes[:i]) for i in range(4)]
        self.row_bytes = [hidden_size * esize, 3 * hidden_size * esize, 4, 4]
        self.hidden = self._region(0, sizes[0]).view(dtype).view(capacity, hidden_size)
        self.aux = self._region(1, sizes[1]).view(dtype).view(capacity, 3 * hidden_size)
        self.ids = self._region(2, sizes[2]).view(torch.int32)
        self.positions = self._region(3, sizes[3]).view(torch.int32)

    def _region(self, index: int, size: int) -> torch.Tensor:
        return self.flat[self.offsets[index]:self.offsets[index] + size]

    def span_view(self, region: int, start: int, rows: int) -> memoryview:
        """Zero-copy bytes of rows [start, start+rows) of one region (0 hidden, 1 aux, 2 ids, 3 pos)."""
        begin = self.offsets[region] + start * self.row_bytes[region]
        size = rows * self.row_bytes[region]
        return memoryview((ctypes.c_ubyte * size).from_address(self.flat.data_ptr() + begin)).cast("B")

    def fits(self, rows: int, hidden_size: int, dtype: torch.dtype) -> bool:
        return rows <= self.capacity and hidden_size == self.hidden_size and dtype == self.dtype


class BufferPool:
    """`count` buffer slots handed out to batches in flight: the dumper's bounded queue.

    A slot's buffer is allocated on first use and re-allocated larger when a
    batch does not fit.  `acquire` blocks (backpressure) or returns None (drop).
    """

    def __init__(self, count: int, min_tokens: int, pin: bool):
        self.count, self.min_tokens, self.pin = count, min_tokens, pin
        self.free: List[Optional[HostBuffer]] = [None] * count
        self.cond = threading.Condition()
        self.in_use = 0
        self.high_water = 0
        self.closed = False

    def acquire(self, rows: int, hidden_size: int, dtype: torch.dtype, block: bool,
                timeout: float) -> Optional[HostBuffer]:
        """A buffer able to hold `rows` rows, or None (pool full and not blocking, timeout, closed)."""
        slot = self._take_slot(block, timeout)
        if slot is False:
            return None
        if slot is None or not slot.fits(rows, hidden_size, dtype):
            slot = None
            try:
                slot = HostBuffer(max(rows, self.min_tokens), hidden_size, dtype, self.pin)
            except BaseException:
                self.release(None)
                raise
        return slot

    def preallocate(self, rows: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Allocate every free slot now (pinned allocation is slow: keep it out of timed loops)."""
        with self.cond:
            for i, buf in enumerate(self.free):
                if buf is None or not buf.fits(rows, hidden_size, dtype):
                    self.free[i] = HostBuffer(max(rows, self.min_tokens), hidden_size, dtype, self.pin)

    def _take_slot(self, block: bool, timeout: float):
        """Pop a slot under the lock (False when none becomes free in time)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.free and not self.closed:
                remaining = deadline - time.monotonic()
                if not block or remaining <= 0:
                    return False
                self.cond.wait(remaining)
            if self.closed:
                return False
            self.in_use += 1
            self.high_water = max(self.high_water, self.in_use)
            return self.free.pop()

    def release(self, buf: Optional[HostBuffer]) -> None:
        """Give a slot back (with its buffer, kept for reuse)."""
        with self.cond:
            self.in_use -= 1
            self.free.append(buf)
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


@dataclass
class Staged:
    """A batch copied (or being copied) into a host buffer; `ready` is the CUDA event or None."""
    buffer: HostBuffer
    rows: int
    ready: Optional[object]

    def wait(self) -> None:
        """Block the calling (writer) thread until the copy landed in host memory."""
        if self.ready is not None:
            self.ready.synchronize()


class Stager:
    """Copies a batch's tensors into a host buffer: on a side stream (CUDA) or synchronously (CPU)."""

    def __init__(self):
        self.side_stream = None

    def stage(self, buf: HostBuffer, hidden: torch.Tensor, aux: Sequence[torch.Tensor],
              ids: torch.Tensor, positions: Optional[torch.Tensor], rows: int) -> Staged:
        if hidden.is_cuda:
            return Staged(buf, rows, self._stage_cuda(buf, hidden, aux, ids, positions, rows))
        self._copy_into(buf, hidden, aux, ids, positions, rows, non_blocking=False)
        return Staged(buf, rows, None)

    def _stage_cuda(self, buf, hidden, aux, ids, positions, rows):
        """Queue the copies on the side stream after the forward's work; return the done event."""
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(device=hidden.device)
        side = self.side_stream
        side.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(side):
            for t in [hidden, ids, *aux] + ([positions] if positions is not None else []):
                if t.is_cuda:
                    t.record_stream(side)
            self._copy_into(buf, hidden, aux, ids, positions, rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    @staticmethod
    def _copy_into(buf, hidden, aux, ids, positions, rows, non_blocking):
        """hidden rows as is; aux concatenated to [rows, 3H] (on the source device); ids/positions as int32."""
        buf.hidden[:rows].copy_(hidden[:rows], non_blocking=non_blocking)
        buf.aux[:rows].copy_(torch.cat([a[:rows] for a in aux], dim=1), non_blocking=non_blocking)
        buf.ids[:rows].copy_(ids[:rows].to(torch.int32), non_blocking=non_blocking)
        if positions is not None:
            buf.positions[:rows].copy_(positions[:rows].to(torch.int32), non_blocking=non_blocking)
