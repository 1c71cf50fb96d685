"""The writer process: span files written outside the forward process (stdlib only, no torch).

Why a process: writer threads inside SGLang's scheduler share its GIL.  Every
torch call of the forward thread releases and re-takes the GIL, and a writer
thread that woke from a hash, a write or an event wait takes it in between,
so the forward thread waited on the writers' Python (measured: 0.3-0.7 ms per
`capture()` and 2-14 % per step, docs/lab/bench-history.md).  Here the writers run in
a child process that maps the same host buffers (shared memfd segments,
page-locked by the parent), so the forward process runs no writer Python.

Protocol.  Setup and rare messages go over one AF_UNIX SOCK_SEQPACKET pair (one
message = one marshal'd tuple):
  parent -> child  ("config", dict)                   once, first
                   ("sems", nslots) + fd              the control segment (records, semaphores, job ring)
                   ("segment", slot, gen, nbytes, capacity) + fd   a slot's (new) buffer
                   ("meta", dict)                     run metadata changed (dtype known)
                   ("spans", seq, spans)              a job's spans too large for its ring entry
                   ("stop", last_seq)                 finish the jobs up to last_seq, then exit
  child -> parent  ("error", slot, first_error)       only for a job with failed spans
Jobs do not travel as messages: the forward thread writes each job (slot, gen,
sizes, dtype, marshal'd spans) into entry seq % N of a ring in the
control segment, seq written last, before anything can signal that the job's
copies landed.  (A `job` message, marshal + send, cost the forward thread
33-47 us per batch on the H200 VMs; the ring entry 13-18 us, no syscall.)
The child's sequencer takes jobs in seq order: one post of the "copies landed"
semaphore per job, then that job's entry.  The posts come in job order: by a
CUDA host function queued after the copies on the one side stream, or by the
parent itself (CPU copies; a cancelled job, whose entry says so).  A job whose segment message was not
yet read waits for it (the reader notifies).

A finished job is reported through shared memory, not a message: the child
writes its counts into the slot's record (seq last) and posts the "a job
finished" semaphore.  The parent reads the records when it needs a slot, when
it flushes, and once a second from its reaper thread.  So no thread of the
forward process wakes up per batch: a reaper woken by a message took the GIL
from the forward thread about once per step (launch-bound 512-token steps on the
H200: 1.05-1.64 voluntary context switches of the forward thread per step with
the writer, 0.27 when nothing was sent to it; docs/lab/bench-history.md).  Likewise the
sequencer writes the seq of each job whose copies it saw land into the control
segment (`copied_seq`): the parent keeps the GPU source tensors referenced
until then (instead of `record_stream`) and checks that number at its next
capture, flush or reaper tick.

Scheduling: the child runs at nice 10 and, by default, SCHED_BATCH: a woken
writer thread never preempts the forward thread on its CPU (a normal thread
woken by the parent's socket message or by a semaphore may), and optionally on
its own CPUs (`writer_cpus`).
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
import struct
import sys
import threading
import time
from typing import Dict, Optional, Tuple

from . import dumpfile
from .cudadrv import COPIED_OFFSET, DONE_FIELDS, DONE_OFFSET, LANDED_OFFSET, SEM_SLOT_BYTES, Timespec, load_libc
from .layout import Layout, span_views

log = logging.getLogger("remote_ops_dump")
MAX_MSG = 1 << 20
NICE = 10  # the forward process's threads come first on a busy CPU
IDLE_S = 1.0  # the reaper's tick: finished jobs collected, stats.json kept fresh
SCHED_POLICIES = {"batch": "SCHED_BATCH", "idle": "SCHED_IDLE", "normal": "SCHED_OTHER"}
U64 = struct.Struct("<Q")
# The job ring, after the control segment's records: entry seq % RING_ENTRIES(nslots) holds job `seq`:
# uint64 seq at 0 (written last: the entry is published), then JOB_HEAD, then the marshal'd spans
# (spans_len bytes; SPANS_ON_SOCKET: too many for the entry, sent before as ("spans", seq, spans)).
JOB_BYTES = 8192
JOB_HEAD = struct.Struct("<10q")  # slot gen rows hidden esize id_size pos_size st_code spans_len state
JOB_SPANS_AT = 8 + JOB_HEAD.size
SPANS_ON_SOCKET = -1
STATE_JOB, STATE_CANCELLED = 0, 1
ST_CODES = {"BF16": 0, "F16": 1, "F32": 2, "F8_E4M3": 3}  # F8_E4M3: FP8 storage (the layout has scales)
ST_NAMES = {v: k for k, v in ST_CODES.items()}
UNLANDED = "the forward process exited before the copy landed"
RECORD_WAIT_S = 10.0  # a post came but its job's entry is not published yet: how long to look (a bug)


def ring_entries(nslots: int) -> int:
    """Entries in the ring: jobs in flight never exceed the slots, and a cancelled one needs no slot."""
    return 2 * nslots + 2


def control_bytes(nslots: int) -> int:
    """Size of the control segment: a record per slot, the shared record, the job ring."""
    return (nslots + 1) * SEM_SLOT_BYTES + ring_entries(nslots) * JOB_BYTES


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
    """The parent's handle: start the child, send it segments and jobs, read what finished.

    A reaper thread blocks on the socket (GIL released): `on_error(slot, text)`
    for a job with failed spans, `on_idle()` once a second (collect finished
    jobs, stats.json); when the child dies, `on_exit()` runs once.
    """

    def __init__(self, config: dict, nslots: int, on_exit, on_idle=lambda: None, on_error=lambda slot, text: None):
        self.on_exit, self.on_idle, self.on_error = on_exit, on_idle, on_error
        self.libc = load_libc()
        self.nslots = nslots
        self.sems_fd, self.sems_map = _shared(control_bytes(nslots), "hs-dump-sems")
        self.sems_base = ctypes.addressof(ctypes.c_char.from_buffer(self.sems_map))
        shared = nslots * SEM_SLOT_BYTES
        self.free_sem = self.sems_base + shared
        self.landed_addr = self.sems_base + shared + LANDED_OFFSET  # "copies landed", one post per job
        self.copied_at = shared + COPIED_OFFSET
        self.ring_at, self.ring = (nslots + 1) * SEM_SLOT_BYTES, ring_entries(nslots)
        self.published = 0  # the last job seq written to the ring
        for addr in (self.free_sem, self.landed_addr):
            if self.libc.sem_init(addr, 1, 0) != 0:
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

    def post_landed(self) -> None:
        """One "copies landed" post from this process (CPU copies, a cancelled job)."""
        self.libc.sem_post(self.landed_addr)

    def copied_seq(self) -> int:
        """The seq of the last job whose copies the child saw land (all earlier ones landed too)."""
        return U64.unpack_from(self.sems_map, self.copied_at)[0]

    def done_seq(self, slot: int) -> int:
        """The seq of the slot's last finished job (0: none yet)."""
        return struct.unpack_from("<Q", self.sems_map, slot * SEM_SLOT_BYTES + DONE_OFFSET)[0]

    def done_counts(self, slot: int) -> Tuple[int, int, int, int]:
        """(files, tokens, bytes, errors) of the slot's last finished job; read after its seq matched."""
        return struct.unpack_from(DONE_FIELDS, self.sems_map, slot * SEM_SLOT_BYTES + DONE_OFFSET + 8)

    def wait_finished(self, timeout: float) -> bool:
        """Take one "a job finished" post, waiting at most `timeout` s (0: don't wait); True if taken."""
        if timeout <= 0:
            return self.libc.sem_trywait(self.free_sem) == 0
        deadline = time.time() + timeout
        until = Timespec(int(deadline), int((deadline % 1) * 1e9))
        return self.libc.sem_timedwait(self.free_sem, ctypes.byref(until)) == 0

    def segment(self, slot: int, gen: int, nbytes: int, capacity: int, fd: int) -> None:
        self._send(("segment", slot, gen, nbytes, capacity), [fd])

    def meta(self, metadata: dict) -> None:
        self._send(("meta", {str(k): str(v) for k, v in metadata.items()}))

    def job(
        self,
        slot: int,
        gen: int,
        seq: int,
        rows: int,
        hidden: int,
        esize: int,
        id_size: int,
        pos_size: int,
        st_dtype: str,
        spans,
    ) -> None:
        """Publish job `seq` in the ring (no message, no syscall), before anything can post its "copies
        landed": the child reads the entry only after that post.  `spans`: a list of (start, tokens,
        prefix_len) tuples.  Once per batch on the forward thread: one frame, few calls."""
        if self.dead:
            raise BrokenPipeError("the writer process has exited")
        data = marshal.dumps(spans)
        at, mm = self.ring_at + (seq % self.ring) * JOB_BYTES, self.sems_map
        n = len(data)
        if n > JOB_BYTES - JOB_SPANS_AT:  # rare: hundreds of requests in one batch
            self._send(("spans", seq, spans))
            n = SPANS_ON_SOCKET
        else:
            mm[at + JOB_SPANS_AT : at + JOB_SPANS_AT + n] = data
        JOB_HEAD.pack_into(
            mm, at + 8, slot, gen, rows, hidden, esize, id_size, pos_size, ST_CODES[st_dtype], n, STATE_JOB
        )
        U64.pack_into(mm, at, seq)
        self.published = seq

    def cancel(self, seq: int) -> None:
        """Job `seq` will not be written (its copies failed, or publishing it did): a cancelled entry and
        its "copies landed" post, so the child moves past it.  Only when nothing else will post for it."""
        at = self.ring_at + (seq % self.ring) * JOB_BYTES
        JOB_HEAD.pack_into(self.sems_map, at + 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, STATE_CANCELLED)
        U64.pack_into(self.sems_map, at, seq)
        self.published = max(self.published, seq)
        self.post_landed()

    def _send(self, msg: tuple, fds=()) -> None:
        if self.dead:
            raise BrokenPipeError("the writer process has exited")
        with self.lock:
            send(self.sock, msg, fds)

    def alive(self) -> bool:
        return not self.dead

    def _reap(self) -> None:
        last = time.monotonic()
        try:
            while True:
                ready, _, _ = select.select([self.sock], [], [], IDLE_S)
                if ready:
                    msg, _ = recv(self.sock)
                    if msg is None:
                        break
                    if msg[0] == "error":
                        self.on_error(msg[1], msg[2])
                if time.monotonic() - last >= IDLE_S:
                    last = time.monotonic()
                    self.on_idle()
        except OSError:
            pass
        finally:
            self.dead = True
            self.on_exit()

    def stop(self, timeout: float) -> bool:
        """Ask the child to finish its queue and exit; True when it exited in time."""
        try:
            self._send(("stop", self.published))  # the child writes the jobs up to this one, then exits
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
    """The child: this module's `main` imported from this package's root, whatever the working directory
    holds (`python -m` would put the working directory first on sys.path: a checkout of another version
    of the package there would be the child)."""
    import subprocess

    package = __name__.rsplit(".", 1)[0]
    root = os.path.dirname(os.path.abspath(__file__))
    for _ in package.split("."):
        root = os.path.dirname(root)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import sys; sys.path.insert(0, %r); from %s import main; sys.exit(main(sys.argv[1:]))" % (root, __name__)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(child_sock.fileno())],
        pass_fds=[child_sock.fileno()],
        env=env,
        close_fds=True,
    )


