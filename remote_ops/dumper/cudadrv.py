"""The few CUDA driver and libc calls the staging path makes through ctypes (stdlib only).

Why not torch: the torch path (Stream/Event objects, record_stream, cat,
copy_) took about twice the forward thread's CPU of this one per batch in a
tight loop (dumper_probe.py: 135.6 vs 62.2 us at 512 tokens), and more calls.
Inside a forward loop every call runs cold: the 9 driver calls of a batch cost
90-128 us there (~10-14 us each, docs/lab/bench-history.md), the largest part of
`capture()` now.  The driver (libcuda.so.1) is the one torch already uses; the
calls act on torch's streams (raw handles) and on the primary context that
torch made current on the calling thread.

libc's POSIX semaphores (`sem_post` as a CUDA host function) tell the writer
process that a batch's copies landed, without any Python in the forward
process: the driver's callback thread calls `sem_post` directly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE = 1, 2
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_EVENT_DISABLE_TIMING = 0x02
SEM_T_BYTES = 32  # sizeof(sem_t) on x86-64 / aarch64 glibc
# The control segment shared with the writer process: one SEM_SLOT_BYTES record per slot, then one
# more, then the job ring (procwriter.RING_*).  A slot's record: the result of its last job at
# DONE_OFFSET: uint64 seq, files, tokens, bytes, errors (seq written last).  The last record: the "a job finished" sem_t at
# 0; at COPIED_OFFSET the uint64 seq of the last job whose copies the child saw land (jobs land in
# order: the forward process then drops its references to the sources); at LANDED_OFFSET the
# "copies landed" sem_t, posted once per job, in job order (by a CUDA host function queued after the
# copies on the one side stream, or by the forward process itself).
SEM_SLOT_BYTES = 128
DONE_OFFSET = 40
DONE_FIELDS = "<4Q"  # files, tokens, bytes, errors, at DONE_OFFSET + 8
COPIED_OFFSET = 32
LANDED_OFFSET = 64


class CUDA_MEMCPY2D(ctypes.Structure):
    """cuda.h's CUDA_MEMCPY2D (the _v2 layout)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class CudaError(RuntimeError):
    pass


class Driver:
    """Bound driver entry points; `Driver.load()` returns None where libcuda is missing."""

    def __init__(self, lib: ctypes.CDLL, libc: ctypes.CDLL):
        self.lib, self.libc = lib, libc
        self._d2h = self._fn(
            "cuMemcpyDtoHAsync_v2", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        )
        self._2d = self._fn("cuMemcpy2DAsync_v2", [ctypes.POINTER(CUDA_MEMCPY2D), ctypes.c_void_p])
        self._host_fn = self._fn("cuLaunchHostFunc", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p])
        self._register = self._fn("cuMemHostRegister_v2", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint])
        self._unregister = self._fn("cuMemHostUnregister", [ctypes.c_void_p])
        self._event_create = self._fn("cuEventCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint])
        self._event_destroy = self._fn("cuEventDestroy_v2", [ctypes.c_void_p])
        self.event_record_fn = self._fn("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p])
        self.wait_event_fn = self._fn("cuStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint])
        self._ctx_get = self._optional(("cuCtxGetCurrent",), [ctypes.POINTER(ctypes.c_void_p)])
        self._ctx_set = self._optional(("cuCtxSetCurrent",), [ctypes.c_void_p])
        self.sem_post_addr = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
        self.params = CUDA_MEMCPY2D()
        self.params.srcMemoryType, self.params.dstMemoryType = CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST
        self.params_ref = ctypes.byref(self.params)
        # the raw entry points, for the per-batch path (staging.Stager.queue): no wrapper frame per call
        self.d2h_fn, self.copy2d_fn, self.host_fn = self._d2h, self._2d, self._host_fn

    def _fn(self, name, argtypes):
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn

    def _optional(self, names, argtypes):
        for name in names:
            if hasattr(self.lib, name):
                return self._fn(name, argtypes)
        return None

    @classmethod
    def load(cls) -> Optional["Driver"]:
        try:
            return cls(ctypes.CDLL("libcuda.so.1"), load_libc())
        except (OSError, AttributeError):
            return None

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise CudaError("%s failed: CUresult %d" % (what, rc))

    def d2h(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Contiguous device -> host copy queued on `stream`."""
        self.check(self._d2h(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")

    def d2h_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: int) -> None:
        """`rows` rows of `width` bytes, device pitch -> host pitch (one strided DMA, no kernel)."""
        p = self.params
        p.srcDevice, p.srcPitch, p.dstHost, p.dstPitch = src, src_pitch, dst, dst_pitch
        p.WidthInBytes, p.Height = width, rows
        self.check(self._2d(self.params_ref, stream), "cuMemcpy2DAsync")

    def post_when_done(self, stream: int, sem_addr: int) -> None:
        """`sem_post(sem_addr)` from the driver's thread once the work queued on `stream` so far is done."""
        self.check(self._host_fn(stream, self.sem_post_addr, sem_addr), "cuLaunchHostFunc")

    def current_context(self) -> int:
        """The calling thread's current CUcontext (0 if none, or the driver lacks the call)."""
        out = ctypes.c_void_p()
        if self._ctx_get is None or self._ctx_get(ctypes.byref(out)):
            return 0
        return int(out.value or 0)

    def make_current(self, ctx: int) -> None:
        """Make `ctx` current on the calling thread (a thread that did not run the forward: the reaper)."""
        if ctx and self._ctx_set is not None:
            self.check(self._ctx_set(ctx), "cuCtxSetCurrent")

    def event_create(self) -> int:
        """A CUevent without timing (the fence between the forward stream and the copy stream)."""
        out = ctypes.c_void_p()
        self.check(self._event_create(ctypes.byref(out), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        return int(out.value or 0)

    def event_destroy(self, event: int) -> None:
        self._event_destroy(event)

    def fence(self, event: int, after: int, before: int) -> None:
        """Work queued on stream `before` from now on waits for the work queued on stream `after` so far."""
        self.check(self.event_record_fn(event, after), "cuEventRecord")
        self.check(self.wait_event_fn(before, event, 0), "cuStreamWaitEvent")

    def register(self, addr: int, nbytes: int) -> None:
        """Page-lock existing host memory (our shared segment) so copies into it are true async DMA."""
        self.check(self._register(addr, nbytes, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")

    def unregister(self, addr: int) -> None:
        self._unregister(addr)


def load_libc() -> ctypes.CDLL:
    """libc with the semaphore calls typed (ctypes releases the GIL around each call)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.sem_init.argtypes, libc.sem_init.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint], ctypes.c_int
    libc.sem_post.argtypes, libc.sem_post.restype = [ctypes.c_void_p], ctypes.c_int
    libc.sem_wait.argtypes, libc.sem_wait.restype = [ctypes.c_void_p], ctypes.c_int
    libc.sem_trywait.argtypes, libc.sem_trywait.restype = [ctypes.c_void_p], ctypes.c_int
    libc.sem_timedwait.argtypes, libc.sem_timedwait.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    return libc


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
