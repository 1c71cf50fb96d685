"""Small steps gathered into one copy job: the bookkeeping, pure (no CUDA, no I/O).

Why: on launch-bound steps (a small prefill batch: ~1,200 kernel launches, the
CPU is the bottleneck) every captured step paid a fixed price per copy job,
whatever its size, measured on the H200 (docs/lab/bench-history.md): the
fence, the completion post (a CUDA host function), the pool, the ring entry
(~100-150 us of the forward thread), and a slower next step (+0.3..+0.9 %:
the DMA event, the host function and the writer waking each add a part; the
DMA part did not grow from 29 MB to 235 MB).  So steps smaller than
`tokens` rows are held (the dumper keeps references to their tensors, as it
already does until copies land) and copied together: one fence, each step's
copies at its row offset in one host buffer, one post, one job for the writer
process, whose spans are the steps' spans shifted by the same offsets.  The
file format does not change: one file per request span, as before.

A gathered step is copied later than its own step's end, so its tensors must
not be rewritten in place by the model meanwhile.  Tensors held by reference
cannot be reused by the caching allocator; buffers the model rewrites itself
(static CUDA-graph buffers) can.  Such a rewrite shows as two waiting steps
whose hidden, aux, ids or positions tensors start at the same address
(impossible while a reference holds allocator memory): the earlier step's data
is gone, so it is dropped and counted, never written, and gathering stops for
the rest of the run (`rewritten`).

A gathered step costs its `capture()` only the references and its spans: the
tensors' pointers and strides (the copy plan), the rewrite check and the
copies are worked out for all the waiting steps at once when their job is
due.  On the H200, `capture()` right after a launch-bound step's ~1,200 kernel
launches runs its Python on cold caches (the same code is ~7 times slower
there than in a warm loop), so one pass over 8 steps costs less than 8 passes
of one step each (docs/lab/bench-history.md).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple


class Gather:
    """Steps waiting for their shared copy job.

    `tokens`: rows at which a job is due (a step this large or larger is never
    gathered); `steps`: most steps per job; `max_age_s`: a job is due when its
    first step waited this long (checked at each capture and by the reaper's
    once-a-second tick, so an idle server writes its last steps too).  `key`:
    what the waiting steps must share to be one job (the stream they ran on:
    one fence covers them).
    """

    def __init__(self, tokens: int, steps: int, max_age_s: float):
        self.tokens, self.max_steps, self.max_age_s = tokens, steps, max_age_s
        self.items: List[Any] = []
        self.rows = 0
        self.key: Any = None
        self.since = 0.0

    def __len__(self) -> int:
        return len(self.items)

    def takes(self, rows: int) -> bool:
        """Whether a step of `rows` rows is gathered at all (else it is copied on its own)."""
        return rows < self.tokens

    def fits(self, rows: int, key: Any) -> bool:
        """A step of `rows` rows and `key` (the stream it ran on) may join the waiting ones."""
        return not self.items or (key == self.key and self.rows + rows <= self.tokens)

    def add(self, item: Any, rows: int, key: Any, now: float) -> int:
        """Take a step; returns its first row in the job."""
        if not self.items:
            self.key, self.since = key, now
        first = self.rows
        self.items.append(item)
        self.rows += rows
        return first

    def due(self, now: float) -> bool:
        """The waiting steps should be copied now (full, enough rows, or the first waited too long)."""
        if not self.items:
            return False
        return len(self.items) >= self.max_steps or self.rows >= self.tokens or now - self.since >= self.max_age_s

    def stale(self, now: float) -> bool:
        """Steps wait longer than `max_age_s` (the reaper's tick copies them: no capture came)."""
        return bool(self.items) and now - self.since >= self.max_age_s

    def take(self) -> Tuple[List[Any], int]:
        """The waiting steps and their rows in all; the gather is empty after."""
        items, rows = self.items, self.rows
        self.items, self.rows, self.key = [], 0, None
        return items, rows


def shifted_spans(parts: List[Tuple[int, List[Tuple[int, int, int]]]]) -> List[Tuple[int, int, int]]:
    """Each step's (start, tokens, prefix_len) spans moved by its first row in the job."""
    return [(start + first, tokens, prefix) for first, spans in parts for start, tokens, prefix in spans]


def rewritten(starts: Sequence[Optional[Tuple[int, ...]]]) -> Set[int]:
    """Indices of waiting steps whose memory a later waiting step also starts at (its tensors were
    rewritten in place: its data is gone); None entries (unplanned steps) take no part."""
    seen: Set[int] = set()
    stale: Set[int] = set()
    for index in range(len(starts) - 1, -1, -1):  # from the newest: a start seen later marks this one
        mine = starts[index]
        if mine is None:
            continue
        if not seen.isdisjoint(mine):
            stale.add(index)
        seen.update(mine)
    return stale


def layout_runs(layouts: Sequence[Any]) -> List[Tuple[int, int]]:
    """[start, end) index ranges of consecutive equal layouts (dtype, id size, position size): the
    steps one host buffer's job can hold (its id and position regions have one element size)."""
    runs: List[Tuple[int, int]] = []
    for index, layout in enumerate(layouts):
        if runs and layouts[runs[-1][0]] == layout:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs
