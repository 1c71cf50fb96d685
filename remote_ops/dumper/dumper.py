"""The dumper object stored as `model._remote_ops_dump`; `capture` runs inside `forward`.

`capture` does only CPU-side bookkeeping plus asynchronous copies: it reads the
Python-list lengths of the ForwardBatch (no GPU sync), takes a host buffer from
the bounded pool, queues the copies and hands the batch to the writer: by
default a separate process (`procwriter`, no GIL shared with the forward
thread), else writer threads (`SGLANG_HS_DUMP_WRITER=thread`, or when the
process cannot start).  A small step (under SGLANG_HS_DUMP_GATHER_TOKENS rows,
GPU path with the writer process) is held and copied with the next ones as one
job (`gather`): a copy job's fixed price on the forward thread is then paid once
per several steps.  It blocks only when every buffer is still waiting for the
disk (backpressure), or never (drop policy).

FP8 storage (`SGLANG_HS_DUMP_DTYPE=fp8_e4m3`, FORMAT.md "FP8 storage"): `capture`
first casts the step's rows with `fp8.encode_step`, on the forward stream (kernels
queued, no sync), and from there on the step is those tensors: e4m3 values and
float32 scales, copied and written like the model's own.  So every path takes it
(driver copies, gathered jobs, torch copies, the CPU), the host buffers and the
copy to the host hold about half the bytes, and a gathered step holds its
encoded tensors, not the model's (fresh allocations of ours: never rewritten).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import dumpfile, fp8, staging
from .config import DumpConfig
from .cudadrv import Driver
from .gather import Gather, layout_runs, rewritten, shifted_spans
from .procwriter import WriterProcess
from .staging import ST_DTYPES, BufferPool, HostBuffer, Staged, Stager, positions_into
from .writer import BatchJob, DumpStats, Span, SpanWriters, ensure_rank_dir, write_span_file

log = logging.getLogger("remote_ops_dump")
DEFAULT_BUFFER_TOKENS = 8192
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what FP8 storage casts from
CLOSE_TIMEOUT_S = 60.0


def forward_mode_name(forward_batch: Any) -> str:
    """'EXTEND', 'DECODE', ... from ForwardBatch.forward_mode (an IntEnum in SGLang)."""
    mode = getattr(forward_batch, "forward_mode", None)
    return str(getattr(mode, "name", mode)).upper()


def split_spans(forward_batch: Any) -> List[Span]:
    """Per-request row spans from the CPU-side lengths (extend_seq_lens_cpu, extend_prefix_lens_cpu)."""
    lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    prefixes = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    prefixes = [int(p) for p in prefixes] if prefixes is not None else [0] * len(lens)
    spans, start = [], 0
    for tokens, prefix in zip(lens, prefixes):
        if tokens > 0:
            spans.append(Span(start, tokens, prefix))
        start += tokens
    return spans


def _span_tuples(forward_batch: Any) -> Tuple[List[Tuple[int, int, int]], int]:
    """split_spans as plain (start, tokens, prefix_len) tuples, and the rows they cover (the capture path)."""
    lens = forward_batch.extend_seq_lens_cpu
    prefixes = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    if prefixes is None:
        prefixes = [0] * len(lens)
    spans, start = [], 0
    for tokens, prefix in zip(lens, prefixes):
        tokens = int(tokens)
        if tokens > 0:
            spans.append((start, tokens, int(prefix)))
        start += tokens
    return spans, start


def graph_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (never copy then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def _stream_capturing() -> bool:
    """graph_capturing() for a batch already known to be on a GPU: one call into torch's C part."""
    return bool(_IS_CAPTURING()) if _IS_CAPTURING is not None else torch.cuda.is_current_stream_capturing()


