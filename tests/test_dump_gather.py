"""Small steps gathered into one copy job (remote_ops/dumper/gather.py), on CPU memory.

The driver path runs here through `MemmoveDriver`, a named stand-in for the
libcuda entry points the dumper calls (copies done at once with memmove, the
completion post made at once with sem_post): there is no GPU.  The writer
process, the shared buffers, the ring and the files are the real ones.  What
is proved: gathered steps land in their files byte for byte with the spans
shifted right, a job is one fence and one post, a capture only keeps
references (the job plans every waiting step), a large step is copied on its
own after the waiting ones, a rewritten buffer drops the earlier step instead
of writing stale data, a step the driver copies cannot take goes the general
path (or is counted as dropped off the forward thread), an idle dumper
copies waiting steps from the reaper thread.  The effect on step time is measured on the H200
(bench/dumper_paired.py, bench/README.md).
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from test_dump_capture import _MemmoveDriver, assert_spans_written, make_batch, make_dumper  # noqa: E402

from remote_ops.dumper import staging  # noqa: E402
from remote_ops.dumper.cudadrv import load_libc  # noqa: E402
from remote_ops.dumper.gather import Gather, layout_runs, rewritten, shifted_spans  # noqa: E402


class MemmoveDriver(_MemmoveDriver):
    """test_dump_capture's memmove copies, with what the gathering path calls besides: fences recorded,
    host functions made at once (sem_post on the address given, as the real one does later), the
    CUDA context calls."""

    def __init__(self):
        super().__init__()
        self.libc = load_libc()
        self.fences, self.contexts = [], []
        self.event_record_fn = lambda event, stream: self.fences.append(stream) or 0

    def host_fn(self, stream, fn, arg):
        super().host_fn(stream, fn, arg)
        self.libc.sem_post(arg)
        return 0

    def current_context(self):
        return 77

    def make_current(self, ctx):
        self.contexts.append((threading.get_ident(), ctx))

    def event_destroy(self, event):
        pass


@pytest.fixture
def gathering(tmp_path, monkeypatch):
    """A dumper with the writer process whose captures take the driver path through MemmoveDriver."""
    made = []

    def make(**env):
        d = make_dumper(tmp_path, writer="process", buffers=2, **env)
        made.append(d)
        driver = MemmoveDriver()
        d.driver, d.stager = driver, staging.Stager(driver)
        d.stager.device_index, d.stager.side_raw, d.stager.fence_event = -1, 1, 1  # CPU: get_device() is -1
        monkeypatch.setattr(staging, "_RAW_STREAM", lambda index: 5)
        d._start_gather()
        return d, driver

    yield make
    for d in made:
        d.close(timeout=10)


def capture(d, *batches):
    """Each batch's forward hook call, in order."""
    for b in batches:
        d.capture(b.fb, b.hidden, b.aux)


def strided_ids(batch):
    """The batch with its ids a stride-2 view: a layout the driver copies cannot take (no plan)."""
    batch.fb.input_ids = torch.stack([batch.fb.input_ids, batch.fb.input_ids], 1)[:, 0]
    return batch


def test_small_steps_land_in_their_files_bit_exact_from_one_job(tmp_path, gathering):
    d, driver = gathering(gather_tokens=16, gather_steps=8)
    assert d.gather is not None and d.stats.static["gather"]["active"]
    batches = [make_batch(lens, seed=60 + i) for i, lens in enumerate([[3], [2, 3], [2], [4, 1]])]  # 15 rows
    for b in batches:
        d.capture(b.fb, b.hidden, b.aux)
    assert len(d.gather) == 4 and driver.posts == [] and d.job_seq == 0  # waiting: nothing copied yet
    assert d.flush(10)
    assert len(driver.fences) == 1 and len(driver.posts) == 1 and d.job_seq == 1  # one fence, one post, one job
    assert driver.fences == [5] and driver.contexts[-1][1] == 77  # the forward stream; the context made current
    stats = d.stats.snapshot()
    assert stats["batches"] == 4 and stats["files"] == 6 and stats["errors"] == 0
    for b in batches:
        assert_spans_written(b, tmp_path)


def test_a_job_is_due_at_the_step_or_row_limit_and_a_large_step_goes_alone_after_the_waiting(tmp_path, gathering):
    d, driver = gathering(gather_tokens=8, gather_steps=3)
    small = [make_batch([2], seed=70 + i) for i in range(4)]
    for b in small[:3]:  # 3 steps: due at the third
        d.capture(b.fb, b.hidden, b.aux)
    assert d.job_seq == 1 and len(driver.posts) == 1 and not len(d.gather)
    d.capture(small[3].fb, small[3].hidden, small[3].aux)  # waits
    big = make_batch([5, 4], seed=75)  # 9 rows >= 8: copied on its own, after the waiting step
    d.capture(big.fb, big.hidden, big.aux)
    assert d.job_seq == 3 and not len(d.gather)
    assert d.flush(10) and d.stats.snapshot()["batches"] == 5
    for b in small + [big]:
        assert_spans_written(b, tmp_path)


