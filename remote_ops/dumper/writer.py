"""Writer threads (SGLANG_HS_DUMP_WRITER=thread) and counters.

The default writer is a separate process (`procwriter`); these in-process
threads are the fallback where it cannot start.  A writer takes a span task,
waits for its batch's copy event (never the forward thread), writes the file
through `dumpfile.write_span` (temp name, fsync, rename, manifest line after
the rename) and gives the batch's buffer back to the pool when the batch's
last span is written.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

from . import dumpfile
from .layout import span_views
from .staging import BufferPool, Staged

log = logging.getLogger("remote_ops_dump")
STATS_EVERY_S = 1.0


@dataclass
class Span:
    """One request's rows in a batch: rows [start, start+tokens), after `prefix_len` cached tokens."""

    start: int
    tokens: int
    prefix_len: int


class DumpStats:
    """Thread-safe counters, written to stats.json at most once a second and at close.

    `add` only counts: the forward thread calls it, and must never wait for the
    file system (a rename next to fsync-heavy writers blocked it for 50-300 ms
    on the H200 host).  `maybe_write` is called by the writer threads or the
    writer process's reaper thread, and at flush/close.
    """

    def __init__(self, path: Optional[str], static: Mapping[str, object]):
        self.path, self.static = path, dict(static)
        self.lock = threading.Lock()
        self.counts: Dict[str, float] = {
            k: 0
            for k in (
                "files",
                "spans",
                "tokens",
                "bytes",
                "dropped_spans",
                "dropped_tokens",
                "dropped_batches",
                "errors",
                "batches",
                "backpressure_waits",
                "backpressure_wait_s",
                "backpressure_timeouts",
                "capture_calls",
                "capture_us",
                "capture_steps",
                "capture_steps_us",
            )
        }
        self.skipped: Dict[str, int] = {}
        self.state, self.reason = "running", None
        self.queue_high_water = 0
        self.last_write = 0.0

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.counts[name] = self.counts.get(name, 0) + delta

    def skip(self, reason: str) -> None:
        with self.lock:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def snapshot(self) -> dict:
        with self.lock:
            out = dict(self.static)
            out.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.counts.items()})
            out.update(
                skipped=dict(self.skipped),
                state=self.state,
                reason=self.reason,
                queue_high_water=self.queue_high_water,
                updated=round(time.time(), 3),
            )
            return out

    def maybe_write(self, force: bool = False) -> None:
        """Rewrite stats.json (atomically) when forced or a second has passed."""
        now = time.monotonic()
        if self.path is None or (not force and now - self.last_write < STATS_EVERY_S):
            return
        self.last_write = now
        try:
            dumpfile.write_json_atomic(self.path, self.snapshot())
        except OSError as exc:
            log.warning("[hs-dump] could not write %s: %s", self.path, exc)


@dataclass
class BatchJob:
    """A staged batch and the spans still to write from it; the last span frees the buffer."""

    staged: Staged
    spans: List[Span]
    pool: BufferPool
    remaining: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self.remaining = len(self.spans)

    def span_done(self) -> None:
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.pool.release(self.staged.buffer.slot)


class SpanWriters:
    """A fixed set of writer threads draining span tasks in order of arrival."""

    def __init__(self, count: int, write_one: Callable[[BatchJob, Span], None], stats: DumpStats):
        self.tasks: "queue.Queue" = queue.Queue()
        self.write_one, self.stats = write_one, stats
        self.threads = [
            threading.Thread(target=self._run, name="hs-dump-writer-%d" % i, daemon=True) for i in range(count)
        ]
        for t in self.threads:
            t.start()

    def submit(self, job: BatchJob) -> None:
        for span in job.spans:
            self.tasks.put((job, span))

    def _run(self) -> None:
        while True:
            item = self.tasks.get()
            if item is None:
                self.tasks.task_done()
                return
            job, span = item
            try:
                job.staged.wait()
                self.write_one(job, span)
            except Exception as exc:  # one bad span must not stop the writers
                self.stats.add(errors=1)
                log.error("[hs-dump] writing a span of %d tokens failed: %r", span.tokens, exc)
            finally:
                job.span_done()
                self.tasks.task_done()
                self.stats.maybe_write()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued span is written (True) or the deadline passes (False)."""
        deadline = time.monotonic() + timeout
        while self.tasks.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.tasks.unfinished_tasks

    def stop(self, timeout: float) -> None:
        for _ in self.threads:
            self.tasks.put(None)
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def write_span_file(
    root: str,
    rank: int,
    job: BatchJob,
    span: Span,
    hidden_size: int,
    dtype: str,
    metadata: Mapping[str, str],
    fsync: bool,
) -> dict:
    """Write one span of a staged batch with the shared stdlib writer; returns the manifest record
    (FP8 storage: the buffer's layout has the scales, written beside the values)."""
    staged = job.staged
    views = span_views(
        staged.buffer.mem, staged.buffer.layout, span.start, span.tokens, staged.id_size, staged.pos_size
    )
    ids, pos, hidden, aux = views[:4]
    scales = (views[4], views[5]) if len(views) > 4 else None
    return dumpfile.write_span(
        root, rank, ids, pos, hidden, aux, hidden_size, dtype, span.prefix_len, metadata, fsync, scales
    )


def ensure_rank_dir(root: str, rank: int) -> str:
    folder = os.path.join(root, dumpfile.rank_dir_name(rank))
    os.makedirs(folder, exist_ok=True)
    return folder