class Dumper:
    """Captures plain-EXTEND batches and writes one file per request span (writer ranks only)."""

    def __init__(
        self,
        config: DumpConfig,
        rank: int,
        writer: bool,
        layers: Sequence[int],
        hidden_size: int,
        metadata: Mapping[str, str],
        buffer_tokens: Optional[int] = None,
    ):
        self.config, self.rank, self.writer = config, rank, writer
        self.layers, self.hidden_size = list(layers), hidden_size
        self.metadata = dict(metadata)
        self.buffer_tokens = buffer_tokens or config.buffer_tokens or DEFAULT_BUFFER_TOKENS
        self.dir = ensure_rank_dir(config.root, rank) if writer else None
        self.stats = DumpStats(
            os.path.join(self.dir, dumpfile.STATS_NAME) if writer and self.dir is not None else None, self._static()
        )
        self.pool: Optional[BufferPool] = None
        self.stager = Stager()
        self.driver: Optional[Driver] = None
        self.writers: Optional[SpanWriters] = None
        self.sink: Optional[WriterProcess] = None
        self.inflight: Dict[int, Tuple[int, int, int]] = {}  # slot -> (spans, tokens, job seq) at the writer process
        # (job seq, source tensors) of jobs whose copies may still run: the tensors stay referenced so the
        # caching allocator cannot reuse their memory before the side stream read it (no record_stream)
        self.held: Deque[Tuple[int, tuple]] = collections.deque()
        self.job_seq = 0
        self.reclaim_lock = threading.Lock()
        self.mode_names: Dict[Any, str] = {}
        self.warned: set = set()
        self.closed = self.closing = False
        self.lock = threading.Lock()
        # small steps copied together (gather.py); made with the pool, on the GPU path with the writer process
        self.gather: Optional[Gather] = None
        self.gather_lock = threading.Lock()  # the waiting steps, and the side stream's fence while they exist
        self.context = 0  # the forward thread's CUcontext (the reaper makes it current to copy stale steps)
        self.fp8 = config.storage == "fp8_e4m3"  # cast to e4m3 + scales on the GPU before the copy
        self.model_dtype: Optional[str] = None  # FP8 storage: the dtype the values decode to (the sources')
        if self.fp8:
            self.metadata["storage"] = dumpfile.STORAGE_FP8
        if writer:
            self._start_writers(config.writer)
            self.stats.maybe_write(force=True)
            atexit.register(self.close)

    def _static(self) -> dict:
        c = self.config
        return {
            "rank": self.rank,
            "writer": self.writer,
            "policy": c.policy,
            "buffers": c.buffers,
            "writers": c.writers,
            "buffer_tokens": self.buffer_tokens,
            "gather": _gather_settings(c, False),
            "storage": c.storage,
            "hidden_size": self.hidden_size,
            "layers_to_capture": self.layers,
            "metadata": self.metadata,
            "pid": os.getpid(),
            "started": round(time.time(), 3),
        }

    def _start_writers(self, mode: str) -> None:
        """The writer process (default), or threads when asked or when the process cannot start."""
        if mode == "process":
            try:
                config = {
                    "root": self.config.root,
                    "rank": self.rank,
                    "fsync": self.config.fsync,
                    "writers": self.config.writers,
                    "metadata": self.metadata,
                    "sched": self.config.writer_sched,
                    "cpus": self.config.writer_cpus,
                }
                self.sink = WriterProcess(config, self.config.buffers, self._on_exit, self._on_idle, self._on_error)
            except Exception as exc:
                log.error("[hs-dump] the writer process could not start (%r): using writer threads", exc)
                mode = "thread"
        if mode == "thread":
            self.writers = SpanWriters(self.config.writers, self._write_one, self.stats)
        self.stats.static["writer_mode"] = mode

    # ------------------------------------------------------------------ forward hook

    def capture(
        self, forward_batch: Any, hidden_states: torch.Tensor, aux_hidden_states: Optional[Sequence[torch.Tensor]]
    ) -> None:
        """Called from DeepseekV2ForCausalLM.forward after the aux unpack; never raises.

        Its own wall time is counted (stats.json `capture_calls` / `capture_us`, and for the
        prefill steps it takes `capture_steps` / `capture_steps_us`): `dumps stats` sets it
        beside the forward time of the same steps from SGLang's log lines."""
        if not self.writer or self.closed:
            return
        t0 = time.perf_counter()
        took = False
        try:
            if self.gather is None:
                took = self._capture(forward_batch, hidden_states, aux_hidden_states)
            else:  # the reaper may copy stale waiting steps: one thread at a time on the side stream
                with self.gather_lock:
                    took = self._capture(forward_batch, hidden_states, aux_hidden_states)
        except Exception as exc:
            self.stats.add(errors=1)
            self._warn_once("capture-error", "capture failed, batch not dumped: %r" % (exc,))
        finally:
            us = int((time.perf_counter() - t0) * 1e6)
            counts = self.stats.counts  # only this thread writes these keys (no lock: GIL-atomic enough)
            counts["capture_calls"] += 1
            counts["capture_us"] += us
            if took:
                counts["capture_steps"] += 1
                counts["capture_steps_us"] += us

    def _capture(self, fb: Any, hidden: torch.Tensor, aux: Optional[Sequence[torch.Tensor]]) -> bool:
        """Take one step (copied now, or held with the next ones); False when it is skipped."""
        reason = self._skip_reason(fb, hidden, aux)
        if reason or aux is None:  # no aux always has a reason ("no_aux")
            self.stats.skip(reason or "no_aux")
            return False
        spans, rows = _span_tuples(fb)
        if not spans:
            return False
        positions = fb.positions
        scale = None
        if self.fp8:
            if not self._shapes_ok(fb.input_ids, hidden, aux, rows, SOURCE_DTYPES):
                return True
            hidden, aux, scale = self._encode(hidden, aux, rows)
        if self.gather is not None and positions is not None and self._gathered(hidden, aux, fb, spans, rows, scale):
            return True
        self._copy_step(hidden, aux, fb.input_ids, positions, spans, rows, scale)
        return True

    def _encode(
        self, hidden: torch.Tensor, aux: Sequence[torch.Tensor], rows: int
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...], torch.Tensor]:
        """FP8 storage: the step's rows cast on their device and current (forward) stream: (e4m3 final
        state [rows, H], the thirds of one e4m3 aux tensor [rows, 3H], scales [rows, 4])."""
        if self.model_dtype is None:
            self.model_dtype = str(hidden.dtype).replace("torch.", "")
        q_hidden, q_aux, scale = fp8.encode_step(hidden, aux, rows)
        h = self.hidden_size
        return q_hidden, tuple(q_aux[:, k * h : (k + 1) * h] for k in range(len(aux))), scale

    def _copy_step(
        self,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
        ids: torch.Tensor,
        positions: Optional[torch.Tensor],
        spans: List[Tuple[int, int, int]],
        rows: int,
        scale: Optional[torch.Tensor] = None,
    ) -> None:
        """One step as its own copy job (forward thread): driver copies when its plan says the tensors
        allow them, else the general path (torch copies); bad shapes are skipped.  `scale`: FP8 storage's
        scales (`hidden` and `aux` are then its e4m3 values)."""
        plan = self.stager.plan(hidden, aux, ids, positions, rows, self.hidden_size, scale)  # None: no driver copies
        if plan is None and not self._shapes_ok(ids, hidden, aux, rows):
            return
        buf = self._acquire(rows, hidden, spans)
        if buf is None:
            return
        step = (hidden, tuple(aux), ids, positions) if scale is None else (hidden, tuple(aux), ids, positions, scale)
        if self.sink is None:
            copied = self._copy_for_threads(buf, step, spans, rows, plan)
        elif plan is not None:
            copied = self._copy_planned(buf, plan, step, spans, rows)
        else:
            copied = self._copy_general(buf, step, spans, rows)
        if copied:
            self.stats.counts["batches"] += 1  # only this thread writes this key (no lock: GIL-atomic enough)

    def _copy_for_threads(self, buf: HostBuffer, step: tuple, spans, rows: int, plan: Optional[tuple]) -> bool:
        """Writer threads: the copies with a blocking-sync event behind them, the spans to the threads."""
        staged = self._staged(buf, step, spans, rows, plan, event=True)
        assert self.writers is not None and self.pool is not None, "no writer process: the writer threads run"
        self.writers.submit(BatchJob(staged, [Span(*s) for s in spans], self.pool))
        return True

    def _copy_planned(self, buf: HostBuffer, plan: tuple, step: tuple, spans, rows: int) -> bool:
        """Writer process, driver copies: publish the job in the ring, then queue fence + copies + the
        sem_post host function (the child reads the entry only after that post)."""
        if step[3] is None:
            self._guarded(buf, lambda: positions_into(buf, _positions_from_spans(spans)))
        seq = self._submit_to_process(buf, plan[4], plan[6], spans, rows, step)
        if seq:
            self._run_planned_job(buf, seq, lambda post: self.stager.queue(plan, buf, rows, post))
        return bool(seq)

    def _copy_general(self, buf: HostBuffer, step: tuple, spans, rows: int) -> bool:
        """Writer process, torch copies (CPU tensors, or GPU tensors the driver copies cannot take): copy,
        publish the job, then signal: a host function behind GPU copies, a post from here after CPU ones."""
        staged = self._staged(buf, step, spans, rows, None, event=False)
        keep, staged.keep = staged.keep, None
        seq = self._submit_to_process(buf, staged.id_size, staged.pos_size, spans, rows, keep)
        if not seq:
            return False
        sink = self.sink
        assert sink is not None, "called with the writer process running"
        try:
            if step[0].is_cuda:
                assert self.driver is not None, "GPU path with the writer process"
                self.driver.post_when_done(self.stager.side_raw, sink.landed_addr)
            else:
                sink.post_landed()
        except BaseException:
            self._abandon(buf, seq)
            raise
        return True

    def _staged(self, buf: HostBuffer, step: tuple, spans, rows: int, plan: Optional[tuple], event: bool) -> Staged:
        """The copies queued (GPU) or done (CPU) into `buf`, positions derived when the batch has none."""
        hidden, aux, ids, positions = step[:4]
        scale = step[4] if len(step) > 4 else None

        def copy() -> Staged:
            if positions is None:
                positions_into(buf, _positions_from_spans(spans))
            return self.stager.stage(buf, hidden, aux, ids, positions, rows, event, plan, scale)

        return self._guarded(buf, copy)

    def _guarded(self, buf: HostBuffer, fn: Callable[[], Any]) -> Any:
        """fn() for a slot just taken; when it fails, no copy may still land in the slot, which goes back."""
        try:
            return fn()
        except BaseException:
            self.stager.synchronize()
            assert self.pool is not None, "_acquire made the pool"
            self.pool.release(buf.slot)
            raise

    def _gathered(
        self, hidden: torch.Tensor, aux: Sequence[torch.Tensor], fb: Any, spans, rows: int, scale=None
    ) -> bool:
        """Take a small step into the waiting ones: its references and spans only (the plan, the rewrite
        check and the copies are made for all waiting steps at once, `_copy_gathered`); True when taken,
        False when it is copied on its own (as large as a job, or on another GPU than the first step)."""
        g = self.gather
        assert g is not None, "called while gathering"
        index = self.stager.device_index
        if not g.takes(rows) or hidden.get_device() != index:
            self._copy_gathered()  # the waiting steps first: files keep the steps' order
            return False
        stream = staging._raw_stream(index)  # the steps of one job share its fence: the same stream
        if not g.fits(rows, stream):
            self._copy_gathered()
            if self.gather is not g:  # that job stopped gathering (a rewrite, or a step with no plan)
                return False
        now = time.monotonic()
        g.add((hidden, tuple(aux), fb.input_ids, fb.positions, spans, rows, scale), rows, stream, now)
        if g.due(now):
            self._copy_gathered()
        return True

    def _copy_gathered(self, forward: bool = True) -> None:
        """The waiting steps as copy jobs (under gather_lock; `forward`: on the forward thread, else on
        another with its CUDA context made current): plan each, drop the rewritten ones, then one job per
        run of steps with one layout: a slot, the ring entry, fence + each step's copies at its rows + the
        post.  A step whose tensors need the general path is copied alone by it (forward thread) or
        dropped (other threads: torch's copies would run on their stream), and gathering stops."""
        assert self.gather is not None and self.sink is not None, "gathering runs with the writer process"
        stream = self.gather.key
        items, _rows = self.gather.take()
        if not items:
            return
        ready, unplanned = self._plan_waiting(items, forward)
        layouts = [(item[0].dtype, plan[4], plan[6]) for plan, item in ready]
        for start, end in layout_runs(layouts):
            self._queue_job(ready[start:end], stream)
        for item in unplanned:
            if forward:
                self._copy_step(*item)
            else:
                self._drop_steps([item])

    def _plan_waiting(self, items: List[tuple], forward: bool) -> Tuple[List[Tuple[tuple, tuple]], List[tuple]]:
        """Each waiting step's plan, in one pass; the rewritten steps dropped; (planned steps as (plan,
        step), steps with no plan: gathering stops for them)."""
        plans = [self.stager.plan(h, a, i, p, n, self.hidden_size, sc) for h, a, i, p, _s, n, sc in items]
        stale = rewritten([_plan_starts(plan) for plan in plans])
        if stale:
            self._drop_rewritten([items[i] for i in sorted(stale)])
        ready: List[Tuple[tuple, tuple]] = []
        unplanned: List[tuple] = []
        for i, (plan, item) in enumerate(zip(plans, items)):
            if plan is None:
                unplanned.append(item)
            elif i not in stale:
                ready.append((plan, item))
        if unplanned:
            self._stop_gathering_unplanned(len(unplanned), forward)
        return ready, unplanned

    def _queue_job(self, ready: List[Tuple[tuple, tuple]], stream: int) -> None:
        """Planned waiting steps of one layout as one job: each step's copies at its first row in one host
        buffer, its spans moved by that row; one fence on `stream`, one post, one ring entry."""
        parts, moved, first = [], [], 0  # (plan, first row, rows) per step; its spans moved by first row
        for plan, (_h, _a, _i, _p, spans, n, _sc) in ready:
            parts.append((plan, first, n))
            moved.append((first, spans))
            first += n
        spans = shifted_spans(moved)
        buf = self._acquire(first, ready[0][1][0], spans, len(ready))
        if buf is None:
            return
        plan0 = ready[0][0]
        keep = tuple(item[:4] + item[6:] for _plan, item in ready)
        seq = self._submit_to_process(buf, plan0[4], plan0[6], spans, first, keep, len(ready))
        if not seq:
            return
        self._run_planned_job(buf, seq, lambda post: self.stager.queue_gathered(parts, buf, post, stream))
        self.stats.counts["batches"] += len(ready)

    def _run_planned_job(self, buf: HostBuffer, seq: int, queue: Callable[[int], Any]) -> None:
        """Queue published job `seq`'s planned copies: `queue(post_addr)` (a Stager call) ends them with the
        `sem_post` host function.  A job that fails is cancelled and its slot freed."""
        sink = self.sink
        assert sink is not None, "planned jobs run with the writer process"
        try:
            queue(sink.landed_addr)
        except BaseException:
            self._abandon(buf, seq)
            raise

    def _drop_steps(self, items: Sequence[tuple]) -> None:
        """Count waiting steps as dropped (never written)."""
        spans = sum(len(item[4]) for item in items)
        rows = sum(item[5] for item in items)
        self.stats.add(errors=1, dropped_batches=len(items), dropped_spans=spans, dropped_tokens=rows)

    def _drop_rewritten(self, items: Sequence[tuple]) -> None:
        """Waiting steps whose tensors a later waiting step also starts at: the model rewrote a buffer we
        hold (static CUDA-graph memory), so their data is gone.  Count them, never write them, and copy
        every later step on its own."""
        self.gather = None
        self._drop_steps(items)
        self._warn_once(
            "gather-clash",
            "the model rewrote a captured tensor's memory before its copy: %d gathered step(s) dropped; "
            "every step is copied on its own from now on (SGLANG_HS_DUMP_GATHER_TOKENS=0 avoids this)" % len(items),
        )

    def _stop_gathering_unplanned(self, steps: int, forward: bool) -> None:
        """Gathered steps whose tensors the driver copies cannot take (layout, dtype, device): gathering
        stops, so every later step takes the per-step path, which has the general copies."""
        self.gather = None
        self._warn_once(
            "gather-unplanned",
            "%d gathered step(s) need the general copy path (tensor layout, dtype or device): %s; every step is "
            "copied on its own from now on"
            % (steps, "copied alone" if forward else "dropped, not on the forward thread"),
        )

    def _copy_waiting(self, stale_only: bool = False) -> None:
        """Copy the gathered steps now, from this thread with the forward thread's CUDA context made
        current: flush/close (all of them), or the reaper's tick (`stale_only`: only steps that waited
        past gather_ms, i.e. no capture came since, an idle server).  The reaper never waits: it skips a
        tick when the lock is busy or no buffer is free (it is the thread that notices a dead writer
        process, so it must not sit in a backpressure wait; under the lock nothing else takes a buffer)."""
        g = self.gather
        if g is None or not (g.stale(time.monotonic()) if stale_only else len(g)):
            return
        if not self.gather_lock.acquire(blocking=not stale_only):
            return
        try:
            if stale_only and self.pool is not None and not self.pool.free:
                return
            if self.gather is not None and len(self.gather):
                assert self.driver is not None, "gathering runs on the driver path"
                self.driver.make_current(self.context)
                self._copy_gathered(forward=False)
        except Exception as exc:
            self.stats.add(errors=1)
            self._warn_once("gather-copy", "copying gathered steps failed, not dumped: %r" % (exc,))
        finally:
            self.gather_lock.release()

    def _submit_to_process(
        self,
        buf: HostBuffer,
        id_size: int,
        pos_size: int,
        spans: List[Tuple[int, int, int]],
        rows: int,
        keep: Optional[tuple] = None,
        batches: int = 1,
    ) -> int:
        """Take the next job seq and publish the job in the ring; its seq, or 0 when the child is gone (the
        batch counted as dropped, the slot freed).  Nothing has posted its "copies landed" yet.

        `keep` (GPU): the source tensors, held until the child reports the copies landed; `batches`: the
        captured steps in the job (gathered steps: several)."""
        sink, pool = self.sink, self.pool
        assert sink is not None and pool is not None, "called with the writer process running"
        with self.reclaim_lock:
            self.job_seq += 1
            seq = self.job_seq
            self.inflight[buf.slot] = (len(spans), rows, seq)
            held = self.held
            if keep is not None:
                held.append((seq, keep))
            if held:  # _release_copied, inline: once per batch on the forward thread
                copied = sink.copied_seq()
                while held and held[0][0] <= copied:
                    held.popleft()
        try:
            sink.job(
                buf.slot, buf.gen, seq, rows, self.hidden_size, buf.esize, id_size, pos_size, ST_DTYPES[buf.dtype],
                spans,
            )  # fmt: skip
        except BaseException as exc:  # OSError: the child is gone (counted as a drop); else re-raised
            self._abandon(buf, seq, cancel=not isinstance(exc, OSError))
            if not isinstance(exc, OSError):
                raise
            self.stats.add(dropped_batches=batches, dropped_spans=len(spans), dropped_tokens=rows)
            return 0
        return seq

    def _abandon(self, buf: HostBuffer, seq: int, cancel: bool = True) -> None:
        """Job `seq` fails before anything posted its "copies landed": wait for what was queued, tell the
        child to skip the job (a cancelled ring entry and its post), forget it, free the slot."""
        self.stager.synchronize()  # no copy may still land in the slot, or read a source we drop
        with self.reclaim_lock:
            self.inflight.pop(buf.slot, None)
            self.held = collections.deque(h for h in self.held if h[0] != seq)
        if cancel and self.sink is not None and self.sink.alive():
            self.sink.cancel(seq)
        assert self.pool is not None, "a job holds a slot of the pool"
        self.pool.release(buf.slot)

    def _release_copied(self) -> None:
        """Drop the source tensors of the jobs whose copies the child saw land (under reclaim_lock)."""
        held = self.held
        if held:
            copied = self.sink.copied_seq() if self.sink is not None else 0
            while held and held[0][0] <= copied:
                held.popleft()

    def _release_all_held(self) -> None:
        """After the side stream synchronized: nothing reads the sources any more."""
        self.stager.synchronize()
        with self.reclaim_lock:
            self.held.clear()

    def _skip_reason(self, fb: Any, hidden: torch.Tensor, aux: Optional[Sequence[torch.Tensor]]) -> Optional[str]:
        """Why this batch is not dumped (None = dump it); cheap, CPU-only checks."""
        if _stream_capturing() if hidden.is_cuda else graph_capturing():
            return "graph_capture"
        mode_obj = getattr(fb, "forward_mode", None)
        try:
            mode = self.mode_names[mode_obj]
        except (KeyError, TypeError):
            mode = forward_mode_name(fb)
            try:
                self.mode_names[mode_obj] = mode
            except TypeError:
                pass
        if mode != "EXTEND":
            return mode.lower()
        if getattr(fb, "can_run_tbo", False):
            return self._warned_reason("two_batch_overlap", "two-batch-overlap batch skipped")
        if aux is None or len(aux) != len(self.layers):
            return self._warned_reason(
                "no_aux",
                "forward returned %s aux states, want %d: is capture on?"
                % (None if aux is None else len(aux), len(self.layers)),
            )
        if getattr(fb, "extend_seq_lens_cpu", None) is None or getattr(fb, "input_ids", None) is None:
            return self._warned_reason("no_lengths", "EXTEND batch without extend_seq_lens_cpu/input_ids")
        return None

    def _shapes_ok(
        self, ids: Any, hidden: torch.Tensor, aux: Sequence[torch.Tensor], rows: int, dtypes: Any = ST_DTYPES
    ) -> bool:
        """Rows cover every span and the width is H (and the dtype one of `dtypes`); otherwise count an
        error and skip."""
        width = self.hidden_size
        for t in (hidden, *aux):
            shape = t.shape
            if len(shape) != 2 or shape[0] < rows or shape[1] != width:
                break
        else:
            if ids.shape[0] >= rows and hidden.dtype in dtypes:
                return True
        tensors = [hidden, *aux]
        bad = [tuple(t.shape) for t in tensors if t.dim() != 2 or t.shape[0] < rows or t.shape[1] != self.hidden_size]
        self.stats.add(errors=1)
        self._warn_once(
            "shape",
            "batch of %d rows skipped: shapes %s, dtype %s, H=%d" % (rows, bad, hidden.dtype, self.hidden_size),
        )
        return False

    def _acquire(self, rows: int, hidden: torch.Tensor, spans: Sequence[Any], batches: int = 1):
        """A host buffer for the batch (`batches` gathered steps): wait (backpressure) or count the drop."""
        pool = self.pool if self.pool is not None else self._pool_for(hidden)
        alive = self._writer_alive()
        block = self.config.policy == "backpressure" and alive
        buf = pool.acquire(rows, self.hidden_size, hidden.dtype, block, self.config.wait_s) if alive else None
        waited = pool.last_wait if alive else 0.0
        self.stats.queue_high_water = pool.high_water
        if block and waited > 0.001:
            self.stats.add(backpressure_waits=1, backpressure_wait_s=waited)
        if buf is None:
            timeout = {"backpressure_timeouts": 1} if block else {}
            self.stats.add(dropped_batches=batches, dropped_spans=len(spans), dropped_tokens=rows, **timeout)
        return buf

    def _writer_alive(self) -> bool:
        if self.sink is not None:
            return self.sink.alive()
        assert self.writers is not None, "no writer process: the writer threads run"
        return self.writers.alive()

    def _pool_for(self, hidden: torch.Tensor) -> BufferPool:
        """Create the pool at the first captured batch (pinned when the tensors live on a GPU)."""
        with self.lock:
            if self.pool is None:
                self._choose_path(hidden)
                pin, shared = hidden.is_cuda, self.sink is not None
                self.pool = BufferPool(
                    self.config.buffers,
                    self.buffer_tokens,
                    lambda slot, gen, rows, h, dtype: self._make_buffer(slot, gen, rows, h, dtype, pin, shared),
                    self._reclaim if shared else None,
                )
                self.metadata["dtype"] = self.model_dtype or str(hidden.dtype).replace("torch.", "")
                if self.sink is not None:
                    self.sink.meta(self.metadata)
            return self.pool

    def _choose_path(self, hidden: torch.Tensor) -> None:
        """GPU tensors: load the driver calls; without them the writer process cannot be told, use threads."""
        if not hidden.is_cuda:
            return
        self.driver = Driver.load()
        self.stager = Stager(self.driver)
        self.stager._side(hidden.device)  # the side stream and its fence event, before any batch
        if self.driver is None:
            log.warning("[hs-dump] libcuda.so.1 not loadable through ctypes: torch copies, writer threads")
            if self.sink is not None:
                self.sink.stop(5.0)
                self.sink = None
                self._start_writers("thread")
        self.stats.static["signal"] = "hostfn" if self.sink is not None else "event"
        self.stats.static["copy"] = "calls" if self.driver is not None else "torch"
        self._start_gather()

    def _start_gather(self) -> None:
        """Gather small steps (gather.py) where it applies: driver copies, the writer process,
        SGLANG_HS_DUMP_GATHER_TOKENS > 0.  No more rows than a buffer holds."""
        c = self.config
        if self.driver is None or self.sink is None:
            return
        if c.gather_tokens > 0 and c.gather_steps > 1:
            self.gather = Gather(min(c.gather_tokens, self.buffer_tokens), c.gather_steps, c.gather_ms / 1000.0)
            self.context = self.driver.current_context()
        self.stats.static["gather"] = _gather_settings(c, self.gather is not None)

    def _make_buffer(
        self, slot: int, gen: int, rows: int, hidden_size: int, dtype: torch.dtype, pin: bool, shared: bool
    ) -> HostBuffer:
        """A slot's buffer; a shared one is handed to the writer process before any job names it."""
        buf = HostBuffer(rows, hidden_size, dtype, pin, shared, slot, gen, self.driver)
        if shared:
            assert self.sink is not None, "shared buffers exist only with the writer process"
            self.sink.segment(slot, gen, buf.layout.nbytes, buf.capacity, buf.fd)
            os.close(buf.fd)
            buf.fd = -1
        return buf

    def preallocate(self, hidden: torch.Tensor, rows: Optional[int] = None) -> None:
        """Create the pool and all its host buffers now, sized like `hidden` (optional warm-up).

        In FP8 storage the buffers hold e4m3 values and scales, whatever `hidden`'s dtype: made
        for `hidden`'s, each would be made again, pinned, at its first capture."""
        if self.writer:
            dtype = staging.FP8 if self.fp8 else hidden.dtype
            self._pool_for(hidden).preallocate(rows or self.buffer_tokens, self.hidden_size, dtype)

    # ------------------------------------------------------------------ writer side

    def _write_one(self, job: BatchJob, span: Span) -> None:
        """Writer-thread body for one span: the file, its manifest line, the counters."""
        dtype = ST_DTYPES[job.staged.buffer.dtype]  # F8_E4M3 in FP8 storage: the layout has the scales
        record = write_span_file(
            self.config.root, self.rank, job, span, self.hidden_size, dtype, self.metadata, self.config.fsync
        )
        self.stats.add(files=1, spans=1, tokens=span.tokens, bytes=record["bytes"])

    def _reclaim(self, wait_s: float) -> int:
        """Free the slots whose job the writer process finished (counts into the stats); how many.

        Called by the pool when it has no free slot (waiting up to `wait_s` for a
        finished job), by flush, and once a second by the reaper thread."""
        sink = self.sink
        if sink is None:
            return 0
        with self.reclaim_lock:
            self._release_copied()
            while sink.wait_finished(0.0):  # the posts only wake waiters; the records say what finished
                pass
            freed = self._collect_finished()
            if not freed and wait_s > 0 and self.inflight and sink.wait_finished(wait_s):
                while sink.wait_finished(0.0):
                    pass
                freed = self._collect_finished()
        return freed

    def _collect_finished(self) -> int:
        assert self.sink is not None and self.pool is not None, "jobs exist only with the writer process"
        done = [(slot, job) for slot, job in self.inflight.items() if self.sink.done_seq(slot) == job[2]]
        for slot, _job in done:
            del self.inflight[slot]
            files, tokens, nbytes, errors = self.sink.done_counts(slot)
            self.stats.add(files=files, spans=files, tokens=tokens, bytes=nbytes, errors=errors)
            self.pool.release(slot)
        return len(done)

    def _on_idle(self) -> None:
        """Reaper thread, once a second: copy steps gathered too long ago, collect finished jobs, rewrite
        stats.json."""
        if self.gather is not None:
            self._copy_waiting(stale_only=True)
        if self.pool is not None:
            self._reclaim(0.0)
        self.stats.maybe_write()

    def _on_error(self, slot: int, first_error: str) -> None:
        """Reaper thread: a job of the writer process had failed spans (counted with its record)."""
        log.error("[hs-dump] writing span(s) of slot %d failed: %s", slot, first_error)

    def _on_exit(self) -> None:
        """Reaper thread: the writer process is gone; what it held is lost, later batches are dropped."""
        if not self.closing:
            log.error("[hs-dump] the writer process exited: batches in flight are lost, later ones dropped")
        if self.pool is not None:
            self._reclaim(0.0)  # what it finished before it went
        self._release_all_held()
        with self.reclaim_lock:
            for slot, (spans, tokens, _seq) in list(self.inflight.items()):
                self.inflight.pop(slot, None)
                self.stats.add(dropped_batches=1, dropped_spans=spans, dropped_tokens=tokens)
                if self.pool is not None:
                    self.pool.release(slot)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop capturing, let the writers finish what is queued (bounded), write final stats."""
        if self.closed or not self.writer:
            self.closed = True
            return
        self.closed = True
        drained = self.flush(timeout)
        self.closing = True
        if self.sink is not None:
            if not self.sink.stop(min(10.0, timeout)):
                self.sink.kill()
        else:
            assert self.writers is not None, "no writer process: the writer threads run"
            self.writers.stop(min(5.0, timeout))
        self._release_all_held()
        if drained:
            self.stager.close()
        if self.pool is not None:
            self.pool.close(free=drained)
        self.stats.state = "closed" if drained else "closed-with-pending"
        self.stats.maybe_write(force=True)

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until everything captured so far is on disk (tests, benchmarks, shutdown hooks); gathered
        steps are copied first, from the calling thread."""
        if self.gather is not None:
            self._copy_waiting()
        if self.sink is not None:
            ok = self.pool.wait_idle(timeout) if self.pool is not None else True
        else:
            ok = self.writers.drain(timeout) if self.writers else True
        self.stats.maybe_write(force=True)
        return ok

    def _warned_reason(self, reason: str, message: str) -> str:
        self._warn_once(reason, message)
        return reason

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.error("[hs-dump] %s", message)


def _gather_settings(c: DumpConfig, active: bool) -> dict:
    """stats.json's "gather": the settings, and whether small steps are gathered in this process."""
    return {"tokens": c.gather_tokens, "steps": c.gather_steps, "ms": c.gather_ms, "active": active}


def _plan_starts(plan: Optional[tuple]) -> Optional[Tuple[int, ...]]:
    """Where a planned step's hidden, aux, ids and positions tensors start (None: not planned)."""
    if plan is None:
        return None
    return (plan[0], plan[2][0][0], plan[2][1][0], plan[2][2][0], plan[3], plan[5])


def _positions_from_spans(spans: Sequence[Tuple[int, int, int]]) -> torch.Tensor:
    """Positions when the batch carries none: prefix_len + 0..n-1 per (start, tokens, prefix_len) span."""
    return torch.cat([torch.arange(prefix, prefix + tokens, dtype=torch.int32) for _start, tokens, prefix in spans])