def test_a_rewritten_buffer_drops_the_waiting_steps_and_stops_gathering(tmp_path, gathering):
    """A new step whose tensor starts where a waiting step's does (a static buffer the model rewrote):
    the waiting data is gone, so it is counted as dropped and never written; later steps go alone."""
    d, driver = gathering(gather_tokens=64)
    first = make_batch([3, 2], seed=80)
    d.capture(first.fb, first.hidden, first.aux)
    again = make_batch([3, 2], seed=81)
    again.hidden = first.hidden  # the same memory, as a CUDA-graph output buffer would be
    first.hidden.copy_(torch.randn(first.hidden.shape).bfloat16())  # rewritten in place
    d.capture(again.fb, again.hidden, again.aux)
    assert d.flush(10)  # the job is planned: the two steps start at one address
    assert d.gather is None
    stats = d.stats.snapshot()
    assert stats["dropped_batches"] == 1 and stats["dropped_spans"] == 2 and stats["errors"] == 1
    assert stats["files"] == 2 and d.job_seq == 1  # the newer step, whose data is the memory's
    assert_spans_written(again, tmp_path)


def test_a_step_whose_arrival_finds_a_rewrite_is_copied_on_its_own(tmp_path, gathering):
    """The job made because a step does not fit finds a rewrite and stops gathering: that step is then
    copied on its own, not left in a gather nobody copies."""
    d, _driver = gathering(gather_tokens=8)
    first, again, late = make_batch([3], seed=84), make_batch([3], seed=85), make_batch([4], seed=86)
    again.hidden = first.hidden  # rewritten in place, as a static buffer would be
    capture(d, first, again, late)  # 3 + 3 + 4 > 8: at `late` the waiting job is made first
    assert d.gather is None and d.job_seq == 2  # `again`'s job, then `late` alone
    assert d.flush(10)
    stats = d.stats.snapshot()
    assert stats["dropped_batches"] == 1 and stats["files"] == 2
    for b in (again, late):
        assert_spans_written(b, tmp_path)


def test_a_rewritten_ids_buffer_is_caught_too(tmp_path, gathering):
    d, _driver = gathering(gather_tokens=64)
    first = make_batch([4], seed=82)
    d.capture(first.fb, first.hidden, first.aux)
    again = make_batch([4], seed=83)
    again.fb.input_ids = first.fb.input_ids  # a persistent ids buffer, refilled for the next step
    d.capture(again.fb, again.hidden, again.aux)
    assert d.flush(10)
    assert d.gather is None and d.stats.snapshot()["dropped_batches"] == 1


def test_a_capture_keeps_references_only_and_the_job_plans_every_waiting_step(tmp_path, gathering, monkeypatch):
    """A gathered step's capture() reads no tensor attribute for the copies: the plans are made when the
    job is due, one pass over all its steps (cheaper on the H200's cold caches)."""
    d, _driver = gathering(gather_tokens=64, gather_steps=3)
    planned = []
    plan = d.stager.plan
    monkeypatch.setattr(d.stager, "plan", lambda *a: planned.append(a[4]) or plan(*a))
    batches = [make_batch([n], seed=100 + n) for n in (2, 3, 4)]
    for b in batches[:2]:
        d.capture(b.fb, b.hidden, b.aux)
    assert planned == [] and d.job_seq == 0
    d.capture(batches[2].fb, batches[2].hidden, batches[2].aux)  # the third step: due
    assert planned == [2, 3, 4] and d.job_seq == 1
    assert d.flush(10)
    for b in batches:
        assert_spans_written(b, tmp_path)


def test_a_step_the_driver_copies_cannot_take_is_copied_alone_and_gathering_stops(tmp_path, gathering):
    """A waiting step whose ids are not contiguous has no plan: on the forward thread it takes the general
    path (torch copies) after the others' job, and every later step is copied on its own."""
    d, _driver = gathering(gather_tokens=64)
    plain, odd = make_batch([3], seed=110), strided_ids(make_batch([2, 2], seed=111))
    capture(d, plain, odd)
    assert d.gather is not None and len(d.gather) == 2
    d.capture(plain.fb, plain.hidden[:0], plain.aux)  # skipped: no rows (spans still say 3): shapes error
    d._copy_gathered()
    assert d.gather is None and d.job_seq == 2
    assert d.flush(10)
    stats = d.stats.snapshot()
    assert stats["dropped_batches"] == 0 and stats["files"] == 3
    for b in (plain, odd):
        assert_spans_written(b, tmp_path)