# --------------------------------------------------------------------------- child side


class Job:
    """A batch to write: the spans of one slot, and how many are still pending."""

    def __init__(self, seq: int, head: tuple, spans):
        self.seq = seq
        (
            self.slot,
            self.gen,
            self.rows,
            self.hidden,
            self.esize,
            self.id_size,
            self.pos_size,
            st_code,
            _spans_len,
            _state,
        ) = head
        self.st_dtype = ST_NAMES.get(st_code, "BF16")
        self.spans = [tuple(s) for s in spans]
        self.remaining = len(self.spans)
        self.files = self.tokens = self.bytes = self.errors = 0
        self.first_error = ""
        self.metadata: Dict[str, str] = {}  # the writer's metadata when the job was taken
        self.lock = threading.Lock()


class Child:
    """Reader (socket: setup, segments, stop) ; sequencer ("copies landed" posts and the job ring, in job
    order) -> N writer threads -> done records."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.libc = load_libc()
        self.config: dict = {}
        self.metadata: dict = {}
        self.segments: Dict[int, Tuple[int, int, mmap.mmap, memoryview]] = {}
        self.sems: Optional[mmap.mmap] = None
        self.sems_base = 0
        self.free_sem = 0  # offset of the "a job finished" semaphore in the control segment
        self.landed = 0  # address of the "copies landed" semaphore
        self.ring_at = self.ring = 0
        self.spans: "queue.Queue" = queue.Queue()
        self.send_lock = threading.Lock()
        self.parent_gone = threading.Event()
        self.changed = threading.Condition()  # the reader mapped something, got spans, a stop or EOF
        self.ready = False  # the control segment is mapped
        self.stop_seq: Optional[int] = None
        self.big_spans: Dict[int, list] = {}  # ("spans", seq, spans) messages not yet taken

    def run(self) -> None:
        msg, fds = recv(self.sock)
        assert msg is not None, "the parent closed the socket before sending the config"
        self.config = msg[1]
        self.metadata = dict(self.config.get("metadata", {}))
        apply_scheduling(self.config.get("sched"), self.config.get("cpus"))
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
                self._notify()
                return
            kind = msg[0]
            if kind == "stop":
                with self.changed:
                    self.stop_seq = msg[1] if len(msg) > 1 else 0
                    self.changed.notify_all()
                return
            if kind == "sems":
                self.sems = mmap.mmap(fds[0], control_bytes(msg[1]))
                os.close(fds[0])
                self.free_sem = msg[1] * SEM_SLOT_BYTES
                self.sems_base = ctypes.addressof(ctypes.c_char.from_buffer(self.sems))
                self.landed = self.sems_base + self.free_sem + LANDED_OFFSET
                self.ring_at, self.ring = (msg[1] + 1) * SEM_SLOT_BYTES, ring_entries(msg[1])
                with self.changed:
                    self.ready = True
                    self.changed.notify_all()
            elif kind == "segment":
                self._map(msg[1], msg[2], msg[3], msg[4], fds[0])
                self._notify()
            elif kind == "meta":
                self.metadata = dict(msg[1])
            elif kind == "spans":
                with self.changed:
                    self.big_spans[msg[1]] = msg[2]
                    self.changed.notify_all()

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def _map(self, slot: int, gen: int, nbytes: int, capacity: int, fd: int) -> None:
        mm = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.segments[slot] = (gen, capacity, mm, memoryview(mm))

    def _wait_for(self, ready, timeout: float = 0.5) -> bool:
        """Wait until `ready()` (re-checked when the reader notifies, at least every `timeout` s), or
        the parent is gone or stopped; True when ready."""
        with self.changed:
            while not ready():
                if self.parent_gone.is_set() or self.stop_seq is not None:
                    return bool(ready())
                self.changed.wait(timeout)
            return True

    def _sequence(self) -> None:
        """Jobs in seq order: take one "copies landed" post, read that job's ring entry, hand its spans
        to the writers.  Posts come in job order (one side stream; or from the parent after publishing)."""
        if not self._wait_for(lambda: self.ready):
            return
        seq = 1
        while True:
            if not self._take_landed(seq):
                if not self.parent_gone.is_set():
                    return  # stopped: every job up to the stop is done
                entry = self._entry(seq)  # the parent died: a published job's copies never landed
                if entry is None:
                    return
                if entry[1][-1] == STATE_JOB:
                    self._finish_unwritten(Job(seq, entry[1], entry[2] or []), UNLANDED)
                seq += 1
                continue
            entry = self._entry(seq, RECORD_WAIT_S)
            if entry is None:
                log.error("[hs-dump] writer: job %d was signalled but never published: skipped", seq)
                seq += 1
                continue
            _seq, head, spans = entry
            assert self.sems is not None, "the control segment came before any job"
            if head[-1] != STATE_JOB:
                U64.pack_into(self.sems, self.free_sem + COPIED_OFFSET, seq)
                seq += 1
                continue
            job = Job(seq, head, spans if spans is not None else self._socket_spans(seq))
            seq += 1
            U64.pack_into(self.sems, self.free_sem + COPIED_OFFSET, job.seq)  # the parent may free the sources
            if not self._wait_for(lambda slot=job.slot, gen=job.gen: self.segments.get(slot, (-1,))[0] == gen):
                self._finish_unwritten(job, "the buffer of slot %d never came" % job.slot)
                continue
            job.metadata = self.metadata
            if not job.spans:
                self._report(job)
            for span in job.spans:
                self.spans.put((job, span))

    def _take_landed(self, seq: int) -> bool:
        """One "copies landed" post (for job `seq`); False once the parent is gone without one, or
        stopped before `seq`."""
        while True:
            deadline = time.time() + 0.5
            ts = Timespec(int(deadline), int((deadline % 1) * 1e9))
            if self.libc.sem_timedwait(self.landed, ctypes.byref(ts)) == 0:
                return True
            if self.parent_gone.is_set():
                return self.libc.sem_trywait(self.landed) == 0
            if self.stop_seq is not None and seq > self.stop_seq:
                return False

    def _entry(self, seq: int, wait_s: float = 0.0):
        """(seq, head, spans or None when they came by socket) of job `seq` once published, else None;
        looks for up to `wait_s` s (a post always follows the publishing: normally at once)."""
        assert self.sems is not None, "the control segment came before any job"
        at, mm = self.ring_at + (seq % self.ring) * JOB_BYTES, self.sems
        deadline, delay = time.monotonic() + wait_s, 20e-6
        while U64.unpack_from(mm, at)[0] != seq:
            if time.monotonic() > deadline or self.parent_gone.is_set():
                if U64.unpack_from(mm, at)[0] != seq:
                    return None
                break
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        head = JOB_HEAD.unpack_from(mm, at + 8)
        n = head[-2]
        if head[-1] != STATE_JOB or n == SPANS_ON_SOCKET:
            return seq, head, None
        return seq, head, marshal.loads(mm[at + JOB_SPANS_AT : at + JOB_SPANS_AT + n])

    def _socket_spans(self, seq: int) -> list:
        """The spans of a job too large for its ring entry (sent on the socket before it was published)."""
        self._wait_for(lambda: seq in self.big_spans)
        with self.changed:
            return self.big_spans.pop(seq, [])

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
        layout = Layout(capacity, job.hidden, job.esize, scaled=job.st_dtype == "F8_E4M3")
        start, tokens, prefix = span
        views = span_views(mem, layout, start, tokens, job.id_size, job.pos_size)
        ids, pos, hidden, aux = views[:4]
        scales = (views[4], views[5]) if len(views) > 4 else None
        c = self.config
        return dumpfile.write_span(
            c["root"], c["rank"], ids, pos, hidden, aux, job.hidden, job.st_dtype, prefix, job.metadata, c["fsync"],
            scales,
        )  # fmt: skip

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
        """The job's counts into its slot's record (seq last), then the "a job finished" post."""
        assert self.sems is not None, "the control segment came before any job"
        offset = job.slot * SEM_SLOT_BYTES + DONE_OFFSET
        struct.pack_into(DONE_FIELDS, self.sems, offset + 8, job.files, job.tokens, job.bytes, job.errors)
        struct.pack_into("<Q", self.sems, offset, job.seq)
        self.libc.sem_post(self.sems_base + self.free_sem)
        if job.errors:
            try:
                with self.send_lock:
                    send(self.sock, ("error", job.slot, job.first_error))
            except OSError:
                pass


def apply_scheduling(sched: Optional[str], cpus) -> None:
    """This (child) process's policy and CPUs, set before its threads start so they inherit both."""
    policy = getattr(os, SCHED_POLICIES.get(sched or "normal", "SCHED_OTHER"), None)
    if policy is not None and sched not in (None, "normal"):
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
        except (OSError, AttributeError) as exc:
            log.warning("[hs-dump] writer process: scheduling policy %s refused (%r)", sched, exc)
    if cpus:
        try:  # not intersected with the inherited mask: that is the spawning thread's, maybe pinned
            os.sched_setaffinity(0, set(cpus))
        except (OSError, AttributeError) as exc:
            log.warning("[hs-dump] writer process: CPUs %s refused (%r)", cpus, exc)


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
