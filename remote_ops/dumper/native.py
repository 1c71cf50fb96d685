"""The native copy queue (`hsq.c`): build it with the host's C compiler, load it, drive it.

Why native code: the copies of a batch are 9 CUDA driver calls, and made through
ctypes on the thread that launches the model's kernels they cost ~85-100 us of
that thread per batch (bench/README.md, issue 15).  With `hsq.c` the forward
thread makes one foreign call (the fence's event record, the job into a ring)
and a native thread, which never takes the GIL, makes the other eight.  Opt-in
(`SGLANG_HS_DUMP_COPY=native`): on the H200 it took 70-85 us off `capture()`,
but the step after a capture ran slower by about as much (the thread's wake-up
and calls beside the next launches), so the default stays `calls`.

Building: `cc -O2 -shared -fPIC` of the one C file and its header (stdlib +
pthreads + dlopen of libcuda; no CUDA headers), once per source version, into the first writable of
$SGLANG_HS_DUMP_NATIVE_DIR, `_native/` beside this file (the patched image
builds it there: `python3 -m remote_ops_dump.native`), ~/.cache/remote-ops-dump,
or a private folder under the temp dir; the dumper builds it when it starts with
native asked for.  No compiler, or a failed build: the dumper logs why once and
uses the ctypes calls (`SGLANG_HS_DUMP_COPY=calls`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

log = logging.getLogger("remote_ops_dump")
SOURCE = Path(__file__).with_name("hsq.c")
HEADER = Path(__file__).with_name("hsq_cuda.h")  # the cuda.h subset hsq.c includes (from HEADER's folder)
ENV_DIR = "SGLANG_HS_DUMP_NATIVE_DIR"
CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread", "-Wall")
BUILD_TIMEOUT_S = 120.0
MAX_COPIES = 48  # hsq.c's HSQ_MAX_COPIES: 8 gathered steps of 6 copies
JOB_HEAD = struct.Struct("<QQQQqII")  # seq, stream, post_addr, cancel_addr, cancel_value, ncopies, pad
COPY = struct.Struct("<6Q")  # src, src_pitch, dst, dst_pitch, width, height (0: one contiguous copy)
JOB_BYTES = JOB_HEAD.size + MAX_COPIES * COPY.size
JOB6 = struct.Struct(JOB_HEAD.format + "36Q")  # a job with room for 6 copies, packed in one call
SUBMIT_TIMEOUT_MS = 10_000  # the ring is full only when the thread is stuck in the driver
CLOSE_TIMEOUT_MS = 10_000
ERROR_CALLS = {1: "cuEventRecord", 2: "cuStreamWaitEvent", 3: "a copy", 4: "cuLaunchHostFunc", 5: "cuCtxSetCurrent"}


class State(ctypes.Structure):
    """hsq.c's hsq_state, read in place (no call)."""

    _fields_ = [
        ("failed", ctypes.c_uint64),
        ("submitted", ctypes.c_uint64),
        ("issued", ctypes.c_uint64),
        ("first_error", ctypes.c_int32),
        ("error_call", ctypes.c_int32),
    ]


def library_name(source: bytes) -> str:
    """The built file's name: a hash of the source, its header and the flags, so an edit never loads an
    old build."""
    parts = (source, HEADER.read_bytes(), " ".join(CFLAGS).encode(), sys.platform.encode())
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()
    return "libhsq-%s.so" % digest[:16]


def candidate_dirs() -> List[Path]:
    """Where a build is looked for and made, in order."""
    dirs = []
    if os.environ.get(ENV_DIR, "").strip():
        dirs.append(Path(os.environ[ENV_DIR].strip()))
    dirs.append(SOURCE.parent / "_native")
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(Path(cache) / "remote-ops-dump")
    dirs.append(Path(tempfile.gettempdir()) / ("remote-ops-dump-%d" % os.getuid()))
    return dirs


def compiler() -> Optional[str]:
    """$CC, else cc or gcc on PATH."""
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def find_or_build() -> Path:
    """The built library (made now if no folder has it); raises OSError saying why not."""
    source = SOURCE.read_bytes()
    name = library_name(source)
    for folder in candidate_dirs():
        if (folder / name).is_file():
            return folder / name
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC) to build %s" % SOURCE.name)
    errors = []
    for folder in candidate_dirs():
        try:
            return _build(cc, folder, name)
        except OSError as exc:
            errors.append("%s: %s" % (folder, exc))
    raise OSError("could not build %s: %s" % (SOURCE.name, "; ".join(errors)))