def test_an_idle_dumper_copies_waiting_steps_from_the_reaper_thread(tmp_path, gathering):
    d, driver = gathering(gather_tokens=64, gather_ms=1)
    b = make_batch([3, 4], seed=90)
    d.capture(b.fb, b.hidden, b.aux)
    deadline = time.monotonic() + 10  # the reaper ticks once a second
    while d.stats.snapshot()["files"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.stats.snapshot()["files"] == 2
    assert driver.contexts and driver.contexts[0] == (d.sink.reaper.ident, 77)  # copied on the reaper thread
    assert_spans_written(b, tmp_path)


def test_the_reaper_never_waits_for_a_buffer_to_copy_stale_steps(tmp_path, gathering):
    """With every buffer taken, the reaper's tick leaves stale steps waiting (it is the thread that would
    notice a dead writer process); once a buffer is back, they are copied."""
    d, driver = gathering(gather_tokens=64, gather_ms=200)
    b = make_batch([2, 2], seed=92)
    d.preallocate(b.hidden, 64)  # the pool exists before the step (as after any first batch)
    d.capture(b.fb, b.hidden, b.aux)
    taken = [d.pool.acquire(4, 32, torch.bfloat16, False, 0.0) for _ in range(2)]
    assert all(taken) and not d.pool.free
    time.sleep(0.25)  # stale now; the real reaper's ticks skip it too
    d._copy_waiting(stale_only=True)  # what a tick does: returns at once
    assert len(d.gather) == 1 and d.job_seq == 0
    for buf in taken:
        d.pool.release(buf.slot)
    d._copy_waiting()  # (or the next tick)
    assert not len(d.gather) and d.job_seq == 1
    assert d.flush(10)
    assert_spans_written(b, tmp_path)


def test_gather_off_copies_every_step_on_its_own(tmp_path, gathering):
    d, driver = gathering(gather_tokens=0)
    assert d.gather is None and not d.stats.static["gather"]["active"]
    for i in range(3):
        b = make_batch([2], seed=95 + i)
        d.capture(b.fb, b.hidden, b.aux)
    assert d.job_seq == 3 and len(driver.posts) == 3


def test_gather_bookkeeping():
    g = Gather(tokens=10, steps=3, max_age_s=0.5)
    assert g.takes(9) and not g.takes(10)
    assert g.fits(9, "k") and not g.due(0.0)
    assert g.add("a", 4, "k", now=1.0) == 0 and g.add("b", 4, "k", now=1.1) == 4
    assert not g.fits(3, "k") and g.fits(2, "k") and not g.fits(1, "other key")
    assert not g.due(1.2) and g.due(1.5) and g.stale(1.5) and not g.stale(1.4)
    g.add("c", 1, "k", now=1.2)
    assert g.due(1.2)  # three steps
    assert g.take() == (["a", "b", "c"], 9) and len(g) == 0 and g.fits(9, "other key")
    assert shifted_spans([(0, [(0, 2, 0), (2, 2, 5)]), (4, [(0, 3, 1)])]) == [(0, 2, 0), (2, 2, 5), (4, 3, 1)]


def test_rewritten_steps_are_the_earlier_ones_sharing_a_start_with_a_later_one():
    assert rewritten([(1, 2), (3, 4), (5, 2), None, (6, 3)]) == {0, 1}
    assert rewritten([(1,), None, (2,)]) == set() and rewritten([]) == set()


def test_layout_runs_split_where_the_layout_changes():
    assert layout_runs(["a", "a", "b", "a"]) == [(0, 2), (2, 3), (3, 4)]
    assert layout_runs([]) == [] and layout_runs(["x"]) == [(0, 1)]


def test_off_the_forward_thread_a_step_with_no_plan_is_dropped_and_counted(tmp_path, gathering):
    """flush/close or the reaper make the job on another thread: torch's copies would run on that thread's
    stream, so a step the driver copies cannot take is counted as dropped, never written wrong."""
    d, _driver = gathering(gather_tokens=64)
    plain, odd = make_batch([3], seed=120), strided_ids(make_batch([2], seed=121))
    capture(d, plain, odd)
    assert d.flush(10)
    stats = d.stats.snapshot()
    assert d.gather is None and stats["dropped_batches"] == 1 and stats["files"] == 1 and d.job_seq == 1
    assert_spans_written(plain, tmp_path)
