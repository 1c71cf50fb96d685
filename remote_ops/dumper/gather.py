"""Small steps gathered into one copy job: the bookkeeping, pure (no CUDA, no I/O).

Why: on launch-bound steps (a small prefill batch: ~1,200 kernel launches, the
CPU is the bottleneck) every captured step paid a fixed price per copy job,
whatever its size, measured on the H200 (bench/README.md, runs 22-23): the
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
(static CUDA-graph buffers) can.  Such a rewrite is detected when a new
step's hidden, aux, ids or positions tensor starts where a gathered one's does
(impossible while a reference holds allocator memory): the gathered steps are
then dropped and counted,
never written, and gathering stops for the rest of the run (`clash`).
"""

from __future__ import annotations

from typing import Any, List, Set, Tuple


class Gather:
    """Steps waiting for their shared copy job.

    `tokens`: rows at which a job is due (a step this large or larger is never
    gathered); `steps`: most steps per job; `max_age_s`: a job is due when its
    first step waited this long (checked at each capture and by the reaper's
    once-a-second tick, so an idle server writes its last steps too).
    """

    def __init__(self, tokens: int, steps: int, max_age_s: float):
        self.tokens, self.max_steps, self.max_age_s = tokens, steps, max_age_s
        self.items: List[Any] = []
        self.rows = 0
        self.key: Any = None
        self.since = 0.0
        self.starts: Set[int] = set()

    def __len__(self) -> int:
        return len(self.items)

    def takes(self, rows: int) -> bool:
        """Whether a step of `rows` rows is gathered at all (else it is copied on its own)."""
        return rows < self.tokens

    def fits(self, rows: int, key: Any) -> bool:
        """A step of `rows` rows and `key` (dtype, id/position sizes, stream) may join the waiting ones."""
        return not self.items or (key == self.key and self.rows + rows <= self.tokens)

    def clash(self, starts: Tuple[int, ...]) -> bool:
        """A new step's tensor starts at a waiting step's address: the model rewrote a held buffer."""
        return bool(self.items) and not self.starts.isdisjoint(starts)

    def add(self, item: Any, rows: int, key: Any, starts: Tuple[int, ...], now: float) -> int:
        """Take a step; returns its first row in the job."""
        if not self.items:
            self.key, self.since = key, now
        first = self.rows
        self.items.append(item)
        self.rows += rows
        self.starts.update(starts)
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
        self.starts = set()
        return items, rows


def shifted_spans(parts: List[Tuple[int, List[Tuple[int, int, int]]]]) -> List[Tuple[int, int, int]]:
    """Each step's (start, tokens, prefix_len) spans moved by its first row in the job."""
    return [(start + first, tokens, prefix) for first, spans in parts for start, tokens, prefix in spans]