def _build(cc: str, folder: Path, name: str) -> Path:
    """Compile into `folder` (made private when new) under a temporary name, then rename into place."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise OSError("not writable")
    if folder.stat().st_uid != os.getuid():
        raise OSError("not owned by this user")
    tmp = folder / (".%s.%d.tmp" % (name, os.getpid()))
    cmd = [cc, *CFLAGS, "-I", str(HEADER.parent), "-o", str(tmp), str(SOURCE), "-ldl"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise OSError("%s timed out after %.0f s" % (cc, BUILD_TIMEOUT_S)) from None
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise OSError("%s exited %d: %s" % (cc, done.returncode, done.stderr.strip()[-500:]))
    os.replace(tmp, folder / name)
    return folder / name


class Library:
    """The loaded `hsq` entry points: `submit` keeps the GIL (it never blocks long), the others release it."""

    def __init__(self, path: Path):
        self.path = path
        free, held = ctypes.CDLL(str(path)), ctypes.PyDLL(str(path))
        self.open = _typed(
            free.hsq_open, ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint]
        )
        self.submit = _typed(held.hsq_submit, ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
        self.drain = _typed(free.hsq_drain, ctypes.c_int, [ctypes.c_void_p, ctypes.c_int])
        self.take_failed = _typed(
            free.hsq_take_failed, ctypes.c_uint, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint]
        )
        self.close = _typed(free.hsq_close, ctypes.c_int, [ctypes.c_void_p, ctypes.c_int])
        self.state_of = _typed(free.hsq_state_of, ctypes.POINTER(State), [ctypes.c_void_p])
        self.set_delay_us = _typed(free.hsq_set_delay_us, None, [ctypes.c_void_p, ctypes.c_uint])  # diagnosis
        self.set_wait = _typed(free.hsq_set_wait, None, [ctypes.c_void_p, ctypes.c_int])  # diagnosis
        self.set_pacing = _typed(  # experiment: sliced, waited-for copies; the thread posts
            free.hsq_set_pacing, None, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint, ctypes.c_int]
        )


def _typed(fn, restype, argtypes):
    fn.restype, fn.argtypes = restype, argtypes
    return fn


_LIBRARY: Optional[Library] = None
_LOAD_ERROR: Optional[str] = None


def load() -> Optional[Library]:
    """The library, built at the first call of the process if needed; None (and why, in `load_error()`)."""
    global _LIBRARY, _LOAD_ERROR
    if _LIBRARY is None and _LOAD_ERROR is None:
        try:
            _LIBRARY = Library(find_or_build())
        except (OSError, AttributeError) as exc:
            _LOAD_ERROR = str(exc)
    return _LIBRARY


def load_error() -> Optional[str]:
    return _LOAD_ERROR


class NativeQueue:
    """One `hsq` queue: copies on `side` (a raw CUstream) in the current thread's CUDA context.

    `threaded`: a native thread makes the calls after the fence
    (`SGLANG_HS_DUMP_COPY=native`); else hsq_submit makes all of them (`inline`)."""

    def __init__(self, lib: Library, side: int, threaded: bool, libcuda: str = "libcuda.so.1", cap: int = 64):
        handle = lib.open(libcuda.encode(), side, int(threaded), cap)
        if not handle:
            raise OSError("hsq_open failed (libcuda %s, its calls, or the current context missing)" % libcuda)
        self.lib, self.handle, self.threaded = lib, handle, threaded
        self.job = ctypes.create_string_buffer(JOB_BYTES)  # packed by the stager (JOB6), read by hsq_submit
        self.job_addr = ctypes.addressof(self.job)
        self.state = lib.state_of(handle).contents
        self.failed_seen = 0
        self.failed_out = (ctypes.c_uint64 * 64)()

    def failures(self) -> List[int]:
        """Seqs of jobs the thread cancelled since the last look ([] at the cost of one field read)."""
        if self.state.failed == self.failed_seen:
            return []
        out: List[int] = []
        while True:
            n = self.lib.take_failed(self.handle, self.failed_out, len(self.failed_out))
            out.extend(self.failed_out[:n])
            if n < len(self.failed_out):
                break
        self.failed_seen += len(out)
        return out

    def error(self) -> str:
        """The first refused call, in words."""
        state = self.state
        return "%s refused: CUresult %d" % (ERROR_CALLS.get(state.error_call, "a call"), state.first_error)

    def drain(self, timeout_ms: int = CLOSE_TIMEOUT_MS) -> bool:
        """True once every submitted job's calls were made (before anything else goes on the side stream)."""
        return self.lib.drain(self.handle, timeout_ms) == 0

    def close(self, timeout_ms: int = CLOSE_TIMEOUT_MS) -> bool:
        """Issue what is queued, stop the thread, free the queue; False if the thread did not end in time."""
        handle, self.handle = self.handle, None
        return not handle or self.lib.close(handle, timeout_ms) == 0


def main(argv=None) -> int:
    """`python3 -m remote_ops_dump.native`: build the library now (the patched image does, at build time)."""
    try:
        path = find_or_build()
    except OSError as exc:
        print("hs-dump native copy queue not built: %s (the dumper will use ctypes calls)" % exc, file=sys.stderr)
        return 0
    print("hs-dump native copy queue: %s" % path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
