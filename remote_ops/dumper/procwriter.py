"""The writer process: span files written outside the forward process (stdlib only, no torch).

Why a process: writer threads inside SGLang's scheduler share its GIL.  Every
torch call of the forward thread releases and re-takes the GIL, and a writer
thread that woke from a hash, a write or an event wait takes it in between,
so the forward thread waited on the writers' Python (measured: 0.3-0.7 ms per
`capture()` and 2-14 % per step, bench/README.md).  Here the writers run in
a child process that maps the same host buffers (shared memfd segments,
page-locked by the parent), so the forward process runs no writer Python.

Protocol, over one AF_UNIX SOCK_SEQPACKET pair (one message = one marshal'd tuple):
  parent -> child  ("config", dict)                   once, first
                   ("sems", nslots) + fd              the control segment: one sem_t per slot
                   ("segment", slot, gen, nbytes, capacity) + fd   a slot's (new) buffer
                   ("meta", dict)                     run metadata changed (dtype known)
                   ("job", slot, gen, rows, hidden, esize, id_size, pos_size, st_dtype, spans)
                   ("stop",)                          finish what is queued, then exit
  child -> parent  ("done", slot, files, tokens, bytes, errors, first_error)   one per job
A job's data is complete when the slot's semaphore is posted: by the CUDA
driver's thread (a host function queued after the copies) or by the parent
itself after CPU copies.  Jobs are taken in order; each slot has at most one
job in flight, so each post pairs with exactly one job.
"""

from __future__ import annotations

import ctypes
import logging
import marshal
import mmap
import os
import queue
import select
import socket
import sys
import threading
import time
from typing import Dict, Optional, Tuple

from . import dumpfile
from .cudadrv import SEM_SLOT_BYTES, Timespec, load_libc
from .layout import Layout, span_views

log = logging.getLogger("remote_ops_dump")
MAX_MSG = 1 << 20
NICE = 10  # the forward process's threads come first on a busy CPU
IDLE_S = 1.0  # the reaper's tick when no batch finishes (stats.json stays fresh)


def send(sock: socket.socket, msg: tuple, fds=()) -> None:
    data = marshal.dumps(msg)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket) -> Tuple[Optional[tuple], list]:
    """One message and the fds that came with it; (None, []) at EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MSG, 4)
    return (marshal.loads(data) if data else None), fds


# --------------------------------------------------------------------------- parent side


class WriterProcess:
    """The parent's handle: start the child, send it segments and jobs, collect results.

    A reaper thread blocks on the socket (GIL released) and hands each `done`
    message to `on_done(slot, files, tokens, bytes, errors, first_error)`;
    `on_idle()` runs at least once a second (stats.json); when the child
    dies, `on_exit()` runs once.
    """

    def __init__(self, config: dict, nslots: int, on_done, on_exit, on_idle=lambda: None):
        self.on_done, self.on_exit, self.on_idle = on_done, on_exit, on_idle
        self.libc = load_libc()
        self.nslots = nslots
        self.sems_fd, self.sems_map = _shared(nslots * SEM_SLOT_BYTES, "hs-dump-sems")
        self.sems_base = ctypes.addressof(ctypes.c_char.from_buffer(self.sems_map))
        for i in range(nslots):
            if self.libc.sem_init(self.sem_addr(i), 1, 0) != 0:
                raise OSError(ctypes.get_errno(), "sem_init failed")
        self.sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lock = threading.Lock()
        self.proc = _spawn(child_sock)
        child_sock.close()
        self.pid = self.proc.pid
        send(self.sock, ("config", dict(config)))
        send(self.sock, ("sems", nslots), [self.sems_fd])
        os.close(self.sems_fd)  # the child holds its own copy; the mapping stays
        self.dead = False
        self.reaper = threading.Thread(target=self._reap, name="hs-dump-reaper", daemon=True)
        self.reaper.start()

    def sem_addr(self, slot: int) -> int:
        return self.sems_base + slot * SEM_SLOT_BYTES

    def post(self, slot: int) -> None:
        """The slot's data is in place (CPU path): let the child write it."""
        self.libc.sem_post(self.sem_addr(slot))

    def segment(self, slot: int, gen: int, nbytes: int, capacity: int, fd: int) -> None:
        self._send(("segment", slot, gen, nbytes, capacity), [fd])

    def meta(self, metadata: dict) -> None:
        self._send(("meta", {str(k): str(v) for k, v in metadata.items()}))

    def job(
        self, slot: int, gen: int, rows: int, hidden: int, esize: int, id_size: int, pos_size: int, st_dtype: str, spans
    ) -> None:
        self._send(
            (
                "job",
                slot,
                gen,
                rows,
                hidden,
                esize,
                id_size,
                pos_size,
                st_dtype,
                [(s.start, s.tokens, s.prefix_len) for s in spans],
            )
        )

    def _send(self, msg: tuple, fds=()) -> None:
        if self.dead:
            raise BrokenPipeError("the writer process has exited")
        with self.lock:
            send(self.sock, msg, fds)

    def alive(self) -> bool:
        return not self.dead

    def _reap(self) -> None:
        try:
            while True:
                ready, _, _ = select.select([self.sock], [], [], IDLE_S)
                if not ready:
                    self.on_idle()
                    continue
                msg, _ = recv(self.sock)
                if msg is None:
                    break
                if msg[0] == "done":
                    self.on_done(*msg[1:])
        except OSError:
            pass
        finally:
            self.dead = True
            self.on_exit()

    def stop(self, timeout: float) -> bool:
        """Ask the child to finish its queue and exit; True when it exited in time."""
        try:
            self._send(("stop",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except Exception:
            return False
        self.reaper.join(timeout=2)
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def _shared(nbytes: int, name: str) -> Tuple[int, mmap.mmap]:
    """An anonymous shared memory segment (memfd: not bound by /dev/shm's size) and its mapping."""
    fd = os.memfd_create(name, 0)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def shared_segment(nbytes: int, name: str) -> Tuple[int, mmap.mmap]:
    return _shared(nbytes, name)


def _spawn(child_sock: socket.socket):
    """`python -m <this package>.procwriter FD` with the package's root on PYTHONPATH."""
    import subprocess

    package = __name__.rsplit(".", 1)[0]
    root = os.path.dirname(os.path.abspath(__file__))
    for _ in package.split("."):
        root = os.path.dirname(root)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen(
        [sys.executable, "-m", __name__, str(child_sock.fileno())],
        pass_fds=[child_sock.fileno()],
        env=env,
        close_fds=True,
    )


# --------------------------------------------------------------------------- child side


class Job:
    """A batch to write: the spans of one slot, and how many are still pending."""

    def __init__(self, msg: tuple):
        (
            _,
            self.slot,
            self.gen,
            self.rows,
            self.hidden,
            self.esize,
            self.id_size,
            self.pos_size,
            self.st_dtype,
            spans,
        ) = msg
        self.spans = [tuple(s) for s in spans]
        self.remaining = len(self.spans)
        self.files = self.tokens = self.bytes = self.errors = 0
        self.first_error = ""
        self.metadata: Dict[str, str] = {}  # the writer's metadata when the job arrived
        self.lock = threading.Lock()


class Child:
    """Reader (socket) -> sequencer (semaphores, in job order) -> N writer threads -> `done` back."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.libc = load_libc()
        self.config: dict = {}
        self.metadata: dict = {}
        self.segments: Dict[int, Tuple[int, int, mmap.mmap, memoryview]] = {}
        self.sems: Optional[mmap.mmap] = None
        self.sems_base = 0
        self.jobs: "queue.Queue" = queue.Queue()
        self.spans: "queue.Queue" = queue.Queue()
        self.send_lock = threading.Lock()
        self.parent_gone = threading.Event()

    def run(self) -> None:
        msg, fds = recv(self.sock)
        assert msg is not None, "the parent closed the socket before sending the config"
        self.config = msg[1]
        self.metadata = dict(self.config.get("metadata", {}))
        threads = [threading.Thread(target=self._write_loop, daemon=True) for _ in range(int(self.config["writers"]))]
        for t in threads:
            t.start()
        sequencer = threading.Thread(target=self._sequence, daemon=True)
        sequencer.start()
        self._read_loop()
        sequencer.join()
        for _ in threads:
            self.spans.put(None)
        for t in threads:
            t.join()

    def _read_loop(self) -> None:
        while True:
            try:
                msg, fds = recv(self.sock)
            except OSError:
                msg, fds = None, []
            if msg is None:
                self.parent_gone.set()
                self.jobs.put(None)
                return
            kind = msg[0]
            if kind == "stop":
                self.jobs.put(None)
                return
            if kind == "sems":
                self.sems = mmap.mmap(fds[0], msg[1] * SEM_SLOT_BYTES)
                os.close(fds[0])
                self.sems_base = ctypes.addressof(ctypes.c_char.from_buffer(self.sems))
            elif kind == "segment":
                self._map(msg[1], msg[2], msg[3], msg[4], fds[0])
            elif kind == "meta":
                self.metadata = dict(msg[1])
            elif kind == "job":
                job = Job(msg)
                job.metadata = self.metadata
                self.jobs.put(job)

    def _map(self, slot: int, gen: int, nbytes: int, capacity: int, fd: int) -> None:
        mm = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.segments[slot] = (gen, capacity, mm, memoryview(mm))

    def _sequence(self) -> None:
        """Jobs in order: wait for the slot's data, then hand its spans to the writers."""
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if not self._wait_ready(job.slot):
                self._finish_unwritten(job, "the forward process exited before the copy landed")
                continue
            for span in job.spans:
                self.spans.put((job, span))

    def _wait_ready(self, slot: int) -> bool:
        addr = self.sems_base + slot * SEM_SLOT_BYTES
        while True:
            deadline = time.time() + 0.5
            ts = Timespec(int(deadline), int((deadline % 1) * 1e9))
            if self.libc.sem_timedwait(addr, ctypes.byref(ts)) == 0:
                return True
            if self.parent_gone.is_set() and self.libc.sem_trywait(addr) != 0:
                return False

    def _write_loop(self) -> None:
        while True:
            item = self.spans.get()
            if item is None:
                return
            job, span = item
            try:
                record = self._write(job, span)
                with job.lock:
                    job.files, job.tokens, job.bytes = job.files + 1, job.tokens + span[1], job.bytes + record["bytes"]
            except Exception as exc:  # one bad span must not stop the writers
                with job.lock:
                    job.errors += 1
                    job.first_error = job.first_error or repr(exc)[:300]
            self._span_done(job)

    def _write(self, job: Job, span: tuple) -> dict:
        gen, capacity, _mm, mem = self.segments[job.slot]
        if gen != job.gen:
            raise RuntimeError("slot %d holds segment %d, job wants %d" % (job.slot, gen, job.gen))
        layout = Layout(capacity, job.hidden, job.esize)
        start, tokens, prefix = span
        ids, pos, hidden, aux = span_views(mem, layout, start, tokens, job.id_size, job.pos_size)
        c = self.config
        return dumpfile.write_span(
            c["root"], c["rank"], ids, pos, hidden, aux, job.hidden, job.st_dtype, prefix, job.metadata, c["fsync"]
        )

    def _span_done(self, job: Job) -> None:
        with job.lock:
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._report(job)

    def _finish_unwritten(self, job: Job, why: str) -> None:
        job.errors, job.first_error = len(job.spans), why
        self._report(job)

    def _report(self, job: Job) -> None:
        msg = ("done", job.slot, job.files, job.tokens, job.bytes, job.errors, job.first_error)
        try:
            with self.send_lock:
                send(self.sock, msg)
        except OSError:
            pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        os.nice(NICE)
    except OSError:
        pass
    sock = socket.socket(fileno=int(argv[0]))
    Child(sock).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
